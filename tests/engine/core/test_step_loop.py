"""StepLoop: sync vs async (one-step lag), deltas, generate (the n fan-out), abort, `submit`."""

from __future__ import annotations

import contextlib
import itertools
import random
from concurrent.futures import Future

import pytest

from engine.core.outputs import RequestOutput
from engine.core.parent_request import ParentRequest
from engine.core.protocol import PENDING_TOKEN_ID, StepPlan, StepResult
from engine.core.request_checks import RequestError
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler
from engine.core.scheduler_config import SchedulerConfig
from engine.core.sequence import BATCH_PRIORITY, ONLINE_PRIORITY, Request
from engine.core.step_loop import StepLoop
from policy import TIERS
from tests.engine.fakes import VOCAB, FakeDetokenizer, FakeExecutor, Outputs, reference

EOS = 3


def workload() -> list[Request]:
    """Mixed requests: EOS stops, stop strings, stop ids, n > 1, long prompts, priorities."""
    requests = []
    for i in range(12):
        sampling = SamplingParams(
            max_tokens=4 + (i * 5) % 17,
            seed=i,
            n=2 if i % 5 == 0 else 1,
            stop=("q",) if i % 3 == 0 else (),
            stop_token_ids=(7,) if i % 4 == 1 else (),
            ignore_eos=i % 6 == 2,
            logprobs=1 if i % 2 else None,
        )
        prompt = [(i * 11 + j * 3 + 1) % VOCAB for j in range(3 + (i * 7) % 23)]
        priority = ONLINE_PRIORITY if i % 4 == 3 else BATCH_PRIORITY
        requests.append(Request(f"r{i}", prompt, sampling, priority))
    return requests


def make_core(async_scheduling: bool, **config: object) -> tuple[StepLoop, FakeExecutor]:
    config = {"gpu_batch_size": 3, "num_gpu_batches": 2, "max_step_tokens": 32, **config}
    scheduler = Scheduler(SchedulerConfig(eos_token_ids=(EOS,), **config), FakeDetokenizer())  # type: ignore[arg-type]
    fake = FakeExecutor(scheduler.config.page_tokens)
    return StepLoop(scheduler, fake, async_scheduling=async_scheduling), fake


def summary(outputs: list[RequestOutput]) -> list[tuple]:
    return [
        (o.request_id, c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason)
        for o in outputs
        for c in o.outputs
    ]


def assert_nothing_after_stop(outputs: list[RequestOutput]) -> None:
    for out in outputs:
        for choice in out.outputs:
            tokens = choice.token_ids
            if choice.finish_reason == "stop" and choice.stop_reason is None:
                assert tokens[-1] == EOS and EOS not in tokens[:-1]
            if isinstance(choice.stop_reason, int):
                assert tokens[-1] == choice.stop_reason
                assert choice.stop_reason not in tokens[:-1]
            if isinstance(choice.stop_reason, str):
                assert choice.stop_reason not in choice.text


@pytest.mark.parametrize(
    "config",
    [{}, {"page_tokens": 4, "kv_capacity_pages": {"gpu": 14}, "expected_gen_tokens": 2}],
    ids=["roomy", "preempting"],
)
def test_async_and_sync_give_identical_outputs(config: dict) -> None:
    results = {}
    for async_scheduling in (False, True):
        core, fake = make_core(async_scheduling, **config)
        outputs = core.generate(workload())
        core.close()
        assert [o.request_id for o in outputs] == [r.request_id for r in workload()]
        assert all(o.finished for o in outputs)
        assert_nothing_after_stop(outputs)
        bm = core.scheduler.page_manager
        assert all(bm.num_used_pages(t) == 0 for t in TIERS)
        returned = sum(len(c.token_ids) for o in outputs for c in o.outputs)
        sampled = sum(c.do_sample for p in fake.plans for c in p.chunks)
        # Sync samples exactly what it returns; async samples a few past a stop and drops them.
        assert sampled > returned if async_scheduling else sampled == returned
        starts = [c.seq_id for p in fake.plans for c in p.chunks if c.start_pos == 0]
        assert (len(starts) > len(set(starts))) == ("expected_gen_tokens" in config)
        results[async_scheduling] = summary(outputs)
    assert results[True] == results[False]
    assert len([s for s in results[False] if s[4] == "stop"]) >= 3, "exercise stops"


