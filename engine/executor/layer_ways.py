"""The one face a layer runs behind (`LayerRun`), and the ways that implement it.

The block schedule (engine/executor/zigzag.py) runs layer j over GPU batch k through one
call, `run(j, w, h, past, batch) -> Computed`; which way depends on the layer and the step:
- `EagerLayer`: every op in turn on the compute stream, the reference (and every layer that
  is not a decoder layer: embedding, head, state and dense layers);
- `GraphLayer`: a GPU batch whose dense ops replay CUDA graphs, its attention eager between
  them (engine/executor/cuda_graphs.py);
- `NanoLayer`: a decoder layer over the batch's nano-batches, the attention of one beside
  the dense ops of another (engine/executor/nano_overlap.py);
- `GroupedMoe`: a MoE layer whose rows are grouped per expert over the whole block
  (engine/executor/moe_block.py): the call runs the batch up to its MLP and holds it, and
  `block_outputs` runs each expert once for the block.
The pipeline picks the way per (layer, batch) (`BlockPipeline._compute`); all of them attend
through `LayerAttention`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from engine.executor.attention import join_kv
from engine.executor.cuda_graphs import GraphRunner, StepGraphs
from engine.executor.gpu_batch import GpuBatch, PastKV
from engine.executor.image_rows import add_deepstack, embed_images
from engine.executor.layer_attention import LayerAttention
from engine.executor.nano_overlap import NanoOverlap
from engine.executor.trace import NoTracer, Tracer
from engine.models.base import Model, Weights
from engine.storage.state_store import StateStore


class Computed(NamedTuple):
    """What layer j made of one GPU batch."""

    out: torch.Tensor
    """(T, hidden) output states; the head's (S, vocab) logits; a grouped MoE layer's
    residual stream, its outputs held to the block's end (`GroupedMoe.block_outputs`)."""
    new_kv: torch.Tensor | None
    """(T, row_dim) new KV rows; None for a layer without attention."""


class LayerRun(Protocol):
    """One way to run layer j over one GPU batch, given its weights `w`, the rows entering it
    `h` (None for the embedding, which reads the batch's token ids) and its past KV."""

    def __call__(
        self, j: int, w: Weights, h: torch.Tensor | None, past: PastKV, batch: GpuBatch
    ) -> Computed: ...


class EagerLayer:
    """Every op of the layer in turn on the compute stream. `states`: a hybrid model's
    per-sequence states, which its state layers read and write."""

    def __init__(self, model: Model, attention: LayerAttention, states: StateStore | None) -> None:
        self.model, self.attention, self.states = model, attention, states
        self.tracer: Tracer | NoTracer = NoTracer()
        self._kv_shape = model.config.kv_shape

    def __call__(
        self, j: int, w: Weights, h: torch.Tensor | None, past: PastKV, batch: GpuBatch
    ) -> Computed:
        kind = self.model.layer_kind(j)
        mixed = self.mixed(j, w, h, batch)
        with self.tracer.span("compute", "compute", j, batch.index):
            if kind == "embed":
                h = self.model.embed(w, batch.token_ids, batch.positions.ids)
                if batch.images is not None:  # an image's tokens take its features
                    h = embed_images(h, batch.images)
                return Computed(h, None)
            assert h is not None
            if kind == "head":
                return Computed(self.model.head(w, h.index_select(0, batch.logit_rows)), None)
            if kind == "state":
                return Computed(self.mix(j, w, h, batch), None)
            if kind == "dense":
                return Computed(self.model.dense_layer(w, h), None)
            q, k, v = self.model.attention_inputs(j, w, h, batch.positions)
            new_kv = join_kv(k, v, self._kv_shape.values_are_keys)  # (T, row_dim)
            o = self.attention(j, batch, past, (q, k, v), new_kv, self.model.attention_spec(j, w))
            out = self.model.layer_output(w, h, o, mixed)
            return Computed(add_deepstack(j - 1, out, batch.images), new_kv)

    def mixed(
        self, j: int, w: Weights, h: torch.Tensor | None, batch: GpuBatch
    ) -> torch.Tensor | None:
        """Falcon-H1: the output of decoder layer j's state mixer beside its attention, over
        the whole batch, run first; None for a layer without one."""
        if self.model.layer_kind(j) != "decoder" or not self.model.has_state(j):
            return None
        assert h is not None
        return self.mix(j, w, h, batch)

    def mix(self, j: int, w: Weights, h: torch.Tensor, batch: GpuBatch) -> torch.Tensor:
        """State layer j over one batch: its sequences' states gathered onto the compute
        device, updated by the layer, written back to their slots."""
        rows = batch.states
        assert self.states is not None and rows is not None, "a state layer without states"
        layer = self.model.state_layer_index(j)
        states = self.states.gather(layer, rows.slots, len(rows.spans), rows.runs)
        out = self.model.state_layer(j, w, h, states, rows.spans)
        self.states.scatter(layer, rows.slots, states, rows.runs)
        return out


@dataclass(frozen=True)
class GraphLayer:
    """A GPU batch's embedding and decoder layers replayed from its captured graphs: a
    decoder layer's dense ops before and after attention, the attention eager between them
    on the graphs' static buffers. Other layers run eagerly."""

    graphs: StepGraphs
    eager: EagerLayer

    def __call__(
        self, j: int, w: Weights, h: torch.Tensor | None, past: PastKV, batch: GpuBatch
    ) -> Computed:
        eager, graphs = self.eager, self.graphs
        kind = eager.model.layer_kind(j)
        if kind not in ("embed", "decoder"):
            return eager(j, w, h, past, batch)
        with eager.tracer.span("compute", "compute", j, batch.index):
            if kind == "embed":
                h = GraphRunner.embed(graphs, w)
                if batch.images is not None:  # as eagerly: an image's tokens take its features
                    h = embed_images(h, batch.images)
                return Computed(h, None)
            graphs.before[j - 1].replay()
            q, k, v = graphs.q, graphs.k, graphs.v
            new_kv = join_kv(k, v, eager.model.config.kv_shape.values_are_keys)  # (T, row_dim)
            spec = eager.model.attention_spec(j, w)
            graphs.o.copy_(eager.attention(j, batch, past, (q, k, v), new_kv, spec))
            graphs.after[j - 1].replay()
            return Computed(graphs.h, new_kv)


@dataclass(frozen=True)
class NanoLayer:
    """A GPU batch cut into nano-batches: its decoder layers run by `NanoOverlap` (with
    `graphs`, one per nano-batch, replaying their dense ops; None: eager), other layers
    eagerly over the whole batch."""

    nano: NanoOverlap
    eager: EagerLayer
    graphs: list[StepGraphs] | None

    def __call__(
        self, j: int, w: Weights, h: torch.Tensor | None, past: PastKV, batch: GpuBatch
    ) -> Computed:
        if self.eager.model.layer_kind(j) != "decoder":
            return self.eager(j, w, h, past, batch)
        mixed = self.eager.mixed(j, w, h, batch)
        assert h is not None
        out, new_kv = self.nano.run_layer(j, w, h, past, batch, self.graphs, mixed)
        return Computed(add_deepstack(j - 1, out, batch.images), new_kv)
