"""Choosing the policy: `policy="auto"` plans with the cost model for this model and machine.

Torch-free: the daemon plans here too. Only measuring a missing hardware profile
needs torch, and that runs in a child process when asked to stay torch-free.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from policy import Policy
from policy.hardware import HardwareSpec, default_cache_path
from policy.specs import ModelSpec, WorkloadSpec

DEFAULT_PROMPT_LEN = 512
DEFAULT_GEN_LEN = 32


@dataclass(frozen=True)
class Workload:
    """The lengths an automatic policy is planned for (FlexGen plans per workload too)."""

    prompt_len: int = DEFAULT_PROMPT_LEN
    gen_len: int = DEFAULT_GEN_LEN


DEFAULT_WORKLOAD = Workload()


def hardware_profile(device: str = "auto", *, torch_free: bool = False) -> HardwareSpec:
    """The cached profile; without one, a quick profile measured now and cached."""
    path = default_cache_path()
    if not path.is_file():
        if torch_free:
            code = f"from engine.profiler import cached_or_quick_profile as p; p({device!r})"
            subprocess.run([sys.executable, "-c", code], check=True)
        else:
            from engine.profiler import cached_or_quick_profile

            return cached_or_quick_profile(device)
    return HardwareSpec.load(path)


def resolve_policy(
    spec: Policy | str | None,
    model_dir: Path,
    *,
    device: str = "auto",
    workload: Workload = DEFAULT_WORKLOAD,
    gpu_mem: int | None = None,
    cpu_mem: int | None = None,
    disk_mem: int | None = None,
    torch_free: bool = False,
) -> tuple[Policy, dict[str, Any] | None]:
    """(policy, plan report). `spec` is a Policy, a JSON file path, or None / 'auto' to plan
    with the cost model; the report holds the prediction and the bottleneck when planned."""
    if isinstance(spec, Policy):
        return spec, None
    if spec not in (None, "auto"):
        return Policy.load(str(spec)), None
    from policy.search import search

    result = search(
        ModelSpec.from_name_or_path(str(model_dir)),
        WorkloadSpec(workload.prompt_len, workload.gen_len),
        hardware_profile(device, torch_free=torch_free),
        gpu_mem=gpu_mem,
        cpu_mem=cpu_mem,
        disk_mem=disk_mem,
    )
    return result.policy, {"predicted": result.predicted, "bottleneck": result.bottleneck}


def predict(
    policy: Policy,
    model_dir: Path,
    workload: Workload,
    *,
    gpu_mem: int | None = None,
    cpu_mem: int | None = None,
) -> dict[str, Any] | None:
    """The cost model's prediction for `policy`, or None when no profile is cached."""
    if not default_cache_path().is_file():
        return None
    from policy.cost_model import estimate, hardware_budgets

    hardware = HardwareSpec.load(default_cache_path())
    result = estimate(
        policy,
        ModelSpec.from_name_or_path(str(model_dir)),
        WorkloadSpec(workload.prompt_len, workload.gen_len),
        hardware,
        hardware_budgets(hardware, gpu_mem, cpu_mem),
    )
    return {**result.predicted(), "bottleneck": result.bottleneck}
