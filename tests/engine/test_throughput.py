"""`nanoflex bench` puts the cost model's prediction, for the block that actually ran, beside
the measurement, and warns in one line when they differ by more than 2x."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from engine.core.auto_policy import hardware_profile, realized_policy
from engine.core.cache import cache_root
from engine.throughput import prediction_warning
from policy import Policy
from policy.hardware import FLEXGEN_T4, HardwareSpec, default_cache_path
from policy.machine import machine_key
from server.cli import main


def test_fewer_prompts_than_a_block_run_in_a_smaller_block() -> None:
    policy = Policy(gpu_batch_size=768)
    assert realized_policy(policy, 8).gpu_batch_size == 8
    shaped = Policy(gpu_batch_size=8, num_gpu_batches=32)
    assert (
        realized_policy(shaped, 20).gpu_batch_size,
        realized_policy(shaped, 20).num_gpu_batches,
    ) == (8, 3)
    assert realized_policy(shaped, 5000) == shaped  # a full block, then block after block


def test_warns_only_past_2x() -> None:
    result = {"generation_throughput": 30.0, "predicted": {"generation_throughput": 20.0}}
    assert prediction_warning(result) is None
    off = prediction_warning({**result, "generation_throughput": 65.0})
    assert off is not None and "3.25x" in off and "nanoflex profile" in off
    assert prediction_warning({**result, "generation_throughput": 9.0}) is not None


def _profile_here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spec: HardwareSpec) -> None:
    """Cache `spec` as this machine's profile (keyed by this machine, so it is used as is)."""
    suite_cache = cache_root()
    monkeypatch.setenv("NANOFLEX_CACHE", str(tmp_path))
    for name in ("demo-v2",):  # the demo model is generated once per cache: reuse the suite's
        shared = suite_cache / name
        if shared.is_dir():
            (tmp_path / name).symlink_to(shared)
    dataclasses.replace(spec, machine=machine_key()).save(default_cache_path())


def test_bench_prints_prediction_and_warns_when_the_profile_is_wrong(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A T4's constants claimed for this CPU: the prediction is far off, and bench says so."""
    _profile_here(tmp_path, monkeypatch, dataclasses.replace(FLEXGEN_T4, compute_device="cpu"))
    argv = ["bench", "--model", "nanoflex-demo", "--device", "cpu", "--prompt-len", "16"]
    assert main([*argv, "--gen-len", "4", "--num-prompts", "2", "--policy", "auto"]) == 0
    out, err = capsys.readouterr()
    assert "predicted    prefill" in out and "x the predicted generation throughput" in out
    warnings = [line for line in err.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "nanoflex profile" in warnings[0]
    assert main([*argv, "--gen-len", "4", "--num-prompts", "2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["predicted"]["generation_throughput"] > 0


@pytest.mark.slow
def test_a_profile_from_another_machine_is_measured_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The planner re-measures (a quick profile, in a child process) and caches this machine's."""
    monkeypatch.setenv("NANOFLEX_CACHE", str(tmp_path))
    dataclasses.replace(FLEXGEN_T4, machine="cpu=elsewhere; cores=32").save(default_cache_path())
    spec = hardware_profile("cpu")
    assert spec.machine == machine_key() and spec.compute_device == "cpu"
    assert spec.spread and HardwareSpec.load(default_cache_path()) == spec
    # this machine's now: used as is, not measured again, however noisy (a noisy one is
    # measured again in the background, which the suite turns off)
    assert hardware_profile("cpu") == spec
