"""`DiskCacheIndex`: which cached KV page each disk page holds, checked whenever one is used.

Every disk page that becomes cached is recorded under its content hash (the prefix hash
chain, which also covers the model, dtype, KV compression and page size: the cache salt)
with one check per layer: the CRC-32 of the layer's bytes continued over the hash and the
layer number (`seal`). A check thus binds what a page claims to be to its bytes: a page
overwritten by someone else, cut short, or listed under another page's hash fails it.

The executor calls `verify(page, hash)` before a step uses a cached disk page (a hit read in
place, or loaded back up): it re-reads the page and compares. A page that fails is a miss,
recomputed, never wrong tokens.

With prefix caching and an `--offload-dir` of the user's the records outlive the process:
`kv-cache-index.json` holds them with the geometry (salt, layers, page size, row size,
format version). At start `load` keeps the entries that check out; anything else (a missing,
garbled or wrongly shaped index, entries of another model, out of range, duplicated, or
failing their check) is dropped and said in one warning line (`warning`, `num_dropped`): it
costs misses, never the start. The file is replaced atomically (written aside, renamed), at
most every SAVE_EVERY_S seconds plus at close; a failed save (a full disk) is retried later.
"""

from __future__ import annotations

import json
import logging
import time
import zlib
from collections import Counter
from pathlib import Path
from typing import Any

from engine.core.cache import publish_file
from engine.core.kv_pages import PageMove
from engine.storage.disk_kv import DiskKVPool

INDEX_NAME = "kv-cache-index.json"
INDEX_VERSION = 2
"""Version 2: checks sealed over the page hash (version 1 covered the bytes only)."""
SAVE_EVERY_S = 2.0

log = logging.getLogger("nanoflex.engine")


def seal(crc: int, page_hash: str, layer: int) -> int:
    """A layer's check: the CRC-32 of its bytes (`crc`) continued over the page's hash and
    the layer number."""
    return zlib.crc32(f"|{page_hash}|{layer}".encode(), crc)


