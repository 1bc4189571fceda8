"""`PageManager`: paged KV bookkeeping, a page table per sequence on tier pools (torch-free).

Words: a *page* is `page_tokens` tokens of one sequence's KV (all layers); a *block* is
FlexGen's num_gpu_batches x gpu_batch_size sequences, never a KV unit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from policy import TIERS


class KVCapacityError(RuntimeError):
    """A tier's KV pool has no free page left."""


@dataclass(slots=True)
class SeqPages:
    """The pages one sequence holds: all on its home tier, in token order."""

    tier: str
    page_ids: list[int] = field(default_factory=list)
    num_tokens: int = 0


class PageManager:
    """Allocates fixed-size KV pages from one pool per tier.

    `capacity_pages[tier]` bounds each pool (None: unbounded, the pool grows).
    A sequence's pages all live on its home tier; its page table lists them
    in token order, so token t sits in page_ids[t // page_tokens].
    """

    def __init__(self, page_tokens: int, capacity_pages: dict[str, int | None]) -> None:
        assert page_tokens > 0
        self.page_tokens = page_tokens
        self.capacity_pages = {tier: capacity_pages.get(tier) for tier in TIERS}
        self._free: dict[str, list[int]] = {tier: [] for tier in TIERS}
        self._next_id: dict[str, int] = {tier: 0 for tier in TIERS}
        self._seqs: dict[int, SeqPages] = {}

    def num_pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_tokens)

    def num_free_pages(self, tier: str) -> int | None:
        cap = self.capacity_pages[tier]
        if cap is None:
            return None
        return cap - self._next_id[tier] + len(self._free[tier])

    def num_used_pages(self, tier: str) -> int:
        return self._next_id[tier] - len(self._free[tier])

    def projected_peak_pages(self, lengths: list[tuple[int, int]]) -> int:
        """Upper bound on the most pages a set of sequences will hold at once.

        `lengths` holds (num_tokens now, num_tokens still to come) per sequence.
        Each sequence grows one token per step and frees everything when it ends,
        so the peak lies at the step just before one of them ends (NanoFlow 4.4).
        At step t the live ones hold sum(ceil((now + t) / B)) pages (B = page_tokens), bounded
        by (tokens + live * (B - 1)) // B. O(n log n).
        """
        peak = 0
        tokens_now = 0
        for num_live, (now, to_come) in enumerate(sorted(lengths, key=lambda x: -x[1]), 1):
            tokens_now += now
            tokens = tokens_now + num_live * to_come
            peak = max(peak, (tokens + num_live * (self.page_tokens - 1)) // self.page_tokens)
        return peak

    def can_append(self, seq_id: int, num_new_tokens: int, tier: str | None = None) -> bool:
        """Would `append` succeed for this sequence (or a new one on `tier`)?"""
        seq = self._seqs.get(seq_id)
        home = seq.tier if seq else tier
        assert home is not None
        have = len(seq.page_ids) if seq else 0
        used = seq.num_tokens if seq else 0
        need = self.num_pages_for(used + num_new_tokens) - have
        free = self.num_free_pages(home)
        return free is None or need <= free

    def append(self, seq_id: int, num_new_tokens: int, tier: str | None = None) -> list[int]:
        """Reserve room for `num_new_tokens` more tokens; returns the pages added."""
        seq = self._seqs.get(seq_id)
        if seq is None:
            if tier not in TIERS:
                raise ValueError(f"new sequence {seq_id} needs a tier, got {tier!r}")
            seq = self._seqs[seq_id] = SeqPages(tier)
        need = self.num_pages_for(seq.num_tokens + num_new_tokens) - len(seq.page_ids)
        if not self.can_append(seq_id, num_new_tokens):
            raise KVCapacityError(
                f"KV pool on {seq.tier} is full: sequence {seq_id} needs {need} more page(s)"
            )
        new_ids = [self._take(seq.tier) for _ in range(need)]
        seq.page_ids.extend(new_ids)
        seq.num_tokens += num_new_tokens
        return new_ids

    def free(self, seq_id: int) -> None:
        seq = self._seqs.pop(seq_id, None)
        if seq is not None:
            self._free[seq.tier].extend(reversed(seq.page_ids))

    def page_table(self, seq_id: int) -> list[int]:
        return list(self._seqs[seq_id].page_ids)

    def tier_of(self, seq_id: int) -> str:
        return self._seqs[seq_id].tier

    def num_tokens(self, seq_id: int) -> int:
        return self._seqs[seq_id].num_tokens

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def _take(self, tier: str) -> int:
        if self._free[tier]:
            return self._free[tier].pop()
        page_id = self._next_id[tier]
        self._next_id[tier] += 1
        return page_id


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
