"""`GraphRunner`: piecewise CUDA graphs of a resident model's dense ops at the discrete sizes.

A decode step of a small block is launch-bound on a GPU: hundreds of small kernels per
layer. With discrete batching every step runs at one of a few row counts, so the dense
ops can be captured once per count and replayed (vLLM's capture sizes). Attention is not
captured: its shapes follow each sequence's past length. So each decoder layer is two
graphs, the ops before attention (norm, QKV, rotary) and the ops after (output projection,
MLP, residuals), with attention run eagerly between them on the same static buffers
(vLLM v1's piecewise graphs). The embedding is one more graph; the head runs eagerly on
the rows that need logits.

Offloaded layers too: a dense model's offloaded decoder layers load into two fixed slots
(engine/storage/weight_slots.py), so layer j's weights sit at the same addresses every step
and its graphs read them there; the copy into a slot is fenced by events as any load. An
embedding that is not resident runs eagerly (its weights arrive at a new address) into the
same static buffers.

Mixed and prefill steps too (vLLM's piecewise graphs): the bodies do not depend on what
the rows are, decodes or a prompt's tokens (attention, the only part that does, runs
eagerly), so a step whose one GPU batch runs at one of the scheduler's discrete sizes
(`dense_sizes`: its dense ops padded to it) replays the graphs of that row count.

Used only where it is sound: CUDA, every decoder layer resident or slotted, uncompressed
(the graphs read the weight tensors by address), activations on the device, and
decode-only steps at a size seen before or captured now, or mixed and prefill steps of one
GPU batch at a discrete size; each GPU batch of the block has its own static buffers and
graphs, and so does each nano-batch of a batch cut into them (its dense ops replayed, its
attention eager beside them: engine/executor/nano_overlap.py). The graphs of one GPU batch
(or nano-batch) share its static buffers, each row count reading their first rows: they
never run at once, and the buffers are the most rows' size, not the sum over row counts.
The engine's warm-up captures every row count a decode step can give each GPU batch, and
the discrete sizes, before the first request (engine/executor/warm_up.py); nano-batches'
graphs, whose row counts follow each step's balance of attention work, are still captured
at first use.
`EngineArgs.cuda_graphs=False` (`--no-cuda-graphs`) turns it off; tokens are identical
either way (the GPU suite checks; on the CPU, tests/engine/executor/test_graph_capture.py
replays the same bodies checking every address they read).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from engine.executor.gpu_batch import GpuBatch, NanoBatch
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
    embed: Any = None  # the embedding and the positions' tables (None: run eagerly)
    embed_step: Any = None  # its body, taking the embedding's weights
    before: list[Any] = field(default_factory=list)  # per decoder layer
    after: list[Any] = field(default_factory=list)  # per decoder layer


@dataclass
class StepReplay:
    """The graphs one step replays: per GPU batch run whole, its `StepGraphs`; per GPU batch
    cut into nano-batches, one `StepGraphs` per nano-batch (its decoder layers' dense ops;
    the embedding runs eagerly over the whole batch)."""

    whole: dict[int, StepGraphs] = field(default_factory=dict)
    nanos: dict[int, list[StepGraphs]] = field(default_factory=dict)


class GraphRunner:
    def __init__(
        self,
        model: Model,
        weights: list[Weights | None],
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        """`weights`: per layer, the tensors its graphs read by address (resident, or the
        slot an offloaded layer loads into); None for an embedding that runs eagerly."""
        self.model, self.weights, self.device, self.dtype = model, weights, device, dtype
        self._graphs: dict[tuple[int, ...], StepGraphs] = {}
        """By (GPU batch, rows), or (GPU batch, nano-batch, rows)."""
        self._buffers: dict[tuple[int, ...], StepGraphs] = {}
        """By (GPU batch,) or (GPU batch, nano-batch): the static buffers of its most rows so
        far, which its graphs of fewer rows read the first rows of."""
        self.dense_sizes: frozenset[int] = frozenset()
        """The row counts a mixed or prefill step of one GPU batch replays graphs at: the
        scheduler's discrete sizes, captured by the warm-up (empty: such steps run eagerly)."""
        self._pool: Any = None
        self.num_replays = 0
        """Steps run through graphs (the GPU suite checks the path was taken)."""
        self.num_piecewise_replays = 0
        """Of them, mixed and prefill steps."""
        self.num_captures = 0
        """Graphs captured so far: after the engine's warm-up (`capture`) a new one is a
        capture inside a step."""

    def applies(self, batches: list[GpuBatch]) -> bool:
        """Activations on the device, and every sequence of every GPU batch decoding one
        token, or one GPU batch (not cut into nano-batches) at one of `dense_sizes`."""
        if any(batch.act_rows for batch in batches):
            return False
        if all(_decoding(batch) for batch in batches):
            return True
        (batch, *others) = batches
        return not others and not batch.nano_batches and batch.num_tokens in self.dense_sizes

    def begin(self, batches: list[GpuBatch]) -> StepReplay:
        """Each GPU batch's graphs (or each of its nano-batches') for its row count,
        captured on first use, all before the step's first load; inputs copied in."""
        out = StepReplay()
        for batch in batches:
            if batch.nano_batches:
                out.nanos[batch.index] = [self._nano(batch, nano) for nano in batch.nano_batches]
                continue
            graphs = self._get((batch.index, batch.num_tokens), batch.num_tokens, embed=True)
            graphs.token_ids.copy_(batch.token_ids)
            graphs.positions.copy_(batch.positions.ids)
            out.whole[batch.index] = graphs
        self.num_replays += 1
        self.num_piecewise_replays += not all(_decoding(batch) for batch in batches)
        return out

    def _nano(self, batch: GpuBatch, nano: NanoBatch) -> StepGraphs:
        """A nano-batch's graphs, its positions and their tables (computed for the whole
        batch by its builder) copied in."""
        graphs = self._get((batch.index, nano.index, nano.num_rows), nano.num_rows, embed=False)
        graphs.positions.copy_(batch.positions.ids[nano.rows])
        assert graphs.tables is not None
        for static, table in zip(graphs.tables.tables, batch.positions.tables, strict=True):
            static.copy_(table[nano.rows])
        return graphs

    def capture(self, batch_index: int, rows: int) -> None:
        """Capture GPU batch `batch_index`'s graphs for a decode step of `rows` rows now (the
        engine's warm-up), unless they are already."""
        self._get((batch_index, rows), rows, embed=True)

    def _get(self, key: tuple[int, ...], rows: int, embed: bool) -> StepGraphs:
        graphs = self._graphs.get(key)
        if graphs is None:
            graphs = self._graphs[key] = self._capture(key[:-1], rows, embed)
        return graphs

    @staticmethod
    def embed(graphs: StepGraphs, w: Weights) -> torch.Tensor:
        """The embedding into the static buffers: replayed, or run eagerly over `w` (the
        weights just loaded) where they are not resident."""
        if graphs.embed is not None:
            graphs.embed.replay()
        else:
            graphs.embed_step(w)
        return graphs.h

    # -- capture ---------------------------------------------------------------------------

    def _static(self, owner: tuple[int, ...], rows: int) -> StepGraphs:
        """Static buffers of `rows` rows for `owner`'s graphs: the first rows of its largest
        buffers, made anew (and kept as the largest) when they are too few."""
        have = self._buffers.get(owner)
        if have is None or have.h.shape[0] < rows:
            have = self._buffers[owner] = self._allocate(rows)
        assert have.tables is not None
        tables = have.tables[:rows]
        return StepGraphs(
            token_ids=have.token_ids[:rows],
            positions=tables.ids,
            h=have.h[:rows],
            q=have.q[:rows],
            k=have.k[:rows],
            v=have.v[:rows],
            o=have.o[:rows],
            tables=tables,
        )

    def _allocate(self, rows: int) -> StepGraphs:
        c = self.model.config
        device, dtype = self.device, self.dtype
        k = torch.zeros(rows, c.num_kv_heads, c.head_dim, dtype=dtype, device=device)
        positions = torch.zeros(rows, dtype=torch.long, device=device)
        made = self.model.positions(positions, dtype)
        return StepGraphs(
            token_ids=torch.zeros(rows, dtype=torch.long, device=device),
            positions=positions,
            h=torch.zeros(rows, c.hidden_size, dtype=dtype, device=device),
            q=torch.zeros(rows, c.num_heads, c.head_dim, dtype=dtype, device=device),
            k=k,
            v=k if c.values_are_keys else torch.zeros_like(k),  # the same buffer, v is k
            o=torch.zeros(rows, c.num_heads, c.head_dim, dtype=dtype, device=device),
            tables=Positions(positions, tuple(torch.zeros_like(t) for t in made.tables)),
        )

    def _capture(self, owner: tuple[int, ...], rows: int, embed_graph: bool = True) -> StepGraphs:
        g = self._static(owner, rows)
        dtype = self.dtype
        embed = self.weights[0]
        tables = g.tables
        assert tables is not None

        def embed_step(w: Weights) -> None:
            g.h.copy_(self.model.embed(w, g.token_ids, g.positions))
            for static, fresh in zip(
                tables.tables, self.model.positions(g.positions, dtype).tables, strict=True
            ):
                static.copy_(fresh)

        g.embed_step = embed_step
        if embed is not None and embed_graph:
            g.embed = self._graph(lambda: embed_step(embed))
        for j in range(1, self.model.num_layers - 1):
            w = self.weights[j]
            assert w is not None, f"decoder layer {j} has no fixed address"

            def before(w: Weights = w, j: int = j) -> None:
                q, k, v = self.model.attention_inputs(j, w, g.h, tables)
                g.q.copy_(q)
                g.k.copy_(k)
                if g.v is not g.k:
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
        self.num_captures += 1
        return graph


def _decoding(batch: GpuBatch) -> bool:
    """Every sequence of `batch` decoding one token."""
    on_device = batch.device_group is None or batch.device_group.layout.q_max == 1
    return on_device and (batch.cpu_group is None or batch.cpu_group.layout.q_max == 1)
