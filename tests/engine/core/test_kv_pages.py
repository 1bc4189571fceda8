"""PageManager: allocation, reuse, capacity, projected peak, tier picking."""

from __future__ import annotations

import random

import pytest

from engine.core.kv_pages import KVCapacityError, PageCopy, PageManager, pick_tier


def test_append_allocates_pages_as_tokens_cross_boundaries() -> None:
    pages = PageManager(4, {"gpu": 10})
    assert pages.append(0, 5, "gpu") == [("gpu", 0), ("gpu", 1)]
    assert pages.append(0, 3) == []  # 8 tokens still fit 2 pages
    assert pages.append(0, 1) == [("gpu", 2)]
    assert pages.page_table(0) == [("gpu", 0), ("gpu", 1), ("gpu", 2)]
    assert pages.num_tokens(0) == 9
    assert pages.tier_of(0) == "gpu"
    assert pages.num_used_pages("gpu") == 3
    assert pages.num_free_pages("gpu") == 7


def test_forked_sequences_copy_a_shared_partial_page_on_first_write() -> None:
    """Two choices fork a 6-token prompt (a full page and a half page): the full page is never
    copied, each writer of the half page copies it while another holds it, the last holder
    writes in place, and the room for the copy is counted before it is made."""
    pages = PageManager(4, {"gpu": 4})
    prompt = pages.append(0, 6, "gpu")
    assert pages.fork(0, 1) == pages.fork(0, 2) == prompt
    assert pages.num_used_pages("gpu") == 2
    assert pages.can_append(1, 1) and pages.append(1, 1) == []  # 7 tokens: still 2 pages
    assert pages.take_copies() == [PageCopy(1, 1, ("gpu", 1), ("gpu", 2))]
    assert pages.append(1, 1) == [] and pages.take_copies() == []  # its own page now
    pages.append(0, 1)
    assert pages.take_copies() == [PageCopy(0, 1, ("gpu", 1), ("gpu", 3))]
    assert not pages.can_append(2, 3)  # a third page: the pool is full
    pages.free(0)
    assert pages.can_append(2, 1)
    pages.append(2, 1)
    assert pages.take_copies() == []  # the last holder writes in place
    assert pages.page_table(2) == prompt
    for seq_id in (1, 2):
        pages.free(seq_id)
    assert pages.num_used_pages("gpu") == 0
    full = PageManager(4, {"gpu": 2})
    full.append(0, 6, "gpu")
    full.fork(0, 1)
    assert not full.can_append(1, 1)  # its 7th token fits its pages, but needs the copy


def test_free_returns_pages_for_reuse() -> None:
    pages = PageManager(4, {"gpu": 3})
    pages.append(0, 8, "gpu")
    pages.free(0)
    assert 0 not in pages
    assert pages.num_used_pages("gpu") == 0
    assert sorted(pages.append(1, 12, "gpu")) == [("gpu", 0), ("gpu", 1), ("gpu", 2)]
    pages.free(99)  # unknown: no-op


def test_capacity_is_enforced_per_tier() -> None:
    pages = PageManager(4, {"gpu": 2, "cpu": None})
    pages.append(0, 8, "gpu")
    assert not pages.can_append(0, 1)
    assert not pages.can_append(1, 1, "gpu")
    assert pages.can_append(1, 1000, "cpu")  # unbounded
    assert pages.num_free_pages("cpu") is None
    with pytest.raises(KVCapacityError):
        pages.append(0, 1)
    with pytest.raises(ValueError):
        pages.append(2, 1)  # a new sequence needs a tier


def exact_peak(lengths: list[tuple[int, int]], page_tokens: int) -> int:
    horizon = max((r for _, r in lengths), default=0)
    return max(
        sum(-(-(now + t) // page_tokens) for now, r in lengths if r >= t)
        for t in range(horizon + 1)
    )


def test_projected_peak_bounds_the_exact_peak() -> None:
    rng = random.Random(0)
    pages = PageManager(4, {})
    for _ in range(200):
        lengths = [(rng.randint(1, 30), rng.randint(0, 20)) for _ in range(rng.randint(1, 6))]
        bound, exact = pages.projected_peak_pages(lengths), exact_peak(lengths, 4)
        assert exact <= bound <= exact + len(lengths)


def simulated_peak(lengths: list[tuple[int, int]], page_tokens: int) -> int:
    """Run the sequences through a real PageManager: each holds `now` tokens, appends one
    token per step for `to_come` steps, then frees everything. The most pages ever in use."""
    pages = PageManager(page_tokens, {})
    for seq_id, (now, _) in enumerate(lengths):
        pages.append(seq_id, now, "gpu")
    peak = pages.num_used_pages("gpu")
    for t in range(1, max((r for _, r in lengths), default=0) + 1):
        for seq_id, (_, to_come) in enumerate(lengths):
            if to_come == t - 1:
                pages.free(seq_id)  # it ended after its last token
            elif to_come >= t:
                pages.append(seq_id, 1)
        peak = max(peak, pages.num_used_pages("gpu"))
    return peak


def test_projected_peak_bounds_a_simulated_run() -> None:
    """The projection is never below what a real run holds, and at most one page per
    sequence above it; sequences that end early stop counting (not every one to the end)."""
    rng = random.Random(1)
    manager = PageManager(4, {})
    for _ in range(200):
        lengths = [(rng.randint(1, 30), rng.randint(0, 20)) for _ in range(rng.randint(1, 6))]
        peak = simulated_peak(lengths, 4)
        assert peak <= manager.projected_peak_pages(lengths) <= peak + len(lengths)
    # a long sequence ending now next to a short one that runs long: the peak is the short
    # one's end alone (26 pages), not that plus the long one's 10
    lengths = [(4, 100), (40, 0)]
    assert simulated_peak(lengths, 4) == 26 <= manager.projected_peak_pages(lengths) < 26 + 2
    assert manager.projected_peak_pages([]) == 0


def test_pick_tier_follows_fractions() -> None:
    counts = {"gpu": 0, "cpu": 0, "disk": 0}
    for _ in range(8):
        counts[pick_tier((0.25, 0.5, 0.25), counts)] += 1
    assert counts == {"gpu": 2, "cpu": 4, "disk": 2}
    assert pick_tier((0.0, 1.0, 0.0), {"gpu": 0, "cpu": 5, "disk": 0}) == "cpu"
