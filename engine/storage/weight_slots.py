"""`WeightSlots`: the fixed device buffers that offloaded layers are loaded into, in turn.

FlexGen's zig-zag schedule loads layer j+1's weights while layer j computes: two buffers,
each layer into the one its predecessor does not use. Loading every layer into fresh
memory instead costs an allocation per layer and step and, on a GPU, gives the weights a
new address every step, which no CUDA graph can read. So the offloaded decoder layers that
share one layout (names, shapes, dtypes: every layer of a dense model) are loaded into
`num_slots` buffers allocated once, each a contiguous byte range with the layer's tensors
as views at the offsets its disk file uses (one read or copy fills a slot), and a layer's
tensors always sit at the same addresses: its slot is fixed by its rank among the slotted
layers. Before a copy overwrites a slot, the copy stream waits for the event recorded after
the last compute that read it (`release`); on the CPU compute is synchronous, so the layer
that last used the slot has finished by the time the next load into it is issued.
"""

from __future__ import annotations

import threading

import torch

from engine.storage.device import Device

ALIGN = 64
"""Byte alignment of each tensor within a layer, as the disk files lay them out."""

Layout = tuple[tuple[str, tuple[int, ...], torch.dtype], ...]
"""A layer's tensors in stored order: (name, shape, dtype)."""


def layout_of(values: dict[str, torch.Tensor]) -> Layout:
    return tuple((name, tuple(t.shape), t.dtype) for name, t in values.items())


def offsets_of(layout: Layout) -> tuple[list[int], int]:
    """Each tensor's byte offset and the end of the last one, aligned as on disk."""
    offsets, offset, end = [], 0, 0
    for _, shape, dtype in layout:
        offsets.append(offset)
        end = offset + _numel(shape) * dtype.itemsize
        offset = -(-end // ALIGN) * ALIGN
    return offsets, end


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class WeightSlots:
    def __init__(
        self, layout: Layout, layers: list[int], device: Device, num_slots: int = 2
    ) -> None:
        """`layers`: the slotted layers in load order (layer j's slot is its rank mod
        `num_slots`, so consecutive loads alternate)."""
        self.layout, self.device = layout, device
        offsets, self.nbytes = offsets_of(layout)
        self.rank = {j: i for i, j in enumerate(layers)}
        self.buffers = [
            torch.empty(self.nbytes, dtype=torch.uint8, device=device.device)
            for _ in range(min(num_slots, len(layers)))
        ]
        self.views = [
            {
                name: buf[off : off + _numel(shape) * dtype.itemsize].view(dtype).view(shape)
                for (name, shape, dtype), off in zip(layout, offsets, strict=True)
            }
            for buf in self.buffers
        ]
        self._freed: list[torch.cuda.Event | None] = [None] * len(self.buffers)
        self._lock = threading.Lock()

    @property
    def total_bytes(self) -> int:
        return self.nbytes * len(self.buffers)

    def holds(self, j: int) -> bool:
        return j in self.rank

    def slot(self, j: int) -> int:
        return self.rank[j] % len(self.buffers)

    def weights(self, j: int) -> dict[str, torch.Tensor]:
        """Layer j's tensors, at the fixed addresses of its slot (what a graph reads)."""
        return dict(self.views[self.slot(j)])

    def target(self, j: int) -> torch.Tensor:
        """Layer j's slot as bytes, to be written on the current (copy) stream: which first
        waits for the compute that last read the slot."""
        s = self.slot(j)
        with self._lock:
            freed = self._freed[s]
        stream = self.device.copy_stream()
        if stream is not None and freed is not None:
            stream.wait_event(freed)
        return self.buffers[s]

    def fill(self, j: int, write: torch.Tensor | dict[str, torch.Tensor]) -> None:
        """Copy layer j's weights into its slot (`target`): `write` is the layer's bytes as
        laid out on disk (one copy), or its tensors by name."""
        buffer = self.target(j)
        if isinstance(write, torch.Tensor):
            buffer[: write.numel()].copy_(write, non_blocking=self.device.is_cuda)
            return
        views = self.views[self.slot(j)]
        for name, tensor in write.items():
            views[name].copy_(tensor, non_blocking=self.device.is_cuda)

    def release(self, j: int, done: torch.cuda.Event | None) -> None:
        """The compute that reads layer j's slot has been enqueued up to `done` (an event on
        the compute stream; None on the CPU): the next load into the slot waits for it."""
        with self._lock:
            self._freed[self.slot(j)] = done
