"""A first start on a machine timed: `nanoflex serve` on an empty cache to `/ready`.

    python -m bench.daemon.fresh_start [--before CHECKOUT] [--repeat 3] [--json OUT]

Each start gets a new, empty nanoflex cache (no hardware profile, no plan check), with the
user's cache as the read-only seed cache, so the default model is found converted as in the
Docker image (run `nanoflex serve` once first) and the kernels as built; the background
re-measure is off. With `--before`, that checkout's daemon starts too, the two alternating.
Reported per start: seconds to `/ready`, the quick profile's seconds, whether a plan check ran
or was deferred, and the load average after (other work on the machine lengthens a start).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import Table, write_json
from bench.daemon.load import launch
from engine.core.auto_policy import BACKGROUND_ENV
from engine.core.cache import CACHE_ENV, SEED_ENV, cache_root


def start_once(tree: Path | None, tmp: Path) -> dict[str, Any]:
    settings = {SEED_ENV: str(cache_root()), CACHE_ENV: str(tmp / "cache"), BACKGROUND_ENV: "0"}
    saved = {name: os.environ.get(name) for name in settings}
    os.environ.update(settings)
    try:
        start = time.monotonic()
        daemon, _ = launch(tmp / "data", [], tree=tree)
        seconds = time.monotonic() - start
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    daemon.terminate()
    daemon.wait(timeout=60)
    log = (tmp / "data" / "daemon.log").read_text(errors="replace")
    profile = re.search(r"hardware profile measured in (\d+) s", log)
    return {
        "seconds": round(seconds, 1),
        "profile_seconds": int(profile.group(1)) if profile else None,
        "plan_check": "deferred"
        if "plan check deferred" in log
        else ("ran" if "plan check: running" in log else "none"),
        "under_load": "UNDER LOAD" in log,
        "load_average_after": round(os.getloadavg()[0], 2),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, default=None, help="an earlier checkout")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    trees: dict[str, Path | None] = {"this checkout": None}
    if args.before is not None:
        trees = {"before": args.before.resolve(), "after": None}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
    for i in range(args.repeat):
        for name, tree in trees.items():
            with tempfile.TemporaryDirectory(prefix="nanoflex-fresh-start-") as tmp:
                run = start_once(tree, Path(tmp))
            runs[name].append(run)
            print(f"{name} {i + 1}/{args.repeat}: {run}", flush=True)
    table = Table(["checkout", "starts", "to /ready, s", "median, s", "quick profile, s", "load"])
    for name, done in runs.items():
        table.rows.append(
            [
                name,
                str(len(done)),
                ", ".join(f"{r['seconds']:.1f}" for r in done),
                f"{statistics.median(r['seconds'] for r in done):.1f}",
                ", ".join(str(r["profile_seconds"]) for r in done),
                ", ".join(f"{r['load_average_after']:.1f}" for r in done),
            ]
        )
    print(table.markdown("llrrrr"))
    results = [{"checkout": name, **run} for name, done in runs.items() for run in done]
    write_json(args.json, results, table, vars(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
