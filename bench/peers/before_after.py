"""This checkout against an earlier one on the named workloads, side by side in one sitting.

    git worktree add /tmp/before COMMIT
    python -m bench.peers.before_after --before /tmp/before [--workloads mixed]
        [--dtypes float32,bfloat16] [--repeat 1] [--json OUT]

Each run is `bench.peers.nanoflex_run` in a fresh process started in its checkout, so that
checkout's `engine` comes first on the path (this checkout's workload files are copied there
when it lacks them), the two alternating. Same virtualenv, model, token ids and calls.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.common import Table, write_json
from bench.subproc import child_record, run_child

HERE = Path(__file__).resolve().parents[2]
CHILD_FILES = ("bench/peers/__init__.py", "bench/peers/workloads.py", "bench/peers/nanoflex_run.py")


def run_once(
    checkout: Path, workload: str, dtype: str, out: Path, timeout: float
) -> dict[str, Any]:
    flags = ["--workload", workload, "--dtype", dtype, "--json", str(out)]
    child = run_child(
        ["-m", "bench.peers.nanoflex_run", "workload", *flags],
        timeout_s=timeout,
        log_path=out.with_suffix(".log"),
        cwd=checkout,  # `python -m` puts the working directory first on the path
    )
    return child_record(child, out, out.with_suffix(".log"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, type=Path, help="the earlier checkout")
    parser.add_argument("--workloads", default="mixed")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    for name in CHILD_FILES:
        if not (args.before / name).is_file():
            (args.before / name).parent.mkdir(exist_ok=True)
            shutil.copy(HERE / name, args.before / name)
    checkouts = {"before": args.before.resolve(), "after": HERE}
    table = Table(["workload", "dtype", "before tok/s", "after tok/s", "after / before"])
    results = []
    with tempfile.TemporaryDirectory(prefix="nanoflex-before-after-") as tmp:
        for workload in args.workloads.split(","):
            for dtype in args.dtypes.split(","):
                runs: dict[str, list[dict[str, Any]]] = {name: [] for name in checkouts}
                for i in range(args.repeat):
                    for name, checkout in checkouts.items():
                        out = Path(tmp) / f"{workload}-{dtype}-{name}-{i}.json"
                        runs[name].append(run_once(checkout, workload, dtype, out, args.timeout))
                        print(f"{workload} {dtype} {name}: done", file=sys.stderr)
                median = {
                    name: statistics.median(r["throughput"] for r in rs if "throughput" in r)
                    for name, rs in runs.items()
                }
                table.rows.append(
                    [
                        workload,
                        dtype,
                        f"{median['before']:.1f}",
                        f"{median['after']:.1f}",
                        f"{median['after'] / median['before']:.2f}x",
                    ]
                )
                results.append({"workload": workload, "dtype": dtype, "runs": runs})
    print(table.markdown("llrrr"))
    write_json(args.json, results, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
