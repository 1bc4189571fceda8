"""Online before batch: an online request that comes while batch lines fill the block enters
at once and runs short steps; the batch lines lose no work (engine/core/wait_queues.py)."""

from __future__ import annotations

import random
from concurrent.futures import Future

import pytest

from engine.core import wait_queues
from engine.core.protocol import StepPlan, StepResult
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler
from engine.core.scheduler_config import SchedulerConfig
from engine.core.sequence import BATCH_PRIORITY, ONLINE_PRIORITY, Request
from engine.core.step_loop import StepLoop
from tests.engine.fakes import VOCAB, FakeExecutor, Outputs, reference

LINE_TOKENS = 16  # each batch line generates this many tokens (as the daemon's benchmark)


def tokens(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, VOCAB) for _ in range(length)]


def batch_job(sched: Scheduler, num_lines: int, prompt_len: int) -> dict[str, list[int]]:
    """Queue `num_lines` batch lines; their prompts by request id."""
    sp = SamplingParams(max_tokens=LINE_TOKENS, temperature=0.0, ignore_eos=True)
    prompts = {f"b{i}": tokens(i, prompt_len) for i in range(num_lines)}
    for request_id, prompt in prompts.items():
        sched.add_request(Request(request_id, prompt, sp, BATCH_PRIORITY))
    return prompts


def is_batch(sched: Scheduler, seq_id: int) -> bool:
    return sched._seqs[seq_id].request.priority == BATCH_PRIORITY


def test_online_request_enters_a_block_full_of_batch_lines_at_once() -> None:
    """The block's 4 slots all hold batch lines (16 tokens each) and more lines wait: an online
    request is admitted in the very next step (the newest batch line makes room), no batch line
    enters while it waits or runs, and every line still answers exactly (its tokens kept)."""
    sched = Scheduler(SchedulerConfig(gpu_batch_size=4, max_step_tokens=64, batch_share=0.25))
    prompts = batch_job(sched, num_lines=8, prompt_len=12)
    fake, outputs = FakeExecutor(), Outputs(sched)
    outputs.track()
    for _ in range(3):  # the block fills with batch lines, each a few tokens in
        plan = sched.schedule()
        assert plan is not None
        outputs.add(sched.postprocess(plan, fake.execute(plan)))
    assert len(sched.running) == 4 and all(is_batch(sched, s.seq_id) for s in sched.running)
    online_prompt = tokens(99, 5)
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    sched.add_request(Request("online", online_prompt, sp, ONLINE_PRIORITY))
    outputs.track()
    num_batch_before = len(sched.running)
    steps_until_admitted = None
    num_steps = 0
    while "online" in sched.requests:
        plan = sched.schedule()
        assert plan is not None
        num_steps += 1
        running_ids = [s.request.request_id for s in sched.running]
        if steps_until_admitted is None and "online" in running_ids:
            steps_until_admitted = num_steps
        num_batch = sum(1 for c in plan.chunks if is_batch(sched, c.seq_id))
        assert num_batch <= num_batch_before  # no batch line enters while online work is here
        num_batch_before = num_batch
        outputs.add(sched.postprocess(plan, fake.execute(plan)))
    assert steps_until_admitted == 1
    assert num_steps == 4  # one step a token: it never waited for a batch line to end
    assert sched.num_preemptions == 1  # one batch line made room
    while sched.has_unfinished():
        plan = sched.schedule()
        assert plan is not None
        outputs.add(sched.postprocess(plan, fake.execute(plan)))
    final = outputs.final()
    assert final["online"].outputs[0].token_ids == reference(online_prompt, 4)
    for request_id, prompt in prompts.items():  # the preempted line kept its tokens
        assert final[request_id].outputs[0].token_ids == reference(prompt, LINE_TOKENS)


def test_online_steps_take_batch_prefill_up_to_the_share_of_the_block() -> None:
    """While online work runs, batch prefill chunks take at most batch_share of the block's
    decode rows a step (2 tokens of a block of 8 at 0.25), not of the step's token budget
    (16 of 64): the online request's steps stay as short as a decode step."""
    sched = Scheduler(SchedulerConfig(gpu_batch_size=8, max_step_tokens=64, batch_share=0.25))
    batch_job(sched, num_lines=8, prompt_len=40)
    fake = FakeExecutor()
    plan = sched.schedule()  # no online work: batch prefill fills the step
    assert plan is not None and plan.num_tokens == 64
    sched.postprocess(plan, fake.execute(plan))
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    sched.add_request(Request("online", tokens(99, 10), sp, ONLINE_PRIORITY))
    online_steps = 0
    while "online" in sched.requests:
        plan = sched.schedule()
        assert plan is not None
        online_steps += 1
        batch_prefill = sum(
            len(c.token_ids)
            for c in plan.chunks
            if is_batch(sched, c.seq_id) and len(c.token_ids) > 1
        )
        assert batch_prefill <= 2
        sched.postprocess(plan, fake.execute(plan))
    assert online_steps == 4
    plan = sched.schedule()  # the online request ended: batch prefill fills the step again
    assert plan is not None and plan.num_tokens == 64


