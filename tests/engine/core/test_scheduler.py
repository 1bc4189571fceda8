"""Scheduler: refill, chunked prefill, discrete sizes, admission, preemption, priorities, stops."""

from __future__ import annotations

import pytest

from base.errors import UserError
from engine.core.detokenizer import Detokenizer
from engine.core.outputs import RequestOutput
from engine.core.parent_request import ParentRequest
from engine.core.protocol import StepPlan, StepResult, TokenLogprobs
from engine.core.request_checks import PromptTooLongError, RequestError
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import EngineProtocolError, Scheduler
from engine.core.scheduler_config import SchedulerConfig, SchedulerConfigError
from engine.core.sequence import BATCH_PRIORITY, ONLINE_PRIORITY, Request
from policy import TIERS, Policy
from tests.engine.fakes import VOCAB, FakeDetokenizer, FakeExecutor, Outputs, reference


def prompt(i: int, length: int = 5) -> list[int]:
    return [(i * 13 + j * 7 + 1) % VOCAB for j in range(length)]


def request(
    i: int, length: int = 5, priority: int = ONLINE_PRIORITY, **sampling: object
) -> Request:
    sp = SamplingParams(**{"max_tokens": 8, **sampling})  # type: ignore[arg-type]
    return Request(f"r{i}", prompt(i, length), sp, priority)


def make(detokenizer: Detokenizer | None = None, **config: object) -> Scheduler:
    return Scheduler(SchedulerConfig(**config), detokenizer)  # type: ignore[arg-type]


def drive(
    sched: Scheduler, fake: FakeExecutor | None = None, outputs: Outputs | None = None
) -> dict[str, RequestOutput]:
    """Synchronous loop; returns the final output of each request that finished (its deltas
    added up, from `outputs` on if given)."""
    fake = fake or FakeExecutor(sched.config.page_tokens)
    outputs = outputs or Outputs(sched)
    for _ in range(10_000):
        if not sched.has_unfinished():
            return outputs.final()
        plan = sched.schedule()
        assert plan is not None, "stalled"
        outputs.track()
        outputs.add(sched.postprocess(plan, fake.execute(plan)))
    raise AssertionError("did not finish")


def assert_kv_empty(sched: Scheduler) -> None:
    assert all(sched.page_manager.num_used_pages(t) == 0 for t in TIERS)
    assert not sched.running and sched.num_waiting == 0


def test_single_request_matches_reference() -> None:
    sched = make()
    sched.add_request(request(0, max_tokens=6))
    out = drive(sched)["r0"]
    assert out.finished and out.prompt_token_ids == prompt(0)
    assert out.outputs[0].token_ids == reference(prompt(0), 6)
    assert out.outputs[0].finish_reason == "length"
    assert_kv_empty(sched)


def test_continuous_refill_admits_waiting_the_step_after_a_finish() -> None:
    sched = make(gpu_batch_size=2)
    for i, max_tokens in enumerate([2, 6, 4, 3]):
        sched.add_request(request(i, max_tokens=max_tokens))
    fake = FakeExecutor()
    finished_at: dict[str, int] = {}
    first_chunk_at: dict[int, int] = {}
    while sched.has_unfinished():
        plan = sched.schedule()
        assert plan is not None and len(plan.chunks) <= 2
        for chunk in plan.chunks:
            first_chunk_at.setdefault(chunk.seq_id, plan.step_id)
        for delta in sched.postprocess(plan, fake.execute(plan)):
            if delta.finished:
                finished_at[delta.request_id] = plan.step_id
    assert first_chunk_at[0] == first_chunk_at[1] == 0
    assert first_chunk_at[2] == finished_at["r0"] + 1  # r0 left, r2 joined right away
    assert first_chunk_at[3] == min(finished_at["r1"], finished_at["r2"]) + 1
    assert fake.freed[:1] == [0]


