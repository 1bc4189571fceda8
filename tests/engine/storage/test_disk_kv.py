"""The disk KV pool: whole-page writes, staged partial pages, reads that see both."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import torch

from engine.storage.device import Device
from engine.storage.disk import DiskFile, DiskIO
from engine.storage.disk_kv import DiskKVPool, runs

P, ROW, LAYERS = 4, 8, 3


class CountingDisk(DiskIO):
    """Real files, counting the writes that reach them."""

    def __init__(self, root: Path) -> None:
        super().__init__(root, 2)
        self.writes: list[int] = []

    def write(self, f: DiskFile, offset: int, data: torch.Tensor) -> None:
        self.writes.append(data.numel())
        super().write(f, offset, data)


def row(layer: int, slot: int, version: int = 0) -> torch.Tensor:
    return torch.full((ROW,), (layer * 31 + slot * 7 + version * 13) % 251, dtype=torch.uint8)


def test_runs_coalesce_consecutive_slots() -> None:
    assert runs([4, 5, 6, 9, 10, 3]) == [(4, 3), (9, 2), (3, 1)]


def test_decoding_writes_one_pwrite_per_full_page(tmp_path: Path) -> None:
    """Ten sequences decode 32 tokens each, one row per layer per step: 4 pages per
    sequence reach the disk as 4 writes per layer, not 16 row writes."""
    disk = CountingDisk(tmp_path)
    pool = DiskKVPool(LAYERS, P, ROW, Device(torch.device("cpu")), disk)
    pages = {s: [s * 100 + i for i in range(8)] for s in range(10)}
    for t in range(32):
        slots = [pages[s][t // P] * P + t % P for s in range(10)]
        for layer in range(LAYERS):
            pool.write(layer, slots, torch.stack([row(layer, x) for x in slots]))
    assert len(disk.writes) == 10 * (32 // P) * LAYERS
    assert set(disk.writes) == {P * ROW}
    assert pool.staged_bytes == 0  # every page complete: nothing held in memory
    for layer in range(LAYERS):
        slots = [pages[3][t // P] * P + t % P for t in range(32)]
        assert torch.equal(pool.read(layer, slots), torch.stack([row(layer, x) for x in slots]))
    disk.close()


def test_reads_see_staged_and_written_rows_and_reused_pages_start_clean(tmp_path: Path) -> None:
    rng = random.Random(0)
    disk = DiskIO(tmp_path, 2)
    pool = DiskKVPool(LAYERS, P, ROW, Device(torch.device("cpu")), disk)
    expected: dict[tuple[int, int], torch.Tensor] = {}
    for version in range(3):  # pages freed and given to a new sequence each round
        pool.begin_pages(list(range(6)))
        length = 0
        while length < 6 * P:
            n = rng.randint(1, 9)  # prefill chunks of any size, then single tokens
            slots = list(range(length, min(length + n, 6 * P)))
            for layer in range(LAYERS):
                data = torch.stack([row(layer, s, version) for s in slots])
                pool.write(layer, slots, data)
                expected.update(((layer, s), r) for s, r in zip(slots, data, strict=True))
            length += len(slots)
            for layer in range(LAYERS):
                want = list(range(length))
                rng.shuffle(want)
                got = pool.read(layer, want)
                assert torch.equal(got, torch.stack([expected[(layer, s)] for s in want]))
    pool.release_pages(list(range(6)))
    assert pool.staged_bytes == 0
    disk.close()


class SlowOpenDisk(DiskIO):
    """Real files whose opening takes a while, counting the opens (each one truncates)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root, 2)
        self.opened: list[str] = []

    def open(self, name: str, keep: bool = False) -> DiskFile:
        self.opened.append(name)
        time.sleep(0.02)
        return super().open(name, keep)


def test_layer_files_open_once_when_threads_race_to_first_use(tmp_path: Path) -> None:
    """The load and store threads of different layers reach the pool's first write at the
    same moment: the files open once, and no late open truncates a page already written."""
    disk = SlowOpenDisk(tmp_path)
    pool = DiskKVPool(LAYERS, P, ROW, Device(torch.device("cpu")), disk)
    start = threading.Barrier(LAYERS)

    def write_layer(layer: int) -> None:
        start.wait()
        pool.write(layer, list(range(P)), torch.stack([row(layer, s) for s in range(P)]))

    threads = [threading.Thread(target=write_layer, args=(j,)) for j in range(LAYERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(disk.opened) == [f"kv-{j:04d}.bin" for j in range(LAYERS)]
    for layer in range(LAYERS):
        want = torch.stack([row(layer, s) for s in range(P)])
        assert torch.equal(pool.read(layer, list(range(P))), want)
