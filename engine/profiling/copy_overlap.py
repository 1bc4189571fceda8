"""How much of a host-to-device copy hides behind GEMMs on a GPU, timed with CUDA events.

The zig-zag schedule copies layer j+1's weights on a side stream while layer j computes
(FlexGen 4.1). Whether the two really run at once is the hardware's business: the copy
engines and the SMs share the memory system, and pageable or freshly pinned host memory
stalls the host before the GEMMs are even issued. So the profile measures it the way the
engine runs it: a layer-sized copy from pinned memory allocated once, on a side stream,
beside GEMMs of about the same length on the compute stream; `HardwareSpec.copy_hidden`
keeps the share of the shorter that disappears, and the cost model charges the rest.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch


def hidden_share(copy_s: float, compute_s: float, both_s: float) -> float:
    """(copy + compute - both) / min(copy, compute), clamped to [0, 1]: 1.0 when the shorter
    hides wholly behind the longer, 0.0 when they run one after the other."""
    shorter = min(copy_s, compute_s)
    if shorter <= 0:
        return 0.0
    return max(0.0, min(1.0, (copy_s + compute_s - both_s) / shorter))


def event_ms(fn: Callable[[], object], stream: torch.cuda.Stream) -> float:
    """Milliseconds `fn`'s work takes on `stream`, from events recorded around it."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        start.record(stream)
        fn()
        end.record(stream)
    end.synchronize()
    return float(start.elapsed_time(end))


@dataclass(frozen=True)
class Overlap:
    copy_ms: float
    """The copy alone (median)."""
    compute_ms: float
    """The GEMMs alone (median)."""
    both_ms: float
    """From the GEMMs' start to the later of the two ends, run together (median)."""
    gemms: int
    """GEMMs issued, to last about as long as the copy."""

    @property
    def hidden(self) -> float:
        return hidden_share(self.copy_ms, self.compute_ms, self.both_ms)


class CopyBesideGemms:
    """A copy on a side stream and square GEMMs on the compute stream of one CUDA device."""

    def __init__(self, device: torch.device, n: int = 8192) -> None:
        self.device = device
        self.compute = torch.cuda.current_stream(device)
        self.side = torch.cuda.Stream(device)
        self.a, self.b = (torch.randn(n, n, dtype=torch.float16, device=device) for _ in "ab")
        self.c = torch.empty(n, n, dtype=torch.float16, device=device)

    def gemm(self) -> None:
        torch.mm(self.a, self.b, out=self.c)

    def measure(self, copy: Callable[[], object], repeats: int = 5) -> Overlap:
        """`copy` alone, as many GEMMs as last about as long alone, and both together."""
        copy_ms = statistics.median(event_ms(copy, self.side) for _ in range(repeats))
        one = statistics.median(event_ms(self.gemm, self.compute) for _ in range(repeats))
        gemms = max(1, round(copy_ms / one))

        def compute() -> None:
            for _ in range(gemms):
                self.gemm()

        compute_ms = statistics.median(event_ms(compute, self.compute) for _ in range(repeats))
        both = [self._together(copy, compute) for _ in range(repeats)]
        return Overlap(copy_ms, compute_ms, statistics.median(both), gemms)

    def _together(self, copy: Callable[[], object], compute: Callable[[], object]) -> float:
        torch.cuda.synchronize(self.device)
        start = torch.cuda.Event(enable_timing=True)
        start.record(self.compute)
        self.side.wait_event(start)
        with torch.cuda.stream(self.side):
            copy()
            copied = torch.cuda.Event()
            copied.record(self.side)
        compute()
        self.compute.wait_event(copied)
        end = torch.cuda.Event(enable_timing=True)
        end.record(self.compute)
        end.synchronize()
        return float(start.elapsed_time(end))


def copy_compute_overlap(device: torch.device, nbytes: int, repeats: int = 5) -> Overlap:
    """`nbytes` copied host to device from pinned memory allocated once (the staging pool's
    way), beside GEMMs: the figure `HardwareSpec.copy_hidden` keeps."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host.random_(0, 255)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    probe = CopyBesideGemms(device)
    return probe.measure(lambda: dst.copy_(host, non_blocking=True), repeats)