def test_prefill_is_chunked_within_the_step_budget() -> None:
    sched = make(max_step_tokens=16, batch_sizes=(4, 8, 16))
    sched.add_request(request(0, length=4, max_tokens=6))
    fake = FakeExecutor()
    plan = sched.schedule()
    assert plan is not None
    sched.postprocess(plan, fake.execute(plan))
    sched.add_request(request(1, length=40, max_tokens=2))
    chunks_of_long = []
    while sched.has_unfinished():
        plan = sched.schedule()
        assert plan is not None and plan.num_tokens <= 16
        chunks_of_long += [c for c in plan.chunks if c.seq_id == 1]
        assert any(c.seq_id == 0 for c in plan.chunks) or not sched.requests.get("r0")
        sched.postprocess(plan, fake.execute(plan))
    prefill = [c for c in chunks_of_long if c.start_pos < 40]
    assert [c.start_pos for c in prefill] == [0, 15, 30]  # 15 prefill + 1 decode per step
    assert [c.do_sample for c in prefill] == [False, False, True]
    assert sum(len(c.token_ids) for c in prefill) == 40


def test_steps_are_filled_while_prefill_waits() -> None:
    """Four 30-token prompts (120 prefill tokens) behind a 16-token step budget: every step
    runs 16 tokens (decodes of the finished prefills plus prompt chunks) until no prompt
    token waits; none is left partly empty while work is queued."""
    sched = make(gpu_batch_size=4, max_step_tokens=16, batch_sizes=(8, 16))
    for i in range(4):
        sched.add_request(request(i, length=30, max_tokens=5))
    fake = FakeExecutor()
    outputs = drive(sched, fake)
    prompt_tokens = [  # per step: prompt tokens it ran (positions < 30)
        sum(max(0, min(30, c.start_pos + len(c.token_ids)) - c.start_pos) for c in p.chunks)
        for p in fake.plans
    ]
    assert sum(prompt_tokens) == 120
    last_prefill = max(i for i, n in enumerate(prompt_tokens) if n)
    assert [p.num_tokens for p in fake.plans[:last_prefill]] == [16] * last_prefill
    for i in range(4):
        assert outputs[f"r{i}"].outputs[0].token_ids == reference(prompt(i, 30), 5)


def test_kv_admission_uses_projected_peak() -> None:
    # 6-token prompts + 6 new tokens peak at 3 pages of 4; 8 pages hold two at once.
    sched = make(page_tokens=4, kv_capacity_pages={"gpu": 8})
    for i in range(5):
        sched.add_request(request(i, length=6, max_tokens=6))
    fake = FakeExecutor(page_tokens=4)
    max_running = 0
    while sched.has_unfinished():
        plan = sched.schedule()
        assert plan is not None
        max_running = max(max_running, len(sched.running))
        assert sched.page_manager.num_used_pages("gpu") <= 8
        sched.postprocess(plan, fake.execute(plan))
    assert max_running == 2
    assert sorted(fake.freed) == list(range(4))  # the last one is never freed: no next plan


def run_with_capacity(
    capacity: int | None, **config: object
) -> tuple[dict, Scheduler, FakeExecutor]:
    sched = make(page_tokens=4, kv_capacity_pages={"gpu": capacity}, **config)
    for i in range(6):
        sched.add_request(request(i, length=3 + i, max_tokens=10 + i))
    fake = FakeExecutor(page_tokens=4)
    final = drive(sched, fake)
    outputs = {
        rid: (o.outputs[0].token_ids, o.outputs[0].finish_reason) for rid, o in final.items()
    }
    return outputs, sched, fake


def test_preemption_recomputes_and_gives_identical_outputs() -> None:
    expected, _, _ = run_with_capacity(None)
    outputs, sched, fake = run_with_capacity(12, expected_gen_tokens=1)
    starts = [c.seq_id for p in fake.plans for c in p.chunks if c.start_pos == 0]
    assert len(starts) > len(set(starts)), "the tight pool should have forced a recompute"
    assert outputs == expected
    assert_kv_empty(sched)


def test_lone_sequence_outgrowing_every_pool_ends_with_length() -> None:
    sched = make(page_tokens=4, kv_capacity_pages={"gpu": 2})
    sched.add_request(request(0, length=5, max_tokens=10))
    out = drive(sched)["r0"].outputs[0]
    assert out.finish_reason == "length"
    assert out.token_ids == reference(prompt(0), 4)  # KV holds at most 8 tokens
    assert_kv_empty(sched)


