"""`BlockExperts`: where one MoE layer's routed experts come from when the whole block's rows
are grouped per expert (`BlockPipeline`, engine/executor/pipeline.py).

The block schedule at expert granularity (MoE-Gen's module-based batching, FlexGen's zig-zag
block): every GPU batch of the step runs the layer's attention first; then the block's rows,
all of them, are routed and grouped by expert, and each expert with rows runs once, one GEMM
pair over every row of the block routed to it. Experts homed on the compute device are used
where they lie; each other expert with rows is loaded once for the block, on a load thread,
in the order the experts run, so the next expert's load runs while this one computes; an
expert no row of the block routes to is not loaded at all. (The layer's other weights,
attention and router, load with the layer, beside the previous layer's compute, as a dense
layer's do.)

When the block has so many rows that it will route to nearly every expert anyway (the
expected distinct experts, `E (1 - (1 - k/E)^T)` for T rows, at least `LOAD_ALL_SHARE` of
them), the experts load with the layer instead: all of them, beside the previous layer's
compute, which hides more of the transfer than the loads within the layer can.

An expert homed in host memory that few rows route to runs on the CPU, where it lies,
instead of crossing PCIe (KTransformers, Fiddler, llama.cpp's `--n-cpu-moe`): when its rows
are at most the break-even of the cost model (`policy.moe.cpu_expert_break_even`: the CPU's
time for them against the copy's), with `Policy.cpu_experts` on. Its rows go to the host
and its output back; on a CPU-only box both paths run on the same memory.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from engine.executor.attention import join_kv
from engine.executor.gpu_batch import GpuBatch, PastKV
from engine.executor.image_rows import add_deepstack
from engine.executor.layer_attention import LayerAttention
from engine.executor.layer_ways import Computed
from engine.executor.tasks import Launch, Task, wait_all
from engine.executor.trace import NoTracer, Tracer
from engine.models.base import Weights
from engine.models.config import ModelConfig
from engine.models.moe import ExpertFn, MoeModel, expert_prefix
from engine.storage.device import Device, Ready
from engine.storage.weight_store import WeightStore
from policy.moe import expected_distinct_experts

LOAD_ALL_SHARE = 0.9
"""A block expected to route to at least this share of a layer's experts loads them all with
the layer (before routing, beside the previous layer's compute)."""


def loads_all_experts(config: ModelConfig, num_rows: int) -> bool:
    """A block of `num_rows` rows loads every expert with its layer (see the module)."""
    e, k = config.num_experts, config.num_experts_per_tok
    return expected_distinct_experts(e, k, num_rows) >= LOAD_ALL_SHARE * e


class BlockExperts:
    """The `ExpertSource` of MoE layer `j` in one step (engine/models/moe.py). `cpu_rows`: an
    expert homed in host memory with at most this many rows runs there, on the CPU, instead
    of being copied to the compute device (0: never)."""

    def __init__(
        self,
        j: int,
        w: Weights,
        store: WeightStore,
        launch: Launch,
        device: Device,
        tracer: Tracer | NoTracer,
        cpu_rows: int = 0,
    ) -> None:
        self.j, self.w, self.store, self.device, self.tracer = j, w, store, device, tracer
        self.launch, self.cpu_rows = launch, cpu_rows
        self._loads: dict[int, Task[Ready[Weights]]] = {}
        self._on_cpu: set[int] = set()

    def start(self, active: dict[int, int]) -> None:
        homes = self.store.layers[self.j].experts
        for e, rows in active.items():
            if f"{expert_prefix(e)}down.weight" in self.w:  # resident, or loaded with the layer
                continue
            if homes[e].tier == "cpu" and rows <= self.cpu_rows:
                self._on_cpu.add(e)  # fewer rows than the copy is worth: computed where it lies
                continue
            self._loads[e] = self.launch(True, self._load, e)

    def _load(self, e: int) -> Ready[Weights]:
        span = self.tracer.span("load_expert", "load", self.j, expert=e)
        with self.device.on_copy_stream(), span:
            return self.store.load_expert(self.j, e)

    def run(self, e: int, x: torch.Tensor, fn: ExpertFn) -> torch.Tensor:
        if e in self._on_cpu:
            with self.tracer.span("cpu_expert", "cpu_expert", self.j, expert=e):
                return fn(self.store.host_expert(self.j, e), x.cpu()).to(x.device)
        load = self._loads.pop(e, None)
        w = self.w if load is None else self.device.wait(load.result())
        with self.tracer.span("expert", "compute", self.j, expert=e):
            return fn(w, x)

    def pending(self) -> list[Task[Ready[Weights]]]:
        """Loads started and not used (a failure part-way): waited for before the step ends."""
        return list(self._loads.values())


class HeldRows(NamedTuple):
    """One GPU batch's rows held at a MoE layer's MLP until the block's experts run."""

    residual: torch.Tensor
    """(T, hidden) the residual stream."""
    normed: torch.Tensor
    """(T, hidden) the MLP's normed input."""
    images: tuple[torch.Tensor, torch.Tensor] | None
    """The batch's image rows and features, for DeepStack (`image_rows.add_deepstack`)."""


class GroupedMoe:
    """The grouped-MoE way of running a layer (`LayerRun`, engine/executor/layer_ways.py): each
    GPU batch's call runs it up to its MLP, holding the batch's normed rows; `block_outputs`
    then runs every batch's rows at once, each expert once for the block. `enabled`: the
    switch (`EngineArgs.group_experts`); off, each GPU batch routes its own rows in its MLP,
    every expert loaded with the layer. `cpu_rows`: as `BlockExperts`'s."""

    def __init__(
        self,
        model: MoeModel,
        attention: LayerAttention,
        store: WeightStore,
        device: Device,
        *,
        enabled: bool,
        cpu_rows: int,
    ) -> None:
        self.model, self.attention, self.store, self.device = model, attention, store, device
        self.enabled, self.cpu_rows = enabled, cpu_rows
        self.tracer: Tracer | NoTracer = NoTracer()
        self._kv_shape = model.config.kv_shape
        self._grouped = self._routed_loads = False
        self._held: list[HeldRows] = []

    def begin(self, batches: list[GpuBatch]) -> None:
        """Set this step's grouping: every MoE layer's rows over the whole block (with
        nano-batches each one's MLP routes its own rows, its experts loaded with the layer),
        its experts off the device loaded once routed, only those with rows, unless the
        block routes to nearly all of them (then all with the layer: `loads_all_experts`)."""
        self._held = []  # a failed step's, if any
        self._grouped = self.enabled and not any(b.nano_batches for b in batches)
        num_rows = sum(b.num_tokens for b in batches)
        self._routed_loads = self._grouped and not loads_all_experts(self.model.config, num_rows)

    def groups(self, j: int) -> bool:
        """Layer j is a MoE layer (after attention, or alone: Nemotron-H's 'dense' ones) whose
        rows this step groups per expert over the block."""
        return (
            self._grouped
            and self.model.layer_kind(j) in ("decoder", "dense")
            and self.model.config.is_moe_layer(j - 1)
        )

    def expert_loads(self, j: int) -> tuple[bool, bool]:
        """How layer j's weights load (`WeightStore.load`): (its routed experts with the
        layer, those homed in host memory too; they may run on the CPU instead)."""
        grouped = self.groups(j)
        host_later = grouped and self.cpu_rows > 0
        return not (grouped and self._routed_loads), not host_later

    def __call__(
        self, j: int, w: Weights, h: torch.Tensor | None, past: PastKV, batch: GpuBatch
    ) -> Computed:
        """MoE layer j over one batch up to its MLP: (the residual stream, the new KV rows;
        None for a layer without attention); its normed rows held for `block_outputs`."""
        assert h is not None
        with self.tracer.span("compute", "compute", j, batch.index):
            if self.model.layer_kind(j) == "dense":
                self._held.append(HeldRows(h, self.model.input_norm(w, h), batch.images))
                return Computed(h, None)
            q, k, v = self.model.attention_inputs(j, w, h, batch.positions)
            new_kv = join_kv(k, v, self._kv_shape.values_are_keys)
            spec = self.model.attention_spec(j, w)
            o = self.attention(j, batch, past, (q, k, v), new_kv, spec)
            h, x = self.model.before_mlp(w, h, o)
            self._held.append(HeldRows(h, x, batch.images))
            return Computed(h, new_kv)

    def block_outputs(self, j: int, w: Weights, launch: Launch) -> list[torch.Tensor]:
        """MoE layer j's MLP over every held batch's rows at once, each expert run once for
        the block, experts off the device loaded by `launch`: each batch's layer output."""
        held, self._held = self._held, []
        source = BlockExperts(j, w, self.store, launch, self.device, self.tracer, self.cpu_rows)
        try:
            outs = self.model.block_mlp(w, [rows.normed for rows in held], source)
        finally:
            wait_all(source.pending())
        return [
            add_deepstack(j - 1, rows.residual + out, rows.images)
            for rows, out in zip(held, outs, strict=True)
        ]
