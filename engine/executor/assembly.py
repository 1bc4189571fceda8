"""`EngineAssembly`: an engine assembled from its `EngineArgs`: device, model, stores, pipeline.

The executor's parts are made here, once, in the order their memory is placed: the
compute device and the model, the memory budgets and the offload directory, the weights
(read into their tiers), the vision tower, a hybrid's state slots, the KV pools and the
disk cache's index, then the block pipeline (with its CUDA graphs, nano-batch overlap and
kernels) and the step's staged inputs and sampler. Switches are read from the record
where they are used (their meaning is documented on `EngineArgs`).
"""

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

from base.pages import PAGE_TOKENS
from engine.core.auto_policy import cached_hardware, model_spec
from engine.core.dtypes import checkpoint_dtype
from engine.core.engine_args import EngineArgs
from engine.core.media import has_image_processor
from engine.core.offload_dir import OffloadDirError, OffloadDirLock, lock_offload_dir
from engine.core.pooling import pooling_spec
from engine.core.protocol import Placement
from engine.core.state_slots import (
    STATE_TIERS,
    snapshot_tier,
    state_slot_capacity,
    state_tier,
)
from engine.executor.budgets import (
    MemoryBudgetError,
    cap_gpu_memory,
    check_budgets,
    check_host_memory,
    derive_budgets,
    kv_capacity_pages,
)
from engine.executor.cuda_graphs import GraphRunner
from engine.executor.layer_io import Stores
from engine.executor.pipeline import BlockPipeline
from engine.executor.pooler import Pooler
from engine.executor.step_inputs import StepInputs
from engine.executor.step_sampler import StepSampler
from engine.executor.trace import NoTracer, Tracer
from engine.executor.vision_encoder import VisionEncoder
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
from policy.reserves import gpu_reserves, reserve_bytes
from policy.specs import ModelSpec
from policy.units import format_bytes