def test_async_plans_one_step_ahead_and_discards_the_extra_token() -> None:
    tokens = reference([1, 2, 3], 10)
    stop_id = tokens[4]
    cut = tokens.index(stop_id) + 1
    sampling = SamplingParams(max_tokens=10, stop_token_ids=(stop_id,))
    core, fake = make_core(True)
    out = core.generate([Request("a", [1, 2, 3], sampling)])[0].outputs[0]
    core.close()
    assert out.token_ids == tokens[:cut] and out.finish_reason == "stop"
    # The engine ran one decode past the stop (built before the stop was seen).
    runs = [c for p in fake.plans for c in p.chunks if c.seq_id == 0]
    assert len(runs) == cut + 1
    assert core.scheduler.page_manager.num_used_pages("gpu") == 0


def test_async_fills_pending_tokens_before_the_engine_sees_them() -> None:
    scheduler = Scheduler(SchedulerConfig())
    scheduler.add_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=4)))
    first = scheduler.schedule()
    ahead = scheduler.schedule()  # built before `first` ran
    assert first is not None and ahead is not None
    assert ahead.chunks[0].token_ids == [PENDING_TOKEN_ID] and ahead.has_pending_tokens
    assert ahead.chunks[0].start_pos == 3 and ahead.chunks[0].num_sampled == 1
    fake = FakeExecutor()
    result = fake.execute(first)
    ahead.fill_pending_tokens(result)
    assert ahead.chunks[0].token_ids == result.token_ids
    assert scheduler.postprocess(first, result)[0].new_token_ids == result.token_ids


def test_deltas_add_up_to_the_outputs_and_finish_once() -> None:
    requests = [r for r in workload()[:6] if r.sampling.n == 1]
    expected = {o.request_id: o.outputs[0] for o in make_core(True)[0].generate(requests)}
    core, _ = make_core(True)
    for request in requests:
        core.add_request(request)
    seen: dict[str, list[list[int]]] = {}
    texts: dict[str, str] = {}
    finished: list[str] = []
    for delta in core.iter_deltas():
        assert delta.request_id not in finished, "a delta after the last one"
        assert len(delta.new_token_ids) == 1  # one token per step, stop tokens included
        seen.setdefault(delta.request_id, []).append(delta.new_token_ids)
        texts[delta.request_id] = texts.get(delta.request_id, "") + delta.new_text
        if delta.finished:
            finished.append(delta.request_id)
    core.close()
    assert sorted(finished) == sorted(seen) == sorted(expected)
    for request_id, pieces in seen.items():
        assert list(itertools.chain(*pieces)) == expected[request_id].token_ids
        assert texts[request_id] == expected[request_id].text


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_abort_mid_run(async_scheduling: bool) -> None:
    core, _ = make_core(async_scheduling)
    sampling = SamplingParams(max_tokens=30, ignore_eos=True)
    outputs = Outputs(core.scheduler)
    for i in range(3):
        core.add_request(Request(f"r{i}", [i + 1, 5, 6], sampling))
    outputs.track()
    for _ in range(4):
        outputs.add(core.step())
    aborted = core.abort("r1")
    assert aborted is not None and aborted.finished
    assert aborted.finish_reason == "abort"
    for delta in core.iter_deltas():
        assert delta.request_id != "r1"
        outputs.add([delta])
    core.close()
    rest = [o for o in outputs.final().values() if o.request_id != "r1"]
    assert sorted(o.request_id for o in rest) == ["r0", "r2"]
    assert all(o.outputs[0].token_ids == reference(o.prompt_token_ids, 30) for o in rest)
    assert core.scheduler.page_manager.num_used_pages("gpu") == 0
    assert not core.has_unfinished()


