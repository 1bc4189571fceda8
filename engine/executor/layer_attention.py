"""`LayerAttention`: one layer's attention over one GPU batch, on the devices its groups attend on.

The device group attends on the compute device, reading the gpu tier's KV pages in place (the
layer's new KV rows written first) or over the packed past `LayerIO.load_cache` gathered;
the CPU group (decodes over host-homed KV, FlexGen Sec. 4.2) attends on the CPU, where only
q and the new k, v cross PCIe. Every way of running a layer whole (eager, CUDA-graph replay,
the grouped-MoE block) attends through it (engine/executor/layer_ways.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.executor.attention import (
    HostSinks,
    cpu_attention,
    paged_attention,
    ragged_attention,
    split_kv,
)
from engine.executor.gpu_batch import AttentionGroup, GpuBatch, PastKV
from engine.executor.trace import NoTracer, Tracer
from engine.kernels import PagedKernels
from engine.models.base import AttentionSpec, Model
from engine.storage.kv_store import KVRows, KVStore


def encoded_rows(kv: KVStore, new_kv: torch.Tensor, kv_rows: KVRows) -> torch.Tensor:
    """The (N, row_bytes) encoded rows of `new_kv` (T, row_dim) that `kv_rows` stores."""
    if len(kv_rows.slots) != new_kv.shape[0]:  # not one tier without padding
        new_kv = new_kv.index_select(0, kv_rows.rows)
    return kv.codec.encode(new_kv)


class LayerAttention:
    """Attention of layer j over a batch's groups. `after_moves(j)`: waits until layer j's
    page moves have landed (before the gpu tier's pool is written in place)."""

    def __init__(
        self,
        model: Model,
        kv: KVStore,
        after_moves: Callable[[int], None],
        kernels: PagedKernels | None,
    ) -> None:
        self.model, self.kv, self.after_moves = model, kv, after_moves
        self.kernels = kernels
        """The native CPU attention over the pool (`engine.kernels`), or None."""
        self.tracer: Tracer | NoTracer = NoTracer()
        self._kv_shape = model.config.kv_shape
        self._host_sinks = HostSinks()

    def __call__(
        self,
        j: int,
        batch: GpuBatch,
        past: PastKV,
        qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        new_kv: torch.Tensor,
        spec: AttentionSpec,
    ) -> torch.Tensor:
        """Layer j's attention output (T, num_heads, head_dim) for every row of the batch,
        from its (q, k, v) rows, as its `spec` scores it. Reading in place, the gpu tier's
        new KV rows (of `new_kv`) are written first."""
        q, k, v = qkv
        dev, cpu = batch.device_group, batch.cpu_group
        in_place = batch.reads_kv_in_place
        if in_place:
            self.after_moves(j)
            kv_rows = batch.new_kv["gpu"]
            self.kv.write(
                "gpu", self.model.kv_layer(j), kv_rows, encoded_rows(self.kv, new_kv, kv_rows)
            )
        if cpu is None and dev is not None and dev.rows is None:  # every row, one device
            return self._device_attention(j, dev, in_place, past, q, k, v, spec)
        o = torch.zeros_like(q)  # padding rows attend to nothing
        if dev is not None:
            assert dev.rows is not None
            o[dev.rows] = self._device_attention(
                j, dev, in_place, past, q[dev.rows], k[dev.rows], v[dev.rows], spec
            )
        if cpu is not None:
            rows = cpu.rows if cpu.rows is not None else slice(None)
            with self.tracer.span("cpu_attention", "cpu_attention", j, batch.index):
                o[rows] = self._cpu_attention(j, cpu, past.cpu, q[rows], k[rows], v[rows], spec)
        return o

    def _device_attention(
        self,
        j: int,
        group: AttentionGroup,
        in_place: bool,
        past: PastKV,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        spec: AttentionSpec,
    ) -> torch.Tensor:
        """Attention of the device group's rows: in place from the pool, or over packed past."""
        layout = group.layouts[spec.window]
        if in_place:
            pool = self.kv.pool("gpu", self.model.kv_layer(j))
            decode, kernels = self.kv.codec.decode, self.kernels
            return paged_attention(q, pool, decode, layout, self._kv_shape, kernels, spec)
        past_k, past_v = split_kv(past.device, self._kv_shape)
        return ragged_attention(q, k, v, past_k, past_v, layout, spec)

    def _cpu_attention(
        self,
        j: int,
        group: AttentionGroup,
        past: torch.Tensor | None,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        spec: AttentionSpec,
    ) -> torch.Tensor:
        """Decode attention on the CPU over host-homed KV (cpu or disk tier): only q and the
        new k, v cross PCIe."""
        spec = self._host_sinks.spec(j, spec)
        out = cpu_attention(q, k, v, past, group.layouts[spec.window], self._kv_shape, spec)
        return out.to(q.device, q.dtype, non_blocking=True)