class DiskCacheIndex:
    """persistent: read the previous run's index at `load` and keep it up to date."""

    def __init__(self, root: Path, salt: str, pool: DiskKVPool, persistent: bool = False) -> None:
        self.path = root / INDEX_NAME if persistent else None
        self.salt, self.pool = salt, pool
        self._pages: dict[int, tuple[str, list[int]]] = {}  # page -> (hash, check per layer)
        self._dirty = False
        self._saved_at = 0.0
        self._save_failed = False
        self.num_dropped = 0
        """Entries of the previous run's index that `load` dropped (damaged or not ours)."""
        self.warning: str | None = None
        """One line saying what `load` dropped and why, when it dropped anything."""

    def geometry(self) -> dict[str, Any]:
        pool = self.pool
        return {
            "version": INDEX_VERSION,
            "salt": self.salt,
            "num_layers": pool.num_layers,
            "page_tokens": pool.page_tokens,
            "row_bytes": pool.row_bytes,
        }

    # -- the previous run's index ------------------------------------------------------

    def load(self, max_pages: int | None = None) -> list[tuple[str, int]]:
        """The (hash, page) pairs of the previous run that check out (each page re-read);
        everything else is dropped and counted. `max_pages`: the disk pool's capacity (a
        page id at or beyond it cannot be one of ours)."""
        if self.path is None:
            return []
        entries, dropped = self._read(max_pages)
        valid: list[tuple[str, int]] = []
        hashes: set[str] = set()
        for page, (h, checks) in sorted(entries.items()):
            if h in hashes:
                dropped["listed twice"] += 1
            elif not self._check(page, h, checks):
                dropped["failing their checksum (changed, cut short or listed wrongly)"] += 1
            else:
                hashes.add(h)
                self._pages[page] = (h, checks)
                valid.append((h, page))
        self.num_dropped = sum(dropped.values())
        self._dirty = self.num_dropped > 0
        if self.num_dropped:
            why = "; ".join(f"{n} {reason}" for reason, n in dropped.items())
            self.warning = (
                f"disk cache index {self.path}: kept {len(valid)} cached pages, dropped "
                f"{self.num_dropped} ({why}); dropped pages are recomputed when needed"
            )
        return valid

    def _read(self, max_pages: int | None) -> tuple[dict[int, tuple[str, list[int]]], Counter[str]]:
        """The well-formed entries of the index file, and what was dropped reading it."""
        assert self.path is not None
        dropped: Counter[str] = Counter()
        try:
            data = json.loads(self.path.read_bytes())
        except FileNotFoundError:  # the first run here
            return {}, dropped
        except OSError as e:
            dropped[f"in an unreadable index ({e.strerror})"] += 1
            return {}, dropped
        except ValueError:
            dropped["in an index that is not JSON"] += 1
            return {}, dropped
        pages = data.get("pages") if isinstance(data, dict) else None
        if not isinstance(pages, dict):
            dropped["in an index without a 'pages' object"] += 1
            return {}, dropped
        if any(data.get(k) != v for k, v in self.geometry().items()):
            dropped["written for another model, dtype, page size or index version"] += len(pages)
            return {}, dropped
        entries = {}
        for key, value in pages.items():
            entry = self._entry(key, value, max_pages)
            if entry is None:
                dropped["malformed or out of range"] += 1
            else:
                entries[entry[0]] = entry[1]
        return entries, dropped

    def _entry(
        self, key: Any, value: Any, max_pages: int | None
    ) -> tuple[int, tuple[str, list[int]]] | None:
        """(page, (hash, checks)) of one index entry, None unless it is exactly well formed."""
        if not isinstance(key, str) or not key.isdigit():
            return None
        page = int(key)
        if max_pages is not None and page >= max_pages:
            return None
        if not isinstance(value, list) or len(value) != 2:
            return None
        h, checks = value
        if not isinstance(h, str) or not h or not isinstance(checks, list):
            return None
        if len(checks) != self.pool.num_layers or not all(
            type(c) is int and 0 <= c < 1 << 32 for c in checks
        ):
            return None
        return page, (h, checks)

    def _check(self, page: int, h: str, checks: list[int]) -> bool:
        """Re-read every layer of `page`: do its bytes, sealed with `h`, give `checks`?"""
        crcs = []
        try:
            for layer, check in enumerate(checks):
                crc = zlib.crc32(self.pool.read_page(layer, page).numpy().data)
                if seal(crc, h, layer) != check:
                    return False
                crcs.append(crc)
        except OSError:  # unreadable, or the file ends before the page
            return False
        self.pool.page_crcs[page] = [*crcs]
        return True

    # -- this run ----------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._pages)

    def verify(self, page: int, h: str) -> bool:
        """Disk page `page` is recorded as the cached page `h` and its bytes still check out."""
        record = self._pages.get(page)
        return record is not None and record[0] == h and self._check(page, h, record[1])

    def failed_checks(self, moves: list[PageMove], hits: list[tuple[int, str]]) -> list[int]:
        """The cached disk pages a step reads (`hits` in place, the disk sources of `moves`)
        that fail `verify`, now forgotten; a page an earlier move of the step writes is fresh,
        not checked."""
        fresh: set[int] = set()
        claims: list[tuple[int, str]] = []
        for move in moves:
            if move.src[0] == "disk" and move.src[1] not in fresh:
                claims.append((move.src[1], move.hash))
            if move.dst[0] == "disk":
                fresh.add(move.dst[1])
        claims += [(page, h) for page, h in hits if page not in fresh]
        bad = sorted({page for page, h in claims if not self.verify(page, h)})
        self.forget(bad)
        return bad

    def forget(self, pages: list[int]) -> None:
        """These disk pages get new contents (or failed): their records no longer hold."""
        for page in pages:
            if self._pages.pop(page, None) is not None:
                self._dirty = True

    def add(self, page: int, h: str) -> None:
        """Disk page `page` holds the cached page `h`, written whole on every layer."""
        crcs = self.pool.page_crcs.get(page)
        if crcs is None or any(c is None for c in crcs):
            return  # not (yet) written whole: not recorded, so at worst a miss
        self._pages[page] = (h, [seal(c, h, j) for j, c in enumerate(crcs) if c is not None])
        self._dirty = True

    def save(self, force: bool = False) -> None:
        """Write the index if it changed (and SAVE_EVERY_S passed, unless `force`). A write
        the disk refuses is logged once and tried again later."""
        now = time.monotonic()
        if self.path is None or not self._dirty:
            return
        if not force and now - self._saved_at < SAVE_EVERY_S:
            return
        self._saved_at = now
        data = {**self.geometry(), "pages": {str(p): [h, c] for p, (h, c) in self._pages.items()}}
        try:
            publish_file(self.path, json.dumps(data))
        except OSError as e:
            if not self._save_failed:
                log.warning(
                    "cannot save the disk cache index %s (%s); retrying, the next run "
                    "misses the pages it does not list",
                    self.path,
                    e.strerror or e,
                )
            self._save_failed = True
            return
        if self._save_failed:
            log.info("saved the disk cache index %s again", self.path)
        self._dirty, self._save_failed = False, False
