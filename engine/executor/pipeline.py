"""`BlockPipeline`: one engine step over a block of GPU batches, layer by layer (FlexGen Fig. 4).

Three parts, one concept each:
- the schedule, FlexGen's zig-zag written once (engine/executor/zigzag.py), in order (the
  reference) or looking ahead (`Policy.overlap`: loads and stores on copy threads beside
  the compute);
- the loads and stores it runs, FlexGen's verbs (engine/executor/layer_io.py);
- the compute of one layer over one GPU batch, behind one face (`_compute`, a `LayerRun`:
  engine/executor/layer_ways.py), run eagerly, as CUDA-graph replays, over nano-batches or
  grouped per expert over the block, as the step and the layer call for.
A step whose loads and stores move no bytes runs in order even with overlap on (nothing to
hide, and the hand-offs would cost time).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.core.engine_args import EngineArgs
from engine.core.kv_pages import PageMove
from engine.executor.cuda_graphs import GraphRunner, StepReplay
from engine.executor.gpu_batch import GpuBatch, PastKV
from engine.executor.layer_attention import LayerAttention
from engine.executor.layer_io import LayerIO, Stores
from engine.executor.layer_ways import Computed, EagerLayer, GraphLayer, LayerRun, NanoLayer
from engine.executor.moe_block import GroupedMoe
from engine.executor.nano_overlap import NanoOverlap
from engine.executor.trace import NoTracer, Tracer
from engine.executor.zigzag import ZigZag
from engine.kernels import PagedKernels, attention_kernels
from engine.models.base import Model, Weights
from engine.models.moe import MoeModel
from engine.storage.device import CopyWindow, Device
from policy import Policy


class BlockPipeline:
    """Runs one step's GPU batches through every layer of `model`, over the bytes `stores`
    holds, on `device`: the block shape's overlap and copy threads from `policy`, the
    switches from `args` (`native_kernels`, `nano_batch_overlap`, `group_experts`).
    `graphs`: the piecewise CUDA graphs of the dense ops, used for the steps where they
    apply (None: none); `cpu_expert_rows`: a MoE expert homed in host memory with at most
    this many rows in a block runs on the CPU (engine/executor/moe_block.py; 0: never)."""

    def __init__(
        self,
        model: Model,
        stores: Stores,
        device: Device,
        policy: Policy,
        args: EngineArgs,
        *,
        tracer: Tracer | NoTracer | None = None,
        graphs: GraphRunner | None = None,
        cpu_expert_rows: int = 0,
    ) -> None:
        self.model, self.device, self.states = model, device, stores.states
        self.overlap = policy.overlap
        self.graphs = graphs
        """Piecewise CUDA graphs of the dense ops, used for the steps where they apply."""
        self.io = LayerIO(model, stores, device, policy.num_load_threads, policy.num_store_threads)
        kernels = attention_kernels(device.is_cuda) if args.native_kernels else None
        self.attention = LayerAttention(model, stores.kv, self.io.after_moves, kernels)
        self.eager = EagerLayer(model, self.attention, stores.states)
        self.nano = (
            NanoOverlap(model, device, overlap=args.nano_batch_overlap)
            if policy.num_nano_batches > 1
            else None
        )
        """Runs the decoder layers of GPU batches cut into nano-batches (NanoFlow 4.3)."""
        self.grouped = (
            GroupedMoe(
                model,
                self.attention,
                stores.weights,
                device,
                enabled=args.group_experts,
                cpu_rows=cpu_expert_rows,
            )
            if isinstance(model, MoeModel)
            else None
        )
        """A MoE model's layers with their rows grouped per expert over the block."""
        self.tracer = tracer or NoTracer()
        self._replaying = StepReplay()
        self._ways: dict[int, LayerRun] = {}
        """This step's way of running each GPU batch's layers, by batch index."""

    def close(self) -> None:
        self.io.close()
        if self.nano is not None:
            self.nano.close()

    @property
    def tracer(self) -> Tracer | NoTracer:
        """Where every part's spans go (set on all of them)."""
        return self.io.tracer

    @tracer.setter
    def tracer(self, tracer: Tracer | NoTracer) -> None:
        parts = (self.io, self.attention, self.eager, self.nano, self.grouped)
        for part in parts:
            if part is not None:
                part.tracer = tracer

    @property
    def kernels(self) -> PagedKernels | None:
        """The native CPU attention over the pool (`engine.kernels`), or None."""
        return self.attention.kernels

    @kernels.setter
    def kernels(self, kernels: PagedKernels | None) -> None:
        self.attention.kernels = kernels

    @property
    def act_bytes(self) -> dict[str, int]:
        """Peak bytes of between-layer activations homed on each tier."""
        return self.io.act_bytes

    @property
    def store_window(self) -> CopyWindow:
        """Bounds the KV rows a step's stores to host memory keep on the device."""
        return self.io.store_window

    def run(self, batches: list[GpuBatch], moves: Sequence[PageMove] = ()) -> list[torch.Tensor]:
        """One step: returns (S_k, vocab) float32 logits for each GPU batch's logit rows.
        `moves` (cached pages spilled down or loaded back up) are applied layer by layer
        before that layer's KV is read or written."""
        io = self.io
        io.moves = list(moves)
        if self.grouped is not None:
            self.grouped.begin(batches)
            io.expert_loads = self.grouped.expert_loads
        self._replaying = StepReplay()
        if self.graphs is not None and self.graphs.applies(batches):
            self._replaying = self.graphs.begin(batches)
        self._ways = {batch.index: self._way(batch) for batch in batches}
        ahead = self.overlap and not io.moves_nothing(batches)
        return ZigZag(self.model, io, self._compute, self.grouped, ahead).run(batches)

    def _way(self, batch: GpuBatch) -> LayerRun:
        """How this step runs `batch`'s layers: over its nano-batches, replaying its graphs,
        or eagerly."""
        if batch.nano_batches:
            assert self.nano is not None
            return NanoLayer(self.nano, self.eager, self._replaying.nanos.get(batch.index))
        graphs = self._replaying.whole.get(batch.index)
        return self.eager if graphs is None else GraphLayer(graphs, self.eager)

    def _compute(
        self, j: int, w: Weights, h: torch.Tensor | None, past: PastKV, batch: GpuBatch
    ) -> Computed:
        """Layer j over one batch, the one face every way of running it is called through:
        (output states or logits, the new (T, row_dim) KV rows)."""
        if self.grouped is not None and self.grouped.groups(j):
            return self.grouped(j, w, h, past, batch)
        return self._ways[batch.index](j, w, h, past, batch)
