"""Steps the executor cannot run (its offload storage failed, a cached page failed its check),
on the torch-free scheduler and step loop with the strict fake executor: nothing of a failed
step counts, its sequences are recomputed to the same tokens, a tier that keeps failing rests
and then fails its requests with a retryable error, and the other requests go on."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from engine.core.outputs import RequestOutput
from engine.core.protocol import StepFailure, StepPlan, StepResult
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler
from engine.core.scheduler_config import SchedulerConfig
from engine.core.sequence import Request
from engine.core.step_loop import StepLoop
from policy import TIERS
from tests.engine.fakes import VOCAB, FakeDetokenizer, FakeExecutor

Decide = Callable[[StepPlan], StepFailure | None]


class FaultyExecutor(FakeExecutor):
    """Runs every plan as the fake does (its writes land, as a real step's partly do), then
    reports the failure `decide` returns for it, if any, instead of the tokens."""

    def __init__(self, page_tokens: int, decide: Decide) -> None:
        super().__init__(page_tokens)
        self.decide = decide
        self.failed: list[StepPlan] = []

    def execute(self, plan: StepPlan) -> StepResult:
        result = super().execute(plan)
        failure = self.decide(plan) if plan.chunks else None
        if failure is None:
            return result
        self.failed.append(plan)
        assert len(self.failed) < 200, "the same failure again and again: recovery loops"
        return StepResult(plan.step_id, [], [], [], failure=failure)


def disk_users(plan: StepPlan) -> list[int]:
    return [c.seq_id for c in plan.chunks if c.kv_tier == "disk"]


def every(n: int) -> Decide:
    """Fail every n-th step that has a disk-homed sequence in it."""
    count = [0]

    def decide(plan: StepPlan) -> StepFailure | None:
        users = disk_users(plan)
        if not users:
            return None
        count[0] += 1
        return StepFailure("disk full", "disk", users) if count[0] % n == 0 else None

    return decide


def requests(num: int = 8, max_tokens: int = 12) -> list[Request]:
    return [
        Request(
            f"r{i}",
            [(i * 13 + j * 5 + 1) % VOCAB for j in range(5 + 9 * i)],
            SamplingParams(max_tokens=max_tokens, seed=i, ignore_eos=True),
        )
        for i in range(num)
    ]


def run(
    decide: Decide | None, async_scheduling: bool, **config: object
) -> tuple[list[RequestOutput], StepLoop, FakeExecutor]:
    settings = {
        "gpu_batch_size": 3,
        "num_gpu_batches": 2,
        "max_step_tokens": 32,
        "page_tokens": 4,
        "offload_retry_s": 0.0,
        "max_offload_faults": 1000,
        **config,
    }
    scheduler = Scheduler(SchedulerConfig(**settings), FakeDetokenizer())  # type: ignore[arg-type]
    fake = FakeExecutor(4) if decide is None else FaultyExecutor(4, decide)
    core = StepLoop(scheduler, fake, async_scheduling=async_scheduling)
    outputs = core.generate(requests())
    core.close()
    return outputs, core, fake


def texts(outputs: list[RequestOutput]) -> list[tuple[list[int], str | None]]:
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outputs]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("caching", [False, True], ids=["no-cache", "cache"])
def test_failed_steps_are_recomputed_to_the_same_tokens(
    async_scheduling: bool, caching: bool
) -> None:
    """Every third step with disk-homed KV fails on its storage, with half the sequences on
    the gpu tier: all outputs equal the clean run's, nothing is held afterwards, and the
    plans after a failure free exactly what the fake executor knows."""
    config = {"kv_frac": (0.5, 0.0, 0.5), "enable_prefix_caching": caching}
    clean, _, _ = run(None, async_scheduling, **config)
    faulty, core, fake = run(every(3), async_scheduling, **config)
    assert isinstance(fake, FaultyExecutor) and len(fake.failed) >= 3
    assert texts(faulty) == texts(clean)
    assert all(o.outputs[0].finish_reason == "length" for o in faulty)
    scheduler = core.scheduler
    assert scheduler.rest.num_faults == len(fake.failed)
    assert scheduler.num_preemptions == 0  # a recovery is not a preemption
    assert all(scheduler.page_manager.num_used_pages(t) == 0 for t in TIERS)
    # every sequence the executor saw was freed (the last ones with the next plan), none twice
    assert set(fake.tables) == set(scheduler._freed_seq_ids)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_failed_forks_and_page_copies_are_recomputed_to_the_same_tokens(
    async_scheduling: bool,
) -> None:
    """n = 3 choices fork their prompt: the first step that forks and the first that copies a
    shared partial page fail; the forks are dropped (still queued) and the outputs equal the
    clean run's, with nothing held afterwards."""

    def outputs(decide: Decide | None) -> tuple[list[list[list[int]]], Scheduler, FakeExecutor]:
        config = SchedulerConfig(
            page_tokens=4, max_step_tokens=32, enable_prefix_caching=True, offload_retry_s=0.0
        )
        scheduler = Scheduler(config, FakeDetokenizer())
        fake = FakeExecutor(4) if decide is None else FaultyExecutor(4, decide)
        core = StepLoop(scheduler, fake, async_scheduling=async_scheduling)
        sampling = [SamplingParams(n=3, max_tokens=6, seed=i, ignore_eos=True) for i in range(3)]
        prompts = [[(i * 7 + j * 3 + 1) % VOCAB for j in range(6 + 5 * i)] for i in range(3)]
        done = core.generate(Request(f"r{i}", p, sampling[i]) for i, p in enumerate(prompts))
        core.close()
        return [[c.token_ids for c in o.outputs] for o in done], scheduler, fake

    failed_kinds: set[str] = set()

    def decide(plan: StepPlan) -> StepFailure | None:
        kinds = {"fork"} if any(c.forked_from is not None for c in plan.chunks) else set()
        kinds |= {"copy"} if plan.page_copies else set()
        if kinds <= failed_kinds:
            return None
        failed_kinds.update(kinds)
        return StepFailure(f"a failed {' and '.join(sorted(kinds))}")

    clean, _, clean_fake = outputs(None)
    assert any(c.forked_from is not None for plan in clean_fake.plans for c in plan.chunks)
    faulty, scheduler, fake = outputs(decide)
    assert failed_kinds == {"fork", "copy"}
    assert faulty == clean
    assert all(scheduler.page_manager.num_used_pages(t) == 0 for t in TIERS)
    assert set(fake.tables) == set(scheduler._freed_seq_ids)


def test_a_tier_that_keeps_failing_rests_then_fails_its_requests_retryably() -> None:
    """All KV on disk and every disk step failing: each request is tried twice (the tier
    rests in between, so no step runs meanwhile), then ends with a retryable error and no
    tokens; once the disk works again the same requests are served as in a clean run."""
    broken = [True]

    def decide(plan: StepPlan) -> StepFailure | None:
        return StepFailure("disk full", "disk", disk_users(plan)) if broken[0] else None

    config = {"kv_frac": (0.0, 0.0, 1.0), "offload_retry_s": 0.02, "max_offload_faults": 2}
    outputs, core, _ = run(decide, False, **config)
    assert all(o.outputs[0].finish_reason == "error" for o in outputs)
    assert all("offload storage failed (disk full)" in (o.outputs[0].error or "") for o in outputs)
    assert all(not o.outputs[0].token_ids for o in outputs)
    scheduler = core.scheduler
    assert not scheduler.requests and not scheduler.has_unfinished()
    assert all(scheduler.page_manager.num_used_pages(t) == 0 for t in TIERS)
    broken[0] = False
    again = core.generate(requests())
    clean, _, _ = run(None, False, **config)
    assert texts(again) == texts(clean)


def test_a_request_failed_by_storage_says_retryable_in_its_delta() -> None:
    scheduler = Scheduler(
        SchedulerConfig(kv_frac=(0.0, 0.0, 1.0), page_tokens=4, max_offload_faults=1),
        FakeDetokenizer(),
    )
    scheduler.add_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=3)))
    plan = scheduler.schedule()
    assert plan is not None
    deltas = scheduler.recover(plan, StepFailure("EIO", "disk", [plan.chunks[0].seq_id]))
    assert [(d.request_id, d.finish_reason, d.retryable) for d in deltas] == [("a", "error", True)]
    assert scheduler.rest.tiers() == {"disk"} and scheduler.is_blocked_by_storage()
    assert scheduler.schedule() is None  # the only tier rests: nothing is admitted meanwhile


def test_a_resting_tier_takes_no_new_kv_and_the_others_go_on() -> None:
    """With gpu and disk allowed, a disk fault sends new sequences to the gpu tier until the
    disk is tried again; the scheduler is not blocked."""
    scheduler = Scheduler(
        SchedulerConfig(kv_frac=(0.5, 0.0, 0.5), page_tokens=4, offload_retry_s=60.0),
        FakeDetokenizer(),
    )
    for i in range(4):
        scheduler.add_request(Request(f"r{i}", [1, 2, 3, i], SamplingParams(max_tokens=3)))
    plan = scheduler.schedule()
    assert plan is not None and {c.kv_tier for c in plan.chunks} == {"gpu", "disk"}
    scheduler.recover(plan, StepFailure("disk full", "disk", disk_users(plan)))
    assert not scheduler.is_blocked_by_storage()
    again = scheduler.schedule()
    assert again is not None and {c.kv_tier for c in again.chunks} == {"gpu"}
    assert set(again.freed_seq_ids) == {c.seq_id for c in plan.chunks}


def test_cached_pages_that_fail_their_check_are_dropped_and_recomputed() -> None:
    """A prompt's pages cached on disk; the next request sharing them reads them in place
    (`disk_hits`), the executor finds them bad: they leave the cache, the request is
    recomputed without them (no cached tokens claimed), and its tokens are right."""
    prompt = [(7 * j + 3) % VOCAB for j in range(14)]  # 3 full pages of 4

    def decide(plan: StepPlan) -> StepFailure | None:
        if not plan.disk_hits:
            return None
        return StepFailure("bad pages", None, [], [page for page, _ in plan.disk_hits])

    config = SchedulerConfig(
        kv_frac=(0.0, 0.0, 1.0), page_tokens=4, enable_prefix_caching=True, gpu_batch_size=2
    )
    scheduler = Scheduler(config, FakeDetokenizer())
    fake = FaultyExecutor(4, decide)
    core = StepLoop(scheduler, fake)
    params = SamplingParams(max_tokens=5, seed=1, ignore_eos=True)
    first = core.generate([Request("a", prompt, params)])[0]
    second = core.generate([Request("b", prompt, params)])[0]
    assert len(fake.failed) == 1 and len(fake.failed[0].disk_hits) == 3
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    assert second.num_cached_tokens == 0
    stats = scheduler.page_manager.stats
    assert stats.failed_pages == 3 and scheduler.rest.num_faults == 0
    assert not scheduler.rest.tiers()  # a bad page is a miss, not a storage fault
