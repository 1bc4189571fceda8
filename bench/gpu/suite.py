"""Run a list of GPU comparison cases within a time budget (one device command's worth).

    python -m bench.gpu.suite [--cases opt-6.7b-p512-16g,opt-30b-p512-16g] [--budget-s 540]
        [--systems nanoflex,flexgen,accelerate] [--variants auto] [--dry-run]

For each case and system it first estimates the seconds the run will take (weight
setup at SETUP_BYTES_PER_S plus one block at the cost model's predicted throughput,
times SAFETY) and skips what would not finish before the budget ends; each child
also gets a hard timeout at the budget's end. `--dry-run` prints the estimates only.
Results land in bench/results/gpu-<case>.json (bench.gpu.compare).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from bench.gpu.cases import CASES, DEFAULT_ORDER, VARIANTS, Case
from bench.gpu.compare import RESULTS_DIR, SYSTEMS, parse_csv, run_case

SETUP_BYTES_PER_S = 1.0e9
"""Generating and placing dummy weights (host memory and pinning), a pessimistic rate."""
SAFETY = 1.5
STARTUP_S = 15.0
"""Python, torch and CUDA start-up per child process."""


def estimate_seconds(case: Case, systems: tuple[str, ...]) -> dict[str, float] | None:
    """Rough seconds per system (nanoflex: its `auto` policy), None without a cached profile."""
    from policy.catalog import builtin_spec, resolve_model_spec
    from policy.cost_model import estimate, hardware_budgets
    from policy.hardware import HardwareSpec, default_cache_path
    from policy.policy import Policy
    from policy.search import PolicyInfeasible, search
    from policy.specs import WorkloadSpec

    if not default_cache_path().is_file():
        return None
    hardware = HardwareSpec.load(default_cache_path())
    spec = builtin_spec(case.model) or resolve_model_spec(case.model)
    workload = WorkloadSpec(case.prompt_len, case.gen_len)
    budgets = hardware_budgets(hardware, case.gpu_mem, case.cpu_mem)
    setup = STARTUP_S + spec.total_weight_bytes / SETUP_BYTES_PER_S

    def run_seconds(policy: Policy) -> float:
        result = estimate(policy, spec, workload, hardware, budgets)
        return policy.block_size * case.gen_len / result.generation_throughput

    out: dict[str, float] = {}
    for system in systems:
        if system == "nanoflex":
            try:
                planned = search(
                    spec, workload, hardware, gpu_mem=case.gpu_mem, cpu_mem=case.cpu_mem
                ).policy
            except PolicyInfeasible:
                out[system] = setup
                continue
            per_variant = setup + run_seconds(planned)
            out[system] = SAFETY * per_variant * len(case.variants)
        elif system == "flexgen" and case.flexgen is not None:
            out[system] = SAFETY * (setup + run_seconds(case.flexgen))
        elif system == "accelerate":
            gpu = budgets["gpu"] * 0.8
            on_gpu = min(1.0, gpu / spec.total_weight_bytes)
            like_accelerate = Policy(
                gpu_batch_size=case.accelerate_batch,
                weights_frac=(on_gpu, 1.0 - on_gpu, 0.0),
                overlap=False,
            )
            out[system] = SAFETY * (setup + run_seconds(like_accelerate))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--cases", default=",".join(DEFAULT_ORDER))
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--variants", default=None, help="nanoflex variants; default the case's")
    parser.add_argument("--budget-s", type=float, default=540.0, help="for the whole call")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--dry-run", action="store_true", help="print estimates, run nothing")
    args = parser.parse_args(argv)
    names = parse_csv(args.cases, tuple(CASES), "cases")
    systems = parse_csv(args.systems, SYSTEMS, "systems")
    variants = parse_csv(args.variants, VARIANTS, "variants") if args.variants else None
    deadline = time.monotonic() + args.budget_s
    summary: list[dict[str, Any]] = []
    for name in names:
        case = CASES[name]
        if variants is not None:
            case = Case(**{**vars(case), "variants": variants})
        estimates = estimate_seconds(case, systems) or {}
        for system in systems:
            guess = estimates.get(system)
            left = deadline - time.monotonic()
            row = {"case": name, "system": system, "estimate_s": guess, "left_s": round(left)}
            if args.dry_run:
                summary.append(row)
                continue
            if guess is not None and guess > left:
                summary.append({**row, "status": "skipped: estimate over the budget left"})
                continue
            record = run_case(
                case,
                systems=(system,),
                device=args.device,
                deadline=deadline,
                results_dir=args.results_dir,
            )
            keys = [k for k in record["runs"] if k.split(":")[0] == system]
            ok = all(record["runs"][k].get("ok") for k in keys) if keys else False
            summary.append({**row, "status": "ok" if ok else "failed or not run"})
    for row in summary:
        guess = row["estimate_s"]
        print(
            f"{row['case']:24s} {row['system']:11s} estimate "
            f"{'?' if guess is None else f'{guess:6.0f} s'}  {row.get('status', '(dry run)')}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
