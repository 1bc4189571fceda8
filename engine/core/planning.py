"""Choosing the policy: `policy="auto"` plans with the cost model for this model and machine.

Torch-free: the daemon plans here too. Only measuring a missing hardware profile
needs torch, and that runs in a child process.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path
from typing import Any

from policy import Policy, UserError
from policy.hardware import HardwareSpec, default_cache_path
from policy.specs import ModelSpec, WorkloadSpec

DEFAULT_WORKLOAD = WorkloadSpec(prompt_len=512, gen_len=32)
"""What an automatic policy is planned for when no workload is given."""


DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}


def model_spec(model_dir: Path, compute_device: str, dtype: str | None = None) -> ModelSpec:
    """The model's shape with the element size the engine will compute in: `dtype` if
    given, else float32 on a CPU, else the checkpoint's half type (float16 if it has none),
    as `engine.storage.device.Device.default_dtype` chooses."""
    spec = ModelSpec.from_name_or_path(str(model_dir))
    if dtype is None:  # on CUDA the half type: 2 bytes whichever it is
        dtype = "float32" if compute_device == "cpu" else "float16"
    return dataclasses.replace(spec, dtype_bytes=DTYPE_BYTES[dtype])


def cached_hardware() -> HardwareSpec | None:
    """The cached hardware profile, or None when `nanoflex profile` has not run."""
    path = default_cache_path()
    return HardwareSpec.load(path) if path.is_file() else None


def hardware_profile(device: str = "auto") -> HardwareSpec:
    """The cached profile; without one, a quick profile is measured now (in a child process,
    since measuring imports torch) and cached."""
    path = default_cache_path()
    if not path.is_file():
        argv = [sys.executable, "-m", "engine.executor.profiler", device]
        if subprocess.run(argv, check=False).returncode != 0:
            raise UserError("measuring a hardware profile failed; run `nanoflex profile`")
    return HardwareSpec.load(path)


def resolve_policy(
    spec: Policy | str | None,
    model_dir: Path,
    *,
    device: str = "auto",
    workload: WorkloadSpec = DEFAULT_WORKLOAD,
    gpu_mem: int | None = None,
    cpu_mem: int | None = None,
    disk_mem: int | None = None,
    dtype: str | None = None,
) -> tuple[Policy, dict[str, Any] | None]:
    """(policy, plan report). `spec` is a Policy, a JSON file path, or None / 'auto' to plan
    with the cost model; the report holds the prediction and the bottleneck when planned."""
    if isinstance(spec, Policy):
        return spec, None
    if spec not in (None, "auto"):
        return Policy.load(str(spec)), None
    from policy.search import search

    hardware = hardware_profile(device)
    result = search(
        model_spec(model_dir, hardware.compute_device, dtype),
        workload,
        hardware,
        gpu_mem=gpu_mem,
        cpu_mem=cpu_mem,
        disk_mem=disk_mem,
    )
    return result.policy, {"predicted": result.predicted, "bottleneck": result.bottleneck}


def predict(
    policy: Policy,
    model_dir: Path,
    workload: WorkloadSpec,
    *,
    gpu_mem: int | None = None,
    cpu_mem: int | None = None,
    dtype: str | None = None,
) -> dict[str, Any] | None:
    """The cost model's prediction for `policy` computing in `dtype`, or None when no profile
    is cached."""
    hardware = cached_hardware()
    if hardware is None:
        return None
    from policy.cost_model import estimate, hardware_budgets

    result = estimate(
        policy,
        model_spec(model_dir, hardware.compute_device, dtype),
        workload,
        hardware,
        hardware_budgets(hardware, gpu_mem, cpu_mem),
    )
    return {**result.predicted(), "bottleneck": result.bottleneck}
