"""The native CPU kernels built ahead (engine/kernels/prebuilt.py, what the Docker images
carry): which level a CPU loads, the fall back to a first-use build where none fits, and, slow,
a library built ahead at a baseline level loaded with no compile and checked against torch."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from engine import kernels
from engine.kernels import ISA_ENV, prebuilt, sources, supported_levels
from tests.engine.executor.test_kernel_isa import run_kernel_checks


def test_a_baseline_level_is_named_alike_on_every_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """A library built ahead on one CPU is found on another: only `native` names the CPU."""
    here = {level: kernels.library_name(level) for level in kernels.ISA_LEVELS}
    monkeypatch.setattr(sources, "_cpu_signature", lambda: "model name: elsewhere")
    elsewhere = {level: kernels.library_name(level) for level in kernels.ISA_LEVELS}
    assert here["native"] != elsewhere["native"]
    assert all(here[level] == elsewhere[level] for level in prebuilt.BEST_FIRST)
    assert len(set(here.values())) == len(here)  # one name a level


def test_a_first_use_build_is_named_by_its_checkout(tmp_path: Path) -> None:
    """Two checkouts of the same sources build apart (torch's build file names the sources by
    path: sharing one name, each would rebuild over the other); one checkout, one name."""
    other = tmp_path / "engine" / "kernels"
    other.mkdir(parents=True)
    name = kernels.build_name()
    assert name == sources.build_name(checkout=sources.HERE)
    assert name.startswith(kernels.library_name())
    assert sources.build_name(checkout=other) != name
    assert sources.build_name(checkout=other).startswith(kernels.library_name())


def test_the_build_runs_the_ninja_package_whatever_path_says(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A first-use build runs the `ninja` package's binary (ninja versions keep their build
    logs apart: two on PATH by turns rebuilt the library whole), and PATH is as it was
    after."""
    ninja = pytest.importorskip("ninja")
    other = tmp_path / "bin"
    other.mkdir()
    (other / "ninja").write_text("#!/bin/sh\necho 0.0.other\n")
    (other / "ninja").chmod(0o755)
    monkeypatch.setenv("PATH", f"{other}{os.pathsep}/usr/bin{os.pathsep}/bin")
    assert shutil.which("ninja") == str(other / "ninja")
    with kernels._ninja_of_the_package():
        found = shutil.which("ninja")
        assert found is not None and Path(found).parent == Path(ninja.BIN_DIR)
        version = subprocess.run([found, "--version"], capture_output=True, text=True).stdout
    assert version.startswith(ninja.__version__) and "0.0.other" not in version
    assert os.environ["PATH"] == f"{other}{os.pathsep}/usr/bin{os.pathsep}/bin"


def test_the_best_level_this_cpu_runs_is_picked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ISA_ENV, raising=False)
    monkeypatch.setattr(prebuilt, "supported_levels", lambda: ["native", "avx2", "avx512"])
    assert prebuilt.pick_level() == "avx512"
    monkeypatch.setattr(prebuilt, "supported_levels", lambda: ["native"])
    assert prebuilt.pick_level() is None  # no AVX2: built at first use
    monkeypatch.setenv(ISA_ENV, "avx2")
    assert prebuilt.pick_level() == "avx2"
    monkeypatch.setenv(ISA_ENV, "native")
    assert prebuilt.pick_level() is None


def test_a_folder_without_this_build_falls_back_with_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv(prebuilt.DIR_ENV, raising=False)
    assert not prebuilt.load()  # not asked for: silent
    monkeypatch.setenv(prebuilt.DIR_ENV, str(tmp_path))
    monkeypatch.setenv(ISA_ENV, "avx2")
    (tmp_path / "nanoflex_kernels_000000000000-torch0.so").write_bytes(b"")  # other sources
    with caplog.at_level(logging.WARNING, logger="nanoflex.engine"):
        assert not prebuilt.load()
    assert "no avx2 library built from these sources" in caplog.text


@pytest.mark.slow
@pytest.mark.skipif("avx2" not in supported_levels(), reason="this CPU runs no AVX2")
def test_a_library_built_ahead_loads_without_a_compile_and_equals_torch(tmp_path: Path) -> None:
    """Built for AVX2 as the Docker build stage builds it, then the kernel tests run in a
    process that finds it through $NANOFLEX_KERNEL_DIR, with $CXX naming no compiler and an
    empty extensions folder (a first-use build would fail there: the kernel tests fail)."""
    assert prebuilt.build(tmp_path / "lib", ["avx2"]) == [
        prebuilt.library_path(tmp_path / "lib", "avx2")
    ]
    env = {
        **os.environ,
        prebuilt.DIR_ENV: str(tmp_path / "lib"),
        ISA_ENV: "avx2",
        "CXX": "/nonexistent/c++",
        "TORCH_EXTENSIONS_DIR": str(tmp_path / "extensions"),
    }
    run_kernel_checks(env)
    assert not (tmp_path / "extensions").exists() or not any((tmp_path / "extensions").iterdir())
