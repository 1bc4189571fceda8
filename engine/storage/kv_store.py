"""`KVStore`: the physical paged KV cache, one pool per tier, holding encoded token rows.

A row is one token's keys then values for one layer, (2 * num_kv_heads * head_dim,)
values, or its keys alone where the model's values are its keys
(`KVShape.values_are_keys`: MLA's latent, stored once), encoded by a `KVRowCodec` into
`row_bytes` bytes (a plain view, or 4-bit groups). Every tier, copy and spill moves rows
as bytes, whatever they hold. Token t of a sequence lives at slot page_ids[t // page_tokens]
* page_tokens + t % page_tokens of its home tier's pool, for every layer. Memory pools grow
by doubling up to the tier's capacity; the disk pool (`DiskKVPool`) is one file per layer,
written a whole page at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.core.prefix_cache import PageRef
from engine.storage.device import Device
from engine.storage.disk import DiskIO
from engine.storage.disk_kv import DiskKVPool
from engine.storage.quant import KVRowCodec
from policy import TIERS

_WORDS = ((8, torch.int64), (4, torch.int32), (2, torch.int16))


def _as_words(rows: torch.Tensor) -> torch.Tensor:
    """(N, row_bytes) uint8 rows (rows may be strided) viewed as the widest integers that
    divide a row and its offsets: torch's row gathers and scatters move one element at a
    time, so 8-byte elements move a pool's rows 1.6x (gather) to 4.7x (scatter) faster than
    bytes on a CPU."""
    if rows.dtype != torch.uint8 or rows.stride(-1) != 1:
        return rows
    for size, dtype in _WORDS:
        if all(n % size == 0 for n in (rows.shape[-1], rows.storage_offset(), *rows.stride()[:-1])):
            return rows.view(dtype)
    return rows


def select_rows(
    pool: torch.Tensor, index: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """`pool.index_select(0, index)` (into `out`, if given), faster for a pool of uint8 rows."""
    if out is None:
        return _as_words(pool).index_select(0, index).view(pool.dtype)
    torch.index_select(_as_words(pool), 0, index, out=_as_words(out))
    return out


def copy_rows(pool: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> None:
    """`pool.index_copy_(0, index, rows)`, faster for a pool of uint8 rows."""
    _as_words(pool).index_copy_(0, index, _as_words(rows))


@dataclass(slots=True)
class KVRows:
    """Token rows of one tier's KV pool that a batch reads or writes, and where they go."""

    slots: list[int]
    """Pool slots (the disk tier reads and writes coalesced runs of them)."""
    slot_index: torch.Tensor | None
    """The same slots on the pool's device, for the memory tiers (None for disk)."""
    rows: torch.Tensor
    """On the compute device: each slot's row in the packed order it is gathered into
    (past KV packed in sequence order) or taken from (the batch's new-token rows)."""


_NO_ROWS = torch.empty(0, dtype=torch.long)


