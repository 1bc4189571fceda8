"""`StateStore`: the physical per-sequence states of a hybrid model's state layers, per tier.

Each state tier (the compute device's memory, host memory) holds, for every state layer and
every state tensor of it (`Model.state_shapes`: a Gated DeltaNet layer's convolution window
and recurrent state), one (slots, *shape) pool allocated once at start: a slot's state is
fixed-size, so nothing grows. A step gathers its sequences' states onto the compute device,
the layer updates them, and they are written back to their slots (engine/core/state_slots.py
assigns the slots).
"""

from __future__ import annotations

import torch

from engine.storage.device import Device


class StateStore:
    """One pool per (tier, state layer, state tensor). `shapes`: name -> (per-slot shape,
    kept in float32); `capacity`: slots per tier."""

    def __init__(
        self,
        num_state_layers: int,
        shapes: dict[str, tuple[tuple[int, ...], bool]],
        capacity: dict[str, int],
        dtype: torch.dtype,
        device: Device,
    ) -> None:
        self.device = device
        self.capacity = dict(capacity)
        self._pools: dict[str, list[dict[str, torch.Tensor]]] = {}
        for tier, slots in capacity.items():
            if not slots:
                continue
            layers = []
            for _ in range(num_state_layers):
                pools = {}
                for name, (shape, is_f32) in shapes.items():
                    kind = torch.float32 if is_f32 else dtype
                    if tier == "gpu":
                        pools[name] = torch.zeros((slots, *shape), dtype=kind, device=device.device)
                    else:
                        pools[name] = device.host_empty((slots, *shape), kind).zero_()
                layers.append(pools)
            self._pools[tier] = layers
        self.slot_bytes = (
            sum(
                (torch.float32 if is_f32 else dtype).itemsize * _numel(shape)
                for shape, is_f32 in shapes.values()
            )
            * num_state_layers
        )
        """Bytes of one sequence's state, every state layer."""

    def bytes_per_tier(self) -> dict[str, int]:
        return {tier: n * self.slot_bytes for tier, n in self.capacity.items()}

    def reset(self, tier: str, slot: int) -> None:
        """Zero a slot's state in every layer: a sequence starts from nothing."""
        for pools in self._pools[tier]:
            for pool in pools.values():
                pool[slot].zero_()

    def copy(self, src: tuple[str, int], dst: tuple[str, int]) -> None:
        """Copy the state of slot `src` into slot `dst`, every layer ((tier, slot) each): a
        saved state of a cached prefix, into a sequence's slot or from it. Waits for the
        device first: a host slot may still be being written back (`scatter`)."""
        self.device.synchronize()
        for pools_src, pools_dst in zip(self._pools[src[0]], self._pools[dst[0]], strict=True):
            for name, pool in pools_src.items():
                pools_dst[name][dst[1]].copy_(pool[src[1]])

    def gather(
        self,
        layer: int,
        slots: dict[str, tuple[torch.Tensor, torch.Tensor]],
        count: int,
        runs: dict[str, list[tuple[int, int, int]]],
    ) -> dict[str, torch.Tensor]:
        """State layer `layer`'s states of `count` sequences on the compute device, name ->
        (count, *shape). Per tier: (its slots on the pool's device, their positions among
        the count), and the same as `runs` (first slot, first position, count): the pool on
        the compute device is read with one `index_select`, a host pool by one copy per run
        (from pinned memory, without blocking the host)."""
        out: dict[str, torch.Tensor] = {}
        for tier, (index, positions) in slots.items():
            for name, pool in self._pools[tier][layer].items():
                if tier == "gpu":
                    part = self.device.to_device(pool.index_select(0, index))
                    if len(slots) == 1:
                        out[name] = part
                        continue
                    if name not in out:
                        out[name] = part.new_empty((count, *pool.shape[1:]))
                    out[name].index_copy_(0, positions, part)
                    continue
                if name not in out:
                    out[name] = torch.empty(
                        (count, *pool.shape[1:]), dtype=pool.dtype, device=self.device.device
                    )
                for first, at, n in runs[tier]:
                    out[name][at : at + n].copy_(pool[first : first + n], non_blocking=True)
        return out

    def scatter(
        self,
        layer: int,
        slots: dict[str, tuple[torch.Tensor, torch.Tensor]],
        states: dict[str, torch.Tensor],
        runs: dict[str, list[tuple[int, int, int]]],
    ) -> None:
        """Write back what `gather` read, after the layer updated it: into a host pool by
        one copy per run, into pinned memory without blocking the host (the step ends with
        the device synchronized, before anything on the host reads a slot again)."""
        for tier, (index, positions) in slots.items():
            for name, pool in self._pools[tier][layer].items():
                if tier == "gpu":
                    rows = states[name]
                    if len(slots) > 1:
                        rows = rows.index_select(0, positions)
                    pool.index_copy_(0, index, rows)
                    continue
                for first, at, n in runs[tier]:
                    pool[first : first + n].copy_(states[name][at : at + n], non_blocking=True)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
