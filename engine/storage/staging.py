"""`StagingPool`: host buffers for copies to and from the device, made once and reused.

A copy between host and GPU runs asynchronously only from pinned host memory, and pinning
memory is slow (the driver maps it) and can synchronize the device: a layer loop that pins a
buffer per copy stalls where it should overlap (FlexGen keeps its staging buffers; the first
GPU sessions found nanoflex pinning one per copy). The pool hands out buffers by size class
(powers of two from `MIN_BYTES`), each returned with the event of the last copy that reads or
writes it; a buffer is handed out again only once that event has completed (checked without
waiting), so a step in its steady state allocates nothing. `allocations` counts the buffers
ever made (a test reads it). On a CPU compute device the buffers are plain memory.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

MIN_BYTES = 64 << 10
"""The smallest size class: 64 KiB."""


def size_class(nbytes: int) -> int:
    return max(MIN_BYTES, 1 << (max(1, nbytes) - 1).bit_length())


def buffer_key(t: torch.Tensor) -> int:
    """The buffer a tensor `take` handed out lies in (its address; the rehearsal's tensors,
    which have none, are told apart another way: engine/fake_cuda.py)."""
    return t.data_ptr()


class StagingPool:
    def __init__(self, pinned: bool) -> None:
        self.pinned = pinned
        self._free: dict[int, list[tuple[torch.Tensor, Any]]] = {}
        self._lent: dict[int, torch.Tensor] = {}  # data_ptr -> its whole buffer
        self._lock = threading.Lock()
        self.allocations = 0

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A host tensor of `shape` and `dtype` (uninitialized), from a free buffer whose last
        copy has completed, else a new one."""
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        size = size_class(nbytes)
        with self._lock:
            free = self._free.setdefault(size, [])
            buf = None
            for i, (_, event) in enumerate(free):
                if event is None or event.query():
                    buf = free.pop(i)[0]
                    break
            if buf is None:
                buf = torch.empty(size, dtype=torch.uint8, pin_memory=self.pinned)
                self.allocations += 1
            self._lent[buffer_key(buf)] = buf
        return buf[:nbytes].view(dtype).view(shape)

    def give(self, t: torch.Tensor, event: Any = None) -> None:
        """Return a tensor `take` handed out; its buffer is reused once `event` (the last copy
        that touches it; None: none pending) has completed."""
        with self._lock:
            buf = self._lent.pop(buffer_key(t))
            self._free.setdefault(buf.numel(), []).append((buf, event))

    @property
    def lent(self) -> int:
        """Buffers handed out and not yet given back."""
        return len(self._lent)
