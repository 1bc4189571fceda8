"""`StateSlots`: the per-sequence state slots of a hybrid model, per tier, torch-free.

A hybrid's state layers (Gated DeltaNet) keep a fixed-size state per sequence (the
convolution window and the recurrent state of every such layer) instead of KV pages that grow
with the context. Each running sequence owns one slot on one tier, beside its KV pages for
the attention layers: taken at admission, given back when it finishes, is aborted or is
preempted (it is recomputed from its tokens, as its KV pages are). A slot's bytes are the
same for every sequence (`EngineInfo.state_bytes`), so admission counts slots, not bytes.
"""

from __future__ import annotations

import math
from collections import OrderedDict

from engine.core.kv_pages import CacheStats
from policy import TIERS

STATE_TIERS = ("gpu", "cpu")
"""Tiers that hold states: the compute device's memory and host memory. A sequence whose KV is
homed on disk keeps its state in host memory (a state is read and written whole every step:
a disk round trip per layer and step would cost more than the state saves)."""


def state_tier(kv_tier: str) -> str:
    """The tier of a sequence's state, given its KV tier."""
    return "cpu" if kv_tier == "disk" else kv_tier


class StateSlots:
    """Free and used state slots per tier. `capacity`: slots each tier holds (absent: 0)."""

    def __init__(self, capacity: dict[str, int]) -> None:
        unknown = set(capacity) - set(STATE_TIERS)
        if unknown:
            raise ValueError(f"state slots on tiers {sorted(unknown)}: only {STATE_TIERS} hold any")
        self.capacity = {t: int(capacity.get(t, 0)) for t in STATE_TIERS}
        self._free = {t: list(range(n - 1, -1, -1)) for t, n in self.capacity.items()}
        self._owner: dict[int, tuple[str, int]] = {}

    @property
    def enabled(self) -> bool:
        """The model has state layers: every sequence needs a slot."""
        return any(self.capacity.values())

    def can_allocate(self, kv_tier: str) -> bool:
        """A sequence homed on `kv_tier` would get a slot now (always, for a model without
        state layers)."""
        return not self.enabled or bool(self._free[state_tier(kv_tier)])

    def allocate(self, seq_id: int, kv_tier: str) -> tuple[str, int] | None:
        """Give `seq_id` a slot on its state tier: (tier, slot); None for a model without
        state layers. The caller checked `can_allocate`."""
        if not self.enabled:
            return None
        assert seq_id not in self._owner, f"sequence {seq_id} already holds a state slot"
        tier = state_tier(kv_tier)
        self._owner[seq_id] = ref = (tier, self._free[tier].pop())
        return ref

    def free(self, seq_id: int) -> None:
        """Give back seq_id's slot, if it holds one."""
        ref = self._owner.pop(seq_id, None)
        if ref is not None:
            self._free[ref[0]].append(ref[1])

    def slot_of(self, seq_id: int) -> tuple[str, int] | None:
        return self._owner.get(seq_id)

    def num_used(self, tier: str) -> int:
        return self.capacity.get(tier, 0) - len(self._free.get(tier, []))


def state_slot_capacity(
    block_size: int, kv_frac: tuple[float, float, float], fits: dict[str, int]
) -> dict[str, int]:
    """Slots per state tier for a block of `block_size` sequences whose KV is split by
    `kv_frac` (disk-homed sequences keep their states in host memory), each tier at most the
    slots that `fits` in it: the share of the block that tier homes, rounded up."""
    out = dict.fromkeys(STATE_TIERS, 0)
    for tier, frac in zip(TIERS, kv_frac, strict=True):
        if frac > 0:
            out[state_tier(tier)] += math.ceil(block_size * frac - 1e-9)
    return {t: min(n, block_size, fits.get(t, n)) for t, n in out.items()}


def snapshot_tier(fits: dict[str, int], needed: dict[str, int]) -> str:
    """Where saved states live: the cpu tier (host memory, which a GPU's KV cache and weights
    do not compete for; a hit costs one copy of one state into the sequence's slot) when it
    has room for one beyond the running slots `needed`, else the gpu tier (on a CPU device,
    the gpu tier is host memory and the cpu tier usually has no budget)."""
    return "cpu" if fits.get("cpu", 0) > needed.get("cpu", 0) else "gpu"


class StateSnapshots:
    """A hybrid's prefix cache of states (docs/architecture.md, "Prefix caching for
    hybrids"): the state at the end of a cached prefix, saved in a snapshot slot and found
    by the hash of the prefix's last full KV page (`page_hashes`).

    A KV prefix of a hybrid is only usable together with the state at its end, so a hit is
    the longest cached prefix of full pages whose end has a snapshot. Snapshots are saved
    where a prefix has shown itself shared: a request whose cached KV prefix runs past its
    last snapshot recomputes that stretch and saves the state at its end, so that the next
    requests with that prefix hit. `capacity` slots of `tier`, from `first` on (after the
    running sequences' slots there); least recently used evicted first. A save is
    reserved when its step is planned and found only once the step has run (`commit`);
    a step that failed gives its reservations back (`cancel`). Torch-free."""

    def __init__(
        self, tier: str, capacity: int, first: int, stats: CacheStats | None = None
    ) -> None:
        self.tier = tier
        self.capacity = max(0, int(capacity))
        self.stats = stats or CacheStats()
        """Where saves and evictions are counted (the prefix cache's, for /metrics)."""
        self._free = list(range(first + self.capacity - 1, first - 1, -1))
        self._by_hash: OrderedDict[str, int] = OrderedDict()
        """Committed snapshots, least recently used first."""
        self._pending: dict[int, list[tuple[str, int]]] = {}
        """Per planned step, the (hash, slot) saves it makes."""
        self._pending_hashes: set[str] = set()

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    def __len__(self) -> int:
        return len(self._by_hash)

    def find(self, h: str) -> tuple[str, int] | None:
        """The snapshot saved at the end of the prefix whose last page hashes to `h`, most
        recently used now; None if there is none (or it is not saved yet)."""
        slot = self._by_hash.get(h)
        if slot is None:
            return None
        self._by_hash.move_to_end(h)
        return self.tier, slot

    def has(self, h: str) -> bool:
        """A snapshot for `h` is saved or being saved."""
        return h in self._by_hash or h in self._pending_hashes

    def reserve(self, step_id: int, h: str) -> tuple[str, int] | None:
        """A slot to save the state for `h` into after step `step_id` runs: a free one, else
        the least recently used snapshot's; None if every slot is being saved into."""
        if not self.enabled or self.has(h):
            return None
        if self._free:
            slot = self._free.pop()
        elif self._by_hash:
            _, slot = self._by_hash.popitem(last=False)
            self.stats.state_evictions += 1
        else:
            return None
        self._pending.setdefault(step_id, []).append((h, slot))
        self._pending_hashes.add(h)
        return self.tier, slot

    def commit(self, step_id: int) -> None:
        """Step `step_id` ran: its saved states can be found."""
        for h, slot in self._pending.pop(step_id, []):
            self._pending_hashes.discard(h)
            self._by_hash[h] = slot
            self.stats.state_saves += 1

    def cancel(self, step_id: int) -> None:
        """Step `step_id` did not run to its end: its reserved slots hold nothing."""
        for h, slot in self._pending.pop(step_id, []):
            self._pending_hashes.discard(h)
            self._free.append(slot)
