"""`nanoflex run-batch --ray` on a local Ray instance (2 CPUs, loopback), two CPU replicas of
the demo model: the same files as the local run-batch, through a lost actor and a lost driver."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pytest import CaptureFixture

from server.cli import main as cli_main
from server.offline.scale_out.pool import ACTOR_NAME_PREFIX
from tests.server.offline.test_run_batch import (
    MODEL,
    by_custom_id,
    line,
    without_cache_hits,
    write_input,
)

ROOT = Path(__file__).resolve().parents[4]
NUM_LINES = 48


def job_lines() -> list[str]:
    """Ragged prompts and lengths, long enough (~1,500 tokens) to kill something mid-run."""
    lines = [
        line(f"r{i}", prompt="word " * (1 + 7 * i % 23), max_tokens=16 + (17 * i) % 33)
        for i in range(NUM_LINES)
    ]
    return [*lines[:25], "{bad", line("r3"), *lines[25:]]  # an invalid and a duplicate line


def run_batch_argv(inp: Path, out: Path, *extra: str) -> list[str]:
    return [
        "run-batch",
        "-i",
        str(inp),
        "-o",
        str(out),
        "--model",
        MODEL,
        "--device",
        "cpu",
        *extra,
    ]


@pytest.fixture(scope="module")
def local_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(input, output) of the local run-batch over `job_lines()`: the reference."""
    root = tmp_path_factory.mktemp("local")
    inp = write_input(root / "in.jsonl", job_lines())
    out = root / "out.jsonl"
    assert cli_main(run_batch_argv(inp, out)) == 0
    return inp, out


def copy_input(inp: Path, tmp_path: Path) -> Path:
    """The same input with the same mtime (`created` in every body comes from it)."""
    copy = tmp_path / "in.jsonl"
    copy.write_bytes(inp.read_bytes())
    stat = inp.stat()
    os.utime(copy, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    return copy


def assert_same_files(out: Path, reference: Path) -> None:
    """Line for line the reference's files (input order, one line per custom_id), byte for
    byte but for cache-hit counts."""
    assert len(by_custom_id(out)) == NUM_LINES  # by_custom_id fails on a duplicate
    for path, expected in ((out, reference), (Path(f"{out}.errors"), Path(f"{reference}.errors"))):
        assert [without_cache_hits(raw) for raw in path.read_text().splitlines()] == [
            without_cache_hits(raw) for raw in expected.read_text().splitlines()
        ]


def answered_per_replica(stderr: str) -> list[int]:
    match = re.search(r"lines answered by (.*?); (\d+) lost", stderr)
    assert match, stderr
    return [int(n) for n in re.findall(r"replica \d+ (\d+)", match.group(1))]


@pytest.mark.slow  # 30-60 s: its own two replicas; the killed-replica test checks the same files
def test_two_replicas_write_what_the_local_run_writes(
    ray_cluster: Any, local_run: tuple[Path, Path], tmp_path: Path, capfd: CaptureFixture[str]
) -> None:
    inp, out = copy_input(local_run[0], tmp_path), tmp_path / "out.jsonl"
    assert cli_main(run_batch_argv(inp, out, "--ray", "--replicas", "2")) == 0
    assert_same_files(out, local_run[1])
    counts = answered_per_replica(capfd.readouterr().err)
    assert len(counts) == 2 and all(n > 0 for n in counts) and sum(counts) == NUM_LINES


def num_lines_in(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def wait_for_lines(path: Path, num_lines: int, proc: subprocess.Popen[bytes] | None = None) -> None:
    """Until `path` has `num_lines` lines (or `proc` ends, or 240 s pass)."""
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and (proc is None or proc.poll() is None):
        if num_lines_in(path) >= num_lines:
            return
        time.sleep(0.01)


def kill_a_replica_after(
    ray: Any, out: Path, num_lines: int, killed: list[int], by_signal: bool
) -> None:
    """Once `out` has `num_lines` lines, kill one replica (SIGKILL to its worker process, or
    `ray.kill`); note how many lines there were."""
    wait_for_lines(out, num_lines)
    names = sorted(n for n in ray.util.list_named_actors() if ACTOR_NAME_PREFIX in n)
    actor = ray.get_actor(names[-1])
    if by_signal:
        os.kill(ray.get(actor.describe.remote()).pid, signal.SIGKILL)
    else:
        ray.kill(actor)
    killed.append(num_lines_in(out))


@pytest.mark.parametrize(
    "by_signal",
    [
        pytest.param(True, id="sigkill"),
        pytest.param(False, id="ray_kill", marks=pytest.mark.slow),  # 30-60 s more
    ],
)
def test_a_replica_killed_mid_job_loses_and_repeats_no_line(
    ray_cluster: Any,
    local_run: tuple[Path, Path],
    tmp_path: Path,
    capfd: CaptureFixture[str],
    by_signal: bool,
) -> None:
    inp, out = copy_input(local_run[0], tmp_path), tmp_path / "out.jsonl"
    killed: list[int] = []
    killer = threading.Thread(
        target=kill_a_replica_after, args=(ray_cluster, out, 2, killed, by_signal)
    )
    killer.start()
    try:
        assert cli_main(run_batch_argv(inp, out, "--ray", "--replicas", "2")) == 0
    finally:
        killer.join()
    assert killed and killed[0] < NUM_LINES, "the replica was killed after the job ended"
    assert_same_files(out, local_run[1])
    stderr = capfd.readouterr().err
    assert "was lost" in stderr
    assert sum(answered_per_replica(stderr)) == NUM_LINES


@pytest.fixture
def driver_process(ray_cluster: Any) -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow  # 45-60 s on 2 idle cores: two more runs, each starting two replicas
def test_a_killed_driver_is_resumed_by_running_it_again(
    ray_cluster: Any,
    local_run: tuple[Path, Path],
    tmp_path: Path,
    driver_process: list[subprocess.Popen[bytes]],
) -> None:
    inp = copy_input(local_run[0], tmp_path)
    out = tmp_path / "out.jsonl"
    address = ray_cluster.get_runtime_context().gcs_address
    argv = run_batch_argv(inp, out, "--ray", address, "--replicas", "2")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "server.cli", *argv], cwd=ROOT, env=env)
    driver_process.append(proc)
    wait_for_lines(out, 4, proc)
    assert proc.poll() is None, "the driver ended before it could be killed: make the job longer"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    num_before = num_lines_in(out)
    assert 4 <= num_before < NUM_LINES

    assert cli_main(run_batch_argv(inp, out, "--ray", "--replicas", "2")) == 0
    assert_same_files(out, local_run[1])
    assert num_lines_in(out) == NUM_LINES


def test_an_engine_that_cannot_start_ends_the_run_with_its_error(
    ray_cluster: Any, tmp_path: Path, capfd: CaptureFixture[str]
) -> None:
    inp = write_input(tmp_path / "in.jsonl", [line("a")])
    out = tmp_path / "out.jsonl"
    argv = run_batch_argv(inp, out, "--ray", "--replicas", "2")
    argv[argv.index(MODEL)] = str(tmp_path / "no-such-model")
    assert cli_main(argv) == 2
    last = capfd.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("nanoflex run-batch: error: replica ") and "could not start" in last
    assert "no-such-model" in last
    assert not out.exists()
    assert not ray_cluster.util.list_named_actors(), "the other replica was left running"
