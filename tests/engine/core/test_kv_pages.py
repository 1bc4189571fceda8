"""PageManager: allocation, reuse, capacity, projected peak, tier picking."""

from __future__ import annotations

import random

import pytest

from engine.core.kv_pages import KVCapacityError, PageManager, pick_tier


def test_append_allocates_blocks_as_tokens_cross_boundaries() -> None:
    bm = PageManager(4, {"gpu": 10})
    assert bm.append(0, 5, "gpu") == [0, 1]
    assert bm.append(0, 3) == []  # 8 tokens still fit 2 blocks
    assert bm.append(0, 1) == [2]
    assert bm.page_table(0) == [0, 1, 2]
    assert bm.num_tokens(0) == 9
    assert bm.tier_of(0) == "gpu"
    assert bm.num_used_pages("gpu") == 3
    assert bm.num_free_pages("gpu") == 7


def test_free_returns_blocks_for_reuse() -> None:
    bm = PageManager(4, {"gpu": 3})
    bm.append(0, 8, "gpu")
    bm.free(0)
    assert 0 not in bm
    assert bm.num_used_pages("gpu") == 0
    assert sorted(bm.append(1, 12, "gpu")) == [0, 1, 2]
    bm.free(99)  # unknown: no-op


def test_capacity_is_enforced_per_tier() -> None:
    bm = PageManager(4, {"gpu": 2, "cpu": None})
    bm.append(0, 8, "gpu")
    assert not bm.can_append(0, 1)
    assert not bm.can_append(1, 1, "gpu")
    assert bm.can_append(1, 1000, "cpu")  # unbounded
    assert bm.num_free_pages("cpu") is None
    with pytest.raises(KVCapacityError):
        bm.append(0, 1)
    with pytest.raises(ValueError):
        bm.append(2, 1)  # a new sequence needs a tier


def exact_peak(lengths: list[tuple[int, int]], page_tokens: int) -> int:
    horizon = max((r for _, r in lengths), default=0)
    return max(
        sum(-(-(now + t) // page_tokens) for now, r in lengths if r >= t)
        for t in range(horizon + 1)
    )


def test_projected_peak_bounds_the_exact_peak() -> None:
    rng = random.Random(0)
    bm = PageManager(4, {})
    for _ in range(200):
        lengths = [(rng.randint(1, 30), rng.randint(0, 20)) for _ in range(rng.randint(1, 6))]
        bound, exact = bm.projected_peak_pages(lengths), exact_peak(lengths, 4)
        assert exact <= bound <= exact + len(lengths)


def test_projected_peak_counts_only_live_sequences() -> None:
    bm = PageManager(4, {})
    # One long-lived sequence and one that ends now: the peak is the long one at its end.
    assert bm.projected_peak_pages([(4, 12), (40, 0)]) == (4 + 40 + 2 * 3) // 4
    assert bm.projected_peak_pages([(4, 100), (40, 0)]) == (104 + 3) // 4
    assert bm.projected_peak_pages([]) == 0


def test_pick_tier_follows_fractions() -> None:
    counts = {"gpu": 0, "cpu": 0, "disk": 0}
    for _ in range(8):
        counts[pick_tier((0.25, 0.5, 0.25), counts)] += 1
    assert counts == {"gpu": 2, "cpu": 4, "disk": 2}
    assert pick_tier((0.0, 1.0, 0.0), {"gpu": 0, "cpu": 5, "disk": 0}) == "cpu"
