"""`LayerIO`: the loads and stores of FlexGen's zig-zag block schedule, for one (layer, GPU batch).

FlexGen's verbs (Algorithm 1), j-th layer, k-th GPU batch: `load_weight(j)`,
`load_cache(j, k)` (the past KV the layer attends over), `load_activation(j, k)` (the rows
entering it), `store_cache(j, k)` (its new KV rows), `store_activation(j, k)` (its output
rows); plus this engine's page moves (cached pages spilled down or loaded back up, applied
layer by layer before the layer's KV is read or written). Each runs on whatever thread the
schedule (engine/executor/zigzag.py) hands it to: on CUDA its copies go on that thread's
side stream, fenced by the events it returns (`Ready`). The predicates say which of them have
bytes to move (what the overlapped loop hands to copy threads).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from engine.core.kv_pages import PageMove
from engine.executor.gpu_batch import NO_PAST, AttentionGroup, GpuBatch, PastKV
from engine.executor.layer_attention import encoded_rows
from engine.executor.tasks import Launch, Task
from engine.executor.trace import NoTracer, Tracer
from engine.models.base import Model, Weights
from engine.storage.device import CopyWindow, Device, Ready
from engine.storage.disk import DiskFile, DiskIO
from engine.storage.kv_store import KVRows, KVStore
from engine.storage.state_store import StateStore
from engine.storage.weight_store import WeightStore
from policy.reserves import LOAD_WINDOW, STORE_WINDOW

Staged = list[tuple[str, KVRows, Ready[torch.Tensor]]]
"""A KV store's first half: per home tier, its rows and (on CUDA) their copy to the host."""


@dataclass(frozen=True)
class Stores:
    """Where a step's bytes live: the placed weights, the KV pools of every tier, a hybrid
    model's per-sequence states (None for a transformer), the disk tier's files."""

    weights: WeightStore
    kv: KVStore
    disk: DiskIO
    states: StateStore | None = None


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """Rows for CPU attention: host-homed ones stay, device-homed ones (a cached prefix
    on the gpu tier) come over."""
    return t.cpu()