class SubmittingExecutor(FakeExecutor):
    """An executor with its own `submit` (here it simply runs the step at once)."""

    submitted: int = 0

    def submit(self, plan: StepPlan) -> Future[StepResult]:
        self.submitted += 1
        future: Future[StepResult] = Future()
        future.set_result(self.execute(plan))
        return future


def test_executor_submit_is_used_in_async_mode() -> None:
    scheduler = Scheduler(SchedulerConfig())
    executor = SubmittingExecutor()
    core = StepLoop(scheduler, executor, async_scheduling=True)
    out = core.generate([Request("a", [4, 5], SamplingParams(max_tokens=5))])[0]
    assert out.outputs[0].token_ids == reference([4, 5], 5)
    assert executor.submitted == len(executor.plans) > 0


def test_add_request_errors_surface_from_core() -> None:
    core, _ = make_core(False)
    with pytest.raises(RequestError):
        core.add_request(Request("x", [], SamplingParams()))
    assert core.abort("missing") is None
    assert list(core.iter_deltas()) == []
    with pytest.raises(RequestError):  # one request that cannot run: none of them runs
        core.generate(
            [Request("ok", [1, 2], SamplingParams(n=2)), Request("y", [], SamplingParams())]
        )
    assert not core.has_unfinished()


def random_run(seed: int, async_scheduling: bool) -> list[tuple]:
    """A random config and workload; checks every choice against the fake model."""
    rng = random.Random(seed)
    page_tokens = rng.choice([1, 4, 16])
    config = SchedulerConfig(
        gpu_batch_size=rng.randint(1, 4),
        num_gpu_batches=rng.randint(1, 3),
        kv_frac=rng.choice([(1.0, 0.0, 0.0), (0.5, 0.5, 0.0), (0.2, 0.3, 0.5)]),
        page_tokens=page_tokens,
        kv_capacity_pages={t: rng.choice([None, rng.randint(2, 30)]) for t in TIERS},
        max_step_tokens=rng.choice([16, 64]),
        eos_token_ids=(rng.randrange(VOCAB),),
        max_model_len=rng.choice([24, 2048]),
        expected_gen_tokens=rng.choice([None, 1, 3]),
    )
    scheduler = Scheduler(config, FakeDetokenizer())
    core = StepLoop(scheduler, FakeExecutor(page_tokens), async_scheduling)
    requests, parents = {}, {}
    for i in range(rng.randint(1, 12)):
        sampling = SamplingParams(
            max_tokens=rng.randint(1, 20),
            seed=rng.randint(0, 5),
            n=rng.randint(1, 3),
            stop=tuple(rng.sample(["ab", "c", "xyz"], rng.randint(0, 2))),
            ignore_eos=rng.random() < 0.3,
        )
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 30))]
        request = Request(f"r{i}", prompt, sampling, rng.randint(0, 1))
        parent = ParentRequest(request)
        with contextlib.suppress(RequestError):  # prompts beyond the context or every pool
            for child in parent.children:
                core.add_request(child)
                parents[child.request_id] = parent
            requests[request.request_id] = request
    for delta in core.iter_deltas():
        parents[delta.request_id].add(delta)
    outputs = [p.output() for p in {id(p): p for p in parents.values()}.values()]
    core.close()
    assert sorted(o.request_id for o in outputs) == sorted(requests)
    assert all(scheduler.page_manager.num_used_pages(t) == 0 for t in TIERS)
    for out in outputs:
        request = requests[out.request_id]
        assert request.sampling.seed is not None
        for choice in out.outputs:
            seed = request.sampling.seed + choice.index
            assert choice.token_ids == reference(out.prompt_token_ids, len(choice.token_ids), seed)
            assert choice.finish_reason in ("stop", "length")
    return sorted(summary(outputs))


@pytest.mark.parametrize("seed", range(40))
def test_random_workloads_never_stall_and_sync_equals_async(seed: int) -> None:
    assert random_run(seed, False) == random_run(seed, True)
