"""The native CPU kernels built ahead, one library a baseline level, and loaded with no compiler.

    python -m engine.kernels.prebuilt OUT_DIR [LEVEL ...]

builds the kernels (engine/kernels/__init__.py) for each baseline level of `ISA_LEVELS` (every
one but `native` by default) into OUT_DIR, one library a level, named by what a first-use
build at that level is named by (`library_name(level)`: the sources and flags) and by the
torch it was built against. The Docker images run it in a build stage, whose compiler the
runtime stage does not carry. It compiles with the C++ compiler directly (`$CXX`, else `c++`),
with torch's headers and libraries and the flags torch's extension loader uses, and never
loads what it built: a builder whose CPU lacks AVX-512 still builds the AVX-512 levels.

At run time, with `$NANOFLEX_KERNEL_DIR` naming that folder, `load()` loads the library of the
best level this CPU runs (`BEST_FIRST`; `$NANOFLEX_KERNEL_ISA` picks one itself). A CPU that
runs none of them, or a folder without a library for these sources, falls back to the
first-use build, with a warning.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from engine.kernels.sources import (
    HERE,
    ISA_ENV,
    ISA_LEVELS,
    SOURCES,
    cflags,
    library_name,
    supported_levels,
)

logger = logging.getLogger("nanoflex.engine")

DIR_ENV = "NANOFLEX_KERNEL_DIR"
BEST_FIRST = ("avx512-bf16", "avx512", "avx2")
"""The baseline levels, the one with the most a CPU runs first."""
TORCH_LIBRARIES = ("-lc10", "-ltorch_cpu", "-ltorch")
"""What torch's extension loader links a CPU extension with (less torch_python: the kernels
register torch ops, no Python module)."""


def library_path(folder: Path, level: str) -> Path:
    """The library of `level` in `folder`: named by the sources, the flags and the torch it
    was built against (a library built on other headers is never loaded)."""
    return folder / f"{library_name(level)}-torch{torch.__version__}.so"


def pick_level() -> str | None:
    """The level to load: `$NANOFLEX_KERNEL_ISA`'s where it names a baseline level, else the
    best this CPU runs; None where it asks for `native` or the CPU runs none."""
    asked = os.environ.get(ISA_ENV)
    if asked is not None:
        return asked if asked in BEST_FIRST else None
    runs = supported_levels()
    return next((level for level in BEST_FIRST if level in runs), None)


def load() -> bool:
    """Load the library built ahead for this CPU from `$NANOFLEX_KERNEL_DIR`; False (a first-use
    build follows) where the variable is unset or no library there fits."""
    folder = os.environ.get(DIR_ENV)
    if not folder:
        return False
    level = pick_level()
    if level is None:
        logger.warning(
            "%s: no library built ahead fits (this CPU runs none of %s, or %s=native); "
            "building the kernels at first use",
            DIR_ENV,
            ", ".join(BEST_FIRST),
            ISA_ENV,
        )
        return False
    path = library_path(Path(folder), level)
    if not path.is_file():
        logger.warning(
            "%s has no %s library built from these sources (%s); building at first use",
            folder,
            level,
            path.name,
        )
        return False
    try:
        torch.ops.load_library(str(path))
    except (OSError, RuntimeError) as e:
        logger.warning("cannot load %s (%s); building the kernels at first use", path, e)
        return False
    logger.info("native CPU kernels: the %s library built ahead (%s)", level, path)
    return True


def build(out_dir: Path, levels: list[str]) -> list[Path]:
    """Compile and link one library a level into `out_dir`, the levels' sources in parallel
    (one compiler a core); the libraries, in `levels`' order."""
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise SystemExit(f"no C++ compiler ({compiler}): install g++ or set $CXX")
    root = Path(torch.__file__).parent  # what torch.utils.cpp_extension.include_paths() gives
    includes = [f"-I{HERE}", f"-isystem{root / 'include'}"]
    includes.append(f"-isystem{root / 'include' / 'torch' / 'csrc' / 'api' / 'include'}")
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="nanoflex-kernels-") as tmp:
        jobs = {
            (level, source): Path(tmp) / level / f"{source.stem}.o"
            for level in levels
            for source in SOURCES
        }

        def compile_one(job: tuple[str, Path]) -> None:
            level, source = job
            obj = jobs[job]
            obj.parent.mkdir(exist_ok=True)
            argv = [compiler, *includes, "-fPIC", "-std=c++20", *cflags(level)]
            _run([*argv, "-c", str(source), "-o", str(obj)])

        with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
            list(pool.map(compile_one, jobs))
        built = []
        for level in levels:
            final = library_path(out_dir, level)
            partial = final.with_suffix(".so.tmp")
            objects = [str(jobs[level, source]) for source in SOURCES]
            libraries = [f"-L{root / 'lib'}", *TORCH_LIBRARIES]
            _run([compiler, "-shared", *objects, "-fopenmp", *libraries, "-o", str(partial)])
            partial.rename(final)
            print(f"{level}: {final}", flush=True)
            built.append(final)
    return built


def _run(argv: list[str]) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)}\n{done.stderr}")


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    levels = argv[2:] or list(BEST_FIRST)
    unknown = [level for level in levels if level not in ISA_LEVELS or level == "native"]
    if unknown:
        print(f"not a baseline level: {', '.join(unknown)} (one of {BEST_FIRST})", file=sys.stderr)
        return 2
    build(Path(argv[1]), levels)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
