"""Choosing the policy: `policy="auto"` plans with the cost model for this model and machine.

Torch-free: the daemon plans here too. Only measuring a missing hardware profile
needs torch, and that runs in a child process.
"""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from base.errors import UserError
from engine.core.dtypes import checkpoint_dtype, default_dtype
from engine.core.pooling import pooling_spec
from policy import Policy
from policy.catalog import resolve_model_spec
from policy.dtypes import DTYPE_BYTES
from policy.errors import ModelSpecError
from policy.hardware import HardwareSpec, default_cache_path
from policy.machine import machine_key
from policy.specs import ModelSpec, WorkloadSpec

DEFAULT_WORKLOAD = WorkloadSpec(prompt_len=512, gen_len=32)
"""What an automatic policy is planned for when no workload is given."""


def model_spec(model_dir: Path, compute_device: str, dtype: str | None = None) -> ModelSpec:
    """The model's shape with the element size the engine will compute in: `dtype` if
    given, else the engine's default for this device and checkpoint (engine/core/dtypes.py)."""
    spec = resolve_model_spec(str(model_dir))
    if dtype is None:
        dtype = default_dtype(compute_device, checkpoint_dtype(model_dir))
    pooling = pooling_spec(model_dir) if model_dir.is_dir() else None
    task = pooling.task if pooling is not None and not pooling.is_encoder else ""
    return dataclasses.replace(spec, dtype_bytes=DTYPE_BYTES[dtype], pooling=task)


def cached_hardware() -> HardwareSpec | None:
    """The cached hardware profile, or None when `nanoflex profile` has not run."""
    path = default_cache_path()
    return HardwareSpec.load(path) if path.is_file() else None


QUICK_PROFILE_S = 30
"""About how long a quick profile takes: 20 s measured in the CPU image on a busy 2-core box
(63 s before its I/O-interference probe took one round; a first-use kernel build adds more)."""
BACKGROUND_ENV = "NANOFLEX_BACKGROUND_PROFILE"
"""Set to 0 to never start the background re-measure of a profile taken under load."""


def hardware_profile(device: str = "auto") -> HardwareSpec:
    """The cached profile, measured now when there is none or when it was measured on another
    machine (`policy.machine.machine_key`): a quick profile, in a child process (measuring
    imports torch), then cached. A profile taken under load, or a quick one measured noisily
    (`HardwareSpec.noise`), is planned from as it is (a loaded one's overlap shares not
    believed) and measured again in the background once the machine is quiet
    (`remeasure_when_quiet`): a restart never waits for a profile this machine already has."""
    profile = _current_profile(device)
    if profile.under_load or profile.noise() is not None:
        remeasure_when_quiet(device, default_cache_path())
    return profile


def remeasure_when_quiet(device: str, path: Path) -> bool:
    """Start engine/profiling/requiet.py, detached, for the profile at `path` (one at a time:
    it holds a lock); it exits with this process. False when `NANOFLEX_BACKGROUND_PROFILE=0`
    forbids it."""
    if os.environ.get(BACKGROUND_ENV, "1") == "0":
        return False
    log = open(path.with_name("requiet.log"), "a")  # noqa: SIM115 (the child owns it)
    with log:
        subprocess.Popen(
            [sys.executable, "-m", "engine.profiling.requiet", device, str(path), str(os.getpid())],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
    return True


def _current_profile(device: str) -> HardwareSpec:
    path = default_cache_path()
    cached = HardwareSpec.load(path) if path.is_file() else None
    reason = "none is cached" if cached is None else cached.staleness(machine_key())
    if reason is None:
        assert cached is not None
        return cached
    print(
        f"nanoflex: measuring a quick hardware profile ({reason}): once per machine, about "
        f"{QUICK_PROFILE_S} s (the start waits for it)",
        file=sys.stderr,
    )
    start = time.monotonic()
    fresh = _measure_quick(device)
    print(
        f"nanoflex: hardware profile measured in {time.monotonic() - start:.0f} s, cached in "
        f"{path}",
        file=sys.stderr,
    )
    fresh.save(path)
    noise = fresh.noise()
    if noise is not None:
        print(
            f"nanoflex: warning: the hardware profile measured noisily ({noise}); planning "
            "from it, and measuring it again in the background once the machine is quiet "
            "(`nanoflex profile` on an idle machine measures a full one)",
            file=sys.stderr,
        )
    return fresh


def _measure_quick(device: str) -> HardwareSpec:
    with tempfile.TemporaryDirectory(prefix="nanoflex-profile-") as tmp:
        out = Path(tmp) / "hardware.json"
        argv = [sys.executable, "-m", "engine.profiling.profiler", device, str(out)]
        if subprocess.run(argv, check=False).returncode != 0 or not out.is_file():
            raise UserError("measuring a hardware profile failed; run `nanoflex profile`")
        return HardwareSpec.load(out)


def realized_policy(policy: Policy, num_seqs: int) -> Policy:
    """The block shape `num_seqs` sequences actually run in under `policy` when they are
    fewer than its block: GPU batches of at most num_seqs, only as many as they fill (the
    scheduler fills slots in order). More sequences than the block run block after block."""
    gbs = min(policy.gpu_batch_size, max(1, num_seqs))
    nb = min(policy.num_gpu_batches, math.ceil(num_seqs / gbs))
    if (gbs, nb) == (policy.gpu_batch_size, policy.num_gpu_batches):
        return policy
    return dataclasses.replace(policy, gpu_batch_size=gbs, num_gpu_batches=nb)


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
    plan_check: bool = True,
) -> tuple[Policy, dict[str, Any] | None]:
    """(policy, plan report). `spec` is a Policy, a JSON file path, or None / 'auto' to plan
    with the cost model; the report holds the prediction, the bottleneck and the profile
    planned from, and, where the best designs are predicted too close to call, what the plan
    check measured (engine/core/plan_check.py; `plan_check` False skips it)."""
    if isinstance(spec, Policy):
        return spec, None
    if spec not in (None, "auto"):
        return Policy.load(str(spec)), None
    from engine.core import plan_check as checking
    from policy.search_cache import cached_search

    hardware = hardware_profile(device)
    planned_from = hardware.describe()
    try:
        model = model_spec(model_dir, hardware.compute_device, dtype)
    except ModelSpecError as e:  # a family or layer kind the cost model does not price
        raise ModelSpecError(
            f"the planner cannot size this model ({e}); run it with a policy of your own "
            "(--policy FILE, a Policy as JSON: docs/policy.md)"
        ) from e
    workload = workload.priced_for(model)
    plan_check = plan_check and not model.pooling  # the check runs generation steps
    result = cached_search(
        model, workload, hardware, gpu_mem=gpu_mem, cpu_mem=cpu_mem, disk_mem=disk_mem
    )
    report: dict[str, Any] = {
        "predicted": result.predicted,
        "bottleneck": result.bottleneck,
        "hardware": planned_from,
    }
    if not plan_check:
        return result.policy, report
    setup = {
        "model_dir": str(model_dir),
        "device": device,
        "dtype": dtype,
        "gpu_mem": gpu_mem,
        "cpu_mem": cpu_mem,
        "disk_mem": disk_mem,
        "prompt_len": workload.prompt_len,
        "gen_len": workload.gen_len,
    }
    found = checking.candidates(result, model, workload, hardware)
    setup["check_prompt_len"] = checking.check_prompt_len(
        found, int(workload.prompt_len), result.predicted["prefill_throughput"]
    )
    policy, measured = checking.check(found, setup, hardware, int(model.total_weight_bytes))
    if measured is not None:
        report["plan_check"] = measured
    return policy, report


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
