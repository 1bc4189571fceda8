"""`GraphRunner`: piecewise CUDA graphs of a resident model's dense ops at the discrete sizes.

A decode step of a small block is launch-bound on a GPU: hundreds of small kernels per
layer. With discrete batching every step runs at one of a few row counts, so the dense
ops can be captured once per count and replayed (vLLM's capture sizes). Attention is not
captured: its shapes follow each sequence's past length. So each decoder layer is two
graphs, the ops before attention (norm, QKV, rotary) and the ops after (output projection,
MLP, residuals), with attention run eagerly between them on the same static buffers
(vLLM v1's piecewise graphs). The embedding is one more graph; the head runs eagerly on
the rows that need logits.

Used only where it is sound: CUDA, every layer's weights resident and uncompressed (the
graphs read the weight tensors by address), one GPU batch, activations on the device, and
decode-only steps at a size seen before or captured now. `EngineArgs.cuda_graphs=False`
(`--no-cuda-graphs`) turns it off; tokens are identical either way (the GPU suite checks).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from engine.executor.gpu_batch import GpuBatch
from engine.models.base import Model, Positions, Weights


@dataclass
class StepGraphs:
    """Static buffers and graphs for one row count T."""

    token_ids: torch.Tensor  # (T,) long
    positions: torch.Tensor  # (T,) long
    h: torch.Tensor  # (T, hidden): the states entering a layer, updated in place per layer
    q: torch.Tensor  # (T, num_heads, head_dim)
    k: torch.Tensor  # (T, num_kv_heads, head_dim)
    v: torch.Tensor  # (T, num_kv_heads, head_dim)
    o: torch.Tensor  # (T, num_heads, head_dim): attention output, written eagerly
    tables: Positions | None = None
    """The positions' rotary tables the graphs read: held here, since a graph keeps no tensor
    alive, and freed tables would be handed to other tensors while replays still use them."""
    embed: Any = None  # the embedding and the positions' tables
    before: list[Any] = field(default_factory=list)  # per decoder layer
    after: list[Any] = field(default_factory=list)  # per decoder layer


class GraphRunner:
    def __init__(
        self, model: Model, weights: list[Weights], device: torch.device, dtype: torch.dtype
    ) -> None:
        self.model, self.weights, self.device, self.dtype = model, weights, device, dtype
        self._graphs: dict[int, StepGraphs] = {}
        self._pool: Any = None
        self.num_replays = 0
        """Steps run through graphs (the GPU suite checks the path was taken)."""

    @staticmethod
    def applies(batches: list[GpuBatch]) -> bool:
        """One GPU batch, every sequence decoding one token, activations on the device."""
        if len(batches) != 1:
            return False
        batch = batches[0]
        decoding = batch.device_group is None or batch.device_group.layout.q_max == 1
        on_cpu = batch.cpu_group is None or batch.cpu_group.layout.q_max == 1
        return decoding and on_cpu and not batch.act_rows

    def begin(self, batch: GpuBatch) -> StepGraphs:
        """The graphs for this batch's row count (captured on first use), inputs copied in."""
        rows = batch.num_tokens
        graphs = self._graphs.get(rows)
        if graphs is None:
            graphs = self._graphs[rows] = self._capture(rows)
        graphs.token_ids.copy_(batch.token_ids)
        graphs.positions.copy_(batch.positions.ids)
        self.num_replays += 1
        return graphs

    # -- capture ---------------------------------------------------------------------------

    def _capture(self, rows: int) -> StepGraphs:
        c = self.model.config
        device, dtype = self.device, self.dtype
        g = StepGraphs(
            token_ids=torch.zeros(rows, dtype=torch.long, device=device),
            positions=torch.zeros(rows, dtype=torch.long, device=device),
            h=torch.zeros(rows, c.hidden_size, dtype=dtype, device=device),
            q=torch.zeros(rows, c.num_heads, c.head_dim, dtype=dtype, device=device),
            k=torch.zeros(rows, c.num_kv_heads, c.head_dim, dtype=dtype, device=device),
            v=torch.zeros(rows, c.num_kv_heads, c.head_dim, dtype=dtype, device=device),
            o=torch.zeros(rows, c.num_heads, c.head_dim, dtype=dtype, device=device),
        )
        embed = self.weights[0]
        made = self.model.positions(g.positions, dtype)
        tables = g.tables = Positions(g.positions, tuple(torch.zeros_like(t) for t in made.tables))

        def embed_step() -> None:
            g.h.copy_(self.model.embed(embed, g.token_ids, g.positions))
            for static, fresh in zip(
                tables.tables, self.model.positions(g.positions, dtype).tables, strict=True
            ):
                static.copy_(fresh)

        g.embed = self._graph(embed_step)
        for j in range(1, self.model.num_layers - 1):
            w = self.weights[j]

            def before(w: Weights = w, j: int = j) -> None:
                q, k, v = self.model.attention_inputs(j, w, g.h, tables)
                g.q.copy_(q)
                g.k.copy_(k)
                g.v.copy_(v)

            def after(w: Weights = w) -> None:
                g.h.copy_(self.model.attention_output(w, g.h, g.o))

            g.before.append(self._graph(before))
            g.after.append(self._graph(after))
        return g

    def _graph(self, body: Any) -> Any:
        """Capture `body` (after a warm-up run on a side stream, as CUDA graphs require)."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            body()
        torch.cuda.current_stream(self.device).wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            body()
        return graph
