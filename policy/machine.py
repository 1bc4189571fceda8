"""`machine_key()`: what a hardware profile was measured on, so a profile from another machine
is never used as if it were this one's. Torch-free: the daemon checks it before planning."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil
import subprocess
from pathlib import Path

import psutil

NVIDIA_PROC = Path("/proc/driver/nvidia/gpus")
"""Where the NVIDIA driver lists its GPUs on Linux (one folder each, with an `information` file)."""


def machine_key() -> str:
    """One line naming what the measured constants depend on: CPU model, hardware threads,
    memory (GiB), GPUs and the torch build, e.g.
    `cpu=AMD EPYC; cores=2; mem=23GiB; gpu=none; torch=2.13.0+cpu`. Two machines with the same
    key are taken to measure alike; anything else is re-profiled."""
    memory = psutil.virtual_memory().total // 2**30
    return (
        f"cpu={cpu_model()}; cores={os.cpu_count() or 1}; mem={memory}GiB; "
        f"gpu={', '.join(gpu_names()) or 'none'}; torch={torch_version()}"
    )


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux, else what `platform` knows)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def gpu_names() -> list[str]:
    """The NVIDIA GPUs' model names, from the driver, without importing torch: the driver's
    /proc files, else `nvidia-smi`; empty when there is none."""
    names = []
    if NVIDIA_PROC.is_dir():
        for info in sorted(NVIDIA_PROC.glob("*/information")):
            for line in info.read_text().splitlines():
                if line.startswith("Model:"):
                    names.append(line.split(":", 1)[1].strip())
    if not names and shutil.which("nvidia-smi"):
        query = ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"]
        try:
            done = subprocess.run(query, capture_output=True, text=True, timeout=10, check=False)
        except (OSError, subprocess.TimeoutExpired):
            return []
        if done.returncode == 0:
            names = [n.strip() for n in done.stdout.splitlines() if n.strip()]
    return names


def torch_version() -> str:
    """The installed torch's version (its build tag says CPU or CUDA), read from its metadata."""
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return "none"
