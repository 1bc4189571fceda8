"""A plan checked against the real model before it is trusted.

The cost model ranks designs (compression, CPU attention, nano-batches, ...) by prediction;
where the best two or three are predicted within `MARGIN` of each other, the prediction
cannot tell them apart, and a profile off in one constant (a busy machine's overlap share, a
path the model prices wrongly) picks the wrong one. So at the first start, each of those
candidates runs one block of the served model for real (its prefill, then `CHECK_STEPS`
decode steps, in a child process: the daemon stays torch-free), the measured generation
throughput for the planned workload is worked out from those times, and the fastest is
kept. The choice is cached (`plan-checks.json` in the nanoflex cache) under everything it
depends on: the model's config, the workload, the budgets, the device and dtype, the
hardware profile and the candidates; the next start reuses it. vLLM likewise runs a forward
pass at start to size its KV cache. `--no-plan-check` (`EngineArgs.plan_check`) or an
explicit `--policy` skip it; so does a model over `MAX_WEIGHT_BYTES` (its loads would take
minutes per candidate), with a log line. A profile measured under load defers it, uncached:
a busy machine would time the candidates as wrongly as it timed the profile, and stretch the
start by their loads and blocks; the start planned from the profile measured again once the
machine is quiet (a new cache key) checks the plan.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.core.cache import cache_root, publish_file
from policy import Policy
from policy.hardware import HardwareSpec
from policy.specs import ModelSpec, WorkloadSpec

if TYPE_CHECKING:  # the search needs numpy and cvxpy, which the daemon loads only to plan
    from policy.search import PlanResult

log = logging.getLogger("nanoflex.engine")

MARGIN = 0.2
"""Candidates predicted within this share of the best are run for real."""
MAX_CANDIDATES = 3
"""The most designs a check runs (the chosen one and the closest others)."""
MAX_WEIGHT_BYTES = 4 << 30
"""Larger models skip the check: each candidate loads the weights anew."""
CHECK_STEPS = 4
"""Decode steps timed per candidate (the first token comes with the prefill)."""
CHECK_PREFILL_SECONDS = 8.0
"""The prefill a candidate's block may take, predicted: where the planned prompts would take
longer (a CPU box's block of 384 x 512 tokens takes minutes), the check's prompts are cut to
fit, at least `MIN_CHECK_PROMPT` tokens, and the prefill time scaled back to the planned
length. The block size, the design's own choice, is never cut."""
MIN_CHECK_PROMPT = 16
ENV = "NANOFLEX_PLAN_CHECK"
"""Set to 0 to skip every plan check (the test suite does, but for the tests of the check)."""
CACHE_FILE = "plan-checks.json"


@dataclass(frozen=True)
class Candidate:
    policy: Policy
    predicted: float
    """Predicted generation throughput, tokens/s."""


def candidates(
    result: PlanResult, model: ModelSpec, workload: WorkloadSpec, hardware: HardwareSpec
) -> list[Candidate]:
    """The chosen policy and the runners-up predicted within MARGIN of it, best first, at most
    MAX_CANDIDATES; one candidate means there is nothing to check."""
    from policy.threads import plan_threads

    best = result.predicted["generation_throughput"]
    out = [Candidate(result.policy, best)]
    for policy, throughput in result.runners_up:
        if len(out) == MAX_CANDIDATES or throughput < best * (1 - MARGIN):
            break
        planned = plan_threads(model, workload, hardware, policy)
        if all(planned != c.policy for c in out):  # two designs can meet in one policy
            out.append(Candidate(planned, throughput))
    return out


def check_prompt_len(found: list[Candidate], prompt_len: int, prefill_throughput: float) -> int:
    """The prompt length the check runs: the planned one, or shorter where the largest
    candidate block's prefill would take more than CHECK_PREFILL_SECONDS at the predicted
    prefill rate (tokens/s)."""
    block = max(c.policy.block_size for c in found)
    fits = int(prefill_throughput * CHECK_PREFILL_SECONDS) // block
    return max(min(prompt_len, MIN_CHECK_PROMPT), min(prompt_len, fits))


def check_key(setup: dict[str, Any], hardware: HardwareSpec, found: list[Candidate]) -> str:
    """What a check's outcome depends on, as one digest."""
    config = Path(setup["model_dir"]) / "config.json"
    key = {
        **setup,
        "config": hashlib.sha256(config.read_bytes()).hexdigest() if config.is_file() else "",
        "profile": [hardware.machine, hardware.notes],
        "candidates": [c.policy.to_dict() for c in found],
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def check(
    found: list[Candidate],
    setup: dict[str, Any],
    hardware: HardwareSpec,
    weight_bytes: int,
) -> tuple[Policy, dict[str, Any] | None]:
    """(the policy to run, what the check measured or why it did not run; None: nothing to
    check). `setup`: model_dir, device, dtype, gpu_mem, cpu_mem, disk_mem, prompt_len,
    gen_len, check_prompt_len."""
    if len(found) < 2:
        return found[0].policy, None
    if os.environ.get(ENV, "1") == "0":
        return found[0].policy, {"skipped": f"{ENV}=0"}
    if hardware.under_load:
        reason = (
            "the hardware profile was measured under load; the check runs at the first start "
            "planned from the profile measured again once the machine is quiet"
        )
        log.info("plan check deferred: %s", reason)
        return found[0].policy, {"skipped": reason}
    if weight_bytes > MAX_WEIGHT_BYTES:
        reason = f"the weights ({weight_bytes / 2**30:.1f} GiB) would load once per candidate"
        log.info("plan check skipped: %s", reason)
        return found[0].policy, {"skipped": reason}
    key = check_key(setup, hardware, found)
    path = cache_root() / CACHE_FILE
    cached = _read(path)
    if key in cached:
        record = cached[key]
        return Policy.from_dict(record["chosen"]), {**record, "cached": True}
    log.info(
        "plan check: running %d candidate plans predicted within %.0f%%, one block each of "
        "prompts of %d tokens (planned %d)",
        len(found),
        100 * MARGIN,
        setup["check_prompt_len"],
        setup["prompt_len"],
    )
    measured = _run(found, setup)
    fastest = max(measured, key=lambda m: m["generation_throughput"])
    record = {"chosen": fastest["policy"], "runs": measured}
    cached[key] = record
    path.parent.mkdir(parents=True, exist_ok=True)
    publish_file(path, json.dumps(cached, indent=1) + "\n")
    return Policy.from_dict(fastest["policy"]), {**record, "cached": False}


def _read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _run(found: list[Candidate], setup: dict[str, Any]) -> list[dict[str, Any]]:
    """Each candidate run for real in a child process (engine/plan_check_run.py)."""
    with tempfile.TemporaryDirectory(prefix="nanoflex-plan-check-") as tmp:
        spec = Path(tmp) / "spec.json"
        out = Path(tmp) / "out.json"
        spec.write_text(
            json.dumps(
                {
                    **setup,
                    "check_steps": CHECK_STEPS,
                    "candidates": [
                        {"policy": c.policy.to_dict(), "predicted": c.predicted} for c in found
                    ],
                }
            )
        )
        argv = [sys.executable, "-m", "engine.plan_check_run", str(spec), str(out)]
        done = subprocess.run(argv, check=False)
        if done.returncode != 0 or not out.is_file():
            raise RuntimeError("the plan check failed; --no-plan-check skips it")
        runs: list[dict[str, Any]] = json.loads(out.read_text())
        return runs
