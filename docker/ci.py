"""CI's Docker step: both images built, the CPU one run end to end, everything it made removed.

    python3 docker/ci.py [--json bench/results/docker-cpu.json] [--keep]

Run as root on a Debian box that reaches Debian's and PyPI's packages and no image registry
(`.ci/run` runs it after the test suite). It installs Docker from Debian's packages when
absent and starts the daemon when none runs; makes a base image with debootstrap
(docker/base-image.sh) unless one is kept from an earlier run (`BASE_TAG`: kept on purpose, a
cache); serves the torch wheel from pip's find-links folder on loopback when it is there;
builds docker/Dockerfile.cpu, and docker/Dockerfile from the CPU image's build stage (a base
with torch: built to catch its errors, never run); then docker/e2e.py runs the CPU image.
It prints the build times, the image sizes and the e2e figures (`--json FILE` also writes
them, as docs/benchmarks.md's table), and exits non-zero on any failure. `--keep` keeps the
images it built (to look into them: `docker history`); without it they are removed. Where
Docker cannot be had (not root, no apt, the daemon does not start) it says why and exits 0:
the step is skipped, not failed. Stdlib only: it runs before any virtualenv.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import e2e  # docker/e2e.py, beside this file

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
BASE_TAG = "nanoflex-ci-base:bookworm"
CPU_TAG = "nanoflex-cpu:ci"
TORCH_BASE_TAG = "nanoflex-ci-torch:ci"
GPU_TAG = "nanoflex-gpu:ci"
TORCH_WHEEL = "torch-2.13.0+cpu-cp311-"
"""The start of the wheel's file name that the CPU image pins (docker/Dockerfile.cpu)."""
DAEMON_LOG = Path("/var/tmp/nanoflex-ci-dockerd.log")
BUILD_TIMEOUT_S = 1800
"""The most one `docker build` may take (a cold CPU build, its kernels for three ISA levels
included, took 642 s on a busy 2-core box)."""


class Skip(Exception):
    """Docker cannot be had here: the step is skipped, with the reason."""


def log(message: str) -> None:
    print(f"ci docker: {message}", flush=True)


def run(argv: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, text=True, check=True, **kwargs)  # type: ignore[call-overload]


def docker_ok() -> bool:
    return subprocess.run(["docker", "info"], capture_output=True, check=False).returncode == 0


def ensure_docker() -> subprocess.Popen[bytes] | None:
    """A running Docker daemon; the one this started (to stop at the end), or None."""
    if shutil.which("docker") is None or shutil.which("dockerd") is None:
        if os.geteuid() != 0 or shutil.which("apt-get") is None:
            raise Skip("no docker and no way to install it (needs root and apt-get)")
        log("installing docker.io from Debian's packages")
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        quiet = {"stdout": subprocess.DEVNULL, "env": env}
        run(["apt-get", "update", "-qq"], **quiet)
        run(["apt-get", "install", "-y", "-qq", "docker.io"], **quiet)
    if docker_ok():
        return None
    if os.geteuid() != 0:
        raise Skip("the Docker daemon is not running and starting it needs root")
    log(f"starting dockerd (log: {DAEMON_LOG})")
    out = DAEMON_LOG.open("w")
    daemon = subprocess.Popen(["dockerd"], stdout=out, stderr=out, start_new_session=True)
    deadline = time.monotonic() + 60
    while not docker_ok():
        if daemon.poll() is not None or time.monotonic() > deadline:
            tail = DAEMON_LOG.read_text()[-1500:]
            daemon.kill()
            raise Skip(f"dockerd does not start here:\n{tail}")
        time.sleep(1)
    return daemon


def stop_daemon(daemon: subprocess.Popen[bytes] | None) -> None:
    if daemon is None:
        return
    daemon.terminate()
    try:
        daemon.wait(timeout=60)
    except subprocess.TimeoutExpired:
        daemon.kill()


def image_exists(tag: str) -> bool:
    probe = ["docker", "image", "inspect", tag]
    return subprocess.run(probe, capture_output=True, check=False).returncode == 0


def image_mb(tag: str) -> float:
    out = run(["docker", "image", "inspect", "--format", "{{.Size}}", tag], capture_output=True)
    return int(out.stdout.strip()) / 1e6