def test_online_requests_are_admitted_before_batch_work_fifo_within_class() -> None:
    sched = make(gpu_batch_size=1)
    sched.add_request(request(0, priority=BATCH_PRIORITY, max_tokens=2))
    sched.add_request(request(1, priority=BATCH_PRIORITY, max_tokens=2))
    sched.add_request(request(2, priority=ONLINE_PRIORITY, max_tokens=2))
    sched.add_request(request(3, priority=ONLINE_PRIORITY, max_tokens=2))
    fake = FakeExecutor()
    drive(sched, fake)
    order = [c.seq_id for p in fake.plans for c in p.chunks if c.start_pos == 0]
    assert order == [2, 3, 0, 1]


def test_abort_waiting_and_running_frees_kv() -> None:
    sched = make(gpu_batch_size=1)
    for i in range(3):
        sched.add_request(request(i, max_tokens=20))
    fake, outputs = FakeExecutor(), Outputs(sched)
    outputs.track()
    for _ in range(3):
        plan = sched.schedule()
        assert plan is not None
        outputs.add(sched.postprocess(plan, fake.execute(plan)))
    aborted = sched.abort_request("r1")
    assert aborted is not None and aborted.finished
    waiting = outputs.add([aborted])[0]
    assert waiting.outputs[0].finish_reason == "abort" and waiting.outputs[0].token_ids == []
    aborted = sched.abort_request("r0")
    assert aborted is not None and aborted.new_token_ids == []
    running = outputs.add([aborted])[0]
    assert running.finished and running.outputs[0].finish_reason == "abort"
    assert running.outputs[0].token_ids == reference(prompt(0), 3)
    assert sched.page_manager.num_used_pages("gpu") == 0
    assert sched.abort_request("r0") is None and sched.abort_request("nope") is None
    plan = sched.schedule()
    assert plan is not None and plan.freed_seq_ids == [0]  # r1 never reached the engine
    assert [c.seq_id for c in plan.chunks] == [2]
    outputs.add(sched.postprocess(plan, fake.execute(plan)))
    assert set(drive(sched, fake, outputs)) == {"r0", "r1", "r2"}
    assert_kv_empty(sched)


def test_eos_and_stop_token_ids() -> None:
    tokens = reference(prompt(0), 8)
    eos = tokens[3]
    cut = tokens.index(eos) + 1
    sched = make(eos_token_ids=(eos,))
    sched.add_request(request(0))
    sched.add_request(Request("ignore", prompt(0), SamplingParams(max_tokens=8, ignore_eos=True)))
    sched.add_request(
        Request(
            "ids", prompt(0), SamplingParams(max_tokens=8, stop_token_ids=(eos,), ignore_eos=True)
        )
    )
    final = drive(sched)
    out = final["r0"].outputs[0]
    assert (out.token_ids, out.finish_reason, out.stop_reason) == (tokens[:cut], "stop", None)
    assert final["ignore"].outputs[0].token_ids == tokens
    ids = final["ids"].outputs[0]
    assert (ids.token_ids, ids.finish_reason, ids.stop_reason) == (tokens[:cut], "stop", eos)


def test_stop_string_is_cut_and_nothing_after_it_is_returned() -> None:
    detok = FakeDetokenizer()
    tokens = reference(prompt(0), 10)
    text = detok.decode(tokens)
    stop = text[4:6]
    pos = text.find(stop)
    sched = make(detokenizer=detok)
    sched.add_request(request(0, max_tokens=10, stop=(stop, "zzzz")))
    out = drive(sched)["r0"].outputs[0]
    assert out.text == text[:pos] and stop not in out.text
    assert out.token_ids == tokens[: pos + len(stop)]  # up to the token completing the stop
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)


def test_n_choices_fan_out_to_seeded_requests() -> None:
    sched = make()
    parent = ParentRequest(request(0, max_tokens=5, n=3, seed=7, logprobs=1))
    for child in parent.children:
        sched.add_request(child)
    fake = FakeExecutor()
    finished = []
    while sched.has_unfinished():
        plan = sched.schedule()
        assert plan is not None
        assert {c.sampling.seed for c in plan.chunks if c.sampling} <= {7, 8, 9}
        for delta in sched.postprocess(plan, fake.execute(plan)):
            parent.add(delta)
            finished.append(parent.finished)
    assert finished.count(True) == 1 and finished[-1]
    final = parent.output().outputs
    assert [c.index for c in final] == [0, 1, 2]
    assert [c.token_ids for c in final] == [reference(prompt(0), 5, 7 + i) for i in range(3)]
    assert all(c.logprobs is not None and len(c.logprobs) == 5 for c in final)


