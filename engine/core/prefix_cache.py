"""`PrefixCache`: full KV pages found by content, and the LRU order of the ones nobody holds.

A full page is identified by a hash chained over its parent page's hash and its token
ids, salted with everything else that changes the KV bytes (the model, the dtype, KV
compression, the page size: `EngineInfo.cache_salt`). Two requests that share a prefix
of full pages share those pages' hashes, and so their KV (NanoFlow 4.4, vLLM's automatic
prefix caching). Partial last pages are never shared.

Torch-free bookkeeping only: where a page lives and who holds it is the PageManager's.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from policy import TIERS

PageRef = tuple[str, int]
"""(tier, page id): where a page lives."""


def page_hashes(
    token_ids: list[int], page_tokens: int, salt: str, parent: str = "", start: int = 0
) -> list[str]:
    """Chained hashes of the full pages of `token_ids` from page `start` on (`parent` is the
    hash of page start - 1, "" for the first page)."""
    out = []
    prev = parent
    for first in range(start * page_tokens, len(token_ids) - page_tokens + 1, page_tokens):
        tokens = array("q", token_ids[first : first + page_tokens]).tobytes()
        digest = hashlib.blake2b(digest_size=16)
        digest.update(salt.encode())
        digest.update(prev.encode())
        digest.update(tokens)
        prev = digest.hexdigest()
        out.append(prev)
    return out


class PrefixCache:
    """hash <-> page for every cached full page; per tier, the pages no sequence holds, least
    recently used first (the ones to spill or drop when the tier needs room)."""

    def __init__(self) -> None:
        self._by_hash: dict[str, PageRef] = {}
        self._hash_of: dict[PageRef, str] = {}
        self.lru: dict[str, OrderedDict[int, None]] = {tier: OrderedDict() for tier in TIERS}

    def __len__(self) -> int:
        return len(self._by_hash)

    def hash_of(self, ref: PageRef) -> str | None:
        return self._hash_of.get(ref)

    def lookup(self, hashes: list[str]) -> list[PageRef]:
        """The pages of the longest prefix of `hashes` that is cached."""
        out = []
        for h in hashes:
            ref = self._by_hash.get(h)
            if ref is None:
                break
            out.append(ref)
        return out

    def add(self, ref: PageRef, h: str) -> bool:
        """Index `ref` under `h`; False (nothing changes) if another page already holds `h`."""
        if h in self._by_hash or ref in self._hash_of:
            return False
        self._by_hash[h], self._hash_of[ref] = ref, h
        return True

    def move(self, src: PageRef, dst: PageRef) -> str:
        """The cached page at `src` now lives at `dst` (same contents); returns its hash."""
        h = self._hash_of.pop(src)
        self._by_hash[h], self._hash_of[dst] = dst, h
        self.lru[src[0]].pop(src[1], None)
        return h

    def remove(self, ref: PageRef) -> str | None:
        """Forget `ref` (its contents are about to change or be dropped)."""
        h = self._hash_of.pop(ref, None)
        if h is not None:
            del self._by_hash[h]
        self.lru[ref[0]].pop(ref[1], None)
        return h

    def release(self, ref: PageRef) -> None:
        """Nobody holds `ref` any more: most recently used among the evictable."""
        self.lru[ref[0]][ref[1]] = None

    def acquire(self, ref: PageRef) -> None:
        """Someone holds `ref` again: it is not evictable."""
        self.lru[ref[0]].pop(ref[1], None)

    def oldest(self, tier: str) -> int | None:
        """The least recently used unheld page of `tier`, if any."""
        return next(iter(self.lru[tier]), None)
