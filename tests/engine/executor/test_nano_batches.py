"""Nano-batching (NanoFlow 4.3): how a GPU batch is cut, that the cut pieces attend exactly as
the whole batch does, and that greedy tokens equal both `num_nano_batches=1` and transformers
for every model family, placement and batch shape. Overlap itself is proven from the trace
(tests/engine/executor/test_trace_overlap.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine import LLM, SamplingParams
from engine.core.protocol import SeqChunk
from engine.core.sampling_params import SamplingParams as Sampling
from engine.executor.attention import ragged_attention
from engine.executor.batch_builder import BatchBuilder
from engine.executor.gpu_batch import SeqState
from engine.executor.nano_batches import NanoBatcher, balanced_cuts
from policy import Policy, PolicyError
from tests.engine.tiny_models import MAX_TOKENS

PAGE = 16


def test_cuts_balance_the_weights_and_never_leave_a_group_empty() -> None:
    assert balanced_cuts([1.0] * 8, 4) == [0, 2, 4, 6, 8]
    assert balanced_cuts([1.0] * 5, 2) == [0, 2, 5]  # unequal when it does not divide
    assert balanced_cuts([6.0, 1.0, 1.0, 1.0, 1.0], 2) == [0, 1, 5]  # a heavy item stands alone
    assert balanced_cuts([1.0, 1.0, 1.0, 9.0], 4) == [0, 1, 2, 3, 4]  # one each, never empty
    assert balanced_cuts([1.0, 2.0, 3.0], 4) == [0, 1, 2, 3]  # fewer items than groups
    assert balanced_cuts([5.0], 2) == [0, 1]


def _builder(cpu_attention: bool, window: int | None = None) -> BatchBuilder:
    return BatchBuilder(
        torch.device("cpu"),
        PAGE,
        cpu_attention=cpu_attention,
        windows=(window or 0,),
        pool_device=lambda tier: torch.device("cpu"),
    )


def _chunks(shapes: list[tuple[int, int, str]]) -> list[tuple[SeqChunk, SeqState]]:
    """(new tokens, past tokens, kv tier) per sequence -> chunks with page tables."""
    out = []
    for seq_id, (q_len, past, tier) in enumerate(shapes):
        ids = range(seq_id * 8, seq_id * 8 + (past + q_len + PAGE - 1) // PAGE)
        state = SeqState(tier, "gpu", Sampling(max_tokens=1), pages=[(tier, p) for p in ids])
        chunk = SeqChunk(seq_id, [5] * q_len, past, 0, [], tier, "gpu", do_sample=True)
        out.append((chunk, state))
    return out


# prefills and decodes, device- and CPU-attended, some with no past: 7 sequences
RAGGED = [
    (9, 0, "gpu"),
    (1, 30, "cpu"),
    (1, 12, "gpu"),
    (4, 20, "cpu"),
    (1, 3, "cpu"),
    (1, 40, "gpu"),
    (2, 0, "cpu"),
]


@pytest.mark.parametrize("num_nano", [2, 4])
@pytest.mark.parametrize("cpu_attention", [False, True])
@pytest.mark.parametrize("window", [None, 8])
def test_nano_batches_attend_exactly_as_the_whole_batch(
    num_nano: int, cpu_attention: bool, window: int | None
) -> None:
    """Each nano-batch's rows, past slices and layouts reproduce the whole batch's attention,
    row for row (padding rows included), whatever the mix of devices and lengths."""
    builder, chunks = _builder(cpu_attention, window), _chunks(RAGGED)
    batch = builder.build(0, chunks, num_padding=3)
    nanos = NanoBatcher(num_nano, builder).split(batch, chunks)
    assert len(nanos) == num_nano
    assert [n.rows.start for n in nanos] == [0, *(n.rows.stop for n in nanos[:-1])]
    assert nanos[-1].rows.stop == batch.num_tokens  # padding rides with the last one
    g = torch.Generator().manual_seed(0)
    t, heads, kv_heads, dim = batch.num_tokens, 4, 2, 8
    q, k, v = (torch.randn(t, h, dim, generator=g) for h in (heads, kv_heads, kv_heads))
    whole = torch.zeros_like(q)
    pasts: dict[bool, torch.Tensor] = {}
    for on_cpu, group in ((False, batch.device_group), (True, batch.cpu_group)):
        if group is None:
            continue
        past = pasts[on_cpu] = torch.randn(group.layout.num_past, 2, kv_heads, dim, generator=g)
        rows = group.rows if group.rows is not None else slice(None)
        whole[rows] = ragged_attention(
            q[rows], k[rows], v[rows], past[:, 0], past[:, 1], group.layout
        )
    assert whole.abs().sum() > 0
    for nano in nanos:
        got = torch.zeros(nano.num_rows, heads, dim)
        for on_cpu, part in ((False, nano.device), (True, nano.cpu)):
            if part is None:
                continue
            local = part.rows if part.rows is not None else slice(None)
            qn, kn, vn = (x[nano.rows][local] for x in (q, k, v))
            past = pasts[on_cpu][part.past]
            layout = part.layouts[window or 0]
            got[local] = ragged_attention(qn, kn, vn, past[:, 0], past[:, 1], layout)
        torch.testing.assert_close(got, whole[nano.rows], rtol=1e-5, atol=1e-6)


def test_one_sequence_is_not_split_and_few_sequences_give_fewer_nano_batches() -> None:
    builder = _builder(cpu_attention=True)
    one = _chunks([(1, 10, "cpu")])
    assert NanoBatcher(4, builder).split(builder.build(0, one), one) == []
    three = _chunks([(1, 10, "cpu"), (1, 5, "gpu"), (1, 7, "cpu")])
    nanos = NanoBatcher(4, builder).split(builder.build(0, three, num_padding=1), three)
    assert [n.num_rows for n in nanos] == [1, 1, 2]
    assert [(n.device is None, n.cpu is None) for n in nanos] == [
        (True, False),
        (False, True),
        (True, False),
    ]


def test_policy_takes_one_two_or_four_nano_batches() -> None:
    assert Policy(num_nano_batches=4).num_nano_batches == 4
    with pytest.raises(PolicyError, match="1, 2 or 4"):
        Policy(num_nano_batches=3)
    with pytest.raises(PolicyError, match="cannot exceed"):
        Policy(gpu_batch_size=1, num_nano_batches=2)


# -- greedy tokens -------------------------------------------------------------------------

PLACEMENTS: dict[str, dict[str, Any]] = {
    "resident": {},
    "offloaded-cpu-attention": dict(
        weights_frac=(0.0, 0.5, 0.5), kv_frac=(0.0, 1.0, 0.0), cpu_attention=True
    ),
    "offloaded-gpu-attention": dict(weights_frac=(0.0, 0.5, 0.5), kv_frac=(0.0, 1.0, 0.0)),
    "mixed-tiers-cpu-attention": dict(
        kv_frac=(0.4, 0.3, 0.3), act_frac=(0.3, 0.3, 0.4), cpu_attention=True
    ),
}
SHAPE = dict(gpu_batch_size=5, num_gpu_batches=2)
"""6 prompts: GPU batches of 5 (cut 3 + 2, or 2 + 1 + 1 + 1) and 1 (not cut); ragged as the
sequences' lengths are, with padding rows on discrete steps."""


