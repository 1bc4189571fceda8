"""Timing a piece of device work: the steady state over several samples, with its spread.

A shared 2-core box makes one timed call worthless: another process, a page fault or a
frequency step can cost it 10x. `measure` warms the work up, makes each sample long enough
for the clock (calls are repeated inside a sample), takes several samples and keeps them all,
so the profile records the fastest (noise only ever adds time) and says how far the samples
disagree.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

from engine.profiling.load import LoadMonitor
from engine.storage.device import Device
from policy.hardware import MAX_SPREAD

REPEATS = 5
"""Timed samples per measurement (the fastest is kept)."""
MIN_SAMPLE_S = 0.005
"""A sample repeats the call until it lasts at least this long (timer and launch noise)."""
MAX_CALLS = 64
"""The most calls one sample makes, however short they are."""


@dataclass(frozen=True, slots=True)
class Timing:
    """Seconds per call of one piece of work, one value per timed sample."""

    samples: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def spread(self) -> float:
        """Interquartile range over the median: 0 when every sample agrees, 0.5 when the
        middle half of them spans half the median. A robust spread (one outlier moves it
        little), the number `nanoflex profile` reports and re-measures on."""
        if len(self.samples) < 2:
            return 0.0
        q1, _, q3 = statistics.quantiles(self.samples, n=4, method="inclusive")
        return (q3 - q1) / self.median


def measure(
    fn: Callable[[], object],
    device: Device,
    repeats: int = REPEATS,
    min_sample_s: float = MIN_SAMPLE_S,
) -> Timing:
    """Time `fn` after a warm-up call (allocations, lazy init, caches): `repeats` samples,
    each of enough back-to-back calls to last `min_sample_s`, device work synchronized."""
    start = time.perf_counter()
    fn()
    device.synchronize()
    warm = time.perf_counter() - start
    calls = max(1, min(MAX_CALLS, int(min_sample_s / max(warm, 1e-9))))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        device.synchronize()
        samples.append((time.perf_counter() - start) / calls)
    return Timing(tuple(samples))


def best_seconds(fn: Callable[[], object], device: Device, repeats: int = 3) -> float:
    """Fastest of `repeats` timed runs after one warm-up (a quick lower bound, for callers
    that need no spread)."""
    fn()
    device.synchronize()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        device.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


class Probe:
    """Times a profile's measurements and keeps each one's spread under the name of the
    constant it feeds (`HardwareSpec.spread`). A measurement whose samples spread wider than
    `max_spread` is taken again, up to `retries` times, and the least spread one is kept: a
    burst of another process's work then costs a few seconds, not a wrong constant. With
    `watch` (the profile's LoadMonitor), no retake starts while the profile so far has run
    under load: the neighbour would slow the retake as it slowed the first take, and a
    profile taken under load is not believed and is measured again once the machine is quiet
    (engine/profiling/requiet.py), so retakes would only stretch a busy machine's start."""

    def __init__(
        self,
        repeats: int = REPEATS,
        max_spread: float = MAX_SPREAD,
        retries: int = 2,
        watch: LoadMonitor | None = None,
    ) -> None:
        self.repeats, self.max_spread, self.retries = repeats, max_spread, retries
        self.watch = watch
        self.spread: dict[str, float] = {}
        self.retakes = 0
        """Retakes taken, over every measurement."""

    def seconds(self, name: str, fn: Callable[[], object], device: Device) -> float:
        """Seconds per call of `fn`: its fastest sample, over every retake (another
        process's work only ever adds time to a sample, so the best of several is the
        machine's own rate; a median of samples all slowed by a busy neighbour is not). The
        spread of the least spread retake is recorded under `name` (the widest when several
        measurements feed one constant, as the rows of a table do)."""
        timing = measure(fn, device, self.repeats)
        best = min(timing.samples)
        for _ in range(self.retries):
            if timing.spread <= self.max_spread or self._busy():
                break
            self.retakes += 1
            again = measure(fn, device, self.repeats)
            best = min(best, *again.samples)
            timing = min(timing, again, key=lambda t: t.spread)
        self.record(name, timing.spread)
        return best

    def _busy(self) -> bool:
        return self.watch is not None and self.watch.sample().under_load

    def record(self, name: str, spread: float) -> None:
        self.spread[name] = max(self.spread.get(name, 0.0), spread)
