"""`DeviceLedger`: every byte a CUDA device would hold, counted as the engine allocates and
frees it (the rehearsal's memory: engine/fake_cuda.py).

A buffer is counted from the operator that makes it until its last tensor is gone, as torch's
caching allocator does, with one refinement that matters for an offloaded step: a buffer a
side stream was told to keep (`Tensor.record_stream`) stays allocated after its tensors are
gone until the host has seen that stream pass the point where it was recorded (an event
recorded after it, synchronized, or the whole device synchronized). The device is assumed to
lag the host as far as it can: nothing completes that the host has not waited for. What a
layer loop runs ahead of the device is therefore held in full, as on a GPU slower than the
loop (the H200's OPT-6.7B run held a whole step's KV stores this way and ran out of memory).
Graph capture keeps the most its bodies held at once for good (a private pool).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(slots=True)
class Buffer:
    """One allocation: its bytes, what made it, and how many tensors still view it."""

    nbytes: int
    label: str
    refs: int = 0
    recorded: int | None = None
    """The ledger's clock when a side stream last recorded it (None: never)."""


@dataclass(frozen=True)
class Peak:
    """Where the most bytes were alive at once."""

    nbytes: int
    step: str
    """`setup` (loading, pools, graphs) or the step: `prefill 1`, `decode 7`, ..."""
    task: str
    """The pipeline task that allocated the byte that made the peak (`compute`, ...)."""
    layer: int | None
    gpu_batch: int | None
    buffers: dict[str, int]
    """Live bytes by what made them, largest first."""


@dataclass
class DeviceLedger:
    """Counts the device bytes alive; `peak` holds where the most were."""

    live_bytes: int = 0
    peak: Peak = field(default_factory=lambda: Peak(0, "setup", "", None, None, {}))
    step: str = "setup"
    step_peak: int = 0
    """The most bytes alive since `step` last changed (the caller resets it)."""
    _buffers: dict[int, Buffer] = field(default_factory=dict)
    _deferred: list[Buffer] = field(default_factory=list)
    _by_label: dict[str, int] = field(default_factory=dict)
    _clock: int = 0
    _completed: int = 0
    label_peaks: dict[str, int] = field(default_factory=dict)
    """The most bytes alive at once by what made them, over the whole run."""
    held: dict[str, int] = field(default_factory=dict)
    """Bytes counted for good by `hold`, by label (graph pools)."""
    deferred_bytes: int = 0
    """Bytes alive only because a side stream may still read them (stores in flight)."""
    deferred_peak: int = 0
    """The most `deferred_bytes` at once, over the whole run."""
    on_complete: list[Callable[[int], None]] = field(default_factory=list)
    """Called with the clock the host has seen the device reach (after `complete`)."""
    _lock: threading.RLock = field(default_factory=threading.RLock)
    _local: threading.local = field(default_factory=threading.local)

    # -- what is running -----------------------------------------------------------------

    @contextmanager
    def task(
        self, label: str, layer: int | None = None, gpu_batch: int | None = None
    ) -> Iterator[None]:
        """Attribute what this thread allocates in the body to `label` (at `layer`)."""
        stack = self._stack()
        stack.append((label, layer, gpu_batch))
        try:
            yield
        finally:
            stack.pop()

    def _stack(self) -> list[tuple[str, int | None, int | None]]:
        stack: list[tuple[str, int | None, int | None]] | None = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def _where(self) -> tuple[str, int | None, int | None]:
        stack = self._stack()
        return stack[-1] if stack else ("step" if self.step != "setup" else "setup", None, None)

    # -- allocations ---------------------------------------------------------------------

    def track(self, t: torch.Tensor) -> None:
        """Note a device tensor an operator returned: a new buffer is counted, a view of a
        counted one keeps it alive."""
        key = storage_key(t)
        with self._lock:
            buffer = self._buffers.get(key)
            if buffer is None:
                label = self._where()[0]
                buffer = self._buffers[key] = Buffer(t.untyped_storage().nbytes(), label)
                self._add(buffer.label, buffer.nbytes)
            buffer.refs += 1
        weakref.finalize(t, self._release, key, buffer)

    def _add(self, label: str, nbytes: int) -> None:
        self.live_bytes += nbytes
        self._by_label[label] = self._by_label.get(label, 0) + nbytes
        self.label_peaks[label] = max(self.label_peaks.get(label, 0), self._by_label[label])
        self.step_peak = max(self.step_peak, self.live_bytes)
        if self.live_bytes > self.peak.nbytes:
            task, layer, gpu_batch = self._where()
            ranked = sorted(self._by_label.items(), key=lambda kv: -kv[1])
            self.peak = Peak(
                self.live_bytes, self.step, task, layer, gpu_batch, {k: v for k, v in ranked if v}
            )

    def _free(self, buffer: Buffer) -> None:
        self.live_bytes -= buffer.nbytes
        self._by_label[buffer.label] -= buffer.nbytes

    def _release(self, key: int, buffer: Buffer) -> None:
        with self._lock:
            buffer.refs -= 1
            if buffer.refs > 0:
                return
            if self._buffers.get(key) is buffer:
                del self._buffers[key]
            if buffer.recorded is not None and buffer.recorded > self._completed:
                self._deferred.append(buffer)  # a side stream may still read it
                self.deferred_bytes += buffer.nbytes
                self.deferred_peak = max(self.deferred_peak, self.deferred_bytes)
            else:
                self._free(buffer)

    def hold(self, label: str, nbytes: int) -> None:
        """Count `nbytes` for good (a graph's private pool)."""
        with self._lock:
            self._add(label, nbytes)
            self.held[label] = self.held.get(label, 0) + nbytes

    # -- streams -------------------------------------------------------------------------

    def record_stream(self, t: torch.Tensor) -> None:
        """A side stream reads `t`: its buffer outlives its tensors until the host has seen
        that stream get past this point."""
        with self._lock:
            buffer = self._buffers.get(storage_key(t))
            if buffer is not None:
                self._clock += 1
                buffer.recorded = self._clock

    def now(self) -> int:
        """The clock, for an event recorded now."""
        with self._lock:
            self._clock += 1
            return self._clock

    def done(self, clock: int) -> bool:
        return clock <= self._completed

    def complete(self, clock: int | None = None) -> None:
        """The host has seen the device get past `clock` (None: everything so far): buffers
        held for side streams since before then are freed."""
        with self._lock:
            self._completed = max(self._completed, self._clock if clock is None else clock)
            kept = []
            for buffer in self._deferred:
                if buffer.recorded is not None and buffer.recorded <= self._completed:
                    self._free(buffer)
                    self.deferred_bytes -= buffer.nbytes
                else:
                    kept.append(buffer)
            self._deferred = kept
            completed = self._completed
        for hook in self.on_complete:
            hook(completed)

    def to_dict(self) -> dict[str, Any]:
        p = self.peak
        return {
            "step": p.step,
            "task": p.task,
            "layer": p.layer,
            "gpu_batch": p.gpu_batch,
            "buffers": p.buffers,
        }


def storage_key(t: torch.Tensor) -> int:
    """Identity of the buffer `t` views (its storage object's address; data pointers of
    tensors without data are all zero)."""
    return int(t.untyped_storage()._cdata)
