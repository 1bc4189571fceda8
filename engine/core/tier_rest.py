"""`TierRest`: the KV tiers that rest after their storage failed in a step, until when, and
why; and how many tokens a tier's KV pool holds (torch-free)."""

from __future__ import annotations

import time
from collections.abc import Callable

from policy import TIERS


class TierRest:
    """Tier -> until when it takes no new KV (no sequence homed there, no spill, no hit read
    there) after a step failed on its storage. Written by the scheduler's thread, read from
    any (the daemon's event loop asks whether requests can run): readers take a copy."""

    def __init__(self, retry_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.retry_s, self.clock = retry_s, clock
        self._until: dict[str, float] = {}
        self.num_faults = 0
        """Steps that failed on their storage so far."""
        self.last_fault = ""
        """What the last one said."""

    def fault(self, tier: str, message: str) -> None:
        """A step failed on `tier`'s storage: it rests for `retry_s` from now."""
        self.num_faults += 1
        self.last_fault = message
        self._until[tier] = self.clock() + self.retry_s

    def tiers(self) -> set[str]:
        """The tiers resting now."""
        now = self.clock()
        return {t for t, until in dict(self._until).items() if until > now}

    def left(self) -> float:
        """Seconds until the last resting tier may be tried again (0: none rests)."""
        now = self.clock()
        return max([until - now for until in dict(self._until).values()] + [0.0])


def pool_tokens(capacity_pages: int | None, page_tokens: int) -> int:
    """Tokens a KV pool of `capacity_pages` holds (None: unbounded)."""
    return 1 << 62 if capacity_pages is None else capacity_pages * page_tokens


def largest_pool_tokens(
    capacity_pages: dict[str, int | None], kv_frac: tuple[float, ...], page_tokens: int
) -> int:
    """Tokens the largest KV pool that `kv_frac` homes sequences on holds: the longest
    sequence the engine can keep in KV."""
    return max(
        pool_tokens(capacity_pages.get(t), page_tokens)
        for t, f in zip(TIERS, kv_frac, strict=True)
        if f > 0
    )