def layer_mb(tag: str, made_by: str) -> float:
    """The size of the image's layer whose command holds `made_by`."""
    argv = [
        "docker",
        "history",
        "--no-trunc",
        "--human=false",
        "--format",
        "{{.Size}}\t{{.CreatedBy}}",
    ]
    for line in run([*argv, tag], capture_output=True).stdout.splitlines():
        size, _, command = line.partition("\t")
        if made_by in command:
            return int(size) / 1e6
    raise RuntimeError(f"no layer of {tag} runs {made_by!r}")


def ensure_base() -> float:
    """The debootstrap base image, made unless kept from an earlier run; seconds it took."""
    if image_exists(BASE_TAG):
        log(f"base image {BASE_TAG}: kept from an earlier run")
        return 0.0
    log(f"making base image {BASE_TAG} with debootstrap (docker/base-image.sh)")
    start = time.monotonic()
    run(["bash", str(HERE / "base-image.sh"), BASE_TAG])
    return time.monotonic() - start


def find_links_folder() -> Path | None:
    """pip's find-links folder (its configuration) if it holds the CPU image's torch wheel."""
    probe = [sys.executable, "-m", "pip", "config", "list"]
    out = subprocess.run(probe, capture_output=True, text=True, check=False).stdout
    for line in out.splitlines():
        name, _, value = line.partition("=")
        if name.endswith("find-links"):
            folder = Path(value.strip().strip("'\""))
            if folder.is_dir() and any(folder.glob(f"{TORCH_WHEEL}*.whl")):
                return folder
    return None


WHEEL_PORT = 8765
"""The loopback port the torch wheel is served on when free (a port of its own keeps the
`TORCH_PIP_ARGS` build argument, and so the torch layer's build cache, the same from run to
run), else any free one."""


def wheel_port() -> int:
    for port in (WHEEL_PORT, 0):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return int(s.getsockname()[1])
    raise RuntimeError("no free loopback port")


