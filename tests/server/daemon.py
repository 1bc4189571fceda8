"""`Daemon`: a real `nanoflex serve` process on the demo model (CPU, engine in its child
process) on loopback, and the `daemons` fixture that kills what a test started."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from policy import Policy
from tests.server.live import MODEL

REPO = Path(__file__).resolve().parents[2]
NANOFLEX = Path(sys.executable).parent / "nanoflex"


class Daemon:
    """`nanoflex serve` on the demo model under a fixed policy (the reference's, `Policy()`,
    unless given), with `extra` flags; waits until it is ready unless `wait` is False."""

    def __init__(
        self,
        data_dir: Path,
        port: int,
        log: Path,
        *,
        policy: Policy | None = None,
        extra: Sequence[str] = (),
        wait: bool = True,
    ) -> None:
        self.data_dir, self.port, self.log = data_dir, port, log
        self.url = f"http://127.0.0.1:{port}"
        policy_file = data_dir.parent / "policy.json"
        policy_file.write_text((policy or Policy()).to_json())  # fixed: nothing is planned
        env = {k: v for k, v in os.environ.items() if k != "NANOFLEX_ENGINE_CLIENT"}
        argv = [str(NANOFLEX), "serve", "--model", MODEL, "--port", str(port)]
        argv += ["--data-dir", str(data_dir), "--device", "cpu", "--policy", str(policy_file)]
        argv += list(extra)
        with open(log, "ab") as out:
            self.process = subprocess.Popen(argv, env=env, cwd=REPO, stdout=out, stderr=out)
        if wait:
            self.wait_ready()

    def wait_ready(self, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.is_ready():
            assert self.process.poll() is None, f"daemon exited:\n{self.log.read_text()}"
            assert time.monotonic() < deadline, "daemon did not become ready"
            time.sleep(0.05)

    def is_ready(self) -> bool:
        try:
            return httpx.get(f"{self.url}/ready", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="x", max_retries=0)

    def engine_process(self) -> psutil.Process:
        """The executor child (multiprocessing 'spawn'), not its resource tracker."""
        children = psutil.Process(self.process.pid).children(recursive=True)
        engines = [c for c in children if "spawn_main" in " ".join(c.cmdline())]
        assert len(engines) == 1, [c.cmdline() for c in children]
        return engines[0]

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=30)


@pytest.fixture
def daemons(tmp_path: Path) -> Iterator[list[Daemon]]:
    started: list[Daemon] = []
    yield started
    for daemon in started:
        daemon.kill()
