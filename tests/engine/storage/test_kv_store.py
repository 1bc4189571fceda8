"""The KV pools' growth: doubling, capped at the tier's capacity, one old layer alive at a time."""

from __future__ import annotations

import weakref
from pathlib import Path

import torch

from engine.storage.device import Device
from engine.storage.disk import DiskIO
from engine.storage.kv_store import KVStore
from engine.storage.quant import KVRowCodec

LAYERS, PAGE, ROW_DIM = 4, 16, 8


class CountingDevice(Device):
    """A CPU device that tracks the host pools it hands out while they are alive."""

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"))
        self.live: list[weakref.ref[torch.Tensor]] = []
        self.peak = 0

    def host_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        t = super().host_empty(shape, dtype)
        self.live.append(weakref.ref(t))
        self.peak = max(self.peak, self.live_bytes())
        return t

    def live_bytes(self) -> int:
        return sum(t.numel() for ref in self.live if (t := ref()) is not None)


def _store(tmp_path: Path, device: Device, capacity: int | None) -> KVStore:
    codec = KVRowCodec(ROW_DIM, dtype=torch.float32)
    store = KVStore(LAYERS, PAGE, codec, device, DiskIO(tmp_path, 1))
    store.capacity = {"gpu": None, "cpu": capacity, "disk": None}
    return store


def test_pools_double_but_never_past_the_capacity(tmp_path: Path) -> None:
    store = _store(tmp_path, CountingDevice(), capacity=10)
    rows = store.page_rows(("cpu", 2))
    data = torch.randn(PAGE, ROW_DIM).view(torch.uint8)
    store.reserve("cpu", 3)
    assert store.num_pages["cpu"] == 4
    for layer in range(LAYERS):
        store.write("cpu", layer, rows, data)
    store.reserve("cpu", 5)
    assert store.num_pages["cpu"] == 8
    store.reserve("cpu", 9)  # doubling would give 16 pages of a tier that holds 10
    assert store.num_pages["cpu"] == 10
    assert store.pool("cpu", 0).shape[0] == 10 * PAGE
    for layer in range(LAYERS):  # what was written before both growths is still there
        assert torch.equal(store.read("cpu", layer, rows), data)
    store.reserve("cpu", 10)
    assert store.num_pages["cpu"] == 10


def test_growth_keeps_one_old_layer_alive_at_a_time(tmp_path: Path) -> None:
    """While the pools grow from 8 to 16 pages, the memory alive is the new pools and at most
    one old layer's pool, not every old and every new one."""
    device = CountingDevice()
    store = _store(tmp_path, device, capacity=None)
    store.reserve("cpu", 8)
    layer_bytes = 8 * PAGE * store.row_bytes
    device.peak = 0
    store.reserve("cpu", 9)
    assert store.num_pages["cpu"] == 16
    assert device.live_bytes() == LAYERS * 2 * layer_bytes
    assert device.peak <= LAYERS * 2 * layer_bytes + layer_bytes, device.peak / layer_bytes
