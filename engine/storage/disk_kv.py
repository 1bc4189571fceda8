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
from dataclasses import dataclass, field

import torch

from engine.storage.device import Device
from engine.storage.disk import DiskFile, DiskIO


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
    def __init__(
        self, num_layers: int, page_tokens: int, row_bytes: int, device: Device, disk: DiskIO
    ) -> None:
        self.num_layers, self.page_tokens, self.row_bytes = num_layers, page_tokens, row_bytes
        self.device, self.disk = device, disk
        self._files: list[DiskFile] = []
        self._staged: dict[int, _StagedPage] = {}
        self._lock = threading.Lock()

    @property
    def staged_bytes(self) -> int:
        """Host memory held by partial pages."""
        return len(self._staged) * self.num_layers * self.page_tokens * self.row_bytes

    def begin_pages(self, page_ids: list[int]) -> None:
        """Pages newly given to a sequence: forget anything staged for their previous owner."""
        with self._lock:
            for page_id in page_ids:
                self._staged.pop(page_id, None)

    def release_pages(self, page_ids: list[int]) -> None:
        """Pages of a sequence that is gone: drop what is staged for them."""
        self.begin_pages(page_ids)

    def write(self, layer: int, slots: list[int], data: torch.Tensor) -> None:
        """Store encoded rows (N, row_bytes) in host memory at `slots` of `layer`."""
        if not self._files:
            self._files = [self.disk.open(f"kv-{j:04d}.bin") for j in range(self.num_layers)]
        f, p = self._files[layer], self.page_tokens
        i = 0
        for first, count in runs(slots):
            slot, end = first, first + count
            while slot < end:
                page, offset = divmod(slot, p)
                if offset == 0 and end - slot >= p:  # whole pages: write them directly
                    n = (end - slot) // p * p
                    self.disk.write(f, slot * self.row_bytes, data[i : i + n])
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
            self.disk.write(
                self._files[layer], page * self.page_tokens * self.row_bytes, staged.rows[layer]
            )
            with self._lock:
                if all(n == self.page_tokens for n in staged.filled):
                    self._staged.pop(page, None)

    def read(self, layer: int, slots: list[int]) -> torch.Tensor:
        """Encoded rows at `slots` of `layer`, (N, row_bytes) in (pinned) host memory."""
        out = self.device.host_empty((len(slots), self.row_bytes), torch.uint8)
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
            self.disk.read(self._files[layer], slot * self.row_bytes, out[i:stop])

    def close(self) -> None:
        self._staged.clear()
