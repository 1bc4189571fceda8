"""The image's recipe, run outside Docker: install the project as the Dockerfile does, then run
its ENTRYPOINT + CMD and its HEALTHCHECK command against the live daemon."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "docker" / "Dockerfile.cpu"


def _json_array(instruction: str) -> list[str]:
    """The exec-form array of the last `instruction` in the CPU Dockerfile."""
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    found = re.findall(rf"^{instruction}\s+(.*)$", text, flags=re.MULTILINE)
    assert found, f"no {instruction} in {DOCKERFILE}"
    line = found[-1]
    if instruction == "HEALTHCHECK":
        line = line.split("CMD", 1)[1]
    return list(json.loads(line.strip()))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_pip_install_builds_the_console_script(tmp_path: Path) -> None:
    """`pip install --no-deps .` (the image's install step) from a copy of the source."""
    target = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(target),
            str(ROOT),
        ],
        check=True,
        cwd=tmp_path,
    )
    assert (target / "bin" / "nanoflex").is_file()
    for package in ("server", "engine", "policy"):
        assert (target / package / "__init__.py").is_file()
    assert not (target / "tests").exists() and not (target / "bench").exists()
    env = {**os.environ, "PYTHONPATH": str(target)}
    out = subprocess.run(
        [sys.executable, "-c", "import server.cli, sys; print(server.cli.__file__)"],
        check=True,
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    assert out.stdout.startswith(str(target))


def test_entrypoint_and_cmd_serve_and_pass_the_healthcheck(tmp_path: Path) -> None:
    entrypoint, cmd = _json_array("ENTRYPOINT"), _json_array("CMD")
    port = _free_port()
    args = list(cmd)
    replace = {
        "--host": "127.0.0.1",
        "--port": str(port),
        "--data-dir": str(tmp_path / "data"),
        "--offload-dir": str(tmp_path / "offload"),
    }
    for i, arg in enumerate(args[:-1]):
        if arg in replace:
            args[i + 1] = replace[arg]
    console = Path(sys.executable).parent / entrypoint[0]
    proc = subprocess.Popen(
        [str(console), *entrypoint[1:], *args],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
            try:
                with urllib.request.urlopen(base + "/ready", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "daemon never became ready"
            time.sleep(0.5)
        health = _json_array("HEALTHCHECK")
        env = {**os.environ, "NANOFLEX_HEALTH_URL": base + "/health"}
        subprocess.run([sys.executable, *health[1:]], check=True, env=env, timeout=30)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
