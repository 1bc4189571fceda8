"""`nanoflex serve` starting up, as a real process on loopback (issue 12, items 3 and 4): the
port is bound before anything loads, /health answers and /ready says what the engine is doing
while it loads, an engine that cannot start ends the daemon with one line, and an engine that
keeps crashing is restarted with back-off until a limit, then ends the daemon too."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from engine.core.model_files import DEMO_MODEL
from policy import Policy
from server.http.settings import ServerSettings
from tests.server.live import engine_args, free_port, start_server

ROOT = Path(__file__).resolve().parents[2]
NANOFLEX = Path(sys.executable).parent / "nanoflex"


def serve(tmp_path: Path, *argv: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """`nanoflex serve` on the demo model on CPU with a fixed policy (nothing planned), its
    stderr piped."""
    policy = tmp_path / "policy.json"
    policy.write_text(Policy().to_json())
    command = [str(NANOFLEX), "serve", "--device", "cpu", "--policy", str(policy)]
    command += ["--data-dir", str(tmp_path / "data"), *argv]
    environ = {k: v for k, v in os.environ.items() if k != "NANOFLEX_ENGINE_CLIENT"}
    return subprocess.Popen(
        command,
        cwd=tmp_path,
        env={**environ, "PYTHONPATH": str(ROOT), **(env or {})},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def get(url: str) -> httpx.Response | None:
    try:
        return httpx.get(url, timeout=5)
    except httpx.TransportError:
        return None


def final_error(process: subprocess.Popen[str], timeout_s: float = 120) -> tuple[int, str]:
    """(exit status, stderr) of a daemon expected to end by itself; stderr holds no traceback
    and ends with exactly one `nanoflex serve: error:` line."""
    try:
        _, stderr = process.communicate(timeout=timeout_s)
    finally:
        process.kill()
    assert "Traceback" not in stderr, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("nanoflex serve: error:")]
    assert len(errors) == 1 and stderr.rstrip().endswith(errors[0]), stderr
    return process.returncode, errors[0]


def test_a_port_in_use_is_reported_before_anything_loads(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # a model that does not exist: the port is refused before the model is looked at
        daemon = serve(tmp_path, "--model", "no/such/model", "--port", str(port))
        status, line = final_error(daemon, timeout_s=60)
    assert status == 2
    assert f"port {port} on 127.0.0.1 is already in use" in line
    assert not (tmp_path / "data").exists()  # nothing was touched


def test_health_answers_and_ready_says_what_loads_before_the_engine_is_ready(
    tmp_path: Path,
) -> None:
    port = free_port()
    # the positional MODEL; --ready-wait 0: a request sent while it loads is refused at once
    daemon = serve(tmp_path, DEMO_MODEL, "--port", str(port), "--ready-wait", "0")
    url = f"http://127.0.0.1:{port}"
    details: list[str] = []
    try:
        deadline = time.monotonic() + 120
        while True:
            assert daemon.poll() is None, daemon.communicate()[1]
            assert time.monotonic() < deadline, details
            ready = get(f"{url}/ready")
            if ready is None:
                continue
            if ready.status_code == 200:
                assert ready.json() == {"status": "ready", "model": DEMO_MODEL}
                break
            assert ready.status_code == 503
            body = ready.json()
            assert body["status"] == "not_ready" and "Traceback" not in body["detail"]
            if not details or details[-1] != body["detail"]:
                details.append(body["detail"])
            health = get(f"{url}/health")  # up while the engine loads
            assert health is not None and health.json() == {"status": "ok"}
            refused = httpx.post(
                f"{url}/v1/completions", json={"model": DEMO_MODEL, "prompt": "Hi"}, timeout=30
            )
            assert refused.status_code in (503, 200)  # 200 only if it became ready meanwhile
            if refused.status_code == 503:
                assert refused.headers["Retry-After"] == "1"
            time.sleep(0.02)
        assert any("loading" in d for d in details), details
        answer = httpx.post(
            f"{url}/v1/completions",
            json={"model": DEMO_MODEL, "prompt": "Hi", "max_tokens": 2},
            timeout=60,
        )
        assert answer.status_code == 200
    finally:
        daemon.terminate()
        _, stderr = daemon.communicate(timeout=60)
    for step in ("engine: finding model", "engine: loading", "loading weights: layer", "ready"):
        assert step in stderr, (step, stderr)


@pytest.mark.parametrize("case", ["no such directory", "bad model", "no device"])
def test_an_engine_that_cannot_start_ends_the_daemon_with_one_line(
    tmp_path: Path, case: str
) -> None:
    if case == "no device":
        import torch

        if torch.cuda.is_available():
            pytest.skip("this box has a CUDA device")
        argv = ["--model", DEMO_MODEL, "--device", "cuda"]
        expected = "no CUDA device is available"
    elif case == "bad model":
        model = tmp_path / "broken"
        model.mkdir()
        (model / "config.json").write_text(json.dumps({"model_type": "llama"}))
        argv = ["--model", str(model)]
        expected = f"{model} has no tokenizer.json"
    else:
        argv = ["--model", "./modles/smollm"]  # a mistyped path: no hub lookup
        expected = "no such directory: './modles/smollm'"
    status, line = final_error(serve(tmp_path, *argv, "--port", str(free_port())))
    assert status == 2 and expected in line, line


def test_ready_shows_a_start_failure_as_one_line(tmp_path: Path) -> None:
    """Without a caller that exits (an embedding app), /ready reports the failure's line."""
    engine = engine_args(model=str(tmp_path / "missing"))
    from engine.runtime.step_loop_client import build_engine_client

    live = start_server(
        ServerSettings(data_dir=tmp_path / "data"), build_engine_client(engine), wait_ready=False
    )
    try:
        deadline = time.monotonic() + 60
        while live.state.engine_error is None:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        with live.http() as http:
            ready = http.get("/ready")
            models = http.get("/v1/models")
        assert ready.status_code == 503
        assert ready.json() == {"status": "failed", "detail": live.state.engine_error}
        assert "no such directory" in ready.json()["detail"]
        assert "\n" not in ready.json()["detail"]
        assert models.status_code == 200 and "max_model_len" not in models.json()["data"][0]
    finally:
        live.stop()


def test_a_crashing_engine_is_restarted_with_back_off_then_ends_the_daemon(
    tmp_path: Path,
) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    client = "tests.server.crashing_engine:build_engine_client"  # crashes on every step
    daemon = serve(
        tmp_path, DEMO_MODEL, "--port", str(port), env={"NANOFLEX_ENGINE_CLIENT": client}
    )
    body = {"model": DEMO_MODEL, "prompt": "Hi", "max_tokens": 2}
    crashes, details = 0, set()
    deadline = time.monotonic() + 120
    while daemon.poll() is None and time.monotonic() < deadline:
        ready = get(f"{url}/ready")
        if ready is not None and ready.status_code == 503:
            details.add(ready.json()["detail"])
        if ready is not None and ready.status_code == 200:
            reply = get_post(f"{url}/v1/completions", body)
            if reply is not None:
                assert reply.status_code == 503, reply.text  # the step crashed the engine
                crashes += 1
        time.sleep(0.02)
    status, line = final_error(daemon)
    assert status == 2
    assert "the engine crashed 3 times within 120 s; giving up" in line
    assert crashes == 3
    waits = {d.split(" after")[0] for d in details if d.startswith("restarting")}
    assert waits == {"restarting the engine in 0 s", "restarting the engine in 1 s"}, details


def get_post(url: str, body: dict[str, object]) -> httpx.Response | None:
    try:
        return httpx.post(url, json=body, timeout=30)
    except httpx.TransportError:
        return None
