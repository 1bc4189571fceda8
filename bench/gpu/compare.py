"""One GPU comparison case side by side: nanoflex, FlexGen, Accelerate, prediction, roofline.

    python -m bench.gpu.compare opt-30b-p512-16g [--systems nanoflex,flexgen,accelerate]
        [--variants auto,overlap-off,...] [--timeout-s 540] [--device cuda]

Each system runs in its own child process (bench.peers.nanoflex_run, bench.gpu.flexgen_run,
bench.gpu.accelerate_run) under a hard timeout and the same GPU budget, one after the
other, so they never share the GPU or host memory. Results are merged into
bench/results/gpu-<case>.json (or $NANOFLEX_BENCH_RESULTS) after every child (a later
call adds systems or variants to the same file); logs go beside it under logs/.
Metrics follow FlexGen's definitions (docs/benchmarks.md, Metrics) for all systems.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.gpu.cases import CASES, VARIANTS, Case, FlexGenArgs
from bench.plans.roofline import best_roofline, roofline
from bench.subproc import child_record, run_child, write_json
from policy import Policy

SYSTEMS: tuple[str, ...] = ("nanoflex", "flexgen", "accelerate")
RESULTS_DIR = Path(os.environ.get("NANOFLEX_BENCH_RESULTS", "bench/results"))
"""Where results go: $NANOFLEX_BENCH_RESULTS (the device runbook uses /tmp/gpu-results)."""


def case_dict(case: Case) -> dict[str, Any]:
    data = dataclasses.asdict(case)
    data["flexgen"] = case.flexgen.to_dict() if case.flexgen else None
    return data


def result_path(case: Case, results_dir: Path = RESULTS_DIR) -> Path:
    return results_dir / f"gpu-{case.name}.json"


def _common(case: Case, device: str) -> list[str]:
    out = ["--model", case.model, "--prompt-len", str(case.prompt_len)]
    out += ["--gen-len", str(case.gen_len), "--device", device, "--cpu-mem", str(case.cpu_mem)]
    return out + ([] if case.gpu_mem is None else ["--gpu-mem", str(case.gpu_mem)])


def run_system(
    case: Case, system: str, variant: str, *, device: str, timeout_s: float, log_dir: Path
) -> dict[str, Any]:
    """One child: its JSON record (ok, metrics, policy, ...) or an error record."""
    tag = system if system != "nanoflex" else f"nanoflex-{variant}"
    log_path = log_dir / f"{case.name}-{tag}.log"
    result_file = log_dir / f"{case.name}-{tag}.json"
    result_file.unlink(missing_ok=True)
    if system == "nanoflex":
        args = [
            "-m",
            "bench.peers.nanoflex_run",
            "case",
            *_common(case, device),
            "--variant",
            variant,
        ]
        if case.flexgen is not None:
            args += ["--flexgen-policy", case.flexgen.to_json()]
    elif system == "accelerate":
        args = ["-m", "bench.gpu.accelerate_run", *_common(case, device)]
        args += ["--batch-size", str(case.accelerate_batch)]
    elif system == "flexgen":
        if case.flexgen is None or not case.is_opt:
            return {"ok": False, "skipped": True, "error": "FlexGen 0.1.8 runs OPT models only"}
        flexgen = FlexGenArgs.from_policy(case.flexgen)
        offload = Path(tempfile.gettempdir()) / f"flexgen-offload-{case.name}"
        argv = flexgen.argv(case.model, case.prompt_len, case.gen_len, str(offload))
        argv += ["--log-file", str(log_dir / f"{case.name}-flexgen.benchlog")]
        gpu = [] if case.gpu_mem is None else ["--gpu-mem", str(case.gpu_mem)]
        args = ["-m", "bench.gpu.flexgen_run", *gpu, "--json", str(result_file), "--", *argv]
    else:
        raise ValueError(f"unknown system {system!r}; known: {SYSTEMS}")
    if system != "flexgen":
        args += ["--json", str(result_file)]
    print(f"[{case.name}] {tag}: running (timeout {timeout_s:.0f} s)", file=sys.stderr)
    child = run_child(args, timeout_s=timeout_s, log_path=log_path)
    record = child_record(child, result_file, log_path)
    if system == "flexgen" and case.flexgen is not None:
        record["policy"] = case.flexgen.to_dict()
        record["flexgen_args"] = dataclasses.asdict(FlexGenArgs.from_policy(case.flexgen))
        if record.get("ok"):
            record["metrics"]["num_prompts"] = case.flexgen.block_size
    status = "ok" if record.get("ok") else record.get("error", "failed").splitlines()[0]
    print(f"[{case.name}] {tag}: {status} ({record['wall_seconds']} s)", file=sys.stderr)
    return record


def analyze(case: Case, runs: dict[str, Any]) -> dict[str, Any]:
    """Cost-model predictions for the policies that ran and the roofline, from the cached
    hardware profile (`nanoflex profile`); empty when there is none."""
    from policy.cost_model import estimate, hardware_budgets
    from policy.hardware import HardwareSpec, default_cache_path
    from policy.specs import WorkloadSpec

    if not default_cache_path().is_file():
        return {"note": "no hardware profile cached: run `nanoflex profile` first"}
    hardware = HardwareSpec.load(default_cache_path())
    spec = _model_spec(case)
    workload = WorkloadSpec(case.prompt_len, case.gen_len)
    budgets = hardware_budgets(hardware, case.gpu_mem, case.cpu_mem)
    predicted: dict[str, Any] = {}
    for name, run in runs.items():
        if run.get("policy") and name != "accelerate":
            result = estimate(Policy.from_dict(run["policy"]), spec, workload, hardware, budgets)
            predicted[name] = {**result.predicted(), "bottleneck": result.bottleneck}
    bounds: dict[str, Any] = {}
    best = best_roofline(spec, workload, hardware, gpu_mem=case.gpu_mem, cpu_mem=case.cpu_mem)
    bounds["best"] = best.to_dict() if best else None
    plain = best_roofline(
        spec, workload, hardware, gpu_mem=case.gpu_mem, cpu_mem=case.cpu_mem,
        allow_compression=False,
    )  # fmt: skip
    bounds["best_uncompressed"] = plain.to_dict() if plain else None
    auto = runs.get("nanoflex:auto", {}).get("policy")
    if auto:
        p = Policy.from_dict(auto)
        at_block = roofline(
            spec, workload, hardware, block_size=p.block_size,
            gpu_mem=case.gpu_mem, cpu_mem=case.cpu_mem, compress_weights=p.compress_weights,
            compress_kv=p.compress_kv,
        )  # fmt: skip
        bounds["nanoflex_block"] = at_block.to_dict()
    return {"hardware": hardware.to_dict(), "predicted": predicted, "roofline": bounds}


def _model_spec(case: Case) -> Any:
    from policy.catalog import builtin_spec, resolve_model_spec

    return builtin_spec(case.model) or resolve_model_spec(case.model)


def run_case(
    case: Case,
    *,
    systems: tuple[str, ...] = SYSTEMS,
    variants: tuple[str, ...] | None = None,
    device: str = "cuda",
    timeout_s: float = 540.0,
    deadline: float | None = None,
    results_dir: Path = RESULTS_DIR,
) -> dict[str, Any]:
    """Run `systems` (nanoflex once per variant) for `case`, merging into its result file.
    `deadline` (time.monotonic()) cuts each child's timeout so the whole call ends by it."""
    path = result_path(case, results_dir)
    record: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {}
    record["case"] = case_dict(case)
    runs: dict[str, Any] = record.setdefault("runs", {})
    log_dir = results_dir / "logs"
    for system in systems:
        for variant in (variants or case.variants) if system == "nanoflex" else ("",):
            left = timeout_s if deadline is None else min(timeout_s, deadline - time.monotonic())
            if left < 30:
                print(f"[{case.name}] out of time: {system} {variant} not run", file=sys.stderr)
                continue
            key = f"nanoflex:{variant}" if system == "nanoflex" else system
            runs[key] = {
                **run_system(case, system, variant, device=device, timeout_s=left, log_dir=log_dir),
                "measured_at": time.strftime("%Y-%m-%d %H:%M:%S"),
            }
            record.update(analyze(case, runs))
            write_json(path, record)
    record.update(analyze(case, runs))
    write_json(path, record)
    return record


def parse_csv(text: str, known: tuple[str, ...], what: str) -> tuple[str, ...]:
    items = tuple(x for x in text.split(",") if x)
    unknown = [x for x in items if x not in known]
    if unknown:
        raise SystemExit(f"unknown {what} {unknown}; known: {', '.join(known)}")
    return items


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("case", help=f"one of: {', '.join(CASES)}")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--variants", default=None, help="nanoflex variants; default the case's")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--timeout-s", type=float, default=540.0, help="per child process")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    if args.case not in CASES:
        raise SystemExit(f"unknown case {args.case!r}; known: {', '.join(CASES)}")
    record = run_case(
        CASES[args.case],
        systems=parse_csv(args.systems, SYSTEMS, "systems"),
        variants=parse_csv(args.variants, VARIANTS, "variants") if args.variants else None,
        device=args.device,
        timeout_s=args.timeout_s,
        results_dir=args.results_dir,
    )
    for name, run in record["runs"].items():
        gen = run.get("metrics", {}).get("generation_throughput")
        shown = f"{gen:.2f} token/s" if gen else str(run.get("error", ""))[:80]
        print(f"{name:28s} {shown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
