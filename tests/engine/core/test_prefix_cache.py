"""Prefix caching in the scheduler (NanoFlow 4.4): hits, reference counts, LRU spill down the
tiers and reload, against a fake executor whose KV is the tokens written into each page."""

from __future__ import annotations

import random
import weakref

import pytest

from engine.core.kv_pages import PageManager
from engine.core.outputs import RequestOutput
from engine.core.parent_request import ParentRequest
from engine.core.prefix_cache import page_hashes
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler
from engine.core.scheduler_config import SchedulerConfig
from engine.core.sequence import Request
from policy import TIERS
from tests.engine.fakes import VOCAB, FakeExecutor, Outputs, reference

P = 4  # tokens per page: small, so pages fill and spill quickly


def make(**config: object) -> Scheduler:
    settings = {"page_tokens": P, "enable_prefix_caching": True, "gpu_batch_size": 4, **config}
    return Scheduler(SchedulerConfig(**settings))  # type: ignore[arg-type]


def tokens(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, VOCAB) for _ in range(length)]


FAKES: weakref.WeakKeyDictionary[Scheduler, FakeExecutor] = weakref.WeakKeyDictionary()


def run(
    sched: Scheduler, prompts: list[list[int]], max_tokens: int = 5, **params: object
) -> dict[str, RequestOutput]:
    """Submit one request per prompt, in order, each after the previous finished (the same
    fake executor, and so the same page contents, for every call on one scheduler)."""
    fake = FAKES.setdefault(sched, FakeExecutor(P))
    outputs = Outputs(sched)
    for i, prompt in enumerate(prompts):
        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **params)  # type: ignore[arg-type]
        sched.add_request(Request(f"r{i}", prompt, sp))
        while sched.has_unfinished():
            plan = sched.schedule()
            assert plan is not None
            outputs.track()
            outputs.add(sched.postprocess(plan, fake.execute(plan)))
    return outputs.final()


def assert_consistent(sched: Scheduler) -> None:
    """Every page is free, held or cached, and counts agree."""
    manager = sched.page_manager
    for tier in TIERS:
        assert manager.num_used_pages(tier) == sum(
            1 for ref, n in manager._refs.items() if ref[0] == tier and n > 0
        )
    held = set(manager._refs)
    cached = {(t, p) for t in TIERS for p in manager.cache.lru[t]}
    assert not held & cached, "a held page is also evictable"
    for tier in TIERS:
        free = set(manager._free[tier])
        assert not free & {p for t, p in held | cached if t == tier}, "a free page is in use"


def test_a_shared_prefix_is_computed_once_and_outputs_do_not_change() -> None:
    system = tokens(0, 3 * P)  # three full pages
    prompts = [system + tokens(i + 1, 3 + i) for i in range(4)]
    on, off = make(), make(enable_prefix_caching=False)
    cached, plain = run(on, prompts), run(off, prompts)
    for i, prompt in enumerate(prompts):
        assert cached[f"r{i}"].outputs[0].token_ids == reference(prompt, 5)
        assert plain[f"r{i}"].outputs[0].token_ids == reference(prompt, 5)
    assert [cached[f"r{i}"].num_cached_tokens for i in range(4)] == [0, 3 * P, 3 * P, 3 * P]
    assert all(o.num_cached_tokens == 0 for o in plain.values())
    assert on.page_manager.stats.hit_tokens == 9 * P
    assert_consistent(on)


@pytest.mark.parametrize(
    "first,second,hit",
    [
        (tokens(5, 3 * P), tokens(5, 3 * P), 2 * P),  # exact duplicate: the last token reruns
        (tokens(6, 2 * P), tokens(6, 3 * P + 2), 2 * P),  # a prompt that prefixes another
        (tokens(7, 2 * P + 3), tokens(7, 2 * P + 3) + tokens(8, 5), 2 * P),  # ends mid-page
        (tokens(9, 4 * P), [*tokens(9, P - 1), 0, *tokens(9, 4 * P)[P:]], 0),  # first page differs
    ],
    ids=["duplicate", "prefix-of-another", "mid-page", "no-shared-page"],
)
def test_hits_cover_only_full_shared_pages_and_leave_a_token(
    first: list[int], second: list[int], hit: int
) -> None:
    sched = make()
    out = run(sched, [first, second], max_tokens=3)
    assert out["r1"].num_cached_tokens == hit
    assert out["r1"].outputs[0].token_ids == reference(second, 3)


