"""`DiskKVPool`: the disk tier of the KV cache, written a whole page at a time.

Decoding adds one row per sequence per layer per step, at scattered slots; a `pwrite`
per row runs far below the disk's bandwidth. So a page's rows are staged in host memory
until the page is full for a layer, and then written with one `pwrite` (a prefill chunk
that covers whole pages writes them directly, coalesced into runs). Reads take staged
rows from memory and the rest from the files, one `pread` per run of consecutive slots.

Layout: one file per layer; slot s (page s // page_tokens, offset s % page_tokens) at byte
s * row_bytes. Host memory held: at most one partial page per disk-homed sequence, for
every layer (`staged_bytes`).
"""

from __future__ import annotations

import threading
import zlib
from dataclasses import dataclass, field

import torch

from engine.storage.device import Device
from engine.storage.disk import DiskFile, DiskIO, OffloadIOError


def runs(slots: list[int]) -> list[tuple[int, int]]:
    """Coalesce slots into (first slot, count) runs of consecutive slots."""
    out: list[tuple[int, int]] = []
    for s in slots:
        if out and out[-1][0] + out[-1][1] == s:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((s, 1))
    return out


@dataclass(slots=True)
class _StagedPage:
    """A page not yet complete on disk for every layer."""

    rows: torch.Tensor
    """(num_layers, page_tokens, row_bytes) uint8 in host memory."""
    filled: list[int] = field(default_factory=list)
    """Per layer: rows written so far; page_tokens means written to disk."""


class DiskKVPool:
    """Every page written whole gets a CRC-32 per layer, so that a cached page can be checked
    when it is used again (engine/storage/disk_cache.py). persistent: the layer files are
    kept across runs (the disk prefix cache)."""

    def __init__(
        self,
        num_layers: int,
        page_tokens: int,
        row_bytes: int,
        device: Device,
        disk: DiskIO,
        persistent: bool = False,
    ) -> None:
        self.num_layers, self.page_tokens, self.row_bytes = num_layers, page_tokens, row_bytes
        self.device, self.disk, self.persistent = device, disk, persistent
        self._files: list[DiskFile] = []
        self._staged: dict[int, _StagedPage] = {}
        self._lock = threading.Lock()
        self.page_crcs: dict[int, list[int | None]] = {}
        """Per page, the CRC-32 of each layer's bytes as last written whole."""

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of one layer."""
        return self.page_tokens * self.row_bytes

    def files(self) -> list[DiskFile]:
        """The layer files, opened on first use, once: the load and store threads of
        different layers may get here together, and a second open would truncate what the
        first one's thread already wrote."""
        with self._lock:
            if not self._files:
                self._files = [
                    self.disk.open(f"kv-{j:04d}.bin", keep=self.persistent)
                    for j in range(self.num_layers)
                ]
            return self._files

    def read_page(self, layer: int, page: int) -> torch.Tensor:
        """One layer of a page as written to disk, (page_tokens, row_bytes)."""
        out = torch.empty((self.page_tokens, self.row_bytes), dtype=torch.uint8)
        self.disk.read(self.files()[layer], page * self.page_bytes, out)
        return out

    def _written(self, layer: int, page: int, rows: torch.Tensor) -> None:
        """A whole page of `layer` reached the disk: remember its checksum."""
        crc = zlib.crc32(rows.contiguous().numpy().data)
        with self._lock:
            self.page_crcs.setdefault(page, [None] * self.num_layers)[layer] = crc

    @property
    def staged_bytes(self) -> int:
        """Host memory held by partial pages."""
        return len(self._staged) * self.num_layers * self.page_tokens * self.row_bytes

    def begin_pages(self, page_ids: list[int]) -> None:
        """Pages newly given to a sequence: forget anything staged for their previous owner."""
        with self._lock:
            for page_id in page_ids:
                self._staged.pop(page_id, None)
                self.page_crcs.pop(page_id, None)

    def release_pages(self, page_ids: list[int]) -> None:
        """Pages of a sequence that is gone: drop what is staged for them (a full page stays
        as it is: it may be cached)."""
        with self._lock:
            for page_id in page_ids:
                self._staged.pop(page_id, None)

    def write(self, layer: int, slots: list[int], data: torch.Tensor) -> None:
        """Store encoded rows (N, row_bytes) in host memory at `slots` of `layer`."""
        f, p = self.files()[layer], self.page_tokens
        i = 0
        for first, count in runs(slots):
            slot, end = first, first + count
            while slot < end:
                page, offset = divmod(slot, p)
                if offset == 0 and end - slot >= p:  # whole pages: write them directly
                    n = (end - slot) // p * p
                    self.disk.write(f, slot * self.row_bytes, data[i : i + n])
                    for k in range(n // p):
                        self._written(layer, page + k, data[i + k * p : i + (k + 1) * p])
                else:
                    n = min(p - offset, end - slot)
                    self._stage(layer, page, offset, data[i : i + n])
                slot, i = slot + n, i + n

    def _stage(self, layer: int, page: int, offset: int, rows: torch.Tensor) -> None:
        n = rows.shape[0]
        with self._lock:
            staged = self._staged.get(page)
            if staged is None:
                shape = (self.num_layers, self.page_tokens, self.row_bytes)
                staged = _StagedPage(torch.empty(shape, dtype=torch.uint8), [0] * self.num_layers)
                self._staged[page] = staged
            staged.rows[layer, offset : offset + n].copy_(rows)
            staged.filled[layer] += n
            full = staged.filled[layer] == self.page_tokens
        if full:
            self.disk.write(self._files[layer], page * self.page_bytes, staged.rows[layer])
            self._written(layer, page, staged.rows[layer])
            with self._lock:
                if all(n == self.page_tokens for n in staged.filled):
                    self._staged.pop(page, None)

    def read(self, layer: int, slots: list[int], for_device: bool = False) -> torch.Tensor:
        """Encoded rows at `slots` of `layer`, (N, row_bytes) in host memory: a staging buffer
        (pinned, `Device.staging`; the caller gives it back) where `for_device` and the
        compute device is a GPU."""
        shape = (len(slots), self.row_bytes)
        if for_device and self.device.is_cuda:
            out = self.device.staging.take(shape, torch.uint8)
        else:
            out = torch.empty(shape, dtype=torch.uint8)
        p, i = self.page_tokens, 0
        for first, count in runs(slots):
            slot, end = first, first + count
            on_disk: tuple[int, int] | None = None  # (first slot, first out row) of a read
            while slot < end:
                page, offset = divmod(slot, p)
                n = min(p - offset, end - slot)
                staged = self._staged.get(page)
                if staged is not None:
                    self._read_disk(layer, on_disk, slot, out, i)
                    on_disk = None
                    out[i : i + n].copy_(staged.rows[layer, offset : offset + n])
                elif on_disk is None:
                    on_disk = (slot, i)
                slot, i = slot + n, i + n
            self._read_disk(layer, on_disk, slot, out, i)
        return out

    def _read_disk(
        self,
        layer: int,
        start: tuple[int, int] | None,
        stop_slot: int,
        out: torch.Tensor,
        stop: int,
    ) -> None:
        """One pread for the slots [start slot, stop_slot) into out[start row:stop]."""
        if start is not None:
            slot, i = start
            assert stop_slot - slot == stop - i
            try:
                self.disk.read(self._files[layer], slot * self.row_bytes, out[i:stop])
            except OffloadIOError as e:  # these pages' bytes are suspect now
                p = self.page_tokens
                e.pages = list(range(slot // p, (stop_slot - 1) // p + 1))
                raise

    def close(self) -> None:
        self._staged.clear()
