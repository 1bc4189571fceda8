"""Durability: atomic result commits, resume after restart, and kill -9 of the daemon mid-batch.

LEAD: the crash test runs `nanoflex serve` on the toy engine via NANOFLEX_ENGINE_CLIENT;
switch it to the real demo model (greedy) once the engine client is wired.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import openai
from conftest import ServerFactory, wait_for
from test_batches import URL, read_lines, request_line, upload, wait_batch
from toy_engine import ToyEngineClient

from server.store import Store

REPO = Path(__file__).resolve().parents[2]


def _batch_record(batch_id: str) -> dict[str, Any]:
    return {
        "id": batch_id,
        "endpoint": URL,
        "input_file_id": "file-x",
        "completion_window": "24h",
        "status": "in_progress",
        "created_at": 1,
        "expires_at": 2,
        "metadata": None,
    }


def test_result_commit_is_atomic_and_once(tmp_path: Path) -> None:
    store = Store(tmp_path / "db.sqlite")
    store.insert_batch(_batch_record("batch_1"))
    rows: list[tuple[int, str | None, str | None, str, str | None]] = [
        (0, "a", "{}", "pending", None),
        (1, "b", "{}", "pending", None),
    ]
    store.insert_requests("batch_1", rows)
    assert store.commit_result("batch_1", 0, True, '{"line": 0}')
    assert not store.commit_result("batch_1", 0, True, '{"line": "again"}')
    store.close()
    reopened = Store(tmp_path / "db.sqlite")
    batch = reopened.get_batch("batch_1")
    assert batch is not None and batch["request_counts"] == {
        "total": 2,
        "completed": 1,
        "failed": 0,
    }
    assert list(reopened.results("batch_1", "done")) == ['{"line": 0}']
    assert [r[1] for r in reopened.pending_requests("batch_1")] == ["b"]
    assert reopened.unfinished_batch_ids() == ["batch_1"]


def _expected_texts(n: int) -> dict[str, str]:
    """Greedy toy output for prompt f'p{i}' (BOS + 2 or 3 bytes), 6 tokens."""
    return {
        f"c{i}": "".join(chr(ord("a") + (len(f"p{i}") + 1 + k) % 26) for k in range(6))
        for i in range(n)
    }


def _check_output(client: openai.OpenAI, batch_id: str, n: int) -> None:
    batch = wait_batch(client, batch_id, timeout_s=60)
    assert batch.status == "completed", batch
    output = read_lines(client, batch.output_file_id)
    assert [line["custom_id"] for line in output] == [f"c{i}" for i in range(n)]
    texts = {line["custom_id"]: line["response"]["body"]["choices"][0]["text"] for line in output}
    assert texts == _expected_texts(n)
    assert batch.error_file_id is None


def test_graceful_restart_resumes(make_server: ServerFactory) -> None:
    n = 12
    first = make_server(ToyEngineClient(step_s=0.02, max_running=2), batch_concurrency=2)
    client = first.openai()
    lines = [request_line(f"c{i}", f"p{i}", max_tokens=6) for i in range(n)]
    batch = client.batches.create(
        input_file_id=upload(client, lines), endpoint=URL, completion_window="24h"
    )
    wait_for(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 3)
    first.stop()
    second = make_server(ToyEngineClient(step_s=0.005))
    _check_output(second.openai(), batch.id, n)


def _spawn_daemon(data_dir: Path, port: int, log: Path | None = None) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), str(Path(__file__).parent)]),
        "NANOFLEX_ENGINE_CLIENT": "toy_engine:build_toy_engine",
        "NANOFLEX_TOY_STEP_S": "0.02",
    }
    argv = ["serve", "--port", str(port), "--data-dir", str(data_dir)]
    code = f"import sys; from server.cli import main; sys.exit(main({argv!r}))"
    stderr = open(log, "wb") if log else subprocess.DEVNULL  # noqa: SIM115
    process = subprocess.Popen([sys.executable, "-c", code], env=env, cwd=REPO, stderr=stderr)
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=1).status_code == 200:
                return process
        except httpx.TransportError:
            pass
        assert process.poll() is None, "daemon exited"
        assert time.monotonic() < deadline, "daemon did not become ready"
        time.sleep(0.1)


def _port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_kill_9_mid_batch_then_resume(tmp_path: Path) -> None:
    n, port = 16, _port()
    data_dir = tmp_path / "data"
    daemon = _spawn_daemon(data_dir, port)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        lines = [request_line(f"c{i}", f"p{i}", max_tokens=6) for i in range(n)]
        batch = client.batches.create(
            input_file_id=upload(client, lines), endpoint=URL, completion_window="24h"
        )
        wait_for(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 2)  # type: ignore[union-attr]
        daemon.send_signal(signal.SIGKILL)
        daemon.wait(timeout=30)
        store = Store(data_dir / "nanoflex.db")
        assert store.pending_requests(batch.id), "the kill should land mid-batch"
        store.close()
        daemon = _spawn_daemon(data_dir, port)
        _check_output(client, batch.id, n)
        lines_by_id = read_lines(client, client.batches.retrieve(batch.id).output_file_id)
        assert len({json.dumps(line["custom_id"]) for line in lines_by_id}) == n
    finally:
        daemon.kill()
        daemon.wait(timeout=30)


def test_sigterm_shuts_down_gracefully(tmp_path: Path) -> None:
    log = tmp_path / "daemon.log"
    daemon = _spawn_daemon(tmp_path / "data", _port(), log)
    daemon.send_signal(signal.SIGTERM)
    # uvicorn re-raises SIGTERM after its graceful shutdown, so the exit reads as -15
    assert daemon.wait(timeout=30) in (0, -signal.SIGTERM)
    text = log.read_text()
    assert "Application shutdown complete" in text and "nanoflex stopped" in text
