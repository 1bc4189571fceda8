"""`BlockManager`: paged KV bookkeeping, block tables per sequence on tier pools (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass, field

from policy import TIERS


class KVCapacityError(RuntimeError):
    """A tier's KV pool has no free block left."""


@dataclass(slots=True)
class SeqBlocks:
    tier: str
    block_ids: list[int] = field(default_factory=list)
    num_tokens: int = 0


class BlockManager:
    """Allocates fixed-size KV blocks from one pool per tier.

    `capacity_blocks[tier]` bounds each pool (None: unbounded, the pool grows).
    A sequence's blocks all live on its home tier; the block table lists them
    in token order, so token t sits in block_ids[t // block_tokens].
    """

    def __init__(self, block_tokens: int, capacity_blocks: dict[str, int | None]) -> None:
        assert block_tokens > 0
        self.block_tokens = block_tokens
        self.capacity_blocks = {tier: capacity_blocks.get(tier) for tier in TIERS}
        self._free: dict[str, list[int]] = {tier: [] for tier in TIERS}
        self._next_id: dict[str, int] = {tier: 0 for tier in TIERS}
        self._seqs: dict[int, SeqBlocks] = {}

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_tokens)

    def num_free_blocks(self, tier: str) -> int | None:
        cap = self.capacity_blocks[tier]
        if cap is None:
            return None
        return cap - self._next_id[tier] + len(self._free[tier])

    def num_used_blocks(self, tier: str) -> int:
        return self._next_id[tier] - len(self._free[tier])

    def projected_peak_blocks(self, lengths: list[tuple[int, int]]) -> int:
        """Upper bound on the most blocks a set of sequences will hold at once.

        `lengths` holds (num_tokens now, num_tokens still to come) per sequence.
        Each sequence grows one token per step and frees everything when it ends,
        so the peak lies at the step just before one of them ends (NanoFlow 4.4).
        At step t the live ones hold sum(ceil((now + t) / B)) blocks, bounded
        by (tokens + live * (B - 1)) // B. O(n log n).
        """
        peak = 0
        tokens_now = 0
        for num_live, (now, to_come) in enumerate(sorted(lengths, key=lambda x: -x[1]), 1):
            tokens_now += now
            tokens = tokens_now + num_live * to_come
            peak = max(peak, (tokens + num_live * (self.block_tokens - 1)) // self.block_tokens)
        return peak

    def can_append(self, seq_id: int, num_new_tokens: int, tier: str | None = None) -> bool:
        """Would `append` succeed for this sequence (or a new one on `tier`)?"""
        seq = self._seqs.get(seq_id)
        home = seq.tier if seq else tier
        assert home is not None
        have = len(seq.block_ids) if seq else 0
        used = seq.num_tokens if seq else 0
        need = self.num_blocks_for(used + num_new_tokens) - have
        free = self.num_free_blocks(home)
        return free is None or need <= free

    def append(self, seq_id: int, num_new_tokens: int, tier: str | None = None) -> list[int]:
        """Reserve room for `num_new_tokens` more tokens; returns the blocks added."""
        seq = self._seqs.get(seq_id)
        if seq is None:
            if tier not in TIERS:
                raise ValueError(f"new sequence {seq_id} needs a tier, got {tier!r}")
            seq = self._seqs[seq_id] = SeqBlocks(tier)
        need = self.num_blocks_for(seq.num_tokens + num_new_tokens) - len(seq.block_ids)
        if not self.can_append(seq_id, num_new_tokens):
            raise KVCapacityError(
                f"KV pool on {seq.tier} is full: sequence {seq_id} needs {need} more block(s)"
            )
        new_ids = [self._take(seq.tier) for _ in range(need)]
        seq.block_ids.extend(new_ids)
        seq.num_tokens += num_new_tokens
        return new_ids

    def free(self, seq_id: int) -> None:
        seq = self._seqs.pop(seq_id, None)
        if seq is not None:
            self._free[seq.tier].extend(reversed(seq.block_ids))

    def block_table(self, seq_id: int) -> list[int]:
        return list(self._seqs[seq_id].block_ids)

    def tier_of(self, seq_id: int) -> str:
        return self._seqs[seq_id].tier

    def num_tokens(self, seq_id: int) -> int:
        return self._seqs[seq_id].num_tokens

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def _take(self, tier: str) -> int:
        if self._free[tier]:
            return self._free[tier].pop()
        block_id = self._next_id[tier]
        self._next_id[tier] += 1
        return block_id


def pick_tier(fracs: tuple[float, float, float], counts: dict[str, int]) -> str:
    """The tier whose share of homed sequences lies furthest below its target fraction.

    Applied to every new sequence, it keeps the realized split as close to
    `fracs` as whole sequences allow (FlexGen splits KV by sequence the same way).
    """
    total = sum(counts.values()) + 1
    best, best_gap = TIERS[0], float("-inf")
    for tier, frac in zip(TIERS, fracs, strict=True):
        if frac <= 0.0:
            continue
        gap = frac * total - counts.get(tier, 0)
        if gap > best_gap + 1e-12:
            best, best_gap = tier, gap
    return best
