"""`cached_search`: the same search is solved once, then read back whole without cvxpy; a
changed input, a damaged file or `NANOFLEX_PLAN_CACHE=0` searches afresh."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from policy import FLEXGEN_T4, WorkloadSpec, search_cache
from policy.catalog import resolve_model_spec
from policy.search import PlanResult, PolicyInfeasible, search

MODEL = "facebook/opt-125m"
WORKLOAD = WorkloadSpec(prompt_len=512, gen_len=32)
GPU_MEM = 1 << 30


@pytest.fixture
def searches(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[int | None]:
    """The GPU budgets actually searched for, in a cache of this test's own."""
    monkeypatch.setenv("NANOFLEX_CACHE", str(tmp_path))
    monkeypatch.delenv(search_cache.ENV, raising=False)
    done: list[int | None] = []

    def counted(model: Any, workload: WorkloadSpec, hardware: Any, **budgets: Any) -> PlanResult:
        done.append(budgets["gpu_mem"])
        return search(model, workload, hardware, **budgets)

    monkeypatch.setattr(search_cache, "search", counted)
    return done


def plan(gpu_mem: int | None = GPU_MEM) -> PlanResult:
    model = resolve_model_spec(MODEL)
    return search_cache.cached_search(model, WORKLOAD, FLEXGEN_T4, gpu_mem=gpu_mem)


def read_in_a_fresh_process(cache: Path) -> str:
    """The cached plan's policy as JSON, read by a process of its own, which fails if that
    imported cvxpy."""
    code = (
        "import sys\n"
        "from policy import FLEXGEN_T4, WorkloadSpec, search_cache\n"
        "from policy.catalog import resolve_model_spec\n"
        f"model = resolve_model_spec({MODEL!r})\n"
        f"workload = WorkloadSpec(prompt_len={WORKLOAD.prompt_len}, gen_len={WORKLOAD.gen_len})\n"
        f"result = search_cache.cached_search(model, workload, FLEXGEN_T4, gpu_mem={GPU_MEM})\n"
        "assert 'cvxpy' not in sys.modules\n"
        "print(result.policy.to_json())\n"
    )
    env = {"NANOFLEX_CACHE": str(cache), "PATH": "", "PYTHONPATH": ":".join(sys.path)}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_the_same_search_is_read_back_whole_without_cvxpy(
    searches: list[int | None], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = plan()
    again = plan()
    assert searches == [GPU_MEM]
    assert again == first and again.num_solved == first.num_solved > 0
    assert read_in_a_fresh_process(tmp_path) == first.policy.to_json().strip()
    (cached,) = (tmp_path / "plans").iterdir()
    cached.write_bytes(b"not a pickle")
    assert plan() == first and len(searches) == 2  # a damaged file: searched afresh
    assert plan() == first and len(searches) == 2  # and written again whole
    monkeypatch.setenv(search_cache.ENV, "0")
    assert plan() == first and len(searches) == 3


def test_a_changed_input_searches_afresh_and_a_failure_is_not_kept(
    searches: list[int | None],
) -> None:
    for _ in range(2):
        with pytest.raises(PolicyInfeasible):
            plan(gpu_mem=1 << 20)
    assert searches == [1 << 20, 1 << 20]
