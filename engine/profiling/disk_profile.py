"""Measuring the disk through the engine's own path, and what its copy threads cost the compute
when the compute device is the CPU (the profile's disk constants)."""

from __future__ import annotations

import os
import statistics
import threading
import time

import torch

from engine.profiling.timing import Probe, measure
from engine.storage.device import Device
from engine.storage.disk import DiskFile, DiskIO

DISK_ROUNDS = 3
"""Write-then-read rounds of the disk measurement (the fastest of each is kept)."""
IO_INTERFERENCE_READS = (64 << 10, 4 << 20)
"""Read sizes of the interference probe: a KV page run, a weight chunk."""


def disk_bandwidth(disk: DiskIO, nbytes: int, device: Device, probe: Probe) -> tuple[float, float]:
    """(read, write) bytes/s through the engine's own disk path: pwrite + fsync, then pread
    after dropping the page cache, with the copy-thread pool and pinned staging; the fastest
    of `DISK_ROUNDS` rounds (another process's I/O only slows a round), their spreads
    recorded as `dtoc_bw` and `ctod_bw`."""
    data = device.host_empty((nbytes,), torch.uint8)
    data.random_(0, 255)
    f = disk.open("profile.bin")
    writes, reads = [], []
    for _ in range(DISK_ROUNDS):
        start = time.perf_counter()
        disk.write(f, 0, data)
        os.fsync(f.fd)
        writes.append(time.perf_counter() - start)
        f.drop_cache()
        start = time.perf_counter()
        disk.read(f, 0, data)
        reads.append(time.perf_counter() - start)
    probe.record("dtoc_bw", _spread(reads))
    probe.record("ctod_bw", _spread(writes))
    return nbytes / min(reads), nbytes / min(writes)


def _spread(samples: list[float]) -> float:
    """(max - min) / median of a few samples (too few for quartiles)."""
    return (max(samples) - min(samples)) / statistics.median(samples)


def io_interference(
    disk: DiskIO, probe: Probe, rounds: int = 3, products: int = 20
) -> tuple[float, float]:
    """(small, large): the share of its rate CPU compute loses while the copy threads read
    from disk with small (64 KiB) or large (4 MiB) reads, each dropped from the page cache
    as the engine does; the median of `rounds` rounds, each timing `products` matmuls alone
    and beside the reads. On a CPU-only box the copies and the compute share the cores. A
    quick profile takes one round of 8."""
    f = disk.open("interference.bin")
    disk.write(f, 0, torch.zeros(64 << 20, dtype=torch.uint8))
    a, b = torch.randn(512, 512), torch.randn(512, 1408)
    cpu = Device(torch.device("cpu"))

    def matmuls() -> None:
        for _ in range(products):
            torch.mm(a, b)

    shares = []
    for size, name in zip(IO_INTERFERENCE_READS, ("small", "large"), strict=True):
        alone, busy = [], []
        for _ in range(rounds):
            alone.append(probe.seconds(f"io_compute_share_{name}", matmuls, cpu))
            stop = threading.Event()
            reader = threading.Thread(target=_read_until, args=(disk, f, size, stop))
            reader.start()
            busy.append(measure(matmuls, cpu).median)  # noisy by design: a thread competes
            stop.set()
            reader.join()
        share = 1.0 - statistics.median(alone) / statistics.median(busy)
        shares.append(min(max(share, 0.0), 1.0))
    return shares[0], shares[1]


def _read_until(disk: DiskIO, f: DiskFile, size: int, stop: threading.Event) -> None:
    buf = torch.empty(size, dtype=torch.uint8)
    offset = 0
    while not stop.is_set():
        disk.read(f, offset, buf)
        offset = (offset + 16 * size) % ((64 << 20) - size)