class LayerIO:
    """The loads and stores of a step's layers. `num_load_threads` fetch weights, past KV
    and activations; `num_store_threads` write new KV and activations."""

    def __init__(
        self,
        model: Model,
        stores: Stores,
        device: Device,
        num_load_threads: int,
        num_store_threads: int,
    ) -> None:
        self.model, self.device = model, device
        self.weights, self.kv, self.disk = stores.weights, stores.kv, stores.disk
        self.tracer: Tracer | NoTracer = NoTracer()
        self.loads = ThreadPoolExecutor(num_load_threads, thread_name_prefix="nanoflex-load")
        self.stores = ThreadPoolExecutor(num_store_threads, thread_name_prefix="nanoflex-store")
        self.moves: list[PageMove] = []
        """This step's page moves."""
        self.moved: dict[int, Task[None]] = {}  # layer -> its page moves, when overlapped
        self.expert_loads: Callable[[int], tuple[bool, bool]] = lambda j: (True, True)
        """Layer j's (routed experts loaded with the layer, host-homed ones too): this step's
        MoE grouping decides (`GroupedMoe.expert_loads`)."""
        self._kv_shape = model.config.kv_shape
        self._acts: dict[int, dict[str, torch.Tensor]] = {}  # GPU batch -> tier -> rows
        self._act_files: dict[int, DiskFile] = {}
        self.act_bytes = {"gpu": 0, "cpu": 0, "disk": 0}
        """Peak bytes of between-layer activations homed on each tier."""
        self.store_window = CopyWindow(STORE_WINDOW)
        """Bounds the KV rows a step's stores to host memory keep on the device (`_stage_kv`)."""
        self.load_window = CopyWindow(LOAD_WINDOW)
        """Bounds the loads that computes not yet run keep on the device (the zig-zag)."""

    def close(self) -> None:
        self.loads.shutdown(wait=True)
        self.stores.shutdown(wait=True)

    # -- what has bytes to move ------------------------------------------------------------

    def moves_nothing(self, batches: list[GpuBatch]) -> bool:
        """No load or store of the step has bytes to move (weights, activations and KV all
        where they are used, no page moves): overlap has nothing to hide, and the overlapped
        loop's hand-offs would only cost time, so the step runs in order."""
        layers = range(self.model.num_layers)
        return (
            not self.moves
            and all(not self.weights_move(j) for j in layers)
            and all(
                not b.act_rows
                and not self.kv_store_moves(b)
                and not any(self.past_moves(j, b) for j in layers)
                for b in batches
            )
        )

    def weights_move(self, j: int) -> bool:
        return not self.weights.is_resident(j)

    def acts_move(self, j: int, batch: GpuBatch) -> bool:
        """Layer j's input is homed off the device (layer 0, the embedding, reads token ids)."""
        return j > 0 and bool(batch.act_rows)

    def past_moves(self, j: int, batch: GpuBatch) -> bool:
        """Layer j's attention gathers past KV (KV loads wait for the layer's page moves)."""
        if self.moves:
            return True
        dev, cpu = batch.device_group, batch.cpu_group
        packed = dev is not None and dev.layout.num_past and not batch.reads_kv_in_place
        host = cpu is not None and cpu.layout.num_past
        return self.model.layer_kind(j) == "decoder" and bool(packed or host)

    def loads_for(self, j: int, batch: GpuBatch) -> bool:
        """Layer j's compute for `batch` reads something loaded onto the device for it."""
        return self.weights_move(j) or self.past_moves(j, batch) or self.acts_move(j, batch)

    def kv_store_moves(self, batch: GpuBatch) -> bool:
        """New KV goes somewhere besides the gpu tier rows written before attention."""
        return bool(self.moves) or not batch.reads_kv_in_place or set(batch.new_kv) != {"gpu"}

    # -- page moves ------------------------------------------------------------------------

    def move_pages(self, j: int) -> None:
        """Layer j's share of the step's page moves, in order (a move may free the page the
        next one fills)."""
        if not self.moves or self.model.layer_kind(j) != "decoder":
            return
        with self._copy_task("move_pages", "load", j):
            for move in self.moves:
                self.kv.copy_page(self.model.kv_layer(j), move.src, move.dst)
            # Landed before this layer's KV is read or stored: wait for this copy stream
            # only, not the whole device (that would wait for the compute queued so far).
            self.device.host_wait(Ready(None, self.device.record()))

    def after_moves(self, j: int) -> None:
        """Layer j's page moves have landed (those handed to a load thread)."""
        moved = self.moved.get(j)
        if moved is not None:
            moved.result()

    # -- loads -----------------------------------------------------------------------------

    @contextmanager
    def _copy_task(self, name: str, cat: str, j: int, k: int = 0) -> Iterator[None]:
        """A load or store on this thread's copy stream, traced."""
        with self.device.on_copy_stream(), self.tracer.span(name, cat, j, k):
            yield

    def load_weight(self, j: int) -> Ready[Weights]:
        with self._copy_task("load_weight", "load", j):
            with_layer, host_experts = self.expert_loads(j)
            return self.weights.load(j, experts=with_layer, host_experts=host_experts)

    def load_activation(
        self, j: int, batch: GpuBatch, after: Task[None] | None
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
                dtype=self.weights.dtype,
                device=self.device.device,
            )
            for tier, rows in batch.act_rows.items():
                if tier == "disk":
                    shape = (rows.shape[0], out.shape[1])
                    part = self.device.staging.take(shape, self.weights.dtype)
                    self.disk.read(self._act_files[batch.index], 0, part)
                else:
                    part = parts[tier]
                out.index_copy_(0, rows, self.device.to_device(part))
                if tier == "disk":
                    self.device.release(part)  # reused once the copy just enqueued has read it
            return Ready(out, self.device.record())

    def load_cache(self, j: int, batch: GpuBatch) -> Ready[PastKV]:
        """Past KV of layer j's attention for both groups: the device group's decoded on the
        compute device, the CPU group's decoded in host memory (read from cpu or disk)."""
        if self.model.layer_kind(j) != "decoder":
            return Ready(NO_PAST)
        self.after_moves(j)
        layer = self.model.kv_layer(j)
        device_past = cpu_past = None
        dev, cpu = batch.device_group, batch.cpu_group
        with self.device.on_copy_stream():
            if dev is not None and dev.layout.num_past and not batch.reads_kv_in_place:
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

    # -- stores ----------------------------------------------------------------------------

    def store_activation(
        self,
        j: int,
        batch: GpuBatch,
        out: torch.Tensor,
        done: torch.cuda.Event | None,
        after: Task[None] | None,
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

    def store_cache(
        self, store: Launch, j: int, batch: GpuBatch, new_kv: torch.Tensor
    ) -> Task[None]:
        """Layer j's KV store, launched by `store`: on CUDA its copy to the host is enqueued
        here first (`_stage_kv`), so the store thread only waits for it and writes the rows;
        on a CPU compute device the whole store (encoding and writing the rows is the work
        to keep off the layer loop there)."""
        moves = self.kv_store_moves(batch)
        if self.device.is_cuda:
            staged = self._stage_kv(j, batch, new_kv)
            return store(moves, self._finish_kv, j, batch, staged)
        return store(moves, self._store_kv, j, batch, new_kv)

    def _store_kv(self, j: int, batch: GpuBatch, new_kv: torch.Tensor) -> None:
        """Write layer j's new KV rows to each sequence's home tier, in this thread."""
        with self.tracer.span("store_cache", "store", j, batch.index):
            staged = self._stage_kv(j, batch, new_kv)
            if staged:
                self.after_moves(j)
            for tier, kv_rows, ready in staged:
                self.kv.write(tier, self.model.kv_layer(j), kv_rows, ready.value)

    def _stage_kv(self, j: int, batch: GpuBatch, new_kv: torch.Tensor) -> Staged:
        """The first half of storing layer j's new KV, blocking nothing: the rows for each
        home tier encoded (on the compute stream); the gpu tier's written to its pool there
        (unless attention wrote them first); on CUDA a host tier's copied into a staging
        buffer on the store stream once the compute stream has made them, so the device
        rows are held only until their copy has run, not until a store thread gets to them
        (a queue of them, a whole step's layers, ran the first H200 run out of memory); on a
        CPU the host tier's rows as they are."""
        staged: Staged = []
        written = batch.reads_kv_in_place  # the gpu tier's rows went in before attention
        for tier, kv_rows in batch.new_kv.items():
            if tier == "gpu" and written:
                continue
            rows = encoded_rows(self.kv, new_kv, kv_rows)
            if tier == "gpu":
                self.after_moves(j)
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

    def _finish_kv(self, j: int, batch: GpuBatch, staged: Staged) -> None:
        """The second half on CUDA, on a store thread: once each copy has landed, the rows
        written into the cpu tier's pool or the disk tier's file, the staging buffer given
        back."""
        if not staged:
            return
        self.after_moves(j)
        with self.tracer.span("write_cache", "store", j, batch.index, host=True):
            for tier, kv_rows, ready in staged:
                rows = self.device.host_wait(ready)
                self.kv.write(tier, self.model.kv_layer(j), kv_rows, rows)
                self.device.staging.give(rows)  # its copy has landed