def run(model_dir: Path, prompts: list[list[int]], policy: Policy, tmp_path: Path, **engine: Any):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    with LLM(
        str(model_dir), policy=policy, offload_dir=tmp_path / "off", device="cpu", **engine
    ) as llm:
        tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        nano = llm.executor.pipeline.nano
        layers_run = 0 if nano is None else nano.num_layers_run
    return tokens, layers_run


@pytest.mark.parametrize("num_nano", [2, 4])
@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_llama_nano_batches_match_one_and_transformers(
    tiny_model, references, tmp_path, placement, num_nano
):
    prompts, expected = references("llama")
    one, _ = run(tiny_model("llama"), prompts, Policy(**SHAPE, **PLACEMENTS[placement]), tmp_path)
    policy = Policy(**SHAPE, **PLACEMENTS[placement], num_nano_batches=num_nano)
    nano, layers_run = run(tiny_model("llama"), prompts, policy, tmp_path)
    assert nano == one == expected
    assert layers_run >= MAX_TOKENS * 3  # every step, every decoder layer of the model


@pytest.mark.parametrize("kind", ["opt", "llama3", "qwen2", "mistral"])
@pytest.mark.parametrize("placement", ["resident", "offloaded-cpu-attention"])
def test_every_family_matches_transformers_with_nano_batches(
    tiny_model, references, tmp_path, kind, placement
):
    prompts, expected = references(kind)
    policy = Policy(**SHAPE, **PLACEMENTS[placement], num_nano_batches=4)
    tokens, layers_run = run(tiny_model(kind), prompts, policy, tmp_path)
    assert tokens == expected and layers_run > 0


def test_nano_batch_only_baseline_and_a_batch_smaller_than_the_nano_batches(
    tiny_model, references, tmp_path
):
    """Split but not overlapped (NanoFlow's ablation baseline) gives the same tokens; so do
    three prompts in a batch cut four ways, and one prompt alone (not cut at all)."""
    prompts, expected = references("llama")
    policy = Policy(**SHAPE, **PLACEMENTS["mixed-tiers-cpu-attention"], num_nano_batches=2)
    tokens, layers_run = run(
        tiny_model("llama"), prompts, policy, tmp_path, nano_batch_overlap=False
    )
    assert tokens == expected and layers_run > 0
    small = Policy(
        gpu_batch_size=4, num_nano_batches=4, kv_frac=(0.0, 1.0, 0.0), cpu_attention=True
    )
    assert run(tiny_model("llama"), prompts[:3], small, tmp_path)[0] == expected[:3]
    tokens, layers_run = run(tiny_model("llama"), prompts[:1], small, tmp_path)
    assert tokens == expected[:1] and layers_run == 0