class KVStore:
    def __init__(
        self,
        num_layers: int,
        page_tokens: int,
        codec: KVRowCodec,
        device: Device,
        disk: DiskIO,
        persistent: bool = False,
    ) -> None:
        self.num_layers, self.page_tokens, self.codec = num_layers, page_tokens, codec
        self.device, self.disk = device, disk
        self.row_bytes = codec.row_bytes
        self._pools: dict[str, list[torch.Tensor]] = {"gpu": [], "cpu": []}  # (slots, row_bytes)
        self.disk_pool = DiskKVPool(
            num_layers, page_tokens, self.row_bytes, device, disk, persistent
        )
        self.num_pages = dict.fromkeys(TIERS, 0)
        self.capacity: dict[str, int | None] = dict.fromkeys(TIERS)
        """Pages each memory tier may hold (None: unbounded); the executor sets it from the
        tiers' budgets once the weights are placed (budgets.kv_capacity_pages)."""

    @property
    def page_bytes(self) -> int:
        """Bytes of one page across all layers (what one page id costs a tier)."""
        return self.page_tokens * self.row_bytes * self.num_layers

    def bytes_per_tier(self) -> dict[str, int]:
        """Pool bytes per tier; the disk tier's partly written pages count as cpu memory."""
        out = {tier: n * self.page_bytes for tier, n in self.num_pages.items()}
        out["cpu"] += self.disk_pool.staged_bytes
        return out

    def reserve(self, tier: str, num_pages: int) -> None:
        """Make page ids [0, num_pages) addressable on `tier`. A memory pool grows by doubling,
        but never by doubling past the tier's capacity (`capacity`, from its budget; the
        scheduler asks for no more than that), and one layer at a time: the new pools and a
        single old one are alive at once. So a pool grown to fill its budget stays within it
        (the first H200 run doubled a 66 GiB pool of a 98 GiB capacity towards 132 GiB, every
        old layer kept until the last new one was made, and ran out of GPU memory)."""
        if num_pages <= self.num_pages[tier]:
            return
        if tier == "disk":
            self.num_pages[tier] = num_pages
            return
        limit = self.capacity.get(tier)
        new_pages = max(num_pages, 2 * self.num_pages[tier], 4)
        if limit is not None:
            new_pages = max(num_pages, min(new_pages, limit))
        shape = (new_pages * self.page_tokens, self.row_bytes)
        pools = self._pools[tier]
        self.device.synchronize()  # copies in flight may still read or write the old pools
        for j in range(self.num_layers):
            pool = (
                torch.empty(shape, dtype=torch.uint8, device=self.device.device)
                if tier == "gpu"
                else self.device.host_empty(shape, torch.uint8)
            )
            if len(pools) > j:
                pool[: pools[j].shape[0]].copy_(pools[j])
                pools[j] = pool  # the old pool is freed here, before the next layer's is made
            else:
                pools.append(pool)
        self.num_pages[tier] = new_pages
        # the copies above run on the compute stream; copy streams read the pools next
        self.device.synchronize()

    def reserve_pages(self, pages: list[PageRef]) -> None:
        """Make every page of `pages` addressable on its tier."""
        top: dict[str, int] = {}
        for tier, page in pages:
            top[tier] = max(top.get(tier, 0), page + 1)
        for tier, num_pages in top.items():
            self.reserve(tier, num_pages)

    def page_rows(self, ref: PageRef) -> KVRows:
        """The slots of every token of page `ref`."""
        tier, page = ref
        first = page * self.page_tokens
        index = None
        if tier != "disk":
            index = torch.arange(first, first + self.page_tokens, device=self.pool_device(tier))
        return KVRows(list(range(first, first + self.page_tokens)), index, _NO_ROWS)

    def copy_page(self, layer: int, src: PageRef, dst: PageRef) -> None:
        """Copy one layer of a page's encoded KV from `src` to `dst` (any two tiers)."""
        data = self.read(src[0], layer, self.page_rows(src))
        if dst[0] == "disk":
            data = data.cpu()
        self.write(dst[0], layer, self.page_rows(dst), data)

    def read(self, tier: str, layer: int, kv_rows: KVRows, staged: bool = False) -> torch.Tensor:
        """Encoded rows at `kv_rows.slots`: on the compute device for gpu, on the host else.
        `staged`: host rows bound for a GPU go into a buffer of `device.staging`, which the
        caller gives back (`Device.release`) once the copy to the device is enqueued."""
        n = len(kv_rows.slots)
        if tier == "disk":
            return self.disk_pool.read(layer, kv_rows.slots, staged)
        assert kv_rows.slot_index is not None
        pool = self._pools[tier][layer]
        if tier == "cpu" and staged and self.device.is_cuda:  # gathered into pinned memory
            out = self.device.staging.take((n, self.row_bytes), torch.uint8)
            return select_rows(pool, kv_rows.slot_index, out)
        return select_rows(pool, kv_rows.slot_index)

    def pool(self, tier: str, layer: int) -> torch.Tensor:
        """One layer's (slots, row_bytes) pool of a memory tier, read in place by attention."""
        return self._pools[tier][layer]

    def write(self, tier: str, layer: int, kv_rows: KVRows, data: torch.Tensor) -> None:
        """Store encoded rows (on the compute device for gpu, on the host otherwise)."""
        if tier == "disk":
            self.disk_pool.write(layer, kv_rows.slots, data)
            return
        assert kv_rows.slot_index is not None
        pool = self._pools[tier][layer]
        copy_rows(pool, kv_rows.slot_index, data.to(pool.device, non_blocking=True))

    def pool_device(self, tier: str) -> torch.device:
        """Where a tier's slot indices must live."""
        return self.device.device if tier == "gpu" else torch.device("cpu")
