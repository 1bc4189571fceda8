"""Settings every test process needs before any test module imports what they govern.

- The suite never reads the user's nanoflex cache (~/.cache/nanoflex): a profile measured
  there on a busy day would change every automatic plan the tests make. It runs in a cache
  of its own, `.test-cache/` in the checkout ($NANOFLEX_TEST_CACHE overrides it), which keeps
  the models it converts between runs; its hardware profile is written afresh at every start
  from tests/fixtures/hardware-cpu.json (a quiet full profile of the development CPU, keyed
  to whatever machine runs the suite), so every automatic plan is the same on any box. A
  test that measures a profile does so in a cache of its own.
- No background re-measure of a profile is started, and no plan is checked against the real
  model, by a test unless it asks for one (each would add seconds to every automatic plan).
- Triton's interpreter runs the CUDA kernels on CPU tensors (tests/engine/kernels). The
  setting is read when triton.language is first imported, for its own jit functions.
- Under pytest-xdist (`make test TEST_WORKERS=N`; one process by default), each worker and
  what it starts compute with their share of the cores (OpenMP's and the BLAS libraries'
  threads, set before they load):
  NumPy's and torch's thread pools spin while they wait, and two workers' pools on two cores
  ran the suite's LP and CLI tests slower than one process did.
- The native CPU kernels (engine/kernels) are built, where this checkout's build is not in
  torch's extensions folder yet (a fresh machine: about 40 s of compiling), on a thread that
  starts before collection, so that the compiler runs while pytest imports the test modules
  (about 20 s); the first test that needs the library waits for the rest of the build.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from pathlib import Path

WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if WORKERS > 1:
    SHARE = str(max(1, (os.cpu_count() or 1) // WORKERS))
    for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(name, SHARE)

import torch  # noqa: E402  (after the thread settings, which it reads when it loads)

from policy.hardware import HardwareSpec  # noqa: E402
from policy.machine import machine_key  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
FIXED_PROFILE = REPO / "tests" / "fixtures" / "hardware-cpu.json"

CACHE = Path(os.environ.get("NANOFLEX_TEST_CACHE", REPO / ".test-cache"))
os.environ["NANOFLEX_CACHE"] = str(CACHE)
os.environ["NANOFLEX_BACKGROUND_PROFILE"] = "0"
os.environ["NANOFLEX_PLAN_CHECK"] = "0"
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    fixed = HardwareSpec.load(FIXED_PROFILE)
    dataclasses.replace(fixed, machine=machine_key()).save(CACHE / "hardware.json")


def pytest_configure() -> None:
    """Start building the native kernels (see above): the first test to ask for them waits on
    the kernels' lock for this thread's build (loading a built library is quick, so this runs
    whether or not it is built). Not on a CUDA machine, whose tests run the CUDA path (the GPU
    pass's minutes are not spent compiling what they may not use)."""
    if torch.cuda.is_available():
        return
    from engine.kernels import paged_kernels

    threading.Thread(target=paged_kernels, name="native-kernels-build", daemon=True).start()
