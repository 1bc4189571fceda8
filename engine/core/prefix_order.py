"""`PrefixQueue` and `PrefixGate`: admission by shared prompt prefix (BlendServe's ordering).

A batch job's lines are known before they run. `PrefixQueue` keeps the batch queue in the
depth-first order of a trie over the prompts' full-page hashes (it sorts by the tuple of
chained page hashes: lines that share their first k pages are adjacent, and among them
those that share k + 1), so each group of lines runs back to back while its prefix is
cached, instead of spread over a shuffled job while the LRU evicts the prefix in between.
`PrefixGate` holds back a sequence whose next uncached page a running sequence is computing
right now: admitted a step later it hits that page instead of computing it a second time
(the lines of one group, the n choices of one request). Torch-free.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import Generic, TypeVar

from engine.core.prefix_cache import PrefixCache, page_hashes

Item = TypeVar("Item", bound=Hashable)
PageHashes = tuple[str, ...]
"""The chained hashes of a prompt's full pages (`page_hashes`), first page first."""
QueueKey = tuple[int, PageHashes, int]
"""(0 for a requeued item, else 1; its page hashes; the order it came in)."""
LOOKAHEAD = 64
"""Queued items `PrefixQueue` offers past ones the gate holds back, per admission."""


def prompt_page_hashes(prompt_token_ids: list[int], page_tokens: int, salt: str) -> PageHashes:
    """The hashes of the prompt's full pages that a prefix hit can cover (`PageManager.match`
    leaves at least one token to compute, so a prompt's last token is never in them)."""
    usable = (len(prompt_token_ids) - 1) // page_tokens * page_tokens
    return tuple(page_hashes(prompt_token_ids[:usable], page_tokens, salt))


class PrefixQueue(Generic[Item]):
    """A waiting queue in trie order of its items' page hashes; requeued items (preempted,
    recovered) go in front of all others, the latest first, as a deque's `appendleft`.

    The scheduler's queue interface: `append`, `appendleft`, `remove`, `in`, `len`, iterating
    from the front. Inserting or removing costs O(log n) comparisons and one list shift."""

    def __init__(self, hashes_of: Callable[[Item], PageHashes]) -> None:
        self._hashes_of = hashes_of
        self._keys: list[QueueKey] = []
        self._items: list[Item] = []
        self._key_of: dict[Item, QueueKey] = {}
        self._counter = itertools.count()

    def append(self, item: Item) -> None:
        """Queue `item` at its place among items sharing its prefix (FIFO among equals)."""
        self._insert(item, (1, self._hashes_of(item), next(self._counter)))

    def appendleft(self, item: Item) -> None:
        """Queue `item` ahead of everything (it was running: finish it first)."""
        self._insert(item, (0, (), -next(self._counter)))

    def remove(self, item: Item) -> None:
        key = self._key_of.pop(item)
        index = bisect.bisect_left(self._keys, key)
        assert self._items[index] == item
        del self._keys[index], self._items[index]

    def __contains__(self, item: object) -> bool:
        return item in self._key_of

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Item]:
        """From the front; like a deque's, not to be held across a change of the queue (a
        copy here made each admission's look at the head cost the whole queue)."""
        return iter(self._items)

    def _insert(self, item: Item, key: QueueKey) -> None:
        index = bisect.bisect_right(self._keys, key)
        self._keys.insert(index, key)
        self._items.insert(index, item)
        self._key_of[item] = key


class PrefixGate:
    """Which queued prompts wait for a page that a running sequence is computing."""

    def __init__(self, cache: PrefixCache, in_flight: Iterable[PageHashes]) -> None:
        """`in_flight`: per running sequence, its prompt's page hashes not yet indexed in
        `cache` (computed or being computed, not yet committed)."""
        self.cache = cache
        self.pending = {h for hashes in in_flight for h in hashes}

    def holds(self, hashes: PageHashes) -> bool:
        """The prompt's first page that is not cached is being computed by another sequence:
        admitted after that step's postprocess, the prompt hits it instead."""
        if not self.pending:
            return False
        num_cached = len(self.cache.lookup(list(hashes)))
        return num_cached < len(hashes) and hashes[num_cached] in self.pending