class RunAtOnce(FakeExecutor):
    """Runs each submitted step at once: the step loop's plan-ahead order stays (step i+1
    is planned before step i's result is read) and the plans come out in a fixed order."""

    def submit(self, plan: StepPlan) -> Future[StepResult]:
        future: Future[StepResult] = Future()
        future.set_result(self.execute(plan))
        return future


def rows_until_answers(batch_step_cap: bool, gap_steps: int = 6) -> list[int]:
    """A batch job through the real step loop planning ahead (as the daemon's does); an
    online request of 4 tokens comes `gap_steps` steps after the last one's answer (0: at
    once), while lines wait. It comes while the step just submitted runs and the worker waits
    for it, having planned the next: it is queued after the next `step()`. For each: the
    tokens of the steps it waited through and rode, from the step in flight when it came to
    the step that sampled its last token."""
    config = SchedulerConfig(
        gpu_batch_size=16,
        max_step_tokens=256,
        discrete_batching=False,
        batch_share=0.25,
        batch_step_cap=batch_step_cap,
    )
    sched, fake = Scheduler(config), RunAtOnce()
    core = StepLoop(sched, fake, async_scheduling=True)
    prompts = batch_job(sched, num_lines=48, prompt_len=48)
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    outputs = Outputs(sched)
    online_prompts: dict[str, list[int]] = {}
    rows: list[int] = []
    came_in: int | None = None  # the step in flight when the online request came
    is_queued, online_seq, answered_at = False, -1, 0
    while core.has_unfinished():
        outputs.track()
        for delta in outputs.add(core.step()):
            if delta.request_id.startswith("online") and delta.finished:
                assert came_in is not None
                since = fake.plans[came_in:]
                rode = [
                    i for i, p in enumerate(since) if any(c.seq_id == online_seq for c in p.chunks)
                ]
                rows.append(sum(p.num_tokens for p in since[: rode[-1] + 1]))
                came_in, is_queued, answered_at = None, False, len(fake.plans)
        if came_in is not None and not is_queued:
            request_id = f"online{len(online_prompts)}"
            online_prompts[request_id] = tokens(100 + len(online_prompts), 5)
            sched.add_request(Request(request_id, online_prompts[request_id], sp))
            online_seq, is_queued = sched.requests[request_id].seq_id, True
        elif came_in is None and sched.num_waiting and len(fake.plans) >= answered_at + gap_steps:
            came_in = len(fake.plans) - 1
    core.close()
    final = outputs.final()
    for request_id, prompt in online_prompts.items():
        assert final[request_id].outputs[0].token_ids == reference(prompt, 4)
    for request_id, prompt in prompts.items():
        assert final[request_id].outputs[0].token_ids == reference(prompt, LINE_TOKENS)
    return rows


def test_an_online_request_waits_behind_short_steps_with_the_batch_step_cap() -> None:
    """With batch_step_cap every step takes at most 64 batch prefill tokens (0.25 of 256), so
    from its arrival to its answer an online request runs through at most the step in flight
    and the one planned ahead (each 16 decodes + 64 prefill) and its own 4 steps (16 decodes,
    4 prefill, its own token): 2 * 80 + 4 * 21 = 244 tokens. Without the cap the steps ahead
    of it take whole budgets of batch prefill (256 tokens) and pass that bound."""
    bound = 2 * (16 + 64) + 4 * (16 + 4 + 1)
    capped = rows_until_answers(batch_step_cap=True)
    uncapped = rows_until_answers(batch_step_cap=False)
    assert len(capped) >= 3 and len(uncapped) >= 3
    assert max(capped) <= bound < max(uncapped)


def test_the_steps_after_online_work_stay_short_for_the_next_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Requests sent one after another (each the moment the last is answered): the step in
    flight was planned while online work ran, and for LINGER_STEPS steps after it left batch
    prefill keeps the online share (4 tokens), so the step planned ahead of the next request
    is as short: its 6 steps (in flight, ahead, its own 4) take at most 16 decodes, 4 prefill
    tokens and its own token each. With no lingering the step ahead takes the capped 64
    prefill tokens: every such request waits longer than any lingering one."""
    lingering = rows_until_answers(batch_step_cap=True, gap_steps=0)[1:]  # the first: alone
    monkeypatch.setattr(wait_queues, "LINGER_STEPS", 0)
    not_lingering = rows_until_answers(batch_step_cap=True, gap_steps=0)[1:]
    assert len(lingering) >= 3 and len(not_lingering) >= 3
    assert max(lingering) <= 6 * (16 + 4 + 1)
    assert max(lingering) < min(not_lingering)
