"""`StepInputs`: a step's index inputs, written into one persistent host buffer (pinned on
CUDA) and moved to the device with one non-blocking copy.

Built per call, `torch.tensor(list, device=cuda)` copies from pageable memory, which holds
the host until the copy is done, and so until every kernel queued before it has run: with
15-30 of them a step, the host waits on the device where it should be queueing the next
step's work. Here the builder stages every list of the step first (`stage`, a write into
host memory), `flush` copies them in one transfer, and `tensor` hands out views of the
device buffer. The buffers alternate between two halves step by step (`begin_step`), so
the host writes step n+1's inputs while step n's copy may still be reading its own half.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

_ALIGN = 8  # bytes: every staged array starts at a multiple of the widest element
_FIRST_CAPACITY = 1 << 16


@dataclass(frozen=True, slots=True)
class Staged:
    """One staged array: its bytes [start, start + count * itemsize) of the step's half."""

    start: int
    count: int
    dtype: torch.dtype

    @property
    def stop(self) -> int:
        return self.start + self.count * self.dtype.itemsize


def host_buffer(capacity: int, pinned: bool) -> torch.Tensor:
    """`capacity` bytes of host memory the host writes a step's arrays into (the rehearsal,
    engine/fake_cuda.py, keeps them real at any size: their values are read)."""
    return torch.empty(capacity, dtype=torch.uint8, pin_memory=pinned)


class StepInputs:
    """Host staging and device copies of a step's inputs. The contract: `stage` every array,
    `flush` once, then read them with `tensor` (the device's copy) or `host` (the staged
    bytes, for indices of host-memory pools). Views stay valid for the step and the next one
    (two halves); nothing keeps them longer."""

    def __init__(self, device: torch.device, pinned: bool) -> None:
        self.device = device
        self.pinned = pinned
        self._host: list[torch.Tensor] = []
        self._device: list[torch.Tensor] = []
        self._allocate(_FIRST_CAPACITY)
        self._side = 0
        self._used = 0
        self._flushed = 0
        self.num_copies = 0
        """Host-to-device copies made (tests count them: one per step)."""
        self.num_grown = 0
        """Times the buffers grew (a step larger than any before it)."""

    def _allocate(self, capacity: int) -> None:
        self._host = [host_buffer(capacity, self.pinned) for _ in range(2)]
        self._device = [
            torch.empty(capacity, dtype=torch.uint8, device=self.device) for _ in range(2)
        ]

    def begin_step(self) -> None:
        """Start a step: its arrays go into the other half of the buffers."""
        assert self._used == self._flushed, "staged inputs never copied"
        self._side ^= 1
        self._used = self._flushed = 0

    def stage(self, values: Sequence[int] | Sequence[float], dtype: torch.dtype) -> Staged:
        """Write `values` into host memory as `dtype`; readable once flushed."""
        start = -(-self._used // _ALIGN) * _ALIGN
        staged = Staged(start, len(values), dtype)
        if staged.stop > self._host[self._side].numel():
            self._grow(staged.stop)
        if values:
            window = self._host[self._side][start : staged.stop].view(dtype)
            window.numpy()[:] = values
        self._used = staged.stop
        return staged

    def _grow(self, needed: int) -> None:
        """Bigger buffers, the bytes staged so far kept (views handed out before keep the
        old buffers alive)."""
        old_host, side = self._host, self._side
        self._allocate(max(needed, 2 * old_host[side].numel()))
        self._host[side][: self._used].copy_(old_host[side][: self._used])
        self._flushed = 0  # the new device buffer holds nothing yet: copy everything
        self.num_grown += 1

    def flush(self) -> None:
        """Copy what was staged since the last flush to the device: one non-blocking copy
        from pinned memory (on the CPU, a copy between host buffers)."""
        if self._used == self._flushed:
            return
        start, stop = self._flushed, self._used
        self._device[self._side][start:stop].copy_(
            self._host[self._side][start:stop], non_blocking=self.pinned
        )
        self._flushed = stop
        self.num_copies += 1

    def tensor(self, staged: Staged) -> torch.Tensor:
        """(count,) `staged` on the device (after `flush`)."""
        assert staged.stop <= self._flushed or staged.count == 0, "read before flush"
        return self._device[self._side][staged.start : staged.stop].view(staged.dtype)

    def host(self, staged: Staged) -> torch.Tensor:
        """(count,) `staged` in host memory (pinned on CUDA)."""
        return self._host[self._side][staged.start : staged.stop].view(staged.dtype)
