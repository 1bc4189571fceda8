"""A plan checked against the real model: close candidates run for real, the fastest kept,
the choice cached; off with plan_check=False."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from engine.core import plan_check
from engine.core.auto_policy import model_spec, resolve_policy
from engine.loading.demo import demo_model_dir
from policy import Policy
from policy.hardware import HardwareSpec, default_cache_path
from policy.search import search
from policy.specs import WorkloadSpec

WORKLOAD = WorkloadSpec(prompt_len=64, gen_len=8)
GPU_MEM = 128 << 20
"""A small compute-memory budget: blocks of 64 sequences, so each candidate runs in seconds."""


def test_candidates_are_the_close_distinct_designs() -> None:
    hardware = HardwareSpec.load(default_cache_path())  # the suite's fixed profile
    model = model_spec(demo_model_dir(), "cpu")
    result = search(model, WORKLOAD, hardware, gpu_mem=GPU_MEM)
    found = plan_check.candidates(result, model, WORKLOAD, hardware)
    best = result.predicted["generation_throughput"]
    assert found[0].policy == result.policy and 2 <= len(found) <= plan_check.MAX_CANDIDATES
    assert all(c.predicted >= best * (1 - plan_check.MARGIN) for c in found)
    assert len({c.policy.to_json() for c in found}) == len(found)  # no policy twice
    far = [t for _, t in result.runners_up if t < best * (1 - plan_check.MARGIN)]
    assert all(t < min(c.predicted for c in found) for t in far)


def test_close_plans_run_for_real_and_the_fastest_is_kept_and_cached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = demo_model_dir()  # built in the suite's cache, before the check gets its own
    profile = default_cache_path().read_text()
    monkeypatch.setenv("NANOFLEX_CACHE", str(tmp_path))
    default_cache_path().write_text(profile)
    monkeypatch.setenv("NANOFLEX_PLAN_CHECK", "1")
    trusted, plain = resolve_policy(
        "auto", model, device="cpu", workload=WORKLOAD, gpu_mem=GPU_MEM, plan_check=False
    )
    assert plain is not None and "plan_check" not in plain
    policy, report = resolve_policy("auto", model, device="cpu", workload=WORKLOAD, gpu_mem=GPU_MEM)
    assert report is not None
    checked = report["plan_check"]
    runs = checked["runs"]
    assert not checked["cached"] and len(runs) >= 2
    assert Policy.from_dict(runs[0]["policy"]) == trusted  # the cost model's pick ran first
    assert all(r["generation_throughput"] > 0 and r["decode_step_seconds"] > 0 for r in runs)
    fastest = max(runs, key=lambda r: r["generation_throughput"])
    assert policy == Policy.from_dict(fastest["policy"])
    again, cached = resolve_policy("auto", model, device="cpu", workload=WORKLOAD, gpu_mem=GPU_MEM)
    assert again == policy and cached is not None and cached["plan_check"]["cached"]
    assert cached["plan_check"]["runs"] == runs  # the first check's figures, not new ones
    assert all(r["prompt_len"] == WORKLOAD.prompt_len for r in runs)  # short enough to run whole


def test_a_long_check_runs_shorter_prompts_in_the_planned_blocks() -> None:
    """A CPU box's planned block (384 x 512 tokens) would take minutes of prefill per
    candidate: the check cuts the prompts to CHECK_PREFILL_SECONDS at the predicted rate,
    for the largest block among the candidates, never under MIN_CHECK_PROMPT tokens nor over
    the planned length."""
    found = [
        plan_check.Candidate(Policy(gpu_batch_size=384), 1.0),
        plan_check.Candidate(Policy(gpu_batch_size=256, num_gpu_batches=2), 1.0),
    ]
    rate = 2000.0  # prefill tokens/s
    expected = int(rate * plan_check.CHECK_PREFILL_SECONDS) // 512
    assert plan_check.check_prompt_len(found, 512, rate) == expected < 512
    assert plan_check.check_prompt_len(found, 512, 1e9) == 512
    assert plan_check.check_prompt_len(found, 512, 1.0) == plan_check.MIN_CHECK_PROMPT
    assert plan_check.check_prompt_len(found, 8, 1.0) == 8


def test_a_profile_measured_under_load_defers_the_check_uncached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same close candidates, planned from a profile a busy machine measured: the cost
    model's pick runs, the check is deferred (said so in the report), nothing is cached, so
    the start planned from the quiet re-measure checks the plan."""
    model = demo_model_dir()
    quiet = HardwareSpec.load(default_cache_path())
    monkeypatch.setenv("NANOFLEX_CACHE", str(tmp_path))
    busy = dataclasses.replace(quiet, machine_load={"others_cores": 1.6, "steal_share": 0.0})
    busy.save(default_cache_path())
    monkeypatch.setenv("NANOFLEX_PLAN_CHECK", "1")
    trusted, _ = resolve_policy(
        "auto", model, device="cpu", workload=WORKLOAD, gpu_mem=GPU_MEM, plan_check=False
    )
    policy, report = resolve_policy("auto", model, device="cpu", workload=WORKLOAD, gpu_mem=GPU_MEM)
    assert policy == trusted and report is not None
    assert "under load" in report["plan_check"]["skipped"]
    assert not (tmp_path / plan_check.CACHE_FILE).exists()
