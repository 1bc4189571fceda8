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
- Under pytest-xdist (`make test` runs `-n 2`), each worker computes with its share of the
  cores (torch's intra-op threads), so that the workers do not oversubscribe them.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch

from policy.hardware import HardwareSpec
from policy.machine import machine_key

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
workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if workers > 1:
    torch.set_num_threads(max(1, torch.get_num_threads() // workers))
