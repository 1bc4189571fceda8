"""The GPU pass script (bench/gpu/pass.sh) runs end to end on the CPU in its dry-run mode, so
that a broken step shows here, not in the few minutes a GPU is at hand."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from policy.hardware import default_cache_path

pytest.importorskip("triton")
REPO = Path(__file__).resolve().parents[2]


def dry_run(tmp_path: Path, *steps: str, **limits: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        **limits,
        "PYTHON": sys.executable,
        "GPU_PASS_DRY_RUN": "1",
        "OUT": str(tmp_path / "out"),
        "NANOFLEX_CACHE": str(tmp_path / "cache"),
        "NANOFLEX_BENCH_RESULTS": str(tmp_path / "results"),
    }
    (tmp_path / "out").mkdir()
    (tmp_path / "cache").mkdir()
    shutil.copy(default_cache_path(), tmp_path / "cache" / "hardware.json")  # the suite's
    return subprocess.run(
        ["bash", "bench/gpu/pass.sh", *steps],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


def test_every_step_runs_on_the_cpu(tmp_path: Path) -> None:
    """Each step of the GPU pass, planning from the suite's fixed profile (the profile step
    apart: its measuring is tested with the profiler, and would add 15 s here)."""
    done = dry_run(tmp_path, "suite", "attention", "overlap", "offloaded", "resident", "breakdown")
    assert done.returncode == 0, done.stderr[-2000:]
    steps = dict(re.findall(r"^(\S+): exit (\d+) after", done.stdout, re.M))
    names = ("pytest-gpu", "attention", "overlap", "suite-offloaded", "suite-resident", "breakdown")
    assert steps == dict.fromkeys(names, "0"), done.stdout[-3000:]
    assert "tests collected" in done.stdout  # the suite, collected
    targets = re.findall(r"^target (.+?): (.+)$", done.stdout, re.M)  # the report's targets
    assert len(targets) == 4 and all(result for _, result in targets), done.stdout[-3000:]
    out = {p.name for p in (tmp_path / "out").iterdir()}
    assert {"logs.tgz", "gpu-attention.json", "gpu-overlap.json", "hardware.json"} <= out
    assert "gpu-breakdown.json" in out and "| prefill |" in done.stdout  # the breakdown's table
    assert len(out) <= 8  # what the device tool brings back


def test_the_dry_run_ignores_the_gpus_time_limits(tmp_path: Path) -> None:
    """A slow box is no failure: a step past its GPU limit, after the GPU deadline, still runs
    to its end in the dry run (on the GPU it would be skipped, or cut at 1 s)."""
    done = dry_run(tmp_path, "run", "sleep", "1.5", GPU_PASS_DEADLINE_S="0", GPU_PASS_RUN_S="1")
    assert done.returncode == 0, done.stderr[-2000:]
    assert re.search(r"^run: exit 0 after \d+ s", done.stdout, re.M), done.stdout[-2000:]


def test_an_unknown_step_is_refused(tmp_path: Path) -> None:
    """Before anything runs: no device probe (a Python start importing torch), no step."""
    done = dry_run(tmp_path, "attention", "bogus")
    assert done.returncode == 2 and "unknown step bogus" in done.stderr
    assert not (tmp_path / "results").exists() and done.stdout == ""
