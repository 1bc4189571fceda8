"""Running one benchmark system in a child process under a hard timeout, output kept in a log."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ChildResult:
    """How a child ended: its exit code (None when killed at the timeout) and its output."""

    returncode: int | None
    output: str
    seconds: float

    @property
    def timed_out(self) -> bool:
        return self.returncode is None


def run_child(
    args: list[str],
    *,
    timeout_s: float,
    log_path: Path,
    env: dict[str, str] | None = None,
    launcher: list[str] | None = None,
    cwd: Path | None = None,
) -> ChildResult:
    """`python <args>` (or `<launcher> <args>`: another interpreter, or a wrapper that sets up
    its environment) in its own process group; the whole group is killed at the timeout
    (FlexGen's copy threads can keep a failed process alive). stdout and stderr go to
    `log_path`, which is read back whole."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [*(launcher or [sys.executable]), *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
            cwd=cwd,
        )
        try:
            returncode: int | None = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            returncode = None
    output = log_path.read_text(errors="replace")
    return ChildResult(returncode, output, time.perf_counter() - start)


def child_record(child: ChildResult, result_path: Path, log_path: Path) -> dict[str, Any]:
    """The child's JSON result when it wrote one; else an error record with the log's tail."""
    record: dict[str, Any] = {"wall_seconds": round(child.seconds, 2), "log": str(log_path)}
    if result_path.is_file():
        return {**json.loads(result_path.read_text()), **record}
    reason = "timed out" if child.timed_out else f"exited with code {child.returncode}"
    tail = "\n".join(child.output.strip().splitlines()[-15:])
    return {"ok": False, "error": f"{reason}; log tail:\n{tail}", **record}


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Atomically: a result file is either absent or complete."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    tmp.replace(path)
