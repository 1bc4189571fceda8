"""Prefix ordering: trie-ordered batch queue, the gate, n choices from one prefill, counted."""

from __future__ import annotations

import random

from engine.core.parent_request import ParentRequest
from engine.core.prefix_order import PrefixQueue
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler
from engine.core.scheduler_config import SchedulerConfig
from engine.core.sequence import BATCH_PRIORITY, ONLINE_PRIORITY, Request
from policy import TIERS
from tests.engine.fakes import VOCAB, FakeExecutor, Outputs, prefill_tokens, reference

P = 16  # tokens per page
NUM_SYSTEMS, LINES_EACH = 24, 5
SYSTEM_PAGES = 4


def tokens(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, VOCAB) for _ in range(length)]


def job() -> list[list[int]]:
    """24 system prompts x 5 lines, grouped: line j of system i is system i + its question."""
    systems = [tokens(1000 + i, SYSTEM_PAGES * P) for i in range(NUM_SYSTEMS)]
    return [systems[i] + tokens(i * 100 + j, 7) for i in range(NUM_SYSTEMS) for j in range(5)]


def run(
    prompts: list[list[int]], *, priority: int = BATCH_PRIORITY, **config: object
) -> tuple[Scheduler, FakeExecutor, Outputs]:
    """All prompts queued at once (a batch job's lines), driven to the end."""
    settings = {"page_tokens": P, "enable_prefix_caching": True, **config}
    sched = Scheduler(SchedulerConfig(**settings))  # type: ignore[arg-type]
    sp = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        sched.add_request(Request(f"line-{i}", prompt, sp, priority))
    fake, outputs = FakeExecutor(P), Outputs(sched)
    outputs.track()
    while sched.has_unfinished():
        plan = sched.schedule()
        assert plan is not None, "stalled"
        outputs.add(sched.postprocess(plan, fake.execute(plan)))
    assert all(sched.page_manager.num_used_pages(t) == 0 for t in TIERS)
    return sched, fake, outputs


def cached_prompt_tokens(outputs: Outputs, prompts: list[list[int]]) -> int:
    """Sum of the requests' cached prompt tokens; checks every line answered exactly right."""
    final = outputs.final()
    assert sorted(final) == sorted(f"line-{i}" for i in range(len(prompts)))
    for i, prompt in enumerate(prompts):
        assert final[f"line-{i}"].outputs[0].token_ids == reference(prompt, 3)
    return sum(out.num_cached_tokens or 0 for out in final.values())


def test_shuffled_job_reaches_the_grouped_jobs_cache_hits_only_with_ordering() -> None:
    """A KV budget of 40 pages holds about 8 of the 24 four-page system prompts at once."""
    grouped = job()
    order = list(range(len(grouped)))
    random.Random(5).shuffle(order)
    shuffled = [grouped[i] for i in order]
    budget = {"kv_capacity_pages": {"gpu": 40, "cpu": 0, "disk": 0}}
    _, _, base = run(grouped, **budget)
    best = cached_prompt_tokens(base, grouped)
    assert best == NUM_SYSTEMS * (LINES_EACH - 1) * SYSTEM_PAGES * P  # every repeat hits
    _, _, ordered = run(shuffled, **budget)
    _, _, fifo = run(shuffled, prefix_ordering=False, **budget)
    assert cached_prompt_tokens(ordered, shuffled) >= 0.9 * best
    assert cached_prompt_tokens(fifo, shuffled) < 0.5 * best


def test_n_choices_prefill_their_prompt_once() -> None:
    """n = 64: the first choice computes the prompt while the others wait; they fork its pages
    and sample from its logits row (their seeds their own), and each copies the shared
    partial last page when it first writes into it (the last holder writes in place). So with
    ordering off too, and for a prompt shorter than a page (the gate has no page to hold it
    on); without prefix caching (the off switch) every choice computes its prompt."""
    results = {}
    for name, length, settings in [
        ("forked", 100, {}),
        ("ordering off", 100, {"prefix_ordering": False}),
        ("short", 10, {}),
        ("off", 100, {"enable_prefix_caching": False}),
    ]:
        prompt = tokens(7, length)
        parent = ParentRequest(Request("n64", prompt, SamplingParams(n=64, max_tokens=4, seed=3)))
        config = {"page_tokens": P, "enable_prefix_caching": True, **settings}
        sched = Scheduler(SchedulerConfig(**config))  # type: ignore[arg-type]
        for child in parent.children:
            sched.add_request(child)
        fake, outputs = FakeExecutor(P), Outputs(sched)
        outputs.track()
        while sched.has_unfinished():
            plan = sched.schedule()
            assert plan is not None
            outputs.add(sched.postprocess(plan, fake.execute(plan)))
        final = outputs.final()
        for i, child in enumerate(parent.children):
            assert final[child.request_id].outputs[0].token_ids == reference(prompt, 4, 3 + i)
        assert all(sched.page_manager.num_used_pages(t) == 0 for t in TIERS)
        copies = sum(len(plan.page_copies) for plan in fake.plans)
        results[name] = (prefill_tokens(fake.plans, len(prompt)), copies)
    assert results["forked"] == results["ordering off"] == (100, 63)
    assert results["short"] == (10, 63)
    assert results["off"] == (64 * 100, 0)


def test_queue_keeps_trie_order_and_requeued_in_front() -> None:
    hashes = {"a": ("x", "y"), "b": ("z",), "c": ("x",), "d": ("x", "y"), "e": ()}
    queue: PrefixQueue[str] = PrefixQueue(hashes.__getitem__)
    for item in "abcde":
        queue.append(item)
    assert list(queue) == ["e", "c", "a", "d", "b"]  # shared first pages adjacent, FIFO ties
    queue.remove("a")
    queue.appendleft("a")  # preempted: back in front, the latest first
    queue.appendleft("f")
    assert list(queue) == ["f", "a", "e", "c", "d", "b"]
    assert "a" in queue and "g" not in queue and len(queue) == 6


def test_online_work_keeps_batch_to_its_share() -> None:
    """With an online request present, batch prefill takes at most batch_share of a step's
    tokens and batch lines at most that share of the slots; none is preempted."""
    sched = Scheduler(SchedulerConfig(max_step_tokens=64, batch_share=0.25, gpu_batch_size=8))
    sp = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    for i in range(8):
        sched.add_request(Request(f"b{i}", tokens(i, 40), sp, BATCH_PRIORITY))
    fake = FakeExecutor()
    plan = sched.schedule()  # no online work: batch fills the step
    assert plan is not None and plan.num_tokens == 64
    sched.postprocess(plan, fake.execute(plan))
    sched.add_request(Request("online", tokens(99, 10), sp, ONLINE_PRIORITY))
    plan = sched.schedule()
    assert plan is not None
    chunks = {sched._seqs[c.seq_id].request.request_id: c for c in plan.chunks}
    assert len(chunks["online"].token_ids) == 10  # admitted at once, whole prompt
    batch = [len(c.token_ids) for rid, c in chunks.items() if rid != "online"]
    batch_prefill = sum(n for n in batch if n > 1)  # a decode is one token
    assert batch_prefill <= 16  # 0.25 of 64
    running_batch = [s for s in sched.running if s.request.priority == BATCH_PRIORITY]
    assert len(running_batch) == 2  # admitted before the online request came: kept
    assert sched.num_preemptions == 0