def test_generated_tokens_are_cached_too_for_the_next_round() -> None:
    """A conversation's second round hits the first round's prompt and answer."""
    sched = make()
    first = tokens(10, 2 * P + 1)
    out = run(sched, [first], max_tokens=P + 3)
    second = first + out["r0"].outputs[0].token_ids + tokens(11, 2)
    assert run(sched, [second], max_tokens=2)["r0"].num_cached_tokens == 3 * P


def test_n_choices_share_their_prompt_pages() -> None:
    sched = make()
    prompt = tokens(12, 3 * P + 1)
    run(sched, [prompt], max_tokens=1)
    fake = FAKES[sched]
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, n=3)
    parent = ParentRequest(Request("n3", prompt, sp))
    for child in parent.children:
        sched.add_request(child)
    while sched.has_unfinished():
        plan = sched.schedule()
        assert plan is not None
        for delta in sched.postprocess(plan, fake.execute(plan)):
            parent.add(delta)
    final = parent.output()
    assert final.finished and final.num_cached_tokens == 3 * P
    assert all(c.token_ids == reference(prompt, 4) for c in final.outputs)


def test_lru_spills_down_the_tiers_and_hits_load_back_with_the_same_tokens() -> None:
    """A gpu pool of 6 pages, cpu 4, disk 4: finished prompts' pages spill gpu -> cpu ->
    disk, least recently used first, and are dropped only from disk. A later request
    hitting a spilled prefix loads it back to the gpu tier and generates the same tokens."""
    sched = make(kv_capacity_pages={"gpu": 6, "cpu": 4, "disk": 4})
    prompts = [tokens(20 + i, 2 * P + 1) for i in range(8)]
    out = run(sched, prompts, max_tokens=2)
    manager = sched.page_manager
    spilled = manager.stats.spilled_pages
    assert spilled["cpu"] > 0 and spilled["disk"] > 0 and manager.stats.evicted_pages > 0
    assert manager.num_cached_pages("cpu") == 4 and manager.num_cached_pages("disk") == 4
    # the oldest prompts were dropped, the middle ones are on disk, the newest on the gpu
    hashes = [page_hashes(p[: 2 * P], P, "") for p in prompts]
    tiers = [[manager.cache._by_hash.get(h, ("gone", 0))[0] for h in hs] for hs in hashes]
    assert tiers[0] == ["gone", "gone"] and tiers[-1] == ["gpu", "gpu"]
    on_disk = next(i for i, t in enumerate(tiers) if t == ["disk", "disk"])
    again = run(sched, [prompts[on_disk] + tokens(99, 3)], max_tokens=3)["r0"]
    assert again.num_cached_tokens == 2 * P
    assert again.outputs[0].token_ids == reference(prompts[on_disk] + tokens(99, 3), 3)
    assert manager.stats.loaded_pages["disk"] == 2
    assert_consistent(sched)
    del out


def test_the_disk_cache_is_bounded() -> None:
    sched = make(kv_capacity_pages={"gpu": 4, "cpu": 0, "disk": None}, max_cached_pages={"disk": 3})
    run(sched, [tokens(40 + i, 2 * P + 1) for i in range(6)], max_tokens=1)
    assert sched.page_manager.num_cached_pages("disk") == 3
    assert sched.page_manager.stats.evicted_pages > 0


def test_preemption_and_abort_while_pages_are_shared() -> None:
    """Four requests share a prefix in a pool that cannot hold them all: some are preempted
    while their prefix pages are held by others, one is aborted; outputs stay exact."""
    system = tokens(50, 2 * P)
    prompts = [system + tokens(51 + i, 2) for i in range(4)]
    # all four admitted at once (no PrefixGate: it would admit three a step later, hitting)
    sched = make(kv_capacity_pages={"gpu": 9}, expected_gen_tokens=1, prefix_ordering=False)
    fake = FakeExecutor(P)
    for i, prompt in enumerate(prompts):
        sp = SamplingParams(max_tokens=3 * P, temperature=0.0, ignore_eos=True)
        sched.add_request(Request(f"r{i}", prompt, sp))
    outputs = Outputs(sched)
    outputs.track()
    steps = 0
    while sched.has_unfinished():
        plan = sched.schedule()
        assert plan is not None
        outputs.add(sched.postprocess(plan, fake.execute(plan)))
        steps += 1
        if steps == 2:  # a waiting one; later ones will hold the shared prefix
            aborted = sched.abort_request("r3")
            assert aborted is not None and aborted.finished
        if steps == 14:  # a running one that holds the shared prefix with others
            assert "r2" in {s.request.request_id for s in sched.running}
            assert sched.abort_request("r2") is not None
    assert sched.num_preemptions > 0
    final = outputs.final()
    for i in (0, 1):
        assert final[f"r{i}"].outputs[0].token_ids == reference(prompts[i], 3 * P)
    assert all(sched.page_manager.num_used_pages(t) == 0 for t in TIERS)
    assert_consistent(sched)


def test_random_workload_leaks_nothing() -> None:
    rng = random.Random(3)
    sched = make(kv_capacity_pages={"gpu": 24, "cpu": 10, "disk": 10}, gpu_batch_size=6)
    bases = [tokens(60 + i, rng.randint(P, 4 * P)) for i in range(5)]
    fake, outputs = FakeExecutor(P), Outputs(sched)
    expected = {}
    for i in range(60):
        prompt = rng.choice(bases)[: rng.randint(1, 4 * P)] + tokens(100 + i, rng.randint(0, 6))
        max_tokens = rng.randint(1, 9)
        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        sched.add_request(Request(f"r{i}", prompt, sp))
        expected[f"r{i}"] = reference(prompt, max_tokens)
        outputs.track()
        for _ in range(rng.randint(0, 3)):
            plan = sched.schedule()
            if plan is not None:
                for o in outputs.add(sched.postprocess(plan, fake.execute(plan))):
                    if o.finished:
                        assert o.outputs[0].token_ids == expected[o.request_id]
            assert_consistent(sched)
    while sched.has_unfinished():
        plan = sched.schedule()
        assert plan is not None
        for o in outputs.add(sched.postprocess(plan, fake.execute(plan))):
            if o.finished:
                assert o.outputs[0].token_ids == expected[o.request_id]
    assert all(sched.page_manager.num_used_pages(t) == 0 for t in TIERS)
    assert sched.page_manager.stats.hit_tokens > 0
    assert_consistent(sched)


def test_page_manager_reference_counts() -> None:
    manager = PageManager(P, {"gpu": 8}, prefix_caching=True)
    manager.append(0, 2 * P + 1, "gpu")
    prompt = tokens(70, 2 * P + 1)
    manager.commit(0, prompt, 2 * P + 1)
    prefix = manager.match([*prompt, 1])
    assert prefix == manager.page_table(0)[:2]
    manager.start(1, "gpu", prefix)
    assert manager._refs[prefix[0]] == 2
    manager.free(0)
    assert manager._refs[prefix[0]] == 1 and manager.num_cached_pages("gpu") == 0
    manager.free(1)
    assert manager.num_cached_pages("gpu") == 2 and manager.num_used_pages("gpu") == 0


def test_a_hit_shorter_than_its_tiers_break_even_is_recomputed() -> None:
    prompt = tokens(80, 3 * P + 1)
    worth = run(make(min_hit_tokens={"gpu": 3 * P}), [prompt, prompt], max_tokens=2)
    not_worth = run(make(min_hit_tokens={"gpu": 3 * P + 1}), [prompt, prompt], max_tokens=2)
    assert worth["r1"].num_cached_tokens == 3 * P
    assert not_worth["r1"].num_cached_tokens == 0
    assert not_worth["r1"].outputs[0].token_ids == reference(prompt, 2)