def test_the_engine_takes_one_choice_per_request() -> None:
    with pytest.raises(RequestError, match="n=2"):
        make().add_request(request(0, n=2))


def test_tiers_follow_fractions_and_batch_index_is_stable() -> None:
    sched = make(gpu_batch_size=2, num_gpu_batches=2, kv_frac=(0.5, 0.5, 0.0), act_frac=(0, 1, 0))
    for i in range(4):
        sched.add_request(request(i, max_tokens=4 + i))
    fake = FakeExecutor()
    drive(sched, fake)
    chunks = [c for p in fake.plans for c in p.chunks]
    assert sorted({(c.seq_id, c.kv_tier) for c in chunks}, key=lambda x: x[0]) == [
        (0, "gpu"), (1, "cpu"), (2, "gpu"), (3, "cpu")
    ]  # fmt: skip
    assert {c.act_tier for c in chunks} == {"cpu"}
    assert {c.seq_id: c.gpu_batch for c in chunks} == {0: 0, 1: 0, 2: 1, 3: 1}
    assert all(c.gpu_batch == {0: 0, 1: 0, 2: 1, 3: 1}[c.seq_id] for c in chunks)


def test_add_request_refusals_are_user_errors() -> None:
    sched = make(max_model_len=8, page_tokens=4, kv_capacity_pages={"gpu": 1})
    with pytest.raises(PromptTooLongError) as info:
        sched.add_request(request(0, length=9))
    assert isinstance(info.value, UserError)
    with pytest.raises(RequestError):
        sched.add_request(request(1, length=0))
    with pytest.raises(RequestError):
        sched.add_request(request(2, length=6))  # 2 pages, the pool has 1
    sched.add_request(request(3, length=4))
    with pytest.raises(RequestError):
        sched.add_request(request(3, length=4))


def test_context_length_ends_generation() -> None:
    sched = make(max_model_len=8)
    sched.add_request(request(0, length=5, max_tokens=100))
    out = drive(sched)["r0"].outputs[0]
    assert (len(out.token_ids), out.finish_reason) == (3, "length")


def test_config_validation_and_from_policy() -> None:
    with pytest.raises(SchedulerConfigError):
        SchedulerConfig(gpu_batch_size=64, max_step_tokens=32)
    with pytest.raises(SchedulerConfigError):
        SchedulerConfig(kv_capacity_pages={"ssd": 3})
    config = SchedulerConfig.from_policy(Policy(gpu_batch_size=4, num_gpu_batches=3), page_tokens=8)
    assert (config.block_size, config.page_tokens) == (12, 8)
    every_row_costs = (*range(1, 16), *range(16, 32, 2), *range(32, 49, 4))  # 1/8 at most
    assert SchedulerConfig(max_step_tokens=48).batch_sizes == every_row_costs


def test_result_that_does_not_answer_the_plan_is_rejected() -> None:
    sched = make()
    sched.add_request(request(0))
    plan = sched.schedule()
    assert plan is not None
    with pytest.raises(EngineProtocolError):
        sched.postprocess(plan, StepResult(plan.step_id, [5], [1], [None]))


def test_sequence_that_outgrows_a_small_pool_moves_to_a_larger_one() -> None:
    sched = make(page_tokens=4, kv_frac=(0.5, 0.5, 0.0), kv_capacity_pages={"gpu": 2, "cpu": 8})
    sched.add_request(request(0, length=5, max_tokens=12))
    fake = FakeExecutor(page_tokens=4)
    out = drive(sched, fake)["r0"].outputs[0]
    assert (out.token_ids, out.finish_reason) == (reference(prompt(0), 12), "length")
    tiers = [c.kv_tier for p in fake.plans for c in p.chunks]
    assert tiers[0] == "gpu" and tiers[-1] == "cpu"
    assert fake.freed == [0]  # preempted once, freed and recomputed in the same plan
    assert_kv_empty(sched)


