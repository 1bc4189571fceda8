"""`Device`: the compute device and how bytes move onto and off it (CUDA streams and events)."""

from __future__ import annotations

import collections
import threading
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch

from engine.core.dtypes import default_dtype
from engine.storage.staging import StagingPool

T = TypeVar("T")


@dataclass(slots=True)
class Ready(Generic[T]):
    """A value produced on a copy stream plus the event the compute stream must wait for."""

    value: T
    event: torch.cuda.Event | None = None


class CopyWindow:
    """At most `depth` copies in flight from one thread: `admit` a copy's event, and once more
    than `depth` are pending the oldest is waited for on the host. What bounds the device
    memory of a step's stores to host memory: the layer loop enqueues a whole step's layers
    ahead of the GPU, and every layer's new KV rows stay on the device until their copy has
    run (a 49,152-token step of OPT-6.7B's 32 layers: 25.8 GB), so the loop may run only
    `depth` copies ahead of them. Events that are None (the CPU copies synchronously) are not
    kept."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self._pending: collections.deque[Any] = collections.deque()
        self._lock = threading.Lock()
        self.waits = 0
        """How many times a thread waited for the oldest copy."""

    def admit(self, event: Any) -> None:
        if event is None:
            return
        with self._lock:
            self._pending.append(event)
            if len(self._pending) <= self.depth:
                return
            oldest = self._pending.popleft()
            self.waits += 1
        oldest.synchronize()


class Device:
    """Where compute runs. On CUDA, copies issued from copy threads run on per-thread side
    streams and are fenced with events, so the compute stream never synchronizes globally.
    On the CPU every method degrades to plain tensor operations."""

    def __init__(self, device: torch.device) -> None:
        if device.type == "cuda" and device.index is None:
            # An indexed device: torch's memory and stream calls refuse a bare "cuda", and a
            # tensor's device (cuda:0) compares unequal to it.
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.is_cuda = device.type == "cuda"
        self._local = threading.local()
        self.staging = StagingPool(pinned=self.is_cuda)
        """Host buffers for copies, reused (engine/storage/staging.py)."""
        self._store_stream: torch.cuda.Stream | None = None

    @classmethod
    def resolve(cls, name: str) -> Device:
        from base.errors import UserError

        if name == "auto":
            name = "cuda" if torch.cuda.is_available() else "cpu"
        if name == "cuda" and not torch.cuda.is_available():
            raise UserError("--device cuda was asked for but no CUDA device is available")
        if name not in ("cuda", "cpu"):
            raise UserError(f"device must be auto, cuda or cpu, got {name!r}")
        return cls(torch.device(name))

    def default_dtype(self, checkpoint_dtype: str | None) -> torch.dtype:
        """The compute dtype when none is given (engine/core/dtypes.py): float32 on the CPU
        (bfloat16 for a half checkpoint where the CPU has bfloat16 in hardware); the
        checkpoint's half type on CUDA."""
        name = default_dtype(self.device.type, checkpoint_dtype)
        dtype: torch.dtype = getattr(torch, name)
        return dtype

    def host_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Host memory for the cpu tier and staging: pinned when a GPU will read it."""
        return torch.empty(shape, dtype=dtype, pin_memory=self.is_cuda)

    def copy_stream(self) -> torch.cuda.Stream | None:
        """This thread's side stream for copies (created on first use)."""
        if not self.is_cuda:
            return None
        stream = getattr(self._local, "stream", None)
        if stream is None:
            stream = self._local.stream = torch.cuda.Stream(self.device)
        return stream

    def on_copy_stream(self) -> AbstractContextManager[object]:
        """Make this thread's side stream current (a no-op on the CPU)."""
        stream = self.copy_stream()
        return nullcontext() if stream is None else torch.cuda.stream(stream)

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device, non_blocking=self.is_cuda and t.is_pinned())

    def on_store_stream(self, after: torch.cuda.Event | None) -> AbstractContextManager[object]:
        """Make the stream of device-to-host stores current, once `after` (the compute that
        made what is stored) is done: one stream, fed by the layer loop itself, so a store is
        enqueued the moment its layer is, never queued behind a thread (a no-op on the CPU)."""
        if not self.is_cuda:
            return nullcontext()
        if self._store_stream is None:
            self._store_stream = torch.cuda.Stream(self.device)
        if after is not None:
            self._store_stream.wait_event(after)
        else:
            self._store_stream.wait_stream(torch.cuda.current_stream(self.device))
        return torch.cuda.stream(self._store_stream)

    def to_host_async(self, t: torch.Tensor) -> Ready[torch.Tensor]:
        """`t` copied into a staging buffer on the current stream, and the event that fences
        the copy; `t`'s memory is kept from reuse until the copy has read it, so the caller
        drops `t` at once. On the CPU, `t` itself (it is host memory)."""
        if not self.is_cuda:
            return Ready(t)
        host = self.staging.take(tuple(t.shape), t.dtype)
        host.copy_(t, non_blocking=True)
        t.record_stream(torch.cuda.current_stream(self.device))
        return Ready(host, self.record())

    def host_wait(self, ready: Ready[T]) -> T:
        """Block this thread until `ready`'s copies have landed, then hand its value over (for
        copy threads: the layer loop uses `wait`, which makes a stream wait instead)."""
        if ready.event is not None:
            ready.event.synchronize()
        return ready.value

    def release(self, t: torch.Tensor) -> None:
        """Give a buffer of `staging` back, to be reused once the copies enqueued on this
        thread's current stream so far (the last one that reads it) are done (at once on the
        CPU, which copies synchronously)."""
        self.staging.give(t, self.record())

    def record(self) -> torch.cuda.Event | None:
        """An event on the current stream of this thread (None on the CPU)."""
        if not self.is_cuda:
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def wait(self, ready: Ready[T]) -> T:
        """Make the current (compute) stream wait for `ready`'s copies, then hand its value over.
        Its tensors are marked as used by the compute stream, so the caching allocator does
        not hand their memory to the copy stream again while compute kernels still read it."""
        if ready.event is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(ready.event)
            for t in _tensors(ready.value):
                if t.is_cuda:
                    t.record_stream(stream)
        return ready.value

    def synchronize(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.device)


def _tensors(value: object) -> list[torch.Tensor]:
    """Every tensor inside nested dicts, lists and tuples (and quantized tensors' parts)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []
