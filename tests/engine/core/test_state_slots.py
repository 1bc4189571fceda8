"""A hybrid model's state slots: one per running sequence, on its state tier, taken at
admission and given back on finish or preemption; the scheduler admits by KV pages and slots."""

from __future__ import annotations

import pytest

from engine.core.sampling_params import SamplingParams
from engine.core.sequence import Request
from engine.core.state_slots import StateSlots, state_slot_capacity, state_tier
from tests.engine.core.test_scheduler import drive, make, request
from tests.engine.fakes import FakeExecutor, reference


def test_slots_are_taken_and_given_back_per_tier() -> None:
    slots = StateSlots({"gpu": 1, "cpu": 2})
    assert slots.enabled and state_tier("disk") == "cpu"
    assert slots.allocate(0, "gpu") == ("gpu", 0)
    assert not slots.can_allocate("gpu") and slots.can_allocate("disk")
    assert slots.allocate(1, "disk") == ("cpu", 0)
    slots.free(0)
    assert slots.can_allocate("gpu") and slots.num_used("gpu") == 0
    assert slots.slot_of(1) == ("cpu", 0) and slots.slot_of(0) is None
    with pytest.raises(ValueError, match="only"):
        StateSlots({"disk": 1})


def test_a_transformer_needs_no_slots() -> None:
    slots = StateSlots({})
    assert not slots.enabled and slots.can_allocate("gpu")
    assert slots.allocate(0, "gpu") is None


def test_capacity_follows_the_kv_split_and_what_fits() -> None:
    assert state_slot_capacity(8, (1.0, 0.0, 0.0), {"gpu": 100}) == {"gpu": 8, "cpu": 0}
    # disk-homed sequences keep their states in host memory
    assert state_slot_capacity(8, (0.5, 0.25, 0.25), {}) == {"gpu": 4, "cpu": 4}
    assert state_slot_capacity(8, (1.0, 0.0, 0.0), {"gpu": 3}) == {"gpu": 3, "cpu": 0}


def test_admission_waits_for_a_free_state_slot() -> None:
    """A block of 4 with KV room for all, but 2 state slots: never more than 2 run at once,
    every chunk carries its sequence's slot, and all slots are free at the end."""
    sched = make(gpu_batch_size=4, state_slots={"gpu": 2})
    requests = [request(i, length=3 + i) for i in range(5)]
    for r in requests:
        sched.add_request(r)
    fake = FakeExecutor(sched.config.page_tokens)
    execute = fake.execute
    most = 0

    def checking(plan):  # type: ignore[no-untyped-def]
        nonlocal most
        assert all(c.state_slot is not None and c.state_slot[0] == "gpu" for c in plan.chunks)
        most = max(most, len({c.state_slot for c in plan.chunks}))
        return execute(plan)

    fake.execute = checking  # type: ignore[method-assign]
    outputs = drive(sched, fake)
    assert most == 2 and sched.state_slots.num_used("gpu") == 0
    for r in requests:
        assert outputs[r.request_id].outputs[0].token_ids == reference(r.prompt_token_ids, 8)


def test_snapshots_are_found_once_their_step_ran_and_evicted_least_recently_used() -> None:
    from engine.core.kv_pages import CacheStats
    from engine.core.state_slots import StateSnapshots, snapshot_tier

    stats = CacheStats()
    snaps = StateSnapshots("cpu", 2, first=3, stats=stats)  # slots 3 and 4 after 3 running
    assert snaps.reserve(0, "a") == ("cpu", 3)
    assert snaps.find("a") is None and snaps.has("a")  # being saved: not found yet
    assert snaps.reserve(0, "a") is None  # nor saved twice
    snaps.commit(0)
    assert snaps.find("a") == ("cpu", 3) and stats.state_saves == 1
    assert snaps.reserve(1, "b") == ("cpu", 4)
    assert snaps.reserve(1, "c") == ("cpu", 3)  # "a" was the least recently used
    assert stats.state_evictions == 1 and snaps.find("a") is None
    assert snaps.reserve(1, "d") is None  # every slot is being saved into
    snaps.cancel(1)  # the step failed: nothing it saved is found, its slots are free again
    assert not snaps.has("b") and snaps.find("c") is None and len(snaps) == 0
    assert {snaps.reserve(2, "e"), snaps.reserve(2, "f")} == {("cpu", 3), ("cpu", 4)}
    assert not StateSnapshots("cpu", 0, first=0).enabled
    # host memory when it has room beyond the running states, else the compute device's
    assert snapshot_tier({"gpu": 9, "cpu": 5}, {"gpu": 2, "cpu": 4}) == "cpu"
    assert snapshot_tier({"gpu": 9, "cpu": 0}, {"gpu": 2, "cpu": 0}) == "gpu"


def test_slot_runs_cover_every_sequence_once() -> None:
    """A host pool is copied by runs of consecutive slots at consecutive positions: each
    (slot, position) pair falls in exactly one run, in order."""
    from engine.executor.gpu_batch import slot_runs

    assert slot_runs([4, 5, 6, 0, 2, 3], [0, 1, 2, 3, 5, 6]) == [(4, 0, 3), (0, 3, 1), (2, 5, 2)]
    assert slot_runs([3, 2], [0, 1]) == [(3, 0, 1), (2, 1, 1)]  # descending slots: apart
    assert slot_runs([], []) == []


def test_a_failed_step_saves_no_state_and_the_next_request_saves_it_again() -> None:
    """Scheduler bookkeeping of a hybrid's prefix cache: the second request with a cached
    prefix reserves a save in its first chunk, cut where the cached KV ends; when that step
    fails, the reservation is given back (nothing found, the slot free), and the request,
    recomputed, saves the state again; the third request then hits it."""
    from engine.core.protocol import StepFailure

    sched = make(
        gpu_batch_size=1,
        state_slots={"gpu": 1},
        state_snapshots={"gpu": 1},
        enable_prefix_caching=True,
        page_tokens=4,
    )
    shared = list(range(100, 112))  # three full pages
    fake = FakeExecutor(4)
    first = Request("a", [*shared, 1, 2], SamplingParams(max_tokens=2))
    sched.add_request(first)
    while sched.has_unfinished():
        plan = sched.schedule()
        assert plan is not None
        sched.postprocess(plan, fake.execute(plan))
    sched.add_request(Request("b", [*shared, 3], SamplingParams(max_tokens=2)))
    plan = sched.schedule()
    assert plan is not None
    (chunk,) = plan.chunks
    assert (chunk.start_pos, len(chunk.token_ids)) == (0, 12) and chunk.state_save == ("gpu", 1)
    fake.execute(plan)  # it ran, then its storage failed: nothing it did counts
    sched.recover(plan, StepFailure("EIO", "disk", [chunk.seq_id]))
    assert not sched.snapshots.has(sched.page_manager.cache.hash_of(("gpu", 2)) or "")
    saves = []
    while sched.has_unfinished():
        plan = sched.schedule()
        assert plan is not None
        saves += [c.state_save for c in plan.chunks if c.state_save is not None]
        sched.postprocess(plan, fake.execute(plan))
    assert saves == [("gpu", 1)] and sched.page_manager.stats.state_saves == 1
    sched.add_request(Request("c", [*shared, 4, 5], SamplingParams(max_tokens=2)))
    plan = sched.schedule()
    assert plan is not None
    (chunk,) = plan.chunks
    assert chunk.start_pos == 12 and chunk.state_restore == ("gpu", 1)
    assert sched.page_manager.stats.state_hits == 1
