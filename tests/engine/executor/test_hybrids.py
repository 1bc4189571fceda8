"""Hybrid models (Qwen3-Next, Qwen3.5 dense and MoE: Gated DeltaNet layers beside attention;
Granite 4 hybrid, dense and MoE, and Nemotron-H, with and without its MoE layers: Mamba-2
layers beside attention; Falcon-H1: Mamba-2 and attention side by side in every layer):
greedy tokens equal transformers' under the placements of the issue (everything on the
compute device; weights on disk with states and KV in host memory; a mixed split), with
continuous refill, preemption and chunked prefill in the same run."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import LLM, SamplingParams
from engine.core.prefix_cache import PageRef
from engine.core.protocol import SeqChunk
from engine.core.scheduler import Scheduler
from engine.core.sequence import Sequence
from engine.core.state_slots import state_slot_capacity
from policy import Policy
from policy.specs import WorkloadSpec
from tests.engine.executor.test_correctness import run
from tests.engine.executor.test_nano_batches import PLACEMENTS as NANO_PLACEMENTS
from tests.engine.executor.test_nano_batches import SHAPE as NANO_SHAPE
from tests.engine.executor.test_nano_batches import run as run_nano
from tests.engine.tiny_models import HYBRIDS, MAX_TOKENS, hf_greedy, random_prompts, vocab_size

PLACEMENTS: dict[str, dict[str, object]] = {
    "all-on-device": {},
    "weights-disk-state-cpu": dict(weights_frac=(0.0, 0.0, 1.0), kv_frac=(0.0, 1.0, 0.0)),
    "mixed": dict(
        gpu_batch_size=2,
        num_gpu_batches=2,
        weights_frac=(0.3, 0.3, 0.4),
        kv_frac=(0.4, 0.3, 0.3),
        act_frac=(0.3, 0.3, 0.4),
        cpu_attention=True,
    ),
}


@pytest.mark.parametrize("placement", list(PLACEMENTS))
@pytest.mark.parametrize("kind", HYBRIDS)
def test_hybrid_matches_transformers(tiny_model, references, tmp_path, kind, placement):
    prompts, expected = references(kind)
    policy = Policy(**PLACEMENTS[placement])  # type: ignore[arg-type]
    assert run(tiny_model(kind), prompts, policy, tmp_path) == expected


AUTO_GPU_BUDGETS = {
    "nemotron_h": 4 << 20,
    "qwen3_next": 2 << 20,
    "falcon_h1": 1 << 20,
    "nemotron_h-moe": 2 << 20,
}
"""GPU budgets a few MiB wide, so that the plan of each tiny hybrid offloads: Nemotron-H's
splits its block's KV and states between the gpu tier and host memory, Qwen3-Next's homes
its weights mostly and every state in host memory; Falcon-H1's (KV and a state in every
layer) homes its weights in host memory and splits KV and states; Nemotron 3's homes its
routed experts in host memory beside split KV and states."""


@pytest.mark.parametrize(
    "kind",
    # Qwen3-Next's plan and reference add ~15 s on a 2-core box: run with the slow tests
    [
        # Nemotron-H's plan splits KV and states as Nemotron 3's does, beside its experts:
        # nemotron_h-moe, in the default run, checks the same pricing and tokens
        pytest.param("nemotron_h", marks=pytest.mark.slow),
        pytest.param("falcon_h1", marks=pytest.mark.slow),  # the default run nears 15 min
        "nemotron_h-moe",
        pytest.param("qwen3_next", marks=pytest.mark.slow),
    ],
)
def test_auto_policy_prices_the_states_and_matches_transformers(
    tiny_model, references, tmp_path, kind
):
    """`--policy auto` plans a hybrid: the cost model counts each sequence's state on the tier
    of its KV (host memory for the disk tier's), so the engine finds room for a state slot for
    every sequence of the planned block where the plan put it, and greedy tokens equal
    transformers' under that plan."""
    prompts, expected = references(kind)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    with LLM(
        str(tiny_model(kind)),
        policy="auto",
        device="cpu",
        gpu_mem=AUTO_GPU_BUDGETS[kind],
        workload=WorkloadSpec(prompt_len=32, gen_len=MAX_TOKENS),
        offload_dir=tmp_path,
    ) as llm:
        policy, slots = llm.policy, llm.scheduler.state_slots.capacity
        assert llm.plan is not None and llm.plan["predicted"]["generation_throughput"] > 0
        assert not (policy.compress_weights or policy.compress_kv)  # 4-bit changes tokens
        assert slots == state_slot_capacity(policy.block_size, policy.kv_frac, {})
        assert slots["cpu"] > 0  # the budget leaves states in host memory
        if kind == "nemotron_h-moe":  # and its routed experts there: priced, placed, run
            assert policy.experts_frac[0] < 1.0
        got = [out.outputs[0].token_ids for out in llm.generate(prompts, params)]
    assert got == expected


@pytest.mark.parametrize("placement", ["resident", "mixed-tiers-cpu-attention"])
def test_falcon_h1_with_nano_batches(tiny_model, references, tmp_path, placement):
    """Falcon-H1's mixer runs over the whole GPU batch, its attention per nano-batch, each
    nano-batch's rows of the mixer's output added to its own."""
    prompts, expected = references("falcon_h1")
    policy = Policy(**NANO_SHAPE, **NANO_PLACEMENTS[placement], num_nano_batches=2)
    tokens, layers_run = run_nano(tiny_model("falcon_h1"), prompts, policy, tmp_path)
    assert tokens == expected and layers_run > 0


def test_nemotron_h_moe_layers_group_the_block_per_expert(tiny_model, references, tmp_path):
    """Nemotron 3's MoE layers (MLP-only) run as the other families' MoE MLPs: weights and
    experts on disk, three GPU batches, each routed expert runs once over the whole block's
    rows routed to it, and where a block routes to few experts only those are loaded."""
    prompts, expected = references("nemotron_h-moe")
    trace = tmp_path / "trace.json"
    policy = Policy(
        weights_frac=(0.0, 0.0, 1.0),
        experts_frac=(0.0, 0.0, 1.0),
        gpu_batch_size=2,
        num_gpu_batches=3,
    )
    assert run(tiny_model("nemotron_h-moe"), prompts, policy, tmp_path, trace=str(trace)) == (
        expected
    )
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
    starts = sorted(
        e["ts"] for e in events if e["name"] == "load_weight" and e["args"]["layer"] == 0
    )
    routed_loads = 0
    for begin, end in zip(starts, [*starts[1:], float("inf")], strict=True):
        for j in (2, 6):  # the 'moe' layers
            mine = [e for e in events if begin <= e["ts"] < end and e["args"]["layer"] == j]
            runs = Counter(e["args"]["expert"] for e in mine if e["name"] == "expert")
            loads = Counter(e["args"]["expert"] for e in mine if e["name"] == "load_expert")
            assert runs and max(runs.values()) == 1  # each expert once for the block
            assert not loads or loads == runs
            routed_loads += bool(loads)
    assert routed_loads > 0


NUM_PROMPTS = 10


@contextmanager
def tight_engine(
    model_dir: Path, policy: Policy, tmp_path: Path, pages: dict[str, int], **kwargs: Any
) -> Iterator[LLM]:
    """An engine on the CPU with 16-token steps (prompts run in chunks) and KV pools of
    `pages` per tier, whose admission expects one generated token per request, so that
    sequences growing past it preempt others (in arrival order: prefix ordering off, since
    its queue order and one-step waits would spare the preemptions these tests are about)."""
    with LLM(
        str(model_dir),
        policy=policy,
        offload_dir=tmp_path,
        device="cpu",
        max_step_tokens=16,
        kv_capacity_pages=pages,
        prefix_ordering=False,
        **kwargs,
    ) as llm:
        llm.scheduler.config = dataclasses.replace(llm.scheduler.config, expected_gen_tokens=1)
        yield llm


Workload = tuple[Path, list[list[int]], list[int], list[list[int]]]


@pytest.fixture(scope="module")
def workloads(tiny_model):  # type: ignore[no-untyped-def]
    """kind -> (model dir, prompts of 2..40 tokens, max_tokens of 8..24, transformers' greedy
    outputs)."""
    cache: dict[str, Workload] = {}

    def get(kind: str) -> Workload:
        if kind not in cache:
            model_dir = tiny_model(kind)
            prompts = random_prompts(NUM_PROMPTS, vocab_size(kind), 2, 40, seed=5)
            g = torch.Generator().manual_seed(6)
            max_tokens = torch.randint(8, 25, (NUM_PROMPTS,), generator=g).tolist()
            expected = [
                hf_greedy(model_dir, p, n) for p, n in zip(prompts, max_tokens, strict=True)
            ]
            cache[kind] = (model_dir, prompts, max_tokens, expected)
        return cache[kind]

    return get


@pytest.mark.parametrize(
    ("kind", "placement"),
    [("qwen3_next", placement) for placement in PLACEMENTS]
    # Granite 4's Mamba-2 mixer is Nemotron-H's: nemotron_h-mixed, in the default run,
    # keeps the same state through refill, preemption and chunks
    + [pytest.param("granite4", "mixed", marks=pytest.mark.slow)]
    + [(kind, "mixed") for kind in ("nemotron_h", "nemotron_h-moe", "falcon_h1")],
)
def test_refill_preemption_and_chunked_prefill_keep_each_state(
    workloads, tmp_path, kind, placement
):
    """Ten ragged requests through a block of 4: sequences leave and join every few steps
    (refill, each new one's state slot zeroed), prompts longer than a step's 16 tokens run
    in chunks that carry their state forward, and KV pools of 4 pages per tier (the longest
    sequence fills one) cannot hold 4 running sequences, so some are preempted (their state
    slots freed) and recomputed."""
    model_dir, prompts, max_tokens, expected = workloads(kind)
    spec = {"gpu_batch_size": 2, "num_gpu_batches": 2, **PLACEMENTS[placement]}
    policy = Policy(**spec)  # type: ignore[arg-type]
    pages = {"gpu": 4, "cpu": 4, "disk": 4}
    with tight_engine(model_dir, policy, tmp_path, pages, async_scheduling=False) as llm:
        scheduler = llm.scheduler
        assert sum(scheduler.state_slots.capacity.values()) >= 4
        chunks = record_chunks(scheduler)
        params = [
            SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in max_tokens
        ]
        outputs = llm.generate(prompts, params)
        assert [out.outputs[0].token_ids for out in outputs] == expected
        assert scheduler.num_preemptions > 0
        assert any(c.start_pos > 0 and len(c.token_ids) > 1 for c in chunks)  # a later chunk
        assert all(c.state_slot is not None for c in chunks)
        assert not any(scheduler.state_slots.num_used(t) for t in ("gpu", "cpu"))


def record_chunks(scheduler: Scheduler) -> list[SeqChunk]:
    """Every chunk `scheduler` plans from now on, in order."""
    chunks: list[SeqChunk] = []
    make_chunk = scheduler._chunk

    def recording_chunk(seq: Sequence, num_new: int, pages: list[PageRef]) -> SeqChunk:
        chunks.append(make_chunk(seq, num_new, pages))
        return chunks[-1]

    scheduler._chunk = recording_chunk  # type: ignore[method-assign]
    return chunks


PREFIX_TOKENS = 40
"""A shared prefix of two full pages and a half: its cached part ends at token 32."""


@pytest.fixture(scope="module")
def shared_prefix(tiny_model):  # type: ignore[no-untyped-def]
    """kind -> (model dir, six prompts of one 40-token prefix and 3..9 tokens of their own,
    transformers' greedy outputs)."""
    cache: dict[str, tuple[Path, list[list[int]], list[list[int]]]] = {}

    def get(kind: str) -> tuple[Path, list[list[int]], list[list[int]]]:
        if kind not in cache:
            model_dir = tiny_model(kind)
            vocab = vocab_size(kind)
            prefix = random_prompts(1, vocab, PREFIX_TOKENS, PREFIX_TOKENS, seed=7)[0]
            prompts = [prefix + tail for tail in random_prompts(6, vocab, 3, 9, seed=8)]
            expected = [hf_greedy(model_dir, p, MAX_TOKENS) for p in prompts]
            cache[kind] = (model_dir, prompts, expected)
        return cache[kind]

    return get


SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    ("kind", "placement"),
    [
        pytest.param("qwen3_next", "all-on-device", marks=SLOW),
        ("qwen3_next", "weights-disk-state-cpu"),
        pytest.param("qwen3_next", "mixed", marks=SLOW),
        pytest.param("granite4", "mixed", marks=SLOW),  # Mamba-2 as Nemotron-H's
        ("nemotron_h", "mixed"),
        ("falcon_h1", "mixed"),
    ],
)
def test_prefix_cache_restores_the_state_at_the_end_of_a_shared_prefix(
    shared_prefix, tmp_path, kind, placement
):
    """Six prompts share a 40-token prefix, sent one after another. The first computes it
    and its full pages are cached, but no state: the second finds 32 tokens of cached KV and
    no saved state at their end, so it recomputes them in a first chunk that ends there and
    saves the state; the other four start from that state and the cached KV (4 hits of 32
    tokens, their first chunk from position 32), and every request's tokens equal
    transformers'. With `prefix_state_slots=0` nothing hits, the tokens are the same and so
    is every generated token's logprob (within 1e-4: the state restored is the state that
    recomputing the prefix reaches; a tiny random model's tokens alone barely depend on it)."""
    model_dir, prompts, expected = shared_prefix(kind)
    spec = {"gpu_batch_size": 2, "num_gpu_batches": 2, **PLACEMENTS[placement]}
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)
    logprobs: dict[int, list[float]] = {}
    for slots in (8, 0):
        with LLM(
            str(model_dir),
            policy=Policy(**spec),  # type: ignore[arg-type]
            offload_dir=tmp_path / str(slots),
            device="cpu",
            prefix_state_slots=slots,
        ) as llm:
            scheduler = llm.scheduler
            chunks = record_chunks(scheduler)
            outs = [llm.generate([p], params)[0].outputs[0] for p in prompts]
            got = [out.token_ids for out in outs]
            logprobs[slots] = [t.logprob for out in outs for t in out.logprobs or []]
            stats = scheduler.page_manager.stats
            first = [c for c in chunks if c.sampling is not None]  # each request's first
        assert got == expected
        if slots == 0:
            assert stats.hit_tokens == stats.state_hits == stats.state_saves == 0
            assert logprobs[8] == pytest.approx(logprobs[0], abs=1e-4)
            continue
        assert (stats.state_saves, stats.state_hits, stats.hit_tokens) == (1, 4, 4 * 32)
        assert [c.start_pos for c in first] == [0, 0, 32, 32, 32, 32]
        assert len(first[1].token_ids) == 32 and first[1].state_save is not None
        assert all(c.state_restore == first[1].state_save for c in first[2:])
        assert sum(c.state_save is not None for c in chunks) == 1


