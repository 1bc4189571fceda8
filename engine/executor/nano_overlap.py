"""`NanoOverlap`: one decoder layer of a GPU batch run as its nano-batches, the attention of one
overlapping the dense operations of the others (NanoFlow 4.3).

Per nano-batch i a decoder layer is three operations: A_i, the dense ops before attention
(norm, QKV projection, rotary); B_i, attention; C_i, the dense ops after it (output
projection, residuals, MLP). A_i -> B_i -> C_i is the only order they need. The compute
stream runs A_0, A_1, ..., A_{n-1}, then C_0, C_1, ..., each C_i once B_i is done, while the
attentions run beside it, in order, each as soon as its A_i is:
- on the compute device, on a second CUDA stream fenced by events (NanoFlow's single-GPU
  pipeline: the MLP of one nano-batch overlaps the attention of another);
- on the CPU (CPU attention over host-homed KV, FlexGen Sec. 4.2), on a CPU thread: while the
  CPU attends nano-batch i, the device runs the QKV projection of i+1 and the output
  projection and MLP of i-1. The q/k/v copies to the host ride their own stream, the
  attention outputs come back on the CPU thread's copy stream.
Issuing every A first means an attention never waits behind an MLP. Where the compute device
is the CPU, the device's attention runs on a thread too (torch ops release the GIL), so the
schedule, its dependencies and its tokens are the same everywhere; only the speed differs.
With `overlap=False` the nano-batches run one operation after another on the compute stream
(NanoFlow's "nano-batch-only" ablation baseline).
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import torch

from engine.executor.attention import (
    HostSinks,
    cpu_attention,
    join_kv,
    ragged_attention,
    split_kv,
)
from engine.executor.cuda_graphs import StepGraphs
from engine.executor.gpu_batch import GpuBatch, NanoAttention, NanoBatch, PastKV
from engine.executor.tasks import Task, start
from engine.executor.trace import NoTracer, Tracer
from engine.models.base import AttentionSpec, Model, Weights
from engine.storage.device import Device

Event = torch.cuda.Event
Attended = tuple[torch.Tensor, Event | None]
"""An attention output (T_a, num_heads, head_dim) on the compute device, and the event the
compute stream waits for before reading it (None: ready now)."""
QKV = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _rows(qkv: QKV, rows: torch.Tensor | None) -> QKV:
    """q, k, v of the given rows (all when None); v stays k where it is k (values that are
    the keys: `KVShape`)."""
    if rows is None:
        return qkv
    k = qkv[1][rows]
    return qkv[0][rows], k, k if qkv[2] is qkv[1] else qkv[2][rows]


class NanoOverlap:
    """Runs decoder layers over the nano-batches of a GPU batch (`GpuBatch.nano_batches`)."""

    def __init__(
        self,
        model: Model,
        device: Device,
        *,
        overlap: bool = True,
        tracer: Tracer | NoTracer | None = None,
    ) -> None:
        self.model, self.device, self.overlap = model, device, overlap
        self.tracer = tracer or NoTracer()
        c = model.config
        self._kv_shape = c.kv_shape
        self._host_sinks = HostSinks()
        cuda = device.is_cuda and overlap
        self._attention_stream = torch.cuda.Stream(device.device) if cuda else None
        """CUDA: the second stream the device's attention runs on."""
        self._to_host_stream = torch.cuda.Stream(device.device) if cuda else None
        """CUDA: the stream q/k/v ride to the host on, for CPU attention."""
        self._attention_thread = (
            ThreadPoolExecutor(1, thread_name_prefix="nanoflex-attention")
            if overlap and not device.is_cuda
            else None
        )
        """CPU compute device: the thread the device's attention runs on."""
        self._cpu_thread = (
            ThreadPoolExecutor(1, thread_name_prefix="nanoflex-cpu-attention") if overlap else None
        )
        self.num_layers_run = 0
        """Decoder layers run as nano-batches (tests check the path was taken)."""

    def close(self) -> None:
        for pool in (self._attention_thread, self._cpu_thread):
            if pool is not None:
                pool.shutdown(wait=True)

    def run_layer(
        self,
        j: int,
        w: Weights,
        h: torch.Tensor,
        past: PastKV,
        batch: GpuBatch,
        graphs: list[StepGraphs] | None = None,
        mixed: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Decoder layer j over `batch`'s nano-batches, given the batch's packed past KV of its
        device and CPU attention groups: (output states (T, hidden), the new (T, row_dim) KV
        rows), the same rows in the same order as the whole-batch path. `graphs`: per
        nano-batch, CUDA graphs of its dense ops (engine/executor/cuda_graphs.py), replayed
        on its static buffers with the attention run eagerly in between. `mixed`: the whole
        batch's output of a state mixer beside the attention (Falcon-H1), or None."""
        span, k = self.tracer.span, batch.index
        self.num_layers_run += 1
        new_kv: list[torch.Tensor] = []
        launched: list[tuple[torch.Tensor, list[tuple[NanoAttention, Task[Attended]]]]] = []
        spec = self.model.attention_spec(j, w)
        for nano in batch.nano_batches:
            with span("attention_inputs", "compute", j, k, nano.index):
                if graphs is not None:
                    g = graphs[nano.index]
                    g.h.copy_(h[nano.rows])
                    g.before[j - 1].replay()
                    q, key, value = g.q, g.k, g.v
                else:
                    q, key, value = self.model.attention_inputs(
                        j, w, h[nano.rows], batch.positions[nano.rows]
                    )
                new_kv.append(join_kv(key, value, self._kv_shape.values_are_keys))
            ready = self.device.record() if self.overlap else None
            launched.append((q, self._launch(j, k, nano, past, (q, key, value), ready, spec)))
        outs = []
        for nano, (q, parts) in zip(batch.nano_batches, launched, strict=True):
            o = self._collect(q, parts)
            with span("attention_output", "compute", j, k, nano.index):
                if graphs is not None:
                    g = graphs[nano.index]
                    g.o.copy_(o)
                    g.after[j - 1].replay()
                    outs.append(g.h)
                else:
                    beside = None if mixed is None else mixed[nano.rows]
                    outs.append(self.model.layer_output(w, h[nano.rows], o, beside))
        return torch.cat(outs), torch.cat(new_kv)

    # -- attention -----------------------------------------------------------------------

    def _launch(
        self,
        j: int,
        k: int,
        nano: NanoBatch,
        past: PastKV,
        qkv: QKV,
        ready: Event | None,
        spec: AttentionSpec,
    ) -> list[tuple[NanoAttention, Task[Attended]]]:
        """Start nano-batch `nano`'s attention: its device part and its CPU part."""
        parts = []
        if nano.device is not None:
            args = (j, k, nano.index, nano.device, past.device, qkv, ready, spec)
            parts.append(
                (nano.device, start(self._attention_thread, self._device_attention, *args))
            )
        if nano.cpu is not None:
            host, copied = self._to_host(j, k, nano.index, nano.cpu, qkv, ready)
            args2 = (j, k, nano.index, nano.cpu, past.cpu, host, copied, qkv[0].dtype, spec)
            parts.append((nano.cpu, start(self._cpu_thread, self._cpu_attention, *args2)))
        return parts

    def _device_attention(
        self,
        j: int,
        k: int,
        index: int,
        part: NanoAttention,
        past: torch.Tensor | None,
        qkv: QKV,
        ready: Event | None,
        spec: AttentionSpec,
    ) -> Attended:
        """Attention of the part's sequences on the compute device (on CUDA, on the attention
        stream once `ready`, the end of the nano-batch's QKV projection, has passed)."""
        with self._on_stream(self._attention_stream, ready, (*qkv, past)):
            q, key, value = _rows(qkv, part.rows)
            with self.tracer.span("attention", "compute", j, k, index):
                past_rows = None if past is None else past[part.past]
                past_k, past_v = split_kv(past_rows, self._kv_shape)
                layout = part.layouts[spec.window]
                out = ragged_attention(q, key, value, past_k, past_v, layout, spec)
            return out, self.device.record() if self._attention_stream is not None else None

    def _to_host(
        self, j: int, k: int, index: int, part: NanoAttention, qkv: QKV, ready: Event | None
    ) -> tuple[QKV, Event | None]:
        """The part's q, k, v on their way to the host (CUDA: on the to-host stream into pinned
        memory, with the event that says they arrived)."""
        if not self.device.is_cuda:
            return _rows(qkv, part.rows), None
        with (
            self._on_stream(self._to_host_stream, ready, qkv),
            self.tracer.span("copy_qkv_to_host", "store", j, k, index),
        ):
            host = []
            q, key, value = _rows(qkv, part.rows)
            for t in (q, key) if value is key else (q, key, value):
                pinned = self.device.staging.take(tuple(t.shape), t.dtype)  # given back in use
                pinned.copy_(t, non_blocking=True)
                host.append(pinned)
            return (host[0], host[1], host[-1]), self.device.record()

    def _cpu_attention(
        self,
        j: int,
        k: int,
        index: int,
        part: NanoAttention,
        past: torch.Tensor | None,
        qkv: QKV,
        copied: Event | None,
        dtype: torch.dtype,
        spec: AttentionSpec,
    ) -> Attended:
        """CPU attention of the part's decodes, once their q, k, v are on the host; the output
        goes back on this thread's copy stream."""
        if copied is not None:
            copied.synchronize()
        with self.tracer.span("cpu_attention", "cpu_attention", j, k, index):
            past_rows = None if past is None else past[part.past]
            layout = part.layouts[spec.window]
            spec = self._host_sinks.spec(j, spec)
            out = cpu_attention(*qkv, past_rows, layout, self._kv_shape, spec)
        if not self.device.is_cuda:
            return out.to(dtype), None
        for t in qkv[:2] if qkv[2] is qkv[1] else qkv:  # staged by _to_host, read by now
            self.device.staging.give(t)
        with (
            self.device.on_copy_stream(),
            self.tracer.span("copy_attention_to_device", "load", j, k, index),
        ):
            staged = self.device.staging.take(tuple(out.shape), dtype)
            staged.copy_(out)
            on_device = self.device.to_device(staged)
            self.device.release(staged)  # reused once the copy just enqueued has read it
            return on_device, self.device.record()

    def _collect(
        self, q: torch.Tensor, parts: list[tuple[NanoAttention, Task[Attended]]]
    ) -> torch.Tensor:
        """The nano-batch's attention output (T_i, num_heads, head_dim) on the compute stream,
        once every part has finished; padding rows attend to nothing (zeros)."""
        outs = []
        for part, future in parts:
            out, done = future.result()
            if done is not None:
                stream = torch.cuda.current_stream(self.device.device)
                stream.wait_event(done)
                out.record_stream(stream)
            outs.append((part, out))
        if len(outs) == 1 and outs[0][0].rows is None:
            return outs[0][1]
        o = torch.zeros_like(q)
        for part, out in outs:
            o[part.rows] = out
        return o

    @contextmanager
    def _on_stream(
        self,
        stream: torch.cuda.Stream | None,
        ready: Event | None,
        tensors: tuple[torch.Tensor | None, ...],
    ) -> Iterator[None]:
        """Make `stream` current once `ready` has passed; the compute stream's `tensors` are
        marked as used by it, so their memory is not reused while it still reads them."""
        if stream is None:
            yield
            return
        with torch.cuda.stream(stream):
            if ready is not None:
                stream.wait_event(ready)
            for t in tensors:
                if t is not None and t.is_cuda:
                    t.record_stream(stream)
            yield
