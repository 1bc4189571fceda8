"""`cached_search`: the policy search, remembered on disk for the same inputs.

A search imports cvxpy and solves hundreds of small LPs: seconds at every `auto` start of a
model on a machine, for the same answer each time. Its result is kept in
`$NANOFLEX_CACHE/plans/`, one file per key: every input of the search (the model's shape,
the workload, the hardware profile, the budgets given) and the source of this package, whose
code is the search. A search with the same key reads the file (cvxpy is not imported); any
changed input, a new profile included, searches afresh. `NANOFLEX_PLAN_CACHE=0` turns it off.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from pathlib import Path

from policy.hardware import HardwareSpec, default_cache_path
from policy.jsonfile import publish_file
from policy.search import PlanResult, search
from policy.specs import ModelSpec, WorkloadSpec

ENV = "NANOFLEX_PLAN_CACHE"
"""Set to 0 to search every time."""
FORMAT = 2
"""The cached file's layout; bumped when it changes (2: `Policy.vision_tier`)."""


def cached_search(
    model: ModelSpec,
    workload: WorkloadSpec,
    hardware: HardwareSpec,
    *,
    gpu_mem: int | None = None,
    cpu_mem: int | None = None,
    disk_mem: int | None = None,
) -> PlanResult:
    """`policy.search.search(model, workload, hardware, gpu_mem=..., cpu_mem=...,
    disk_mem=...)`, read from the cache where the same search ran before; raises as it does
    (a failed search is not cached)."""

    def run() -> PlanResult:
        return search(
            model, workload, hardware, gpu_mem=gpu_mem, cpu_mem=cpu_mem, disk_mem=disk_mem
        )

    if os.environ.get(ENV, "1") == "0":
        return run()
    path = _path(repr((FORMAT, model, workload, hardware, gpu_mem, cpu_mem, disk_mem)))
    cached = _load(path)
    if cached is None:
        cached = run()
        _store(path, cached)
    return cached


def _path(inputs: str) -> Path:
    digest = hashlib.sha256(inputs.encode())
    for source in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(source.name.encode())
        digest.update(source.read_bytes())
    return default_cache_path().parent / "plans" / f"{digest.hexdigest()[:32]}.pickle"


def _load(path: Path) -> PlanResult | None:
    """The cached result, or None where there is none or it does not read (then the search
    runs and writes it again)."""
    try:
        with path.open("rb") as f:
            result = pickle.load(f)
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ImportError):
        return None
    return result if isinstance(result, PlanResult) else None


def _store(path: Path, result: PlanResult) -> None:
    """Write the result in one step (`publish_file`); a cache that cannot be written is no
    error (the next start searches again)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        publish_file(path, pickle.dumps(result))
    except OSError:
        pass
