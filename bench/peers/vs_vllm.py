"""nanoflex against vLLM's CPU build, side by side in one sitting: same checkpoint, workload,
dtype and token ids, each run in a fresh process, the two systems alternating.

    python -m bench.peers.vs_vllm [--cases smollm2-mixed-float32,...] [--repeat 1]
        [--vllm-python /opt/venvs/vllm/bin/python] [--json bench/results/vllm-cpu.json]

vLLM runs from its own virtualenv (`bash bench/peers/setup_vllm_venv.sh`; never a dependency of
nanoflex) through bench/peers/vllm_env.sh; nanoflex through bench/peers/nanoflex_run.py with its
defaults. The 1.1B case uses TinyLlama's shape with generated weights on both sides
(nanoflex's `dummy:`, vLLM's `load_format="dummy"`): the work is the same, the values are
not. Throughput is generated tokens per second of the one timed `generate` call; the ratio
is nanoflex / vLLM, from the median run of each.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import Table, write_json
from bench.subproc import child_record, run_child

VLLM_PYTHON = "/opt/venvs/vllm/bin/python"
DEFAULT_MODEL = "smollm2-135m-instruct"
TINYLLAMA = "dummy:tinyllama-1.1b"


@dataclass(frozen=True)
class Case:
    model: str | None
    """nanoflex's model reference (None: the default model)."""
    workload: str
    dtype: str

    @property
    def name(self) -> str:
        model = "smollm2" if self.model is None else "tinyllama-1.1b"
        return f"{model}-{self.workload}-{self.dtype}"


CASES = {
    case.name: case
    for case in [
        *(
            Case(None, workload, dtype)
            for workload in ("mixed", "prefill-heavy", "decode-heavy")
            for dtype in ("float32", "bfloat16")
        ),
        Case(TINYLLAMA, "mixed-32", "bfloat16"),
        Case(TINYLLAMA, "mixed-32", "float32"),
    ]
}


def model_dir(case: Case) -> Path:
    from engine.loading.generated import local_model_dir

    return local_model_dir(case.model)


def run_system(system: str, case: Case, scratch: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One timed run of `system` on `case` in a fresh process."""
    out = scratch / f"{case.name}-{system}-{len(list(scratch.iterdir()))}.json"
    log = out.with_suffix(".log")
    flags = ["--workload", case.workload, "--dtype", case.dtype, "--json", str(out)]
    if system == "vllm":
        flags += ["--model", str(model_dir(case))]
        if case.model is not None and case.model.startswith("dummy:"):
            flags += ["--load-format", "dummy"]
        launcher = ["bash", "bench/peers/vllm_env.sh", args.vllm_python]
        child = run_child(
            ["-m", "bench.peers.vllm_run", *flags],
            timeout_s=args.timeout,
            log_path=log,
            launcher=launcher,
        )
    else:
        flags += [] if case.model is None else ["--model", case.model]
        child = run_child(
            ["-m", "bench.peers.nanoflex_run", "workload", *flags],
            timeout_s=args.timeout,
            log_path=log,
        )
    record = child_record(child, out, log)
    print(f"{case.name} {system}: {record.get('throughput', record.get('error'))}", file=sys.stderr)
    return record


def median_throughput(runs: list[dict[str, Any]]) -> float | None:
    values = [r["throughput"] for r in runs if "throughput" in r]
    return statistics.median(values) if values else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated case names")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each system per case")
    parser.add_argument("--vllm-python", default=VLLM_PYTHON)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    parser.add_argument("--json", default=None, help="also write the table and runs here")
    args = parser.parse_args()
    unknown = [name for name in args.cases.split(",") if name not in CASES]
    if unknown:
        parser.error(f"unknown cases {unknown}; known: {', '.join(CASES)}")
    table = Table(["model", "workload", "dtype", "nanoflex tok/s", "vLLM tok/s", "ratio"])
    results = []
    with tempfile.TemporaryDirectory(prefix="nanoflex-vs-vllm-") as tmp:
        for name in args.cases.split(","):
            case = CASES[name]
            runs: dict[str, list[dict[str, Any]]] = {"nanoflex": [], "vllm": []}
            for _ in range(args.repeat):
                for system in runs:
                    runs[system].append(run_system(system, case, Path(tmp), args))
            ours, theirs = median_throughput(runs["nanoflex"]), median_throughput(runs["vllm"])
            ratio = f"{ours / theirs:.2f}x" if ours and theirs else "-"
            model = "SmolLM2-135M" if case.model is None else "TinyLlama-1.1B shape"
            table.rows.append(
                [
                    model,
                    case.workload,
                    case.dtype,
                    "-" if ours is None else f"{ours:.1f}",
                    "-" if theirs is None else f"{theirs:.1f}",
                    ratio,
                ]
            )
            results.append({"case": name, "runs": runs})
    print(table.markdown("lllrrr"))
    write_json(args.json, results, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
