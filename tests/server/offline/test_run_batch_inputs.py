"""`nanoflex run-batch` refusing bad paths with one line, and its exit status, run as a real
subprocess (issue 12, item 5)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.core.model_files import DEMO_MODEL

ROOT = Path(__file__).resolve().parents[3]
LINE = json.dumps(
    {
        "custom_id": "a",
        "method": "POST",
        "url": "/v1/completions",
        "body": {"model": DEMO_MODEL, "prompt": "Hi", "max_tokens": 2},
    }
)


def run_batch(cwd: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "server.cli", "run-batch", *argv, "--model", DEMO_MODEL]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run(
        [*command, "--device", "cpu"], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )
    assert "Traceback" not in run.stderr, run.stderr
    return run


def one_error_line(run: subprocess.CompletedProcess[str]) -> str:
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1, run.stderr
    assert lines[0].startswith("nanoflex run-batch: error: "), lines[0]
    return lines[0]


@pytest.mark.parametrize("output", ["in.jsonl", "./in.jsonl", "link.jsonl", "hard.jsonl"])
def test_the_output_may_not_be_the_input(tmp_path: Path, output: str) -> None:
    inp = tmp_path / "in.jsonl"
    inp.write_text(LINE + "\n")
    (tmp_path / "link.jsonl").symlink_to(inp)
    os.link(inp, tmp_path / "hard.jsonl")
    run = run_batch(tmp_path, "-i", "in.jsonl", "-o", output)
    assert run.returncode == 2
    assert "the output and the input are the same file" in one_error_line(run)
    assert inp.read_text() == LINE + "\n"


def test_the_error_file_may_not_be_the_input_or_the_output(tmp_path: Path) -> None:
    (tmp_path / "in.jsonl").write_text(LINE + "\n")
    for error_file, other in (("in.jsonl", "input"), ("out.jsonl", "output")):
        run = run_batch(tmp_path, "-i", "in.jsonl", "-o", "out.jsonl", "--error-file", error_file)
        assert run.returncode == 2
        assert f"the error file and the {other} are the same file" in one_error_line(run)
    assert not (tmp_path / "out.jsonl").exists()


def test_an_output_that_cannot_be_written_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "in.jsonl").write_text(LINE + "\n")
    (tmp_path / "results").mkdir()
    run = run_batch(tmp_path, "-i", "in.jsonl", "-o", "results")
    assert run.returncode == 2
    assert "cannot write the output results: it is a directory" in one_error_line(run)
    run = run_batch(tmp_path, "-i", "in.jsonl", "-o", "missing/out.jsonl")
    assert run.returncode == 2
    assert "missing is not a directory" in one_error_line(run)
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        run = run_batch(tmp_path, "-i", "in.jsonl", "-o", "locked/out.jsonl")
        assert run.returncode == 2
        assert "locked is read-only" in one_error_line(run)


def test_nothing_succeeded_exits_non_zero_and_names_no_missing_file(tmp_path: Path) -> None:
    (tmp_path / "in.jsonl").write_text("{not json\n" + json.dumps({"custom_id": "x"}) + "\n")
    run = run_batch(tmp_path, "-i", "in.jsonl", "-o", "out.jsonl")
    assert run.returncode == 1, run.stderr
    assert not (tmp_path / "out.jsonl").exists()
    assert "out.jsonl" not in run.stderr.replace("out.jsonl.errors", "")
    assert "0 completed, 2 failed of 2 lines" in run.stderr
    assert "errors in out.jsonl.errors" in run.stderr
    assert "no line succeeded" in run.stderr
    assert len((tmp_path / "out.jsonl.errors").read_text().splitlines()) == 2


def test_one_success_exits_zero_and_names_the_results(tmp_path: Path) -> None:
    (tmp_path / "in.jsonl").write_text(LINE + "\n{not json\n")
    run = run_batch(tmp_path, "-i", "in.jsonl", "-o", "out.jsonl")
    assert run.returncode == 0, run.stderr
    assert "1 completed, 1 failed of 2 lines" in run.stderr
    assert "results in out.jsonl; errors in out.jsonl.errors" in run.stderr
    assert json.loads((tmp_path / "out.jsonl").read_text())["response"]["status_code"] == 200
