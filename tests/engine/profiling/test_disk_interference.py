"""The disk-read interference probe at a quick profile's size."""

from __future__ import annotations

from pathlib import Path

from engine.profiling.disk_profile import io_interference
from engine.profiling.timing import Probe
from engine.storage.disk import DiskIO


def test_one_round_measures_both_read_sizes(tmp_path: Path) -> None:
    disk = DiskIO(tmp_path, 2)
    probe = Probe(repeats=3, retries=0)
    try:
        small, large = io_interference(disk, probe, rounds=1, products=2)
    finally:
        disk.close()
    assert 0.0 <= small <= 1.0 and 0.0 <= large <= 1.0
    assert set(probe.spread) == {"io_compute_share_small", "io_compute_share_large"}
