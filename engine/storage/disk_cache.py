"""`DiskCacheIndex`: what the disk tier's cached KV pages hold, so a restarted engine finds them.

With prefix caching and an `--offload-dir` of its own, the disk KV files outlive the
process. Beside them, `kv-cache-index.json` maps each cached disk page to its content hash
and the CRC-32 of every layer's bytes, under the cache salt (model, dtype, compression,
page size) and the page geometry. At start the engine reads the index, re-reads every
listed page, and keeps only the entries whose salt, geometry and checksums all match: a
missing, torn or corrupted entry is a miss (recomputed), never wrong tokens. The file is
replaced atomically (written aside, renamed) and at most every SAVE_EVERY_S seconds, plus
at close; a page given new contents is forgotten before it is written.
"""

from __future__ import annotations

import json
import os
import time
import zlib
from pathlib import Path
from typing import Any

from engine.storage.disk_kv import DiskKVPool

INDEX_NAME = "kv-cache-index.json"
SAVE_EVERY_S = 2.0


class DiskCacheIndex:
    def __init__(self, root: Path, salt: str, pool: DiskKVPool) -> None:
        self.path = root / INDEX_NAME
        self.salt, self.pool = salt, pool
        self._pages: dict[int, tuple[str, list[int]]] = {}  # page -> (hash, crc per layer)
        self._dirty = False
        self._saved_at = 0.0

    def geometry(self) -> dict[str, Any]:
        pool = self.pool
        return {
            "salt": self.salt,
            "num_layers": pool.num_layers,
            "page_tokens": pool.page_tokens,
            "row_bytes": pool.row_bytes,
        }

    def load(self) -> list[tuple[str, int]]:
        """The (hash, page) pairs of the previous run that check out, re-read and verified;
        everything else in the old index is dropped."""
        try:
            data = json.loads(self.path.read_text())
            if {k: data.get(k) for k in self.geometry()} != self.geometry():
                return []
            entries = {
                int(page): (str(h), [int(c) for c in crcs])
                for page, (h, crcs) in data["pages"].items()
            }
        except (OSError, ValueError, KeyError, TypeError):
            return []
        valid = []
        for page, (h, crcs) in sorted(entries.items()):
            if len(crcs) == self.pool.num_layers and self._verify(page, crcs):
                self._pages[page] = (h, crcs)
                self.pool.page_crcs[page] = [*crcs]
                valid.append((h, page))
        self._dirty = len(valid) != len(entries)
        return valid

    def _verify(self, page: int, crcs: list[int]) -> bool:
        try:
            for layer, crc in enumerate(crcs):
                data = self.pool.read_page(layer, page)
                if zlib.crc32(data.numpy().tobytes()) != crc:
                    return False
        except OSError:  # a short file: the page was never written whole
            return False
        return True

    def __len__(self) -> int:
        return len(self._pages)

    def forget(self, pages: list[int]) -> None:
        """These disk pages get new contents: their old entries no longer hold."""
        for page in pages:
            if self._pages.pop(page, None) is not None:
                self._dirty = True

    def add(self, page: int, h: str) -> None:
        """Disk page `page` holds the cached page `h`, written whole on every layer."""
        crcs = self.pool.page_crcs.get(page)
        if crcs is None or any(c is None for c in crcs):
            return  # not (yet) written whole: not recorded, so at worst a miss next run
        self._pages[page] = (h, [int(c) for c in crcs if c is not None])
        self._dirty = True

    def save(self, force: bool = False) -> None:
        """Write the index if it changed (and SAVE_EVERY_S passed, unless `force`)."""
        now = time.monotonic()
        if not self._dirty or (not force and now - self._saved_at < SAVE_EVERY_S):
            return
        data = {**self.geometry(), "pages": {str(p): [h, c] for p, (h, c) in self._pages.items()}}
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, self.path)
        self._dirty, self._saved_at = False, now