@contextlib.contextmanager
def torch_source() -> Iterator[list[str]]:
    """The build arguments that pick the torch wheel: the find-links folder served on loopback
    (builds run with --network host), else the Dockerfile's default (the PyTorch index)."""
    folder = find_links_folder()
    if folder is None:
        log("no torch wheel in pip's find-links folder: the PyTorch index it is")
        yield []
        return
    port = wheel_port()
    argv = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"]
    server = subprocess.Popen(
        [*argv, "--directory", str(folder)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    log(f"serving {folder} on 127.0.0.1:{port} for torch")
    try:
        yield ["--build-arg", f"TORCH_PIP_ARGS=--find-links http://127.0.0.1:{port}/"]
    finally:
        server.terminate()
        server.wait(timeout=30)


def build(dockerfile: str, tag: str, args: list[str]) -> float:
    """`docker build` from the repository root; seconds it took."""
    log(f"building {tag} from {dockerfile}")
    start = time.monotonic()
    argv = ["docker", "build", "--network", "host", "-f", dockerfile, "-t", tag, *args, "."]
    env = {**os.environ, "DOCKER_BUILDKIT": "0"}  # the classic builder: no buildx plugin needed
    done = subprocess.run(
        argv,
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=BUILD_TIMEOUT_S,
    )
    if done.returncode != 0:
        print(done.stdout[-6000:], done.stderr[-4000:], sep="\n", flush=True)
        raise RuntimeError(f"docker build of {dockerfile} failed")
    return time.monotonic() - start


def has_compiler(tag: str) -> str:
    """The compilers on the image's PATH (empty: none)."""
    probe = "for c in cc gcc g++ c++ clang; do command -v $c; done; true"
    argv = ["docker", "run", "--rm", "--entrypoint", "sh", tag, "-c", probe]
    return run(argv, capture_output=True).stdout.strip()


def remove_images(tags: list[str]) -> None:
    present = [t for t in tags if image_exists(t)]
    if present:
        subprocess.run(["docker", "rmi", "-f", *present], capture_output=True, check=False)
    dangling = ["docker", "image", "prune", "-f", "--filter", "label=org.nanoflex.stage=build"]
    subprocess.run(dangling, capture_output=True, check=False)


def table(figures: dict[str, float]) -> dict[str, list[Any]]:
    """The figures as docs/benchmarks.md shows them ("Docker images")."""
    rows = [
        ["base image (debootstrap: Debian 12, Python 3.11)", f"{figures['base_mb']:.0f} MB",
         "kept from an earlier run" if not figures["base_s"] else f"{figures['base_s']:.0f} s"],
        ["CPU image, build stage (g++, the venv, the kernels)", f"{figures['stage_mb']:.0f} MB",
         "-"],
        ["of which the compiler (the build stage's g++ layer)",
         f"{figures['compiler_mb']:.0f} MB", "-"],
        ["CPU image (runtime stage, no compiler)", f"{figures['cpu_image_mb']:.0f} MB",
         f"{figures['cpu_build_s']:.0f} s (both stages, empty build cache)"],
        ["GPU image on the CI base (its torch: the CPU build)", f"{figures['gpu_image_mb']:.0f} MB",
         f"{figures['gpu_build_s']:.0f} s (kernels for AVX2 only)"],
        ["`docker run` to `/ready`, fresh volumes", "-", f"{figures['fresh_ready_s']:.1f} s"],
        ["new container on the kept volumes to `/ready`", "-",
         f"{figures['restart_ready_s']:.1f} s"],
        ["Docker's health check healthy after `/ready`", "-", f"{figures['healthy_s']:.0f} s"],
        ["the whole CI step (`docker/ci.py`)", "-", f"{figures['step_s'] / 60:.1f} min"],
    ]  # fmt: skip
    return {"header": ["what", "size", "time"], "rows": rows}


def main(argv: list[str]) -> int:
    out = Path(argv[argv.index("--json") + 1]) if "--json" in argv else None
    keep = "--keep" in argv
    try:
        daemon = ensure_docker()
    except Skip as e:
        log(f"SKIPPED: {e}")
        return 0
    figures: dict[str, float] = {}
    start, load_before = time.monotonic(), os.getloadavg()[0]
    try:
        figures["base_s"] = ensure_base()
        base = ["--build-arg", f"BASE_IMAGE={BASE_TAG}"]
        with torch_source() as torch_args:
            figures["cpu_build_s"] = build("docker/Dockerfile.cpu", CPU_TAG, base + torch_args)
            stage = [*base, *torch_args, "--target", "build"]
            build("docker/Dockerfile.cpu", TORCH_BASE_TAG, stage)
            gpu_args = ["--build-arg", f"BASE_IMAGE={TORCH_BASE_TAG}"]
            gpu_args += ["--build-arg", "KERNEL_LEVELS=avx2"]  # one level: it only has to build
            figures["gpu_build_s"] = build("docker/Dockerfile", GPU_TAG, gpu_args)
        for name, tag in (("base", BASE_TAG), ("cpu_image", CPU_TAG), ("gpu_image", GPU_TAG)):
            figures[f"{name}_mb"] = image_mb(tag)
        figures["stage_mb"] = image_mb(TORCH_BASE_TAG)
        figures["compiler_mb"] = layer_mb(TORCH_BASE_TAG, "install -y --no-install-recommends g++")
        compilers = has_compiler(CPU_TAG)
        if compilers:
            raise RuntimeError(f"the CPU image carries a compiler: {compilers}")
        log("built: " + json.dumps({k: round(v, 1) for k, v in figures.items()}))
        figures.update(e2e.run(CPU_TAG))
        figures["step_s"] = time.monotonic() - start
    except (RuntimeError, subprocess.SubprocessError, e2e.Failed) as e:
        log(f"FAILED: {e}")
        return 1
    finally:
        if not keep:
            remove_images([CPU_TAG, GPU_TAG, TORCH_BASE_TAG])
        stop_daemon(daemon)
    if out is not None:
        model = next(
            (ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
             if ln.startswith("model name")), platform.machine(),
        )  # fmt: skip
        machine = f"{os.cpu_count()} cores, {model}"
        # other work on the machine slows a build: the 1-minute load average, start and end
        load = {"start": load_before, "end": os.getloadavg()[0]}
        result = {"table": table(figures), "figures": figures, "machine": machine, "load": load}
        out.write_text(json.dumps(result, indent=2) + "\n")
    log("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