class EngineAssembly:
    """The parts of an engine built from `args` (its `model` a model reference or directory,
    see engine.core.model_files) under `policy`, and what they report: KV capacity per
    tier, realized placement, the cache salt. `close()` releases them.

    The offload directory (`args.offload_dir`) is locked for this process while the engine
    runs (engine/core/offload_dir.py); without one, a temporary directory is made and
    removed by `close()`. on_progress: called with (layers loaded, layers) while the
    weights load (the engine process reports it to the daemon); None: `args.show_progress`
    decides.
    """

    def __init__(
        self,
        args: EngineArgs,
        policy: Policy,
        on_progress: Callable[[int, int], None] | None = None,
    ) -> None:
        self.args = args
        self.policy = policy
        self.step_tokens = args.step_tokens(policy)
        """The most tokens one step runs (`EngineArgs.step_tokens`)."""
        self.workload = args.workload
        """The prompt and output lengths planned for: on a GPU, the reserves the planner
        priced for them and `step_tokens` are left out of the KV pool."""
        self.device = Device.resolve(args.device)
        self.model_dir = local_model_dir(args.model)
        self.config = read_model_config(self.model_dir)
        self.model = build_model(self.config)
        spec = pooling_spec(self.model_dir)
        self.pooler = Pooler.of(spec, self.model) if spec is not None else None
        """A decoder pooling model's: its requests' head rows are their answers."""
        if args.native_kernels:
            self.model.dense_ops = fused_dense_ops(self.device.is_cuda)
        given_dtype = None if args.dtype is None else getattr(torch, args.dtype)
        self.dtype = given_dtype or self.device.default_dtype(checkpoint_dtype(self.model_dir))
        if policy.num_cpu_threads > 0:  # 0 keeps torch's default; copy pools size themselves
            torch.set_num_threads(policy.num_cpu_threads)
        keep_freed_memory()
        self._own_offload_dir = args.offload_dir is None
        self.offload_dir = Path(args.offload_dir or tempfile.mkdtemp(prefix="nanoflex-offload-"))
        self.offload_dir.mkdir(parents=True, exist_ok=True)
        self._lock: OffloadDirLock | None = (
            None if self._own_offload_dir else lock_offload_dir(self.offload_dir)
        )
        self.budgets = derive_budgets(
            self.device,
            self.offload_dir,
            args.gpu_mem,
            args.cpu_mem,
            args.disk_mem,
            policy,
            moe=self.model.config.is_moe,
        )
        """Byte budget per tier, given or derived from the machine (see budgets.py)."""
        self._print_budgets()
        cap_gpu_memory(self.device, self.budgets["gpu"])
        if self._own_offload_dir:  # removed at close, or at exit if close never comes
            self._remove_scratch = weakref.finalize(
                self, shutil.rmtree, self.offload_dir, ignore_errors=True
            )
        self.disk = DiskIO(self.offload_dir, policy.num_copy_threads)
        self.weights = self._read_weights(on_progress)
        self.vision = (
            None
            if self.config.vision is None or not has_image_processor(self.model_dir)
            else VisionEncoder(
                self.model_dir,
                self.config.vision,
                open_reader(self.model_dir),
                self.device.device if policy.vision_tier == "gpu" else torch.device("cpu"),
                self.dtype,
            )
        )
        """The vision tower (a vision model's) on the policy's `vision_tier`: resident on the
        compute device, or homed and run on the host; None without the checkpoint's image
        processor (Gemma 3 then runs on text, as the daemon's `VisionSpec` says)."""
        self.snapshots: dict[str, int] = {}
        """A hybrid's snapshot slots for the prefix cache of states: {tier: count}."""
        self.states = self._state_store(args.state_snapshots)
        row_dim = self.config.kv_shape.row_dim
        codec = KVRowCodec(row_dim, compress=policy.compress_kv, dtype=self.dtype)
        self.kv = KVStore(
            len(self.config.kv_layers),
            PAGE_TOKENS,
            codec,
            self.device,
            self.disk,
            args.persist_kv_cache,
        )
        self.disk_cache = DiskCacheIndex(
            self.offload_dir, self.cache_salt(), self.kv.disk_pool, persistent=args.persist_kv_cache
        )
        """What each cached disk page holds, verified when used (and kept on disk if persistent)."""
        self.kv.capacity = self.kv_capacity_pages()
        self.found_on_disk = self.disk_cache.load(self.kv.capacity["disk"])
        """(hash, page) of the cached disk pages a persistent index kept from an earlier run."""
        self.kv.reserve_pages([("disk", page) for _, page in self.found_on_disk])
        check_budgets(self.weights.bytes_per_tier(), self.budgets)
        self.trace_path = None if args.trace is None else Path(args.trace)
        self.tracer = Tracer(cuda=self.device.is_cuda) if args.trace is not None else NoTracer()
        self.pipeline = self._block_pipeline()
        self.inputs = StepInputs(self.device.device, pinned=self.device.is_cuda)
        """The step's index inputs and sampling settings, staged on the host and copied to
        the device at once (engine/executor/step_inputs.py)."""
        native = args.native_kernels and not self.device.is_cuda
        self.sampler = StepSampler(
            self.model_dir,
            self.config.vocab_size,
            token_mask() if native else None,
            # beside a GPU's forward pass the cores are free; on a CPU it needs them
            grammar_threads=min(8, max(1, (os.cpu_count() or 2) - 1)) if self.device.is_cuda else 1,
            overlap_masks=self.device.is_cuda,
            inputs=self.inputs,
        )
        self.is_resident = (
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

    # -- the parts, in order -----------------------------------------------------------------

    def _print_budgets(self) -> None:
        """The budgets on stderr, with `show_progress` or when any was derived."""
        a = self.args
        if not a.show_progress and None not in (a.gpu_mem, a.cpu_mem, a.disk_mem):
            return
        given = {"gpu": a.gpu_mem, "cpu": a.cpu_mem, "disk": a.disk_mem}
        parts = [
            f"{t} {format_bytes(self.budgets[t])}" + ("" if given[t] else " (derived)")
            for t in TIERS
        ]
        where = ""
        if not self.device.is_cuda:
            where = " (no GPU: the compute device is the CPU, the gpu tier is host memory)"
        print(f"nanoflex: memory budgets: {', '.join(parts)}{where}", file=sys.stderr)

    def _read_weights(self, on_progress: Callable[[int, int], None] | None) -> WeightStore:
        """The weights placed by the policy and read into their tiers (refused before reading
        anything when they do not fit), offloaded layers loading into fixed slots."""
        policy = self.policy
        weights = WeightStore(
            self.model,
            self._reader(),
            weights_frac=policy.weights_frac,
            experts_frac=policy.experts_frac,
            compress=policy.compress_weights,
            dtype=self.dtype,
            device=self.device,
            disk=self.disk,
            prepack=self.args.prepack_weights,
            picks=self._expert_picks(),
            hot_experts=self.args.hot_experts,
        )
        if not policy.compress_weights:  # refuse before reading anything
            check_budgets(weights.planned_bytes(), self.budgets)
            check_host_memory(weights.planned_bytes(), self.device)
        progress = on_progress or (self._print_progress if self.args.show_progress else None)
        try:
            weights.read_all(progress)
        except OffloadIOError as e:
            raise OffloadDirError(
                f"the weights placed on disk cannot be written ({e}); free space under "
                f"{self.offload_dir}, or lower weights_frac[2]"
            ) from e
        if self.args.weight_slots:
            weights.make_slots()
        return weights

    def _reader(self) -> TensorReader:
        """The checkpoint's tensors, as a pooling model's head reads them when it pools."""
        reader = open_reader(self.model_dir)
        return self.pooler.reader(reader) if self.pooler is not None else reader

    def _print_progress(self, done: int, total: int) -> None:
        print(f"\rloading {self.model_dir.name}: layer {done}/{total}", end="", file=sys.stderr)
        if done == total:
            print(file=sys.stderr)

    def _expert_picks(self) -> ExpertPicks | None:
        """A MoE model's router counts, from the model's cache (empty the first time)."""
        c = self.config
        if not c.is_moe:
            return None
        layers = [j + 1 for j in range(c.num_layers) if c.is_moe_layer(j)]
        return ExpertPicks(picks_path(self.model_dir), layers, c.num_experts)

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

    def _block_pipeline(self) -> BlockPipeline:
        """The pipeline that runs a step's GPU batches layer by layer, with the CUDA graphs,
        nano-batch overlap and attention kernels the args switch on."""
        args, policy = self.args, self.policy
        return BlockPipeline(
            self.model,
            Stores(self.weights, self.kv, self.disk, self.states),
            self.device,
            policy,
            args,
            tracer=self.tracer,
            graphs=self._graph_runner() if args.cuda_graphs else None,
            cpu_expert_rows=self._cpu_expert_rows(),
        )

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

    def _cpu_expert_rows(self) -> int:
        """The most rows for which a CPU-homed expert runs on the CPU (0: never):
        `args.cpu_expert_rows`, or the cost model's break-even."""
        if not (self.policy.cpu_experts and self.config.is_moe):
            return 0
        if self.args.cpu_expert_rows is not None:
            return self.args.cpu_expert_rows
        hardware = cached_hardware()
        if hardware is None:
            logging.getLogger("nanoflex.engine").warning(
                "cpu_experts: no hardware profile to weigh CPU compute against copies "
                "(run `nanoflex profile`); every expert runs on the compute device"
            )
            return 0
        threads = self.policy.num_cpu_threads
        return cpu_expert_break_even(self._spec(), hardware, threads, self.policy.compress_weights)

    def _spec(self) -> ModelSpec:
        """The planner's spec of the served model on this device and dtype."""
        return model_spec(
            self.model_dir, str(self.device.device), str(self.dtype).removeprefix("torch.")
        )

    # -- what the assembled engine reports ----------------------------------------------------

    def kv_capacity_pages(self) -> dict[str, int | None]:
        """KV pages each tier may hold: its budget less its weights (a vision tower's on its
        tier) and, on a GPU, less the
        reserves the planner prices (`gpu_reserve_bytes`); on the CPU, less the slots disk
        layers load into and GPU_RESERVE_FRAC of the "gpu" tier (budgets.py)."""
        placed = self.weights.bytes_per_tier()
        for tier, nbytes in self.state_bytes().items():
            placed[tier] += nbytes
        if self.vision is not None:  # the tower's weights, on its tier
            placed[self.policy.vision_tier] += self.vision.weight_bytes
        if self.device.is_cuda:
            return kv_capacity_pages(
                self.budgets, placed, self.kv.page_bytes, gpu_reserve=self.gpu_reserve_bytes()
            )
        slots = 0 if self.weights.slots is None else self.weights.slots.total_bytes
        return kv_capacity_pages(self.budgets, placed, self.kv.page_bytes, in_flight=slots)

    def gpu_reserve_bytes(self) -> int:
        """What a step holds on the GPU beside the weights and KV homed there, as the planner
        prices it for this policy, workload and step budget (policy/reserves.py)."""
        slots = None if self.weights.slots is None else self.weights.slots.total_bytes
        reserves = gpu_reserves(
            self._spec(),
            self.policy,
            int(self.workload.prompt_len),
            int(self.workload.gen_len),
            self.step_tokens,
            slot_bytes=slots,
        )
        return reserve_bytes(reserves, self.policy)

    def state_bytes(self) -> dict[str, int]:
        """A hybrid's state slots' bytes per tier (none for a transformer)."""
        return {} if self.states is None else self.states.bytes_per_tier()

    def running_state_slots(self) -> dict[str, int]:
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
            state_bytes=self.state_bytes(),
        )

    def bytes_per_tier(self) -> dict[str, int]:
        """Weights, KV pools and activations resident per tier now."""
        return self.placement().bytes_per_tier()

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