@pytest.mark.parametrize("kind", ["qwen3_next", "falcon_h1"])
def test_prefix_cache_under_refill_preemption_and_chunked_prefill(tiny_model, tmp_path, kind):
    """Ten prompts of one 40-token prefix and 2..20 tokens of their own through a block of
    4, planned one step ahead, 24 tokens generated each: 16-token steps cut every prompt into
    chunks (the state save falls inside one: the chunk is cut there), a KV pool of 8 pages
    admits two sequences whose growth then preempts one (a preempted sequence's restore or
    save is looked up again when it is readmitted), and later requests start from the saved
    state. Every request's tokens equal transformers'."""
    model_dir = tiny_model(kind)
    vocab = vocab_size(kind)
    prefix = random_prompts(1, vocab, PREFIX_TOKENS, PREFIX_TOKENS, seed=9)[0]
    prompts = [prefix + tail for tail in random_prompts(10, vocab, 2, 20, seed=10)]
    expected = [hf_greedy(model_dir, p, 24) for p in prompts]
    policy = Policy(gpu_batch_size=2, num_gpu_batches=2)
    with tight_engine(model_dir, policy, tmp_path, {"gpu": 8}) as llm:
        scheduler = llm.scheduler
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        got = [out.outputs[0].token_ids for out in llm.generate(prompts, params)]
        stats = scheduler.page_manager.stats
        assert got == expected
        assert scheduler.num_preemptions > 0
        assert stats.state_saves >= 1 and stats.state_hits > 0
        assert not any(scheduler.state_slots.num_used(t) for t in ("gpu", "cpu"))
