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
