"""`BlockPipeline`: one engine step over a block of GPU batches, layer by layer (FlexGen Fig. 4).

For each layer j the weights are loaded once and used by every GPU batch k of
the block. Two loops share every load, compute and store function:
- `overlap=False`: the plain sequential loop, the reference;
- `overlap=True`: while batch k computes, layer j+1's weights and the next
  batch's activations and past KV are prefetched and batch k's results are
  stored, on copy threads (and CUDA side streams, fenced by events).
Both produce bit-identical tokens; tests hold them to it.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from engine.executor.attention import ragged_attention
from engine.executor.gpu_batch import AttentionGroup, GpuBatch
from engine.models.base import Model, Weights
from engine.storage.device import Device, Ready
from engine.storage.disk import DiskFile, DiskIO
from engine.storage.kv_store import KVStore
from engine.storage.weight_store import WeightStore

Past = torch.Tensor | None  # (P, 2 * kv_dim) past KV of the device group, packed by sequence
Inputs = tuple[torch.Tensor | None, Past]


class BlockPipeline:
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
    ) -> None:
        self.model, self.weights, self.kv, self.device, self.disk = model, weights, kv, device, disk
        self.overlap, self.dtype = overlap, dtype
        c = model.config
        self._kv_dim = c.kv_dim
        self._kv_shape = (c.num_kv_heads, c.head_dim)
        self._acts: dict[int, dict[str, torch.Tensor]] = {}  # batch -> tier -> rows
        self._act_files: dict[int, DiskFile] = {}
        self._prefetch = ThreadPoolExecutor(2, thread_name_prefix="nanoflex-prefetch")
        self.act_bytes = {"gpu": 0, "cpu": 0, "disk": 0}
        """Peak bytes of between-layer activations homed on each tier."""

    def close(self) -> None:
        self._prefetch.shutdown(wait=True)

    # -- the two loops -------------------------------------------------------------------

    def run(self, batches: list[GpuBatch]) -> list[torch.Tensor]:
        """One step: returns (S_k, vocab) float32 logits for each batch's logit rows."""
        if self.overlap:
            return self._run_overlapped(batches)
        return self._run_sequential(batches)

    def _run_sequential(self, batches: list[GpuBatch]) -> list[torch.Tensor]:
        logits: list[torch.Tensor] = []
        for j in range(self.model.num_layers):
            w = self.device.wait(self.weights.load(j))
            for batch in batches:
                h, past = self.device.wait(self._load_inputs(j, batch, None))
                out, new_kv = self._compute(j, w, h, past, batch)
                if self.model.layer_kind(j) == "head":
                    logits.append(out)
                else:
                    self._store(j, batch, out, new_kv, self.device.record(), None)
        return logits

    def _run_overlapped(self, batches: list[GpuBatch]) -> list[torch.Tensor]:
        num_layers, num_batches = self.model.num_layers, len(batches)
        submit = self._prefetch.submit
        weight_futures = {0: submit(self.weights.load, 0)}
        stored: dict[int, Future[None]] = {}  # batch -> its latest store
        stores: list[Future[None]] = []
        inputs: dict[tuple[int, int], Future[Ready[Inputs]]] = {}

        def prefetch_inputs(j: int, k: int) -> None:
            if j < num_layers and (j, k) not in inputs:
                inputs[(j, k)] = submit(self._load_inputs, j, batches[k], stored.get(k))

        prefetch_inputs(0, 0)
        logits: list[torch.Tensor] = []
        for j in range(num_layers):
            if j + 1 < num_layers:
                weight_futures[j + 1] = submit(self.weights.load, j + 1)
            w = self.device.wait(weight_futures.pop(j).result())
            for k, batch in enumerate(batches):
                nxt = (j, k + 1) if k + 1 < num_batches else (j + 1, 0)
                if nxt[1] != k:  # its inputs do not depend on this batch's store
                    prefetch_inputs(*nxt)
                h, past = self.device.wait(inputs.pop((j, k)).result())
                out, new_kv = self._compute(j, w, h, past, batch)
                if self.model.layer_kind(j) == "head":
                    logits.append(out)
                else:
                    done = self.device.record()
                    stored[k] = submit(self._store, j, batch, out, new_kv, done, stored.get(k))
                    stores.append(stored[k])
                prefetch_inputs(*nxt)
        for fut in stores:
            fut.result()
        return logits

    # -- loads, compute, stores ------------------------------------------------------------

    def _load_inputs(self, j: int, batch: GpuBatch, after: Future[None] | None) -> Ready[Inputs]:
        """GpuBatch's activations entering layer j and, for decoder layers, the past KV of its
        sequences that attend on the compute device."""
        if after is not None:
            after.result()  # the previous layer's store of this batch must have landed
        stream = self.device.copy_stream()
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            h = None if j == 0 else self._load_act(batch)
            past: Past = None
            if self.model.layer_kind(j) == "decoder" and batch.device_group is not None:
                past = self._load_past(j - 1, batch.device_group)
            return Ready((h, past), self.device.record())

    def _load_act(self, batch: GpuBatch) -> torch.Tensor:
        parts = self._acts[batch.index]
        if "all" in parts:
            return parts["all"]
        out = torch.empty(
            (batch.num_tokens, self.model.config.hidden_size),
            dtype=self.dtype,
            device=self.device.device,
        )
        for tier, rows in batch.act_rows.items():
            if tier == "disk":
                host = self.device.host_empty((rows.shape[0], out.shape[1]), self.dtype)
                self.disk.read(self._act_files[batch.index], 0, host)
                part = host
            else:
                part = parts[tier]
            out.index_copy_(0, rows, self.device.to_device(part))
        return out

    def _load_past(self, layer: int, group: AttentionGroup) -> Past:
        """The group's past KV, read per tier and decoded on the compute device, packed in
        sequence order: (P, 2 * kv_dim), or None when no sequence has a past."""
        if not group.layout.num_past:
            return None
        packed: torch.Tensor | None = None
        for tier, kv_rows in group.past.items():
            rows = self.kv.codec.decode(self.device.to_device(self.kv.read(tier, layer, kv_rows)))
            if len(group.past) == 1:
                return rows  # one tier: its rows are already in packed order
            if packed is None:
                packed = rows.new_empty(group.layout.num_past, rows.shape[1])
            packed.index_copy_(0, kv_rows.rows, rows)
        return packed

    def _split_kv(
        self, rows: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(N, 2 * kv_dim) rows -> k and v, each (N, num_kv_heads, head_dim)."""
        if rows is None:
            return None, None
        n = rows.shape[0]
        return (
            rows[:, : self._kv_dim].reshape(n, *self._kv_shape),
            rows[:, self._kv_dim :].reshape(n, *self._kv_shape),
        )

    def _compute(
        self, j: int, w: Weights, h: torch.Tensor | None, past: Past, batch: GpuBatch
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Layer j over one batch: (output states or logits, the new (T, 2 * kv_dim) KV rows)."""
        kind = self.model.layer_kind(j)
        if kind == "embed":
            return self.model.embed(w, batch.token_ids, batch.positions), None
        assert h is not None
        if kind == "head":
            return self.model.head(w, h.index_select(0, batch.logit_rows)), None
        new_kv: list[torch.Tensor] = []

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            new_kv.append(torch.cat([k.flatten(1), v.flatten(1)], dim=1))  # (T, 2 * kv_dim)
            return self._attend(j - 1, batch, past, q, k, v)

        out = self.model.decoder(w, h, batch.positions, attend)
        return out, new_kv[0]

    def _attend(
        self,
        layer: int,
        batch: GpuBatch,
        past: Past,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> torch.Tensor:
        dev, cpu = batch.device_group, batch.cpu_group
        if cpu is None:
            assert dev is not None
            return ragged_attention(q, k, v, *self._split_kv(past), dev.layout)
        o = torch.empty_like(q)
        if dev is not None:
            assert dev.rows is not None
            o[dev.rows] = ragged_attention(
                q[dev.rows], k[dev.rows], v[dev.rows], *self._split_kv(past), dev.layout
            )
        rows = cpu.rows if cpu.rows is not None else slice(None)
        o[rows] = self._cpu_attention(layer, cpu, q[rows], k[rows], v[rows]).to(
            q.device, non_blocking=True
        )
        return o

    def _cpu_attention(
        self,
        layer: int,
        group: AttentionGroup,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> torch.Tensor:
        """Decode attention on the CPU over CPU-homed KV: only q and the new k, v cross PCIe.
        Computes in float32 (CPU half-precision matmuls are slow and less exact)."""
        past = None
        if group.layout.num_past:
            past = self.kv.codec.decode(self.kv.read("cpu", layer, group.past["cpu"])).float()
        out = ragged_attention(
            q.to("cpu", torch.float32),
            k.to("cpu", torch.float32),
            v.to("cpu", torch.float32),
            *self._split_kv(past),
            group.layout,
        )
        return out.to(q.dtype)

    def _store(
        self,
        j: int,
        batch: GpuBatch,
        out: torch.Tensor,
        new_kv: torch.Tensor | None,
        done: torch.cuda.Event | None,
        after: Future[None] | None,
    ) -> None:
        """Write layer j's new KV rows to each sequence's home tier and its output activations
        to theirs. On CUDA, waits for `done` (compute finished) on this thread's copy stream."""
        if after is not None:
            after.result()
        stream = self.device.copy_stream()
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            if stream is not None and done is not None:
                stream.wait_event(done)
                out.record_stream(stream)
            if new_kv is not None:
                self._store_kv(j - 1, batch, new_kv, stream)
            self._store_act(batch, out)
            if stream is not None:
                stream.synchronize()

    def _store_kv(
        self, layer: int, batch: GpuBatch, new_kv: torch.Tensor, stream: torch.cuda.Stream | None
    ) -> None:
        if stream is not None:
            new_kv.record_stream(stream)
        encoded = self.kv.codec.encode(new_kv)  # (T, row_bytes) on the compute device
        for tier, kv_rows in batch.new_kv.items():
            rows = encoded if len(batch.new_kv) == 1 else encoded.index_select(0, kv_rows.rows)
            if tier != "gpu":
                host = self.device.host_empty(tuple(rows.shape), torch.uint8)
                host.copy_(rows, non_blocking=stream is not None)
                if stream is not None:
                    stream.synchronize()
                rows = host
            self.kv.write(tier, layer, kv_rows, rows)

    def _store_act(self, batch: GpuBatch, out: torch.Tensor) -> None:
        if not batch.act_rows:
            self._acts[batch.index] = {"all": out}
            self.act_bytes["gpu"] = max(self.act_bytes["gpu"], out.numel() * out.element_size())
            return
        parts: dict[str, torch.Tensor] = {}
        for tier, rows in batch.act_rows.items():
            part = out.index_select(0, rows)
            nbytes = part.numel() * part.element_size()
            self.act_bytes[tier] = max(self.act_bytes[tier], nbytes)
            if tier == "gpu":
                parts[tier] = part
                continue
            host = self.device.host_empty(tuple(part.shape), part.dtype)
            host.copy_(part)
            if tier == "cpu":
                parts[tier] = host
            else:
                if batch.index not in self._act_files:
                    self._act_files[batch.index] = self.disk.open(f"act-{batch.index:04d}.bin")
                self.disk.write(self._act_files[batch.index], 0, host)
        self._acts[batch.index] = parts
