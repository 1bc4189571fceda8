"""The profile's nano-batch overlap probe (`nanoflex profile`: nano_overlap_device/host)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import torch

from engine.profiling.nano_profile import _overlap_share, nano_batch_overhead, nano_overlap
from engine.profiling.timing import Probe
from engine.storage.device import Device

CPU = Device(torch.device("cpu"))


def _wait() -> None:
    time.sleep(0.02)  # releases the GIL, as torch ops do


def test_overlap_share_sees_what_runs_side_by_side_and_what_does_not() -> None:
    with ThreadPoolExecutor(1) as pool:

        def side_by_side() -> None:
            running = pool.submit(_wait)
            _wait()
            running.result()

        def one_after_the_other() -> None:
            _wait()
            _wait()

        assert _overlap_share(_wait, _wait, side_by_side, CPU, rounds=3) > 0.7
        assert _overlap_share(_wait, _wait, one_after_the_other, CPU, rounds=3) < 0.3


def test_probe_measures_both_shares_on_this_machine() -> None:
    device_share, host_share = nano_overlap(CPU, torch.float32, quick=True)
    assert 0.0 <= device_share <= 1.0 and 0.0 <= host_share <= 1.0


def test_a_nano_batch_has_a_fixed_cost_through_the_engine() -> None:
    """Four one-token sequences cut four ways run 3 more pieces per layer than whole: the
    measurement runs both through the engine and gives a per-piece cost of at most a few ms
    (not asserted above 0: on a loaded machine the difference can drown in the noise)."""
    assert 0.0 <= nano_batch_overhead("cpu", Probe()) < 0.05


def test_attention_probes_read_keys_on_pages_as_the_engine_stores_them() -> None:
    """The probes' slots: each sequence's tokens on whole 16-token pages of consecutive rows,
    the pages shuffled among sequences, no row shared; the CPU's probes take a small layer."""
    from engine.profiling.profiler import attention_shape, paged_slots

    lens = [1025, 40, 16]
    slots = paged_slots(lens, seed=3)
    assert [len(s) for s in slots] == lens
    rows = [r for s in slots for r in s]
    assert len(set(rows)) == len(rows) and max(rows) < 16 * (65 + 3 + 1)
    for s in slots:
        for page in range(0, len(s), 16):
            run = s[page : page + 16]
            assert run[0] % 16 == 0 and run == list(range(run[0], run[0] + len(run)))
    starts = [s[t] // 16 for s in slots for t in range(0, len(s), 16)]
    assert starts != sorted(starts)  # shuffled, not laid out in order
    assert attention_shape(CPU) == (16, 4, 64)
