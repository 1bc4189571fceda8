"""Timing a piece of device work: the steady state, not a cold start."""

from __future__ import annotations

import time
from collections.abc import Callable

from engine.storage.device import Device


def best_seconds(fn: Callable[[], object], device: Device, repeats: int = 3) -> float:
    """Fastest of `repeats` timed runs after one warm-up (the steady state, not a cold start)."""
    fn()
    device.synchronize()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        device.synchronize()
        best = min(best, time.perf_counter() - start)
    return best
