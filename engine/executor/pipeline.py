"""`BlockPipeline`: one engine step over a block of GPU batches, layer by layer (FlexGen Fig. 4).

For each layer j the weights are loaded once and used by every GPU batch k of the block
(j-th layer, k-th GPU batch, as in FlexGen). Two loops share every load, compute and store:
- `overlap=False`: the plain sequential loop, the reference;
- `overlap=True`: while (j, k) computes, the load threads fetch layer j+1's weights and the
  next (j, k)'s past KV and activations, and the store threads write (j, k)'s new KV and
  activations (CUDA side streams fenced by events). Only a true dependency waits: the
  activations entering (j+1, k) wait for (j, k)'s activation store; past KV never waits
  for this step's stores (it was written in earlier steps), so with one GPU batch the next
  layer's past KV loads while this layer computes.
Both loops produce bit-identical tokens; tests hold them to it, and the trace
(`engine/executor/trace.py`) shows what overlapped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from engine.core.kv_pages import PageMove
from engine.executor.attention import (
    HostSinks,
    cpu_attention,
    join_kv,
    paged_attention,
    ragged_attention,
    split_kv,
)
from engine.executor.cuda_graphs import GraphRunner, StepReplay
from engine.executor.gpu_batch import AttentionGroup, GpuBatch
from engine.executor.moe_block import BlockExperts, loads_all_experts
from engine.executor.nano_overlap import NanoOverlap
from engine.executor.tasks import Launch, inline, start, wait_all
from engine.executor.trace import NoTracer, Tracer
from engine.kernels import PagedKernels
from engine.models.base import AttentionSpec, Model, Weights
from engine.models.moe import MoeModel
from engine.storage.device import CopyWindow, Device, Ready
from engine.storage.disk import DiskFile, DiskIO
from engine.storage.kv_store import KVRows, KVStore
from engine.storage.state_store import StateStore
from engine.storage.weight_store import WeightStore
from policy.reserves import LOAD_WINDOW, STORE_WINDOW


@dataclass(slots=True)
class PastKV:
    """The past KV a (layer, GPU batch) attends over, per attention group, packed by sequence."""

    device: torch.Tensor | None
    """(P, row_dim) on the compute device for the device group; None if no past."""
    cpu: torch.Tensor | None
    """(P_cpu, row_dim) float32 in host memory for the CPU-attention group; None if none."""


NO_PAST = PastKV(None, None)
T = TypeVar("T")


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """Rows for CPU attention: host-homed ones stay, device-homed ones (a cached prefix
    on the gpu tier) come over."""
    return t.cpu()


class BlockPipeline:
    """Runs one step's GPU batches through every layer. `num_load_threads` fetch weights,
    past KV and activations; `num_store_threads` write new KV and activations."""

    def __init__(
        self,
        model: Model,
        weights: WeightStore,
        kv: KVStore,
        device: Device,
        disk: DiskIO,
        *,
        overlap: bool,
        dtype: torch.dtype,
        num_load_threads: int = 2,
        num_store_threads: int = 1,
        tracer: Tracer | NoTracer | None = None,
        graphs: GraphRunner | None = None,
        nano: NanoOverlap | None = None,
        kernels: PagedKernels | None = None,
        cpu_expert_rows: int = 0,
        group_experts: bool = True,
        states: StateStore | None = None,
    ) -> None:
        self.model, self.weights, self.kv, self.device, self.disk = model, weights, kv, device, disk
        self.states = states
        """A hybrid model's per-sequence states (its state layers read and write them)."""
        self.overlap, self.dtype = overlap, dtype
        self.tracer = tracer or NoTracer()
        self.graphs = graphs
        """Piecewise CUDA graphs of the dense ops, used for the steps where they apply."""
        self._replaying = StepReplay()
        self._moves: list[PageMove] = []
        self._moved: dict[int, Future[None]] = {}  # layer -> its page moves, when overlapped
        self.nano = nano
        """Runs the decoder layers of GPU batches cut into nano-batches (NanoFlow 4.3)."""
        self.kernels = kernels
        """The native CPU attention over the pool (`engine.kernels`), or None."""
        c = model.config
        self._kv_shape = c.kv_shape
        self._host_sinks = HostSinks()
        self._acts: dict[int, dict[str, torch.Tensor]] = {}  # GPU batch -> tier -> rows
        self._act_files: dict[int, DiskFile] = {}
        self._loads = ThreadPoolExecutor(num_load_threads, thread_name_prefix="nanoflex-load")
        self._stores = ThreadPoolExecutor(num_store_threads, thread_name_prefix="nanoflex-store")
        self.act_bytes = {"gpu": 0, "cpu": 0, "disk": 0}
        """Peak bytes of between-layer activations homed on each tier."""
        self.cpu_expert_rows = cpu_expert_rows
        """A MoE expert homed in host memory with at most this many rows in a block runs on
        the CPU (engine/executor/moe_block.py); 0: never."""
        self.group_experts = group_experts
        """MoE layers group the whole block's rows per expert (else each GPU batch's alone)."""
        self._moe = model if isinstance(model, MoeModel) else None
        self._grouped = self._routed_loads = False
        self.store_window = CopyWindow(STORE_WINDOW)
        """Bounds the KV rows a step's stores to host memory keep on the device (`_stage_kv`)."""
        self.load_window = CopyWindow(LOAD_WINDOW)
        """Bounds the loads that computes not yet run keep on the device (`_overlapped_layers`)."""

    def close(self) -> None:
        self._loads.shutdown(wait=True)
        self._stores.shutdown(wait=True)
        if self.nano is not None:
            self.nano.close()

    # -- the two loops -------------------------------------------------------------------

    def run(self, batches: list[GpuBatch], moves: Sequence[PageMove] = ()) -> list[torch.Tensor]:
        """One step: returns (S_k, vocab) float32 logits for each GPU batch's logit rows.
        `moves` (cached pages spilled down or loaded back up) are applied layer by layer
        before that layer's KV is read or written."""
        self._moves = list(moves)
        self._grouped = (
            self._moe is not None
            and self.group_experts
            and not any(b.nano_batches for b in batches)
        )
        """This step groups each MoE layer's rows per expert over the whole block (with
        nano-batches each one's MLP routes its own rows, its experts loaded with the layer)."""
        num_rows = sum(b.num_tokens for b in batches)
        self._routed_loads = self._grouped and not loads_all_experts(self.model.config, num_rows)
        """This step loads a MoE layer's experts off the device once routed, only those with
        rows (else all of them with the layer: engine/executor/moe_block.py)."""
        self._replaying = StepReplay()
        if self.graphs is not None and self.graphs.applies(batches):
            self._replaying = self.graphs.begin(batches)
        if self.overlap and not self._moves_nothing(batches):
            return self._run_overlapped(batches)
        return self._run_sequential(batches)

    def _run_sequential(self, batches: list[GpuBatch]) -> list[torch.Tensor]:
        logits: list[torch.Tensor] = []
        wait = self.device.wait
        for j in range(self.model.num_layers):
            w = wait(self._load_weights(j))
            self._move_pages(j)
            if self._groups_experts(j):
                mids = []
                for batch in batches:
                    past = wait(self._load_past(j, batch))
                    h = wait(self._load_act(j, batch, None))
                    mids.append(self._before_experts(j, w, h, past, batch))
                    new_kv = mids[-1][2]
                    if new_kv is not None:
                        self._store_kv(j, batch, new_kv)
                for batch, out in zip(batches, self._experts(j, w, mids, inline), strict=True):
                    self._store_act(j, batch, out, self.device.record(), None)
                continue
            for batch in batches:
                past = wait(self._load_past(j, batch))
                h = wait(self._load_act(j, batch, None))
                out, new_kv = self._compute(j, w, h, past, batch)
                if self.model.layer_kind(j) == "head":
                    logits.append(out)
                    continue
                done = self.device.record()
                self._store_act(j, batch, out, done, None)
                if new_kv is not None:
                    self._store_kv(j, batch, new_kv)
            self.weights.release(j)
        return logits

    def _run_overlapped(self, batches: list[GpuBatch]) -> list[torch.Tensor]:
        """The zig-zag loop with loads and stores on copy threads. If one fails, every task
        already started is waited for before the error goes up: none of them may still
        write into the KV pools when the next step (or a recompute) reuses their pages."""
        # Tasks not yet done: a done one is dropped, so that what it loaded (a layer's past
        # KV, its decoded weights) is freed once the loop is through with it, not kept by
        # this set to the step's end (the rehearsal found a whole step's past KV held so:
        # 48 GiB for OPT-6.7B's 96-sequence batches, engine/rehearsal.py).
        started: set[Future[Any]] = set()

        def track(future: Future[T]) -> Future[T]:
            started.add(future)
            future.add_done_callback(started.discard)
            return future

        # A load or store with bytes to move goes to a copy thread; one without runs inline
        # (a hand-off would cost more than the nothing it does).
        def load(moves: bool, fn: Callable[..., T], *args: Any) -> Future[T]:
            return track(start(self._loads if moves else None, fn, *args))

        def store(moves: bool, fn: Callable[..., T], *args: Any) -> Future[T]:
            return track(start(self._stores if moves else None, fn, *args))

        try:
            return self._overlapped_layers(batches, load, store)
        except BaseException:  # a failed load or store: let the others land before we return
            wait_all(list(started))
            raise

    def _overlapped_layers(
        self, batches: list[GpuBatch], load: Launch, store: Launch
    ) -> list[torch.Tensor]:
        num_layers, num_batches = self.model.num_layers, len(batches)
        wait = self.device.wait
        if self._moves:  # first in the load queue: every KV load and store waits for its layer's
            self._moved = {j: load(True, self._move_pages, j) for j in range(1, num_layers - 1)}
        first = batches[0]
        weights = {0: load(self._weights_move(0), self._load_weights, 0)}
        pasts = {(0, 0): load(self._past_moves(0, first), self._load_past, 0, first)}
        acts = {(0, 0): load(self._acts_move(0, first), self._load_act, 0, first, None)}
        act_stored: dict[int, Future[None]] = {}  # GPU batch -> its latest activation store
        kv_stores: list[Future[None]] = []
        logits: list[torch.Tensor] = []
        for j in range(num_layers):
            if j + 1 < num_layers:
                weights[j + 1] = load(self._weights_move(j + 1), self._load_weights, j + 1)
            w = wait(weights.pop(j).result())
            if self._groups_experts(j):
                zigzag = (pasts, acts, act_stored, kv_stores)
                self._overlapped_moe_layer(j, w, batches, load, store, *zigzag)
                continue
            for k, batch in enumerate(batches):
                nxt = (j, k + 1) if k + 1 < num_batches else (j + 1, 0)
                if nxt[0] < num_layers:  # past KV never depends on this step's stores
                    jn, bn = nxt[0], batches[nxt[1]]
                    pasts[nxt] = load(self._past_moves(jn, bn), self._load_past, jn, bn)
                    if nxt[1] != k:  # nor does another batch's activation on this one's
                        after = act_stored.get(nxt[1])
                        acts[nxt] = load(self._acts_move(jn, bn), self._load_act, jn, bn, after)
                past = wait(pasts.pop((j, k)).result())
                h = wait(acts.pop((j, k)).result())
                out, new_kv = self._compute(j, w, h, past, batch)
                if self.model.layer_kind(j) == "head":
                    logits.append(out)
                    continue
                done = self.device.record()
                if self._loads_for(j, batch):  # the loop runs LOAD_WINDOW computes ahead
                    self.load_window.admit(done)
                act_stored[k] = store(
                    bool(batch.act_rows), self._store_act, j, batch, out, done, act_stored.get(k)
                )
                if new_kv is not None:
                    moves = self._kv_store_moves(batch)
                    kv_stores.append(self._store_kv_task(store, moves, j, batch, new_kv))
                if nxt[0] < num_layers and nxt[1] == k:
                    acts[nxt] = load(
                        self._acts_move(nxt[0], batch), self._load_act, nxt[0], batch, act_stored[k]
                    )
            # before layer j + 2's load is issued (next iteration): its slot is this layer's
            self.weights.release(j)
        for fut in (*kv_stores, *act_stored.values()):
            fut.result()
        return logits

    def _overlapped_moe_layer(
        self,
        j: int,
        w: Weights,
        batches: list[GpuBatch],
        load: Launch,
        store: Launch,
        pasts: dict[tuple[int, int], Future[Ready[PastKV]]],
        acts: dict[tuple[int, int], Future[Ready[torch.Tensor | None]]],
        act_stored: dict[int, Future[None]],
        kv_stores: list[Future[None]],
    ) -> None:
        """MoE layer j of the overlapped loop: each GPU batch's attention (the next one's past
        and activations loading meanwhile, its new KV stored behind), then the block's rows
        per expert (`_experts`), then each batch's output stored; the next layer's first
        activations load after their store, as the zig-zag needs."""
        num_layers, num_batches = self.model.num_layers, len(batches)
        wait = self.device.wait
        mids = []
        for k, batch in enumerate(batches):
            nxt = (j, k + 1) if k + 1 < num_batches else (j + 1, 0)
            if nxt[0] < num_layers:
                jn, bn = nxt[0], batches[nxt[1]]
                pasts[nxt] = load(self._past_moves(jn, bn), self._load_past, jn, bn)
                if jn == j:  # this layer's input: the previous layer's store of that batch
                    after = act_stored.get(nxt[1])
                    acts[nxt] = load(self._acts_move(jn, bn), self._load_act, jn, bn, after)
            past = wait(pasts.pop((j, k)).result())
            h = wait(acts.pop((j, k)).result())
            mids.append(self._before_experts(j, w, h, past, batch))
            new_kv = mids[-1][2]
            if new_kv is not None:
                moves = self._kv_store_moves(batch)
                kv_stores.append(self._store_kv_task(store, moves, j, batch, new_kv))
        outs = self._experts(j, w, mids, load)
        for k, (batch, out) in enumerate(zip(batches, outs, strict=True)):
            done = self.device.record()
            act_stored[k] = store(
                bool(batch.act_rows), self._store_act, j, batch, out, done, act_stored.get(k)
            )
        if j + 1 < num_layers:
            first = batches[0]
            acts[(j + 1, 0)] = load(
                self._acts_move(j + 1, first), self._load_act, j + 1, first, act_stored[0]
            )

    def _groups_experts(self, j: int) -> bool:
        """Layer j is a MoE layer (after attention, or alone: Nemotron-H's 'dense' ones) whose
        rows this step groups per expert over the block."""
        return (
            self._grouped
            and self.model.layer_kind(j) in ("decoder", "dense")
            and self.model.config.is_moe_layer(j - 1)
        )

    def _before_experts(
        self, j: int, w: Weights, h: torch.Tensor | None, past: PastKV, batch: GpuBatch
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """MoE layer j over one batch up to its MLP: (the residual stream, its normed rows,
        the new (T, row_dim) KV rows; None for a layer without attention)."""
        assert self._moe is not None and h is not None
        with self.tracer.span("compute", "compute", j, batch.index):
            if self.model.layer_kind(j) == "dense":
                return h, self._moe.input_norm(w, h), None
            q, k, v = self._moe.attention_inputs(j, w, h, batch.positions)
            new_kv = join_kv(k, v, self._kv_shape.values_are_keys)
            spec = self._moe.attention_spec(j, w)
            o = self._attend(j, batch, past, q, k, v, new_kv, spec)
            h, x = self._moe.before_mlp(w, h, o)
            return h, x, new_kv

    def _experts(
        self,
        j: int,
        w: Weights,
        mids: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]],
        launch: Launch,
    ) -> list[torch.Tensor]:
        """MoE layer j's MLP over every GPU batch's rows at once, each expert run once for
        the block (engine/executor/moe_block.py): each batch's layer output."""
        assert self._moe is not None
        source = BlockExperts(
            j, w, self.weights, launch, self.device, self.tracer, self.cpu_expert_rows
        )
        try:
            outs = self._moe.block_mlp(w, [x for _, x, _ in mids], source)
        finally:
            wait_all(source.pending())
        return [h + out for (h, _, _), out in zip(mids, outs, strict=True)]

    # -- what has bytes to move ------------------------------------------------------------

    def _moves_nothing(self, batches: list[GpuBatch]) -> bool:
        """No load or store of the step has bytes to move (weights, activations and KV all
        where they are used, no page moves): overlap has nothing to hide, and the overlapped
        loop's hand-offs would only cost time, so the step runs in order."""
        layers = range(self.model.num_layers)
        return (
            not self._moves
            and all(not self._weights_move(j) for j in layers)
            and all(
                not b.act_rows
                and not self._kv_store_moves(b)
                and not any(self._past_moves(j, b) for j in layers)
                for b in batches
            )
        )

    def _weights_move(self, j: int) -> bool:
        return not self.weights.is_resident(j)

    def _acts_move(self, j: int, batch: GpuBatch) -> bool:
        """Layer j's input is homed off the device (layer 0, the embedding, reads token ids)."""
        return j > 0 and bool(batch.act_rows)

    def _past_moves(self, j: int, batch: GpuBatch) -> bool:
        """Layer j's attention gathers past KV (KV loads wait for the layer's page moves)."""
        if self._moves:
            return True
        dev, cpu = batch.device_group, batch.cpu_group
        packed = dev is not None and dev.layout.num_past and not self._in_place(batch)
        host = cpu is not None and cpu.layout.num_past
        return self.model.layer_kind(j) == "decoder" and bool(packed or host)

    def _loads_for(self, j: int, batch: GpuBatch) -> bool:
        """Layer j's compute for `batch` reads something loaded onto the device for it."""
        return self._weights_move(j) or self._past_moves(j, batch) or self._acts_move(j, batch)

    def _kv_store_moves(self, batch: GpuBatch) -> bool:
        """New KV goes somewhere besides the gpu tier rows written before attention."""
        return bool(self._moves) or not self._in_place(batch) or set(batch.new_kv) != {"gpu"}

    # -- page moves ------------------------------------------------------------------------

    def _move_pages(self, j: int) -> None:
        """Layer j's share of the step's page moves, in order (a move may free the page the
        next one fills)."""
        if not self._moves or self.model.layer_kind(j) != "decoder":
            return
        with self._copy_task("move_pages", "load", j):
            for move in self._moves:
                self.kv.copy_page(self.model.kv_layer(j), move.src, move.dst)
            # Landed before this layer's KV is read or stored: wait for this copy stream
            # only, not the whole device (that would wait for the compute queued so far).
            self.device.host_wait(Ready(None, self.device.record()))

    def _after_moves(self, j: int) -> None:
        moved = self._moved.get(j)
        if moved is not None:
            moved.result()

    # -- loads ---------------------------------------------------------------------------

    @contextmanager
    def _copy_task(self, name: str, cat: str, j: int, k: int = 0) -> Iterator[None]:
        """A load or store on this thread's copy stream, traced."""
        with self.device.on_copy_stream(), self.tracer.span(name, cat, j, k):
            yield

    def _load_weights(self, j: int) -> Ready[Weights]:
        with self._copy_task("load_weight", "load", j):
            grouped = self._groups_experts(j)
            with_layer = not (grouped and self._routed_loads)
            host_later = grouped and self.cpu_expert_rows > 0  # may run on the CPU
            return self.weights.load(j, experts=with_layer, host_experts=not host_later)

    def _load_act(
        self, j: int, batch: GpuBatch, after: Future[None] | None
    ) -> Ready[torch.Tensor | None]:
        """The activations entering layer j (None for the embedding), once `after` (the
        previous layer's activation store of this batch) has landed."""
        if after is not None:
            after.result()
        if j == 0:
            return Ready(None)
        parts = self._acts[batch.index]
        if "all" in parts:  # every row stayed on the compute device: nothing to move
            return Ready(parts["all"])
        with self._copy_task("load_activation", "load", j, batch.index):
            out = torch.empty(
                (batch.num_tokens, self.model.config.hidden_size),
                dtype=self.dtype,
                device=self.device.device,
            )
            for tier, rows in batch.act_rows.items():
                if tier == "disk":
                    shape = (rows.shape[0], out.shape[1])
                    part = self.device.staging.take(shape, self.dtype)
                    self.disk.read(self._act_files[batch.index], 0, part)
                else:
                    part = parts[tier]
                out.index_copy_(0, rows, self.device.to_device(part))
                if tier == "disk":
                    self.device.release(part)  # reused once the copy just enqueued has read it
            return Ready(out, self.device.record())

    def _load_past(self, j: int, batch: GpuBatch) -> Ready[PastKV]:
        """Past KV of layer j's attention for both groups: the device group's decoded on the
        compute device, the CPU group's decoded in host memory (read from cpu or disk)."""
        if self.model.layer_kind(j) != "decoder":
            return Ready(NO_PAST)
        self._after_moves(j)
        layer = self.model.kv_layer(j)
        device_past = cpu_past = None
        dev, cpu = batch.device_group, batch.cpu_group
        with self.device.on_copy_stream():
            if dev is not None and dev.layout.num_past and not self._in_place(batch):
                with self.tracer.span("load_cache", "load", j, batch.index):
                    device_past = self._gather(layer, dev, to_device=True)
            if cpu is not None and cpu.layout.num_past:
                with self.tracer.span("load_cache", "load", j, batch.index, host=True):
                    cpu_past = self._gather(layer, cpu, to_device=False).float()
            return Ready(PastKV(device_past, cpu_past), self.device.record())

    def _gather(self, layer: int, group: AttentionGroup, to_device: bool) -> torch.Tensor:
        """The group's past rows from every tier that homes them, decoded, packed in
        sequence order: (P, row_dim), on the compute device (`to_device`: host rows go
        through staging buffers, pinned on a GPU) or in host memory (for CPU attention)."""
        packed: torch.Tensor | None = None
        for tier, kv_rows in group.past.items():
            read = self.kv.read(tier, layer, kv_rows, staged=to_device)
            rows = self.kv.codec.decode(
                self.device.to_device(read) if to_device else _to_host(read)
            )
            if to_device and tier != "gpu" and self.device.is_cuda:  # a staging buffer
                self.device.release(read)  # reused once the copy just enqueued has read it
            if len(group.past) == 1:
                return rows  # one tier: its rows are already in packed order
            if packed is None:
                packed = rows.new_empty(group.layout.num_past, rows.shape[1])
            packed.index_copy_(0, kv_rows.rows.to(rows.device), rows)
        assert packed is not None
        return packed

    # -- compute -------------------------------------------------------------------------

    def _split_kv(
        self, rows: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return split_kv(rows, self._kv_shape)

    def _compute(
        self, j: int, w: Weights, h: torch.Tensor | None, past: PastKV, batch: GpuBatch
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Layer j over one batch: (output states or logits, the new (T, row_dim) KV rows)."""
        kind = self.model.layer_kind(j)
        # Falcon-H1: the state mixer beside the attention, over the whole batch first
        mixed = None
        if kind == "decoder" and self.model.has_state(j):
            assert h is not None
            mixed = self._mix(j, w, h, batch)
        if batch.nano_batches and kind == "decoder":
            assert self.nano is not None and h is not None
            pieces = self._replaying.nanos.get(batch.index)
            return self.nano.run_layer(j, w, h, (past.device, past.cpu), batch, pieces, mixed)
        with self.tracer.span("compute", "compute", j, batch.index):
            graphs = self._replaying.whole.get(batch.index)
            if kind == "embed":
                if graphs is not None:
                    return GraphRunner.embed(graphs, w), None
                h = self.model.embed(w, batch.token_ids, batch.positions.ids)
                if batch.images is not None:  # an image's tokens take its features
                    h = h.index_copy(0, batch.images[0], batch.images[1].to(h.dtype))
                return h, None
            assert h is not None
            if kind == "head":
                return self.model.head(w, h.index_select(0, batch.logit_rows)), None
            if kind == "state":
                return self._mix(j, w, h, batch), None
            if kind == "dense":
                return self.model.dense_layer(w, h), None
            if graphs is not None:  # dense ops replayed, attention eager in between
                graphs.before[j - 1].replay()
                q, k, v = graphs.q, graphs.k, graphs.v
            else:
                q, k, v = self.model.attention_inputs(j, w, h, batch.positions)
            new_kv = join_kv(k, v, self._kv_shape.values_are_keys)  # (T, row_dim)
            o = self._attend(j, batch, past, q, k, v, new_kv, self.model.attention_spec(j, w))
            if graphs is not None:
                graphs.o.copy_(o)
                graphs.after[j - 1].replay()
                return graphs.h, new_kv
            return self.model.layer_output(w, h, o, mixed), new_kv

    def _mix(self, j: int, w: Weights, h: torch.Tensor, batch: GpuBatch) -> torch.Tensor:
        """State layer j over one batch: its sequences' states gathered onto the compute
        device, updated by the layer, written back to their slots."""
        rows = batch.states
        assert self.states is not None and rows is not None, "a state layer without states"
        layer = self.model.state_layer_index(j)
        states = self.states.gather(layer, rows.slots, len(rows.spans), rows.runs)
        out = self.model.state_layer(j, w, h, states, rows.spans)
        self.states.scatter(layer, rows.slots, states, rows.runs)
        return out

    def _attend(
        self,
        j: int,
        batch: GpuBatch,
        past: PastKV,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        new_kv: torch.Tensor,
        spec: AttentionSpec,
    ) -> torch.Tensor:
        """Layer j's attention output (T, num_heads, head_dim) for every row of the batch, as
        its `spec` scores it. Reading in place, the gpu tier's new KV rows (of `new_kv`) are
        written first."""
        dev, cpu = batch.device_group, batch.cpu_group
        in_place = self._in_place(batch)
        if in_place:
            self._after_moves(j)
            kv_rows = batch.new_kv["gpu"]
            self.kv.write(
                "gpu", self.model.kv_layer(j), kv_rows, self._encoded_rows(new_kv, kv_rows)
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

    def _in_place(self, batch: GpuBatch) -> bool:
        """The batch's device group reads its KV in place (a nano-batched one reads it packed:
        each nano-batch slices its sequences' rows)."""
        dev = batch.device_group
        return dev is not None and dev.layout.in_place and not batch.nano_batches

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
        return ragged_attention(q, k, v, *self._split_kv(past.device), layout, spec)

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

    # -- stores --------------------------------------------------------------------------

    def _store_act(
        self,
        j: int,
        batch: GpuBatch,
        out: torch.Tensor,
        done: torch.cuda.Event | None,
        after: Future[None] | None,
    ) -> None:
        """Home layer j's output rows on each row's activation tier (after the previous
        layer's store of this batch, which the next load may still be reading)."""
        if after is not None:
            after.result()
        if not batch.act_rows:  # every row stays on the compute device
            self._acts[batch.index] = {"all": out}
            self.act_bytes["gpu"] = max(self.act_bytes["gpu"], out.numel() * out.element_size())
            return
        with self._copy_task("store_activation", "store", j, batch.index):
            stream = self.device.copy_stream()
            if stream is not None and done is not None:
                stream.wait_event(done)
                out.record_stream(stream)
            parts: dict[str, torch.Tensor] = {}
            for tier, rows in batch.act_rows.items():
                part = out.index_select(0, rows)
                self.act_bytes[tier] = max(self.act_bytes[tier], part.numel() * part.element_size())
                if tier == "gpu":
                    parts[tier] = part
                    continue
                host = self.device.host_empty(tuple(part.shape), part.dtype)
                host.copy_(part, non_blocking=stream is not None)
                if stream is not None:
                    stream.synchronize()
                if tier == "cpu":
                    parts[tier] = host
                    continue
                if batch.index not in self._act_files:
                    self._act_files[batch.index] = self.disk.open(f"act-{batch.index:04d}.bin")
                self.disk.write(self._act_files[batch.index], 0, host)
            if stream is not None:
                stream.synchronize()
            self._acts[batch.index] = parts

    def _encoded_rows(self, new_kv: torch.Tensor, kv_rows: KVRows) -> torch.Tensor:
        """The (N, row_bytes) encoded rows of `new_kv` (T, row_dim) that `kv_rows` stores."""
        if len(kv_rows.slots) != new_kv.shape[0]:  # not one tier without padding
            new_kv = new_kv.index_select(0, kv_rows.rows)
        return self.kv.codec.encode(new_kv)

    def _store_kv_task(
        self,
        store: Launch,
        moves: bool,
        j: int,
        batch: GpuBatch,
        new_kv: torch.Tensor,
    ) -> Future[None]:
        """Layer j's KV store, handed to a store thread: on CUDA its copy to the host is
        enqueued here first (`_stage_kv`), so the thread only waits for it and writes the
        rows; on a CPU compute device the whole store (encoding and writing the rows is the
        work to keep off the layer loop there)."""
        if self.device.is_cuda:
            staged = self._stage_kv(j, batch, new_kv)
            return store(moves, self._finish_kv, j, batch, staged)
        return store(moves, self._store_kv, j, batch, new_kv)

    def _store_kv(self, j: int, batch: GpuBatch, new_kv: torch.Tensor) -> None:
        """Write layer j's new KV rows to each sequence's home tier, in this thread."""
        if self.device.is_cuda:
            self._finish_kv(j, batch, self._stage_kv(j, batch, new_kv))
            return
        with self.tracer.span("store_cache", "store", j, batch.index):
            staged = self._stage_kv(j, batch, new_kv)
            if staged:
                self._after_moves(j)
            for tier, kv_rows, ready in staged:
                self.kv.write(tier, self.model.kv_layer(j), kv_rows, ready.value)

    def _stage_kv(
        self, j: int, batch: GpuBatch, new_kv: torch.Tensor
    ) -> list[tuple[str, KVRows, Ready[torch.Tensor]]]:
        """The first half of storing layer j's new KV, blocking nothing: the rows for each
        home tier encoded (on the compute stream); the gpu tier's written to its pool there
        (unless attention wrote them first); on CUDA a host tier's copied into a staging
        buffer on the store stream once the compute stream has made them, so the device
        rows are held only until their copy has run, not until a store thread gets to them
        (a queue of them, a whole step's layers, ran the first H200 run out of memory); on a
        CPU the host tier's rows as they are."""
        staged: list[tuple[str, KVRows, Ready[torch.Tensor]]] = []
        written = self._in_place(batch)  # the gpu tier's rows went in before attention
        for tier, kv_rows in batch.new_kv.items():
            if tier == "gpu" and written:
                continue
            rows = self._encoded_rows(new_kv, kv_rows)
            if tier == "gpu":
                self._after_moves(j)
                self.kv.write(tier, self.model.kv_layer(j), kv_rows, rows)
            elif self.device.is_cuda:
                if rows.untyped_storage().nbytes() > rows.numel() * rows.element_size():
                    # a view of the layer's fused q, k, v output: copied out on this stream,
                    # so the store in flight holds its rows alone, not the whole output (a
                    # 65,536-token OPT-30B prefill: 2.8 GB a layer for 1.9 GB of rows)
                    with self.tracer.span("compact_cache", "compute", j, batch.index):
                        rows = rows.clone(memory_format=torch.contiguous_format)
                # the copy waits for the rows' selection on this (the compute) stream, which
                # follows the layer's compute (waiting for the compute alone, it read rows not
                # yet written: every placement with KV off the GPU gave wrong tokens on the
                # H200, 2026-11-28)
                with (
                    self.device.on_store_stream(self.device.record()),
                    self.tracer.span("store_cache", "store", j, batch.index),
                ):
                    ready = self.device.to_host_async(rows)
                staged.append((tier, kv_rows, ready))
                self.store_window.admit(ready.event)  # the loop runs STORE_WINDOW copies ahead
            else:
                staged.append((tier, kv_rows, Ready(rows)))
        return staged

    def _finish_kv(
        self, j: int, batch: GpuBatch, staged: list[tuple[str, KVRows, Ready[torch.Tensor]]]
    ) -> None:
        """The second half on CUDA, on a store thread: once each copy has landed, the rows
        written into the cpu tier's pool or the disk tier's file, the staging buffer given
        back."""
        if not staged:
            return
        self._after_moves(j)
        with self.tracer.span("write_cache", "store", j, batch.index, host=True):
            for tier, kv_rows, ready in staged:
                rows = self.device.host_wait(ready)
                self.kv.write(tier, self.model.kv_layer(j), kv_rows, rows)
                self.device.staging.give(rows)  # its copy has landed
