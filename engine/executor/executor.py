"""`Executor`: owns the device, placed weights and KV pools; runs one `StepPlan` per call."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
import tempfile
import weakref
from collections.abc import Callable
from pathlib import Path

import torch

from engine.core.dtypes import checkpoint_dtype
from engine.core.engine_args import EngineArgs
from engine.core.kv_pages import PageManager, PageMove
from engine.core.offload_dir import OffloadDirError, OffloadDirLock, lock_offload_dir
from engine.core.planning import DEFAULT_WORKLOAD, cached_hardware, model_spec
from engine.core.pooling import pooling_spec
from engine.core.protocol import (
    EngineInfo,
    Placement,
    SeqChunk,
    StepFailure,
    StepPlan,
    StepResult,
    TokenLogprobs,
    WarmUp,
)
from engine.core.sampling_params import SamplingParams
from engine.core.state_slots import (
    STATE_TIERS,
    snapshot_tier,
    state_slot_capacity,
    state_tier,
)
from engine.executor.batch_builder import BatchBuilder
from engine.executor.budgets import (
    MemoryBudgetError,
    cap_gpu_memory,
    check_budgets,
    check_host_memory,
    derive_budgets,
    kv_capacity_pages,
)
from engine.executor.cuda_graphs import GraphRunner
from engine.executor.gpu_batch import SeqState
from engine.executor.layer_io import Stores
from engine.executor.nano_batches import NanoBatcher
from engine.executor.pipeline import BlockPipeline
from engine.executor.pooler import Pooler
from engine.executor.sampler import top_logprobs
from engine.executor.step_inputs import StepInputs
from engine.executor.step_sampler import StepSampler
from engine.executor.trace import NoTracer, Tracer
from engine.executor.vision_encoder import UNUSED, VisionEncoder
from engine.executor.warm_up import warm_up
from engine.kernels import fused_dense_ops, token_mask
from engine.loading.checkpoint import open_reader
from engine.loading.generated import local_model_dir
from engine.models import build_model
from engine.models.config_cache import read_model_config
from engine.storage.device import Device
from engine.storage.disk import DiskIO, OffloadIOError
from engine.storage.disk_cache import DiskCacheIndex
from engine.storage.expert_picks import ExpertPicks, picks_path
from engine.storage.host_memory import keep_freed_memory
from engine.storage.kv_store import KVStore
from engine.storage.quant import KVRowCodec
from engine.storage.state_store import StateStore
from engine.storage.weight_store import TensorReader, WeightStore
from policy import TIERS, Policy
from policy.moe import cpu_expert_break_even
from policy.prefix import PAGE_TOKENS
from policy.reserves import gpu_reserves, reserve_bytes
from policy.specs import WorkloadSpec
from policy.steps import RESIDENT_STEP_TOKENS
from policy.units import format_bytes


class Executor:
    """The engine side of the step protocol. Construct, call `execute(plan)` per step, `close()`.

    model: a model reference or directory (see engine.core.model_files).
    gpu_mem / cpu_mem / disk_mem: byte budgets per tier; gpu_mem also caps CUDA memory.
    dtype: compute dtype; None: float32 on the CPU, the checkpoint's half type on CUDA.
    offload_dir: the disk tier's directory, locked for this executor's process while it runs
        (engine/core/offload_dir.py); None: a temporary one, removed by `close()`.
    trace: write a Chrome trace of every step's loads, stores and compute to this path at
        `close()` (engine/executor/trace.py); None: no tracing.
    cuda_graphs: replay decode steps' dense ops as CUDA graphs where that is sound
        (engine/executor/cuda_graphs.py); False runs every op eagerly.
    weight_slots: offloaded decoder layers load into two fixed device buffers in turn
        (engine/storage/weight_slots.py; what lets graphs run over offloaded layers); False
        loads each into fresh memory every step.
    persist_kv_cache: keep the disk tier's cached KV pages in `offload_dir` with a verified
        index, for the next run to find (engine/storage/disk_cache.py). Cached disk pages are
        verified whenever a step uses one, persistent or not.
    nano_batch_overlap: with `policy.num_nano_batches` > 1, overlap the nano-batches' operations
        (engine/executor/nano_overlap.py); False runs them one after another (NanoFlow's
        nano-batch-only ablation baseline).
    paged_attention: attention reads the gpu tier's KV pages in place, the layer's new KV
        written first (engine/executor/attention.py); False gathers a packed copy of every
        past row first, as other tiers and compressed KV always do.
    native_kernels: on the CPU, the native kernels (engine/kernels, built on first use) run
        decode and prefill attention in place and the fused norm, rotary and SiLU ops; on
        CUDA, the Triton kernels (engine/kernels/triton_attention.py) run decode and prefill
        attention in place. False gathers the keys into a copy for SDPA and runs torch's own
        ops.
    prepack_weights: on the CPU, resident linear weights are stored in oneDNN's blocked
        layout once at load (engine/models/base.py: prepack); False keeps them plain for
        `F.linear`, which reorders them on every call.
    hot_experts: a MoE model's routed experts are homed most-picked first (the router's
        counts, kept with the model's cache: engine/storage/expert_picks.py), so the fastest
        tier holds the experts used most; False homes them in index order.
    group_experts: a MoE layer's rows are grouped per expert over the whole block, each
        expert off the device loaded once routed (engine/executor/moe_block.py); False: each
        GPU batch routes its own rows, the layer's experts loaded with it.
    cpu_expert_rows: with `policy.cpu_experts`, a MoE expert homed in host memory that at
        most this many rows of a block route to runs on the CPU instead of being copied
        (engine/executor/moe_block.py); None: the cost model's break-even on the cached
        hardware profile (`nanoflex profile`; without one, never).
    step_tokens: the most tokens one step runs (`EngineArgs.step_tokens`).
    workload: the prompt and output lengths planned for (`EngineArgs.workload`): on a GPU,
        the reserves the planner priced for them and `step_tokens` (policy/reserves.py: a
        step's workspace, loads and stores in flight) are left out of the KV pool.
    on_progress: called with (layers loaded, layers) while the weights load (the engine
        process reports it to the daemon); None: `show_progress` decides.
    """

    def __init__(
        self,
        model: str | Path | None,
        policy: Policy,
        *,
        device: str = "auto",
        offload_dir: str | Path | None = None,
        gpu_mem: int | None = None,
        cpu_mem: int | None = None,
        disk_mem: int | None = None,
        dtype: torch.dtype | None = None,
        show_progress: bool = False,
        trace: str | Path | None = None,
        cuda_graphs: bool = True,
        weight_slots: bool = True,
        persist_kv_cache: bool = False,
        nano_batch_overlap: bool = True,
        paged_attention: bool = True,
        native_kernels: bool = True,
        prepack_weights: bool = True,
        hot_experts: bool = True,
        group_experts: bool = True,
        cpu_expert_rows: int | None = None,
        state_snapshots: int = 0,
        step_tokens: int = RESIDENT_STEP_TOKENS,
        workload: WorkloadSpec = DEFAULT_WORKLOAD,
        on_progress: Callable[[int, int], None] | None = None,
    ) -> None:
        self.policy = policy
        self.step_tokens = step_tokens
        self.workload = workload
        self.device = Device.resolve(device)
        self.model_dir = local_model_dir(model)
        self.config = read_model_config(self.model_dir)
        self.model = build_model(self.config)
        spec = pooling_spec(self.model_dir)
        self.pooler = Pooler.of(spec, self.model) if spec is not None else None
        """A decoder pooling model's: its requests' head rows are their answers."""
        native = native_kernels and not self.device.is_cuda
        if native_kernels:
            self.model.dense_ops = fused_dense_ops(self.device.is_cuda)
        self.dtype = dtype or self.device.default_dtype(checkpoint_dtype(self.model_dir))
        self._apply_thread_counts()
        keep_freed_memory()
        self._own_offload_dir = offload_dir is None
        self.offload_dir = Path(offload_dir or tempfile.mkdtemp(prefix="nanoflex-offload-"))
        self.offload_dir.mkdir(parents=True, exist_ok=True)
        self._lock: OffloadDirLock | None = (
            None if self._own_offload_dir else lock_offload_dir(self.offload_dir)
        )
        self.budgets = derive_budgets(
            self.device,
            self.offload_dir,
            gpu_mem,
            cpu_mem,
            disk_mem,
            policy,
            moe=self.model.config.is_moe,
        )
        """Byte budget per tier, given or derived from the machine (see _budgets)."""
        if show_progress or None in (gpu_mem, cpu_mem, disk_mem):
            given = {"gpu": gpu_mem, "cpu": cpu_mem, "disk": disk_mem}
            parts = [
                f"{t} {format_bytes(self.budgets[t])}" + ("" if given[t] else " (derived)")
                for t in TIERS
            ]
            where = ""
            if not self.device.is_cuda:
                where = " (no GPU: the compute device is the CPU, the gpu tier is host memory)"
            print(f"nanoflex: memory budgets: {', '.join(parts)}{where}", file=sys.stderr)
        cap_gpu_memory(self.device, self.budgets["gpu"])
        if self._own_offload_dir:  # removed at close, or at exit if close never comes
            self._remove_scratch = weakref.finalize(
                self, shutil.rmtree, self.offload_dir, ignore_errors=True
            )
        self.disk = DiskIO(self.offload_dir, policy.num_copy_threads)
        self.weights = WeightStore(
            self.model,
            self._reader(),
            weights_frac=policy.weights_frac,
            experts_frac=policy.experts_frac,
            compress=policy.compress_weights,
            dtype=self.dtype,
            device=self.device,
            disk=self.disk,
            prepack=prepack_weights,
            picks=self._expert_picks(),
            hot_experts=hot_experts,
        )
        if not policy.compress_weights:  # refuse before reading anything
            check_budgets(self.weights.planned_bytes(), self.budgets)
            check_host_memory(self.weights.planned_bytes(), self.device)
        try:
            self.weights.read_all(on_progress or (self._print_progress if show_progress else None))
        except OffloadIOError as e:
            raise OffloadDirError(
                f"the weights placed on disk cannot be written ({e}); free space under "
                f"{self.offload_dir}, or lower weights_frac[2]"
            ) from e
        if weight_slots:
            self.weights.make_slots()
        self.vision = (
            None
            if self.config.vision is None
            else VisionEncoder(
                self.model_dir,
                self.config.vision,
                open_reader(self.model_dir),
                self.device.device,
                self.dtype,
            )
        )
        """The vision tower (a vision model's), resident on the compute device."""
        self.snapshots: dict[str, int] = {}
        """A hybrid's snapshot slots for the prefix cache of states: {tier: count}."""
        self.states = self._state_store(state_snapshots)
        row_dim = self.config.kv_shape.row_dim
        codec = KVRowCodec(row_dim, compress=policy.compress_kv, dtype=self.dtype)
        self.kv = KVStore(
            len(self.config.kv_layers),
            PAGE_TOKENS,
            codec,
            self.device,
            self.disk,
            persist_kv_cache,
        )
        self.disk_cache = DiskCacheIndex(
            self.offload_dir, self.cache_salt(), self.kv.disk_pool, persistent=persist_kv_cache
        )
        """What each cached disk page holds, verified when used (and kept on disk if persistent)."""
        self.kv.capacity = self.kv_capacity_pages()
        self._found_on_disk = self.disk_cache.load(self.kv.capacity["disk"])
        self.kv.reserve_pages([("disk", page) for _, page in self._found_on_disk])
        check_budgets(self.weights.bytes_per_tier(), self.budgets)
        self.trace_path = None if trace is None else Path(trace)
        self.tracer = Tracer(cuda=self.device.is_cuda) if trace is not None else NoTracer()
        switches = EngineArgs(  # the pipeline's switches, until the executor is given its args
            native_kernels=native_kernels,
            nano_batch_overlap=nano_batch_overlap,
            group_experts=group_experts,
        )
        self.pipeline = BlockPipeline(
            self.model,
            Stores(self.weights, self.kv, self.disk, self.states),
            self.device,
            policy,
            switches,
            tracer=self.tracer,
            graphs=self._graph_runner() if cuda_graphs else None,
            cpu_expert_rows=self._cpu_expert_rows(cpu_expert_rows),
        )
        self.inputs = StepInputs(self.device.device, pinned=self.device.is_cuda)
        """The step's index inputs and sampling settings, staged on the host and copied to
        the device at once (engine/executor/step_inputs.py)."""
        self.sampler = StepSampler(
            self.model_dir,
            self.config.vocab_size,
            token_mask() if native else None,
            # beside a GPU's forward pass the cores are free; on a CPU it needs them
            grammar_threads=min(8, max(1, (os.cpu_count() or 2) - 1)) if self.device.is_cuda else 1,
            overlap_masks=self.device.is_cuda,
            inputs=self.inputs,
        )
        self._resident = (
            not self.weights.uses_tier("cpu")
            and not self.weights.uses_tier("disk")
            and policy.kv_frac[0] == 1.0
            and policy.act_frac[0] == 1.0
            and self.states is None
        )
        """Nothing is homed off the gpu tier (weights, KV, activations, states), so a step
        copies to or from another tier only when its plan moves pages; otherwise its one
        read of the device, the sampled tokens, already waits for all it queued."""
        self._closed = False
        self._seqs: dict[int, SeqState] = {}
        self._builder = BatchBuilder(
            self.device.device,
            PAGE_TOKENS,
            cpu_attention=policy.cpu_attention,
            windows=self.config.windows,
            pool_device=self.kv.pool_device,
            positions=lambda ids: self.model.positions(ids, self.dtype),
            paged_attention=paged_attention and not policy.compress_kv,
            inputs=self.inputs,
            mrope=bool(self.config.mrope_section),
        )
        self._nano_batcher = (
            NanoBatcher(policy.num_nano_batches, self._builder)
            if policy.num_nano_batches > 1
            else None
        )
        self.warmed: WarmUp | None = None
        """What `warm_up` made ready, if it ran."""

    # -- setup -------------------------------------------------------------------------

    def _reader(self) -> TensorReader:
        """The checkpoint's tensors, as a pooling model's head reads them when it pools."""
        reader = open_reader(self.model_dir)
        return self.pooler.reader(reader) if self.pooler is not None else reader

    def _apply_thread_counts(self) -> None:
        """The policy's intra-op thread count (0 keeps torch's default); the load, store and
        disk pools are sized where they are made."""
        if self.policy.num_cpu_threads > 0:
            torch.set_num_threads(self.policy.num_cpu_threads)

    def _print_progress(self, done: int, total: int) -> None:
        print(f"\rloading {self.model_dir.name}: layer {done}/{total}", end="", file=sys.stderr)
        if done == total:
            print(file=sys.stderr)

    def _state_store(self, snapshots: int) -> StateStore | None:
        """A hybrid model's state slots: on each state tier, one per sequence of the block
        its KV share homes there (disk-homed sequences keep theirs in host memory), as many
        as fit beside the weights, then up to `snapshots` slots in host memory for the
        states of cached prefixes (`StateSnapshots`); None for a transformer."""
        c = self.config
        if not c.is_hybrid:
            return None
        shapes = self.model.state_shapes()
        one = StateStore(len(c.state_layers), shapes, {}, self.dtype, self.device).slot_bytes
        placed = self.weights.bytes_per_tier()
        fits = {t: max(0, int((self.budgets[t] - placed[t]) // one)) for t in STATE_TIERS}
        capacity = state_slot_capacity(self.policy.block_size, self.policy.kv_frac, fits)
        for tier, frac in zip(TIERS, self.policy.kv_frac, strict=True):
            if frac > 0 and not capacity[state_tier(tier)]:
                raise MemoryBudgetError(
                    f"no room on the {state_tier(tier)} tier for one sequence's state "
                    f"({format_bytes(one)}) beside the weights: give it more memory or "
                    "move weights off it"
                )
        tier = snapshot_tier(fits, capacity)
        count = max(0, min(snapshots, fits[tier] - capacity[tier]))
        if count < snapshots:
            logging.getLogger("nanoflex.engine").warning(
                "room for %d of %d saved states of cached prefixes (each %s)",
                count,
                snapshots,
                format_bytes(one),
            )
        self.snapshots = {tier: count} if count else {}
        stored = {**capacity, tier: capacity[tier] + count}
        return StateStore(len(c.state_layers), shapes, stored, self.dtype, self.device)

    def _cpu_expert_rows(self, given: int | None) -> int:
        """The most rows for which a CPU-homed expert runs on the CPU (0: never)."""
        if not (self.policy.cpu_experts and self.config.is_moe):
            return 0
        if given is not None:
            return given
        hardware = cached_hardware()
        if hardware is None:
            logging.getLogger("nanoflex.engine").warning(
                "cpu_experts: no hardware profile to weigh CPU compute against copies "
                "(run `nanoflex profile`); every expert runs on the compute device"
            )
            return 0
        spec = model_spec(
            self.model_dir, str(self.device.device), str(self.dtype).removeprefix("torch.")
        )
        threads = self.policy.num_cpu_threads
        return cpu_expert_break_even(spec, hardware, threads, self.policy.compress_weights)

    def _expert_picks(self) -> ExpertPicks | None:
        """A MoE model's router counts, from the model's cache (empty the first time)."""
        c = self.config
        if not c.is_moe:
            return None
        layers = [j + 1 for j in range(c.num_layers) if c.is_moe_layer(j)]
        return ExpertPicks(picks_path(self.model_dir), layers, c.num_experts)

    def _graph_runner(self) -> GraphRunner | None:
        """CUDA graphs where they are sound: on CUDA, every decoder layer's weights at fixed
        addresses (resident, or loaded into slots) and uncompressed, activations on the
        device, a model whose dense ops have the same shapes every step
        (`Model.can_capture`); nano-batches replay per-nano-batch graphs."""
        p = self.policy
        if not (self.device.is_cuda and self.model.can_capture) or p.compress_weights:
            return None
        if p.act_frac[0] < 1.0:
            return None
        weights = self.weights.fixed_weights()
        if weights is None:
            return None
        return GraphRunner(self.model, weights, self.device.device, self.dtype)

    def warm_up(self, batch_sizes: tuple[int, ...] | None, piecewise: bool = True) -> WarmUp:
        """Capture every decode graph (and with `piecewise`, every mixed and prefill step's
        graphs) and compile every Triton specialization a step of the scheduler's discrete
        sizes `batch_sizes` (None: no discrete batching) can meet, before the first step
        (engine/executor/warm_up.py)."""
        self.warmed = warm_up(self, batch_sizes, piecewise)
        return self.warmed

    # -- what the scheduler needs ------------------------------------------------------

    def kv_capacity_pages(self) -> dict[str, int | None]:
        """KV pages each tier may hold: its budget less its weights and, on a GPU, less the
        reserves the planner prices (`gpu_reserve_bytes`); on the CPU, less the slots disk
        layers load into and GPU_RESERVE_FRAC of the "gpu" tier (budgets.py)."""
        placed = self.weights.bytes_per_tier()
        for tier, nbytes in self._state_bytes().items():
            placed[tier] += nbytes
        if self.device.is_cuda:
            return kv_capacity_pages(
                self.budgets, placed, self.kv.page_bytes, gpu_reserve=self.gpu_reserve_bytes()
            )
        slots = 0 if self.weights.slots is None else self.weights.slots.total_bytes
        return kv_capacity_pages(self.budgets, placed, self.kv.page_bytes, in_flight=slots)

    def gpu_reserve_bytes(self) -> int:
        """What a step holds on the GPU beside the weights and KV homed there, as the planner
        prices it for this policy, workload and step budget (policy/reserves.py)."""
        spec = model_spec(
            self.model_dir, str(self.device.device), str(self.dtype).removeprefix("torch.")
        )
        slots = None if self.weights.slots is None else self.weights.slots.total_bytes
        reserves = gpu_reserves(
            spec,
            self.policy,
            int(self.workload.prompt_len),
            int(self.workload.gen_len),
            self.step_tokens,
            slot_bytes=slots,
        )
        return reserve_bytes(reserves, self.policy)

    def _state_bytes(self) -> dict[str, int]:
        return {} if self.states is None else self.states.bytes_per_tier()

    def describe(self) -> EngineInfo:
        """What a scheduler in this or another process needs to plan for this engine."""
        scratch = str(self.offload_dir) if self._own_offload_dir else None
        return EngineInfo(
            page_tokens=PAGE_TOKENS,
            kv_capacity_pages=self.kv_capacity_pages(),
            placement=self.placement(),
            page_bytes=self.kv.page_bytes,
            cache_salt=self.cache_salt(),
            disk_cache=list(self._found_on_disk),
            scratch_dir=scratch,
            budgets=dict(self.budgets),
            disk_cache_dropped=self.disk_cache.num_dropped,
            warnings=[w for w in [self.disk_cache.warning] if w],
            state_slots=self._running_state_slots(),
            state_bytes=0 if self.states is None else self.states.slot_bytes,
            state_snapshots=dict(self.snapshots),
            warm_up=self.warmed,
        )

    def _running_state_slots(self) -> dict[str, int]:
        """A hybrid's state slots per tier for running sequences (the snapshots follow)."""
        if self.states is None:
            return {}
        out = dict(self.states.capacity)
        for tier, count in self.snapshots.items():
            out[tier] -= count
        return out

    def cache_salt(self) -> str:
        """A digest of everything besides the tokens that decides a KV page's bytes."""
        digest = hashlib.sha256((self.model_dir / "config.json").read_bytes())
        codec = self.kv.codec
        digest.update(f"{self.dtype}|{codec.compress}|{codec.group_size}|{PAGE_TOKENS}".encode())
        return digest.hexdigest()[:16]

    def placement(self) -> Placement:
        """What was realized: bytes per tier for weights, KV and activations, and layer homes."""
        weights = self.weights.bytes_per_tier()
        total = sum(weights.values()) or 1
        realized = tuple(round(weights[t] / total, 4) for t in TIERS)
        return Placement(
            planned_weights_frac=self.policy.weights_frac,
            realized_weights_frac=(realized[0], realized[1], realized[2]),
            weights_bytes=weights,
            kv_bytes=self.kv.bytes_per_tier(),
            act_bytes=dict(self.pipeline.act_bytes),
            weight_tiers=tuple(self.weights.tiers),
            device=str(self.device.device),
            dtype=str(self.dtype).removeprefix("torch."),
            state_bytes=self._state_bytes(),
        )

    def bytes_per_tier(self) -> dict[str, int]:
        """Weights, KV pools and activations resident per tier now."""
        return self.placement().bytes_per_tier()

    # -- one step ----------------------------------------------------------------------

    def execute(self, plan: StepPlan) -> StepResult:
        """Run one plan. A cached disk page that fails verification, or a read or write of the
        offload directory that fails (a full disk, an I/O error), ends the step early with a
        `StepFailure` instead of tokens: the scheduler recomputes its sequences."""
        for seq_id in plan.freed_seq_ids:
            self.sampler.drop(seq_id)
            gone = self._seqs.pop(seq_id, None)
            if gone is not None:  # drop what is staged for its partly written disk pages
                self.kv.disk_pool.release_pages([p for tier, p in gone.pages if tier == "disk"])
        for page, h in plan.cached_disk_pages:  # cached by earlier steps: record them
            self.disk_cache.add(page, h)
        if not plan.chunks:  # records only: nothing runs
            self.disk_cache.save()
            return StepResult(plan.step_id, [], [], [], bytes_per_tier=self.bytes_per_tier())
        bad = self.disk_cache.failed_checks(plan.page_moves, plan.disk_hits)
        if bad:
            message = f"{len(bad)} cached KV page(s) on disk failed verification"
            return self._failed(plan, StepFailure(message, bad_pages=bad))
        try:
            return self._run(plan)
        except OffloadIOError as e:
            self.sampler.discard()
            self.disk_cache.forget(e.pages)
            failure = StepFailure(str(e), "disk", self._disk_users(plan), e.pages)
            return self._failed(plan, failure)

    def _run(self, plan: StepPlan) -> StepResult:
        by_batch: dict[int, list[SeqChunk]] = {}
        forks: list[SeqChunk] = []  # no tokens to run: they sample from their leader's row
        for chunk in plan.chunks:
            self._admit(chunk)
            if chunk.forked_from is None:
                by_batch.setdefault(chunk.gpu_batch, []).append(chunk)
            else:
                forks.append(chunk)
        for copy in plan.page_copies:  # copy-on-write: the copy is made with the page moves
            self._seqs[copy.seq_id].pages[copy.index] = copy.dst
        moves = [*plan.page_moves, *(PageMove(c.src, c.dst, "") for c in plan.page_copies)]
        padding = max(0, plan.dense_size - plan.num_tokens)  # to the step's discrete size
        last = max(by_batch)
        self.inputs.begin_step()
        to_sample = [
            c
            for _, cs in sorted(by_batch.items())
            for c in cs
            if c.do_sample and not self._seqs[c.seq_id].sampling.pooling
        ] + forks
        self.sampler.prepare(  # stages the draws; grammar masks start now, while layers run
            to_sample,
            [self._seqs[c.seq_id].sampling for c in to_sample],
            [not self._seqs[c.seq_id].has_sampled for c in to_sample],
        )
        members = {k: [(c, self._seqs[c.seq_id]) for c in cs] for k, cs in by_batch.items()}
        batches = self._builder.build_step(  # stages the batches, copies all in one go
            [(k, members[k], padding if k == last else 0) for k in sorted(by_batch)]
        )
        if self._nano_batcher is not None:
            for batch in batches:
                batch.nano_batches = self._nano_batcher.split(batch, members[batch.index])
        self.kv.reserve_pages([m.dst for m in moves])
        moved_to_disk = [m.dst[1] for m in plan.page_moves if m.dst[0] == "disk"]
        self.kv.disk_pool.begin_pages(moved_to_disk)
        self.disk_cache.forget(moved_to_disk + self._disk_pages_written(plan))  # new contents
        logits = self.pipeline.run(batches, moves)
        for c in plan.chunks:  # a hybrid's state at the end of a shared prefix, kept
            if c.state_save is not None:
                assert self.states is not None and c.state_slot is not None
                self.states.copy(c.state_slot, c.state_save)
        for move in plan.page_moves:  # spilled to disk, or loaded up from there
            if move.dst[0] == "disk":
                self.disk_cache.add(move.dst[1], move.hash)
        self.disk_cache.save()
        # Split each batch's logit rows by chunk: the row to sample from, and for echo +
        # logprobs requests the prompt positions. Rows follow batch order; results plan order.
        sample_rows: list[torch.Tensor] = []
        sampled: list[SeqChunk] = []
        prompt_logprobs: dict[int, list[TokenLogprobs]] = {}
        pooled_rows: list[torch.Tensor] = []  # (width,) each: a pooling request's head row
        pooled_ids: list[int] = []
        for batch, batch_logits, (_, chunks) in zip(
            batches, logits, sorted(by_batch.items()), strict=True
        ):
            row = 0
            for c, count in zip(chunks, batch.logit_counts, strict=True):
                rows, row = batch_logits[row : row + count], row + count
                state = self._seqs[c.seq_id]
                if state.wants_prompt_logprobs:
                    score_prompt(c, state, rows)
                    if c.do_sample:
                        prompt_logprobs[c.seq_id] = state.prompt_logprobs
                if c.do_sample and state.sampling.pooling:  # its answer, not a token
                    pooled_rows.append(rows[-1])
                    pooled_ids.append(c.seq_id)
                elif c.do_sample:
                    sample_rows.append(rows[-1:])
                    sampled.append(c)
                    state.has_sampled = True
        pooled: dict[int, list[float]] = {}
        if pooled_rows:
            assert self.pooler is not None, "a pooling request on a generation model"
            outputs = self.pooler.outputs(torch.stack(pooled_rows).float())
            pooled = dict(zip(pooled_ids, outputs, strict=True))
        by_seq = {c.seq_id: i for i, c in enumerate(sampled)}  # its row in sample_rows
        for fork in forks:  # the same logits row, sampled with the fork's own settings
            assert fork.forked_from is not None
            by_seq[fork.seq_id] = len(sampled)
            sample_rows.append(sample_rows[by_seq[fork.forked_from]])
            sampled.append(fork)
            self._seqs[fork.seq_id].has_sampled = True
        whole = not forks and len(logits) == 1 and len(sample_rows) == logits[0].shape[0]
        token_ids, logprobs, errors = self.sampler.sample(
            # every row of the one batch, in order (a decode step): no copy
            logits[0] if whole else torch.cat(sample_rows) if sampled else torch.empty(0)
        )
        order = [by_seq[c.seq_id] for c in plan.chunks if c.seq_id in by_seq]
        if not self._resident or moves:  # stores on other streams: fence them
            self.device.synchronize()
        return StepResult(
            plan.step_id,
            [sampled[i].seq_id for i in order],
            [token_ids[i] for i in order],
            [logprobs[i] for i in order],
            prompt_logprobs=prompt_logprobs,
            bytes_per_tier=self.bytes_per_tier(),
            errors=errors,
            pooled=pooled,
        )

    def _disk_pages_written(self, plan: StepPlan) -> list[int]:
        """Disk pages the plan's chunks write new KV into."""
        out: list[int] = []
        for c in plan.chunks:
            if not c.token_ids:  # a fork writes nothing
                continue
            pages = self._seqs[c.seq_id].pages
            first, last = (
                c.start_pos // PAGE_TOKENS,
                (c.start_pos + len(c.token_ids) - 1) // PAGE_TOKENS,
            )
            out.extend(p for tier, p in pages[first : last + 1] if tier == "disk")
        return out

    def _admit(self, chunk: SeqChunk) -> None:
        state = self._seqs.get(chunk.seq_id)
        if state is None:
            if chunk.sampling is None:
                raise ValueError(f"first chunk of sequence {chunk.seq_id} carries no sampling")
            state = self._seqs[chunk.seq_id] = SeqState(
                chunk.kv_tier, chunk.act_tier, chunk.sampling, state=chunk.state_slot
            )
            if chunk.state_slot is not None:  # a sequence (or its recompute) starts at zero
                assert self.states is not None  # or at the state its cached prefix ends with
                if chunk.state_restore is not None:
                    self.states.copy(chunk.state_restore, chunk.state_slot)
                else:
                    assert chunk.start_pos == 0
                    self.states.reset(*chunk.state_slot)
            self.sampler.admit(chunk.seq_id, chunk.sampling)
            if chunk.media is not None:
                if self.vision is None:
                    raise ValueError(f"sequence {chunk.seq_id} has images; the model takes text")
                state.media = chunk.media
                state.image_features = [  # an image in the cached prefix is never run again
                    self.vision.features(i) if i.start + i.num_tokens > chunk.start_pos else UNUSED
                    for i in chunk.media.images
                ]
        self.sampler.feed(chunk)
        state.pages.extend(chunk.new_pages)
        self.kv.reserve_pages(chunk.new_pages)
        # fresh disk pages start clean (a cached prefix page is full: nothing staged for it)
        self.kv.disk_pool.begin_pages([p for tier, p in chunk.new_pages if tier == "disk"])

    def score(self, prompts: list[list[int]], prefill_len: int | None = None) -> list[torch.Tensor]:
        """(len, vocab) float32 logits at every position of each prompt: for offline
        log-likelihood evaluation and for measuring compressed paths. The first `prefill_len`
        tokens (all by default) run as one prefill; the rest one per step, as decodes that read
        the KV cache back. Uses its own KV pages: not while scheduled requests are in flight."""
        pages = PageManager(PAGE_TOKENS, {})
        greedy = SamplingParams(max_tokens=1, temperature=0.0)
        out = []
        for i, prompt in enumerate(prompts):
            seq_id = -1 - i  # negative ids never collide with the scheduler's
            first = len(prompt) if prefill_len is None else max(1, min(prefill_len, len(prompt)))
            pieces = [(0, first)] + [(t, t + 1) for t in range(first, len(prompt))]
            logits = []
            for start, stop in pieces:
                new_pages = pages.append(seq_id, stop - start, "gpu")
                chunk = SeqChunk(
                    seq_id,
                    list(prompt[start:stop]),
                    start,
                    0,
                    new_pages,
                    "gpu",
                    "gpu",
                    do_sample=False,
                    sampling=greedy,
                    state_slot=self._scoring_slot(),
                )
                self._admit(chunk)
                batch = self._builder.build(0, [(chunk, self._seqs[seq_id])])
                batch.logit_rows = torch.arange(stop - start, device=self.device.device)
                logits.append(self.pipeline.run([batch])[0].cpu())
            out.append(torch.cat(logits))
            self._seqs.pop(seq_id)
            self.sampler.drop(seq_id)
            pages.free(seq_id)
        return out

    def _scoring_slot(self) -> tuple[str, int] | None:
        """The state slot `score` uses (no scheduled sequence holds one meanwhile)."""
        if self.states is None:
            return None
        return next((tier, 0) for tier, n in self._running_state_slots().items() if n)

    def _disk_users(self, plan: StepPlan) -> list[int]:
        """Sequences of the plan that use the disk tier: all of them when weights live there,
        else those with KV pages or activations there."""
        if self.weights.uses_tier("disk"):
            return [c.seq_id for c in plan.chunks]
        out = []
        for c in plan.chunks:
            state = self._seqs.get(c.seq_id)
            pages = state.pages if state is not None else c.new_pages
            if c.act_tier == "disk" or c.kv_tier == "disk" or any(t == "disk" for t, _ in pages):
                out.append(c.seq_id)
        return out

    def _failed(self, plan: StepPlan, failure: StepFailure) -> StepResult:
        return StepResult(
            plan.step_id, [], [], [], bytes_per_tier=self.bytes_per_tier(), failure=failure
        )

    def close(self) -> None:
        """Write the trace, stop the copy threads, remove the scratch directory. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if isinstance(self.tracer, Tracer) and self.trace_path is not None:
            self.device.synchronize()
            self.tracer.save(self.trace_path)
        self.disk_cache.save(force=True)
        if self.weights.picks is not None:
            self.weights.picks.save()
        self.pipeline.close()
        self.sampler.close()
        self.disk.close()
        if self._own_offload_dir:
            self._remove_scratch()
        if self._lock is not None:
            self._lock.release()


def build_executor(
    args: EngineArgs,
    model_dir: str,
    policy: Policy,
    on_progress: Callable[[int, int], None] | None = None,
) -> Executor:
    """The executor `args` describe, for the resolved model directory and policy: what `LLM`
    and the engine process (`engine.runtime`) build, the record passed as it is; on CUDA,
    warmed up (`Executor.warm_up`) unless `args.warmup` is off."""
    executor = Executor(
        model_dir,
        policy,
        device=args.device,
        offload_dir=args.offload_dir,
        gpu_mem=args.gpu_mem,
        cpu_mem=args.cpu_mem,
        disk_mem=args.disk_mem,
        dtype=None if args.dtype is None else getattr(torch, args.dtype),
        show_progress=args.show_progress,
        trace=args.trace,
        cuda_graphs=args.cuda_graphs,
        weight_slots=args.weight_slots,
        persist_kv_cache=args.persist_kv_cache,
        nano_batch_overlap=args.nano_batch_overlap,
        paged_attention=args.paged_attention,
        native_kernels=args.native_kernels,
        prepack_weights=args.prepack_weights,
        hot_experts=args.hot_experts,
        group_experts=args.group_experts,
        cpu_expert_rows=args.cpu_expert_rows,
        state_snapshots=args.prefix_state_slots if args.enable_prefix_caching else 0,
        step_tokens=args.step_tokens(policy),
        workload=args.workload,
        on_progress=on_progress,
    )
    if args.warmup and executor.device.is_cuda:
        try:
            sizes = args.discrete_batch_sizes(policy) if args.discrete_batching else None
            executor.warm_up(sizes, piecewise=args.piecewise_graphs)
        except BaseException:
            executor.close()
            raise
    return executor


def score_prompt(chunk: SeqChunk, state: SeqState, logits: torch.Tensor) -> None:
    """Logprobs of a prompt chunk's tokens (echo + logprobs). logits: (q_len, vocab), row r
    predicting position start_pos + r + 1; the prediction for the chunk's first token was
    left by the previous chunk. Position 0 has no logprob, as in OpenAI's API."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)  # stays on the compute device
    k = state.sampling.logprobs
    if state.pending_logprobs is not None:
        state.prompt_logprobs += top_logprobs(state.pending_logprobs, chunk.token_ids[:1], [k])
    later = chunk.token_ids[1:]
    state.prompt_logprobs += top_logprobs(log_probs[: len(later)], later, [k] * len(later))
    state.pending_logprobs = log_probs[-1:]
