"""Timing device work: warm-up, samples, median and spread; a noisy measurement is retaken."""

from __future__ import annotations

import itertools
import time

import pytest
import torch

from engine.profiling.load import LoadMonitor
from engine.profiling.timing import Probe, Timing, measure
from engine.storage.device import Device
from tests.engine.profiling.neighbours import busy_neighbours

CPU = Device(torch.device("cpu"))


def test_spread_is_the_interquartile_range_over_the_median() -> None:
    assert Timing((1.0, 1.0, 1.0, 1.0, 1.0)).spread == 0.0
    timing = Timing((1.0, 1.0, 2.0, 3.0, 3.0))
    assert timing.median == 2.0 and timing.spread == pytest.approx(1.0)
    # one outlier barely moves it
    assert Timing((1.0, 1.0, 1.0, 1.0, 50.0)).spread == 0.0


def test_measure_warms_up_then_takes_the_median_of_its_samples() -> None:
    calls = itertools.count()
    durations = iter([0.05] + [0.01] * 100)  # a slow first call (warm-up), then steady

    def work() -> None:
        next(calls)
        time.sleep(next(durations))

    timing = measure(work, CPU, repeats=5, min_sample_s=0.0)
    assert len(timing.samples) == 5 and next(calls) == 6  # warm-up + 5 samples of one call
    assert timing.median == pytest.approx(0.01, rel=0.5)


def test_probe_retakes_a_noisy_measurement_and_records_its_spread() -> None:
    durations = iter([0.001] + [0.001, 0.02] * 3 + [0.001] * 100)  # noisy, then quiet

    def work() -> None:
        time.sleep(next(durations))

    probe = Probe(repeats=5, max_spread=0.25, retries=2)
    seconds = probe.seconds("gpu_flops", work, CPU)
    assert seconds == pytest.approx(0.001, rel=1.0)
    assert probe.spread["gpu_flops"] <= 0.25


def test_probe_takes_no_retake_while_the_machine_is_busy() -> None:
    """A noisy measurement is retaken (the control: no load monitor); while the profile's
    load monitor sees other processes busy, no retake starts: the neighbour would slow it
    too, and a profile taken under load is measured again once the machine is quiet."""

    def noisy(probe: Probe) -> int:
        """Calls made measuring samples of one call each, alternating 6 and 30 ms: always
        over the spread."""
        durations = itertools.cycle([0.006, 0.03])
        calls = itertools.count()

        def work() -> None:
            next(calls)
            time.sleep(next(durations))

        probe.seconds("gpu_flops", work, CPU)
        return next(calls)

    control = Probe(repeats=5, max_spread=0.25, retries=2)
    control_calls = noisy(control)
    assert control.retakes == 2 and control_calls == 3 * 6  # warm-up + 5 samples, 3 takes
    with busy_neighbours(2), LoadMonitor() as watch:
        time.sleep(1.0)  # the neighbours' work, seen before the measurement starts
        assert watch.sample().under_load
        busy = Probe(repeats=5, max_spread=0.25, retries=2, watch=watch)
        busy_calls = noisy(busy)
    assert busy.retakes == 0 and busy_calls == 6 and busy.spread["gpu_flops"] > 0.25