class PromptScoringFake(FakeExecutor):
    """Also returns prompt logprobs at the end of each prompt prefill (as the real executor
    does for echo + logprobs), stamped with the step that computed them."""

    def execute(self, plan: StepPlan) -> StepResult:
        result = super().execute(plan)
        for c in plan.chunks:
            if c.do_sample and c.start_pos == 0 and len(c.token_ids) > 1:  # a whole prompt
                stamp = -float(plan.step_id)
                scores = [TokenLogprobs(t, stamp, []) for t in c.token_ids[1:]]
                result.prompt_logprobs[c.seq_id] = scores
        return result


def test_prompt_logprobs_are_kept_from_the_first_prefill() -> None:
    """A preempted echo + logprobs request is prefilled again; the prompt logprobs it reports
    are those of its first prefill, not the recompute's."""
    sched = make(page_tokens=4, kv_capacity_pages={"gpu": 6}, expected_gen_tokens=1)
    sched.add_request(request(0, length=8, max_tokens=12))
    sched.add_request(request(1, length=5, max_tokens=10, echo=True, logprobs=0))
    fake = PromptScoringFake(page_tokens=4)
    final = drive(sched, fake)
    prefills = [
        p.step_id for p in fake.plans for c in p.chunks if c.seq_id == 1 and c.start_pos == 0
    ]
    assert len(prefills) == 2, "the tight pool should have preempted the echo request"
    scores = final["r1"].prompt_logprobs
    assert scores is not None and len(scores) == 4
    assert {s.logprob for s in scores} == {-float(prefills[0])}


def test_a_wrong_length_estimate_preempts_and_recovers_with_identical_tokens() -> None:
    """Admission assumes the running mean output length (NanoFlow 4.4). Short requests
    first teach it "2 tokens"; long ones then join more than the pool holds when they grow,
    are preempted and recomputed, and end with the same tokens as under an admission that
    assumes every request runs to max_tokens (which never preempts)."""

    def run(**config: object) -> tuple[dict[str, RequestOutput], Scheduler]:
        sched = make(page_tokens=4, kv_capacity_pages={"gpu": 24}, **config)
        for i in range(6):
            sched.add_request(request(i, length=4, max_tokens=2))
        for i in range(6, 14):
            sched.add_request(request(i, length=6, max_tokens=30))
        return drive(sched), sched

    estimated, sched = run()
    conservative, safe = run(conservative_admission=True)
    assert sched.num_preemptions > 0 and safe.num_preemptions == 0
    assert {k: o.outputs[0].token_ids for k, o in estimated.items()} == {
        k: o.outputs[0].token_ids for k, o in conservative.items()
    }
    for i in range(6, 14):
        assert estimated[f"r{i}"].outputs[0].token_ids == reference(prompt(i, 6), 30)
    assert_kv_empty(sched)


def test_pooling_request_is_a_prefill_answered_by_its_pooled_output() -> None:
    """A pooling request's prompt runs in chunks; the chunk that ends it is answered with a
    pooled output (not a token), the request finishes and frees its KV; a generation
    request in the same steps goes on sampling."""
    sched = make(max_step_tokens=8, page_tokens=4)
    pooled = SamplingParams(max_tokens=0, pooling=True)
    sched.add_request(Request("p", prompt(1, 20), pooled))
    sched.add_request(request(2, max_tokens=3))
    fake, answers, steps = FakeExecutor(4), [], 0
    while sched.has_unfinished():
        plan = sched.schedule()
        assert plan is not None
        steps += 1
        result = fake.execute(plan)
        ends = [c for c in plan.chunks if c.seq_id == 0 and c.do_sample]
        if ends:  # the executor's pooled row in place of the token it sampled
            at = result.seq_ids.index(0)
            result.pooled[0] = [0.5, -0.5]
            for field in (result.seq_ids, result.token_ids, result.logprobs):
                del field[at]
        answers += [d for d in sched.postprocess(plan, result) if d.request_id == "p"]
    assert steps >= 3  # 20 prompt tokens in chunks of at most 8
    assert len(answers) == 1 and answers[0].pooled == [0.5, -0.5]
    assert answers[0].finish_reason == "stop" and answers[0].new_token_ids == []
    assert_kv_empty(sched)
    with pytest.raises(ValueError, match="pooling request generates nothing"):
        SamplingParams(max_tokens=4, pooling=True)
