"""`Tracer`: a timeline of what ran when, written as Chrome trace-event JSON (Perfetto).

Every load, store, compute and CPU-attention task of the block pipeline is one complete
event (`"ph": "X"`, `ts` and `dur` in microseconds) with `cat` one of `load`, `store`,
`compute`, `cpu_attention` and `args` {layer, gpu_batch, nano_batch}. `tid` is the
thread that ran it; on CUDA, spans that run on the device are timed with CUDA events on
the thread's current stream, and `tid` is that stream. Tracing is off unless asked for
(`EngineArgs.trace`, `nanoflex bench --trace FILE`): the off path costs nothing.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

CATEGORIES = ("load", "store", "compute", "cpu_attention", "cpu_expert")
HOST_CATEGORIES = ("cpu_attention", "cpu_expert")
"""Work the CPU does itself: timed on the host clock, on CUDA too."""


@dataclass(slots=True)
class Span:
    """One task as it ran; times in seconds from the tracer's start."""

    name: str
    """What ran: load_weight, load_cache, load_activation, compute, store_cache, ..."""
    cat: str
    """One of CATEGORIES."""
    track: str
    """The thread (or CUDA stream) it ran on."""
    args: dict[str, int]
    """layer, gpu_batch, nano_batch."""
    start_s: float = 0.0
    end_s: float = 0.0
    events: tuple[Any, Any] | None = None
    """CUDA: (start, end) timing events, resolved into start_s/end_s at `flush`."""


@dataclass
class Tracer:
    """Collects spans from any thread (appends are atomic under the GIL)."""

    cuda: bool = False
    """Time device work with CUDA events instead of the host clock."""
    spans: list[Span] = field(default_factory=list)
    _t0: float = field(default_factory=time.perf_counter)
    _base: Any = None

    def __post_init__(self) -> None:
        if self.cuda:
            self._base = torch.cuda.Event(enable_timing=True)
            self._base.record()
            self._t0 = time.perf_counter()

    @contextmanager
    def span(
        self,
        name: str,
        cat: str,
        layer: int,
        gpu_batch: int = 0,
        nano_batch: int = 0,
        host: bool = False,
        expert: int | None = None,
    ) -> Iterator[None]:
        """Time the body as one event: on CUDA, device time on the current stream, unless
        `host` (work the CPU does itself, such as CPU attention) or the category is one of
        `HOST_CATEGORIES`; elsewhere the host clock. `expert`: a MoE layer's routed expert the
        event is about."""
        assert cat in CATEGORIES, cat
        args = {"layer": layer, "gpu_batch": gpu_batch, "nano_batch": nano_batch}
        if expert is not None:
            args["expert"] = expert
        on_device = self.cuda and not host and cat not in HOST_CATEGORIES
        if on_device:
            stream = torch.cuda.current_stream()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            yield
            end.record(stream)
            track = f"cuda stream {stream.stream_id}"
            self.spans.append(Span(name, cat, track, args, events=(start, end)))
            return
        start_s = time.perf_counter() - self._t0
        yield
        end_s = time.perf_counter() - self._t0
        self.spans.append(Span(name, cat, threading.current_thread().name, args, start_s, end_s))

    def flush(self) -> None:
        """Resolve CUDA timings (call after the device finished the traced work)."""
        for span in self.spans:
            if span.events is not None:
                start, end = span.events
                span.start_s = self._base.elapsed_time(start) / 1e3
                span.end_s = self._base.elapsed_time(end) / 1e3
                span.events = None

    def to_chrome(self) -> dict[str, Any]:
        """Chrome trace-event JSON: complete events plus thread-name metadata."""
        self.flush()
        tids: dict[str, int] = {}
        events: list[dict[str, Any]] = []
        for span in sorted(self.spans, key=lambda s: s.start_s):
            tid = tids.setdefault(span.track, len(tids) + 1)
            events.append(
                {
                    "name": span.name,
                    "cat": span.cat,
                    "ph": "X",
                    "ts": round(span.start_s * 1e6, 3),
                    "dur": round((span.end_s - span.start_s) * 1e6, 3),
                    "pid": 1,
                    "tid": tid,
                    "args": span.args,
                }
            )
        names = [
            {"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": track}}
            for track, tid in tids.items()
        ]
        return {"traceEvents": names + events, "displayTimeUnit": "ms"}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_chrome()))


class NoTracer:
    """Tracing off: `span` returns one shared do-nothing context."""

    _NULL = nullcontext()

    def span(
        self,
        name: str,
        cat: str,
        layer: int,
        gpu_batch: int = 0,
        nano_batch: int = 0,
        host: bool = False,
        expert: int | None = None,
    ) -> AbstractContextManager[None]:
        return self._NULL
