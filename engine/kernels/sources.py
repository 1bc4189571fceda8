"""What the native CPU kernels are built from: their sources, the compiler flags of each
instruction-set level, and the library's name, which changes with any of them. Shared by
the first-use build (engine/kernels/__init__.py) and the build ahead (prebuilt.py)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

HERE = Path(__file__).parent
SOURCES = (
    HERE / "paged_decode.cpp",
    HERE / "paged_prefill.cpp",
    HERE / "dense_ops.cpp",
    HERE / "token_mask.cpp",
)
HEADERS = (HERE / "vector_math.h", HERE / "attention_sinks.h")
CFLAGS = ("-O3", "-mprefer-vector-width=512", "-fopenmp", "-ffp-contract=off")
"""`-fopenmp` makes `at::parallel_for` run on torch's own OpenMP threads (the library
links `libgomp.so.1`, which resolves to the copy torch has loaded), not serially.
`-ffp-contract=off`: a product and a sum stay two roundings, as in the torch ops the
fused ones replace (explicit FMA intrinsics still fuse)."""
ISA_LEVELS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "native": (("-march=native",), ()),
    "avx2": (("-march=x86-64-v3",), ("avx2", "fma")),
    "avx512": (("-march=x86-64-v4",), ("avx512f", "avx512bw", "avx512vl", "avx512dq")),
    "avx512-bf16": (
        ("-march=x86-64-v4", "-mavx512bf16"),
        ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"),
    ),
}
"""Instruction-set levels the kernels build for: level -> (compiler flags, the CPU flags a
machine needs to run them). The sources pick their paths at compile time: plain loops the
compiler vectorizes (AVX2), AVX-512 registers, AVX512-BF16's dot products. `native` (the
default) is whatever this CPU has; `$NANOFLEX_KERNEL_ISA` picks another, to build a library
for a baseline or to test each level (tests/engine/executor/test_kernel_isa.py)."""
ISA_ENV = "NANOFLEX_KERNEL_ISA"


def isa_level() -> str:
    level = os.environ.get(ISA_ENV, "native")
    if level not in ISA_LEVELS:
        raise ValueError(f"{ISA_ENV} must be one of {', '.join(ISA_LEVELS)}, got {level!r}")
    return level


def cflags(level: str | None = None) -> tuple[str, ...]:
    """The compiler flags for a build at `level` (default `isa_level()`): the level's
    architecture, then CFLAGS."""
    return (*ISA_LEVELS[level or isa_level()][0], *CFLAGS)


def supported_levels() -> list[str]:
    """The levels this CPU runs (from /proc/cpuinfo's flags; native always)."""
    try:
        line = next(
            ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")
        )
    except (OSError, StopIteration):
        return ["native"]
    flags = set(line.split(":", 1)[1].split())
    return [level for level, (_, needs) in ISA_LEVELS.items() if set(needs) <= flags]


def _cpu_signature() -> str:
    """What `-march=native` compiles for: the CPU model and its feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return "unknown"
    wanted = [ln for ln in lines if ln.startswith(("model name", "flags"))]
    return "\n".join(dict.fromkeys(wanted))


def library_name(level: str | None = None) -> str:
    """One build per source, flags and, for `native`, CPU (a home folder shared by unlike
    machines); a baseline level's build is the same on every CPU, so it can be made ahead."""
    level = level or isa_level()
    digest = hashlib.sha256()
    parts = [p.read_bytes() for p in (*SOURCES, *HEADERS)]
    parts.append(" ".join(cflags(level)).encode())
    if level == "native":
        parts.append(_cpu_signature().encode())
    for part in parts:
        digest.update(part)
    return f"nanoflex_kernels_{digest.hexdigest()[:12]}"


def build_name(level: str | None = None, checkout: Path = HERE) -> str:
    """The first-use build's name: `library_name(level)` and, apart, the folder the sources
    are compiled from. torch's loader builds a name in one folder of its extensions
    directory, and its build file names the sources by path: two checkouts of the same
    sources (a release and a source tree, or two worktrees) sharing a name would each
    rebuild the library over the other's at every first use, a minute or more of compiling."""
    where = hashlib.sha256(str(checkout.resolve()).encode()).hexdigest()[:8]
    return f"{library_name(level)}_{where}"
