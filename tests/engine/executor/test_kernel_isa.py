"""The native CPU kernels built and checked at every instruction-set level this CPU runs.

The kernels pick their code paths when compiled (plain loops the compiler vectorizes,
AVX-512 registers, AVX512-BF16 dot products), so one machine can check the paths a
different CPU would take: each level (`engine.kernels.ISA_LEVELS`) is built in a process of
its own (`NANOFLEX_KERNEL_ISA`; torch allows one library of these ops a process) and runs the
kernel tests there, against torch's own attention and ops. Slow: a build takes a minute or
two on 2 cores. `pytest -m slow tests/engine/executor/test_kernel_isa.py` runs it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.kernels import ISA_ENV, supported_levels

REPO = Path(__file__).resolve().parents[3]
CHECKS = ["tests/engine/executor/test_attention.py", "tests/engine/executor/test_cpu_kernels.py"]


def run_kernel_checks(env: dict[str, str]) -> None:
    """The kernel tests in a process of their own with `env` (test_cpu_kernels fails there if
    the library did not build or load)."""
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *CHECKS],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("level", [lv for lv in supported_levels() if lv != "native"])
def test_kernels_at_each_level_equal_torch(level: str) -> None:
    run_kernel_checks({**os.environ, ISA_ENV: level})


def test_prefill_chunks_use_the_native_kernel_only_with_its_avx512_tiles() -> None:
    """Without AVX-512 the prefill kernel's rows run in plain loops, slower than SDPA's flash
    kernel over a gathered copy: the engine's CPU kernels drop it there (decodes keep theirs)."""
    from engine.kernels import attention_kernels, isa_level, supported_levels, tiled_prefill

    assert tiled_prefill("avx512", ["native", "avx2", "avx512"])
    assert tiled_prefill("avx512-bf16", ["native", "avx2"])  # built so: its tiles, wherever
    assert tiled_prefill("native", ["native", "avx2", "avx512"])
    assert not tiled_prefill("native", ["native", "avx2"])
    assert not tiled_prefill("avx2", ["native", "avx2", "avx512"])
    kernels = attention_kernels(cuda=False)
    assert kernels is not None and kernels.decode is not None
    has_tiles = tiled_prefill(isa_level(), supported_levels())
    assert (kernels.prefill is not None) == has_tiles
