"""The sampler draws every row of a step in one batch: its uniforms are a counter-based
hash (the same for a (key, counter) pair wherever the row sits), its truncation keeps the
same tokens as one row at a time did, and its draws follow the truncated distribution."""

from __future__ import annotations

import pytest
import torch

from engine.core.sampling_params import SamplingParams
from engine.executor.draws import as_int64, mix64, uniforms
from engine.executor.logits import LogitsProcessor, RowTokens, apply_row_bits
from engine.executor.sampler import Sampler, draw_rows_of, truncate
from engine.kernels import token_mask

MASK = 2**64 - 1


def splitmix64(x: int) -> int:
    """The reference: SplitMix64's finalizer on Python integers."""
    z = (x + 0x9E3779B97F4A7C15) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def test_the_hash_is_splitmix64_and_a_pair_draws_the_same_anywhere() -> None:
    inputs = [0, 1, 2, 12345, -1, 2**63 - 1, -(2**63), 0x5EED]
    got = mix64(torch.tensor(inputs, dtype=torch.long)).tolist()
    assert got == [as_int64(splitmix64(x % 2**64)) for x in inputs]
    keys = torch.tensor([7, 7, 99, 7], dtype=torch.long)
    counters = torch.tensor([0, 1, 0, 0], dtype=torch.long)
    u = uniforms(keys, counters)
    assert u[0] == u[3] and u[0] != u[1] and u[0] != u[2]  # the pair decides, not the row
    assert uniforms(keys[3:], counters[3:])[0] == u[0]  # nor the batch around it
    many = uniforms(torch.full((50_000,), 3, dtype=torch.long), torch.arange(50_000))
    assert float(many.min()) >= 0.0 and float(many.max()) < 1.0
    assert abs(float(many.mean()) - 0.5) < 4 * (1 / 12 / 50_000) ** 0.5
    deciles = torch.histc(many, bins=10, min=0.0, max=1.0)
    assert float(((deciles - 5_000) ** 2 / 5_000).sum()) < 27.9  # chi-square, 9 dof, p=0.001


def reference_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """One row's distribution as the sampler computed it a row at a time before it batched."""
    scores = logits.float() / p.temperature
    if p.min_p > 0.0:
        probs = torch.softmax(scores, dim=-1)
        scores = scores.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    if 0 < p.top_k < scores.shape[-1]:
        kth = torch.topk(scores, p.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        sorted_probs = torch.softmax(sorted_scores, dim=-1)
        drop = sorted_probs.cumsum(dim=-1) - sorted_probs >= p.top_p
        drop[0] = False
        scores = scores.scatter(0, order, sorted_scores.masked_fill(drop, float("-inf")))
    return torch.softmax(scores, dim=-1)


SETTINGS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.6),
    SamplingParams(temperature=1.0, min_p=0.2),
    SamplingParams(temperature=0.9, top_k=8, top_p=0.8, min_p=0.05),
    SamplingParams(temperature=2.0, top_k=1000),  # a top-k past the vocabulary: off
]


def test_batched_truncation_keeps_what_one_row_at_a_time_kept() -> None:
    """Every setting in one batch: each row's distribution equals its own reference."""
    vocab = 40
    logits = torch.randn(len(SETTINGS), vocab, generator=torch.Generator().manual_seed(1)) * 3
    draws = draw_rows_of(SETTINGS, {}, vocab)
    floats = torch.tensor(
        [
            [p.temperature for p in SETTINGS],
            [p.min_p for p in SETTINGS],
            [float(p.top_k if p.top_k < vocab else 0) for p in SETTINGS],
            [p.top_p for p in SETTINGS],
        ]
    )
    scores = truncate(logits / floats[0][:, None], draws, *floats[1:])
    probs = torch.softmax(scores, dim=-1)
    for row, p in enumerate(SETTINGS):
        want = reference_probs(logits[row], p)
        assert torch.equal(probs[row] > 0, want > 0), p
        torch.testing.assert_close(probs[row], want)


@pytest.mark.parametrize("setting", range(len(SETTINGS)))
def test_draws_follow_the_reference_distribution(setting: int) -> None:
    """4,000 unseeded draws of one row's settings, as rows of a few big steps: each token's
    count within 4.5 standard deviations of its reference probability, and no token the
    reference excludes."""
    p = SETTINGS[setting]
    vocab, num = 24, 4_000
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(setting)) * 2
    sampler = Sampler(seed=setting)
    counts = torch.zeros(vocab)
    for _ in range(num // 500):  # steps of 500 rows
        tokens, _, errors = sampler.sample(logits.expand(500, -1).clone(), [p] * 500, [0] * 500)
        assert not errors
        counts += torch.bincount(torch.tensor(tokens), minlength=vocab)
    want = reference_probs(logits, p)
    assert float(counts[want == 0].sum()) == 0
    spread = 4.5 * (want * (1 - want) / num).sqrt() + 1e-9
    assert bool(((counts / num - want).abs() <= spread).all()), (counts / num, want)


def test_greedy_rows_beside_drawn_rows_are_the_argmax() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=4)] * 3
    tokens, _, _ = Sampler().sample(logits.clone(), params, [0] * 6)
    assert tokens[::2] == logits.argmax(dim=-1)[::2].tolist()


def test_a_seeded_row_draws_the_same_wherever_it_sits() -> None:
    logits = torch.randn(50, generator=torch.Generator().manual_seed(3))
    seeded = SamplingParams(temperature=1.0, seed=77)
    other = SamplingParams(temperature=1.0)
    alone = [Sampler().sample(logits[None].clone(), [seeded], [i])[0][0] for i in range(30)]
    crowded = []
    for i in range(30):
        tokens, _, _ = Sampler(seed=i).sample(
            logits.expand(3, -1).clone(),
            [other, other, seeded][i % 3 :] + [other] * (i % 3),
            [5, 6, i][i % 3 :] + [0] * (i % 3),
        )
        crowded.append(tokens[2 - i % 3])
    assert crowded == alone and len(set(alone)) > 3


def test_the_batched_logits_stage_equals_each_row_alone() -> None:
    """Rows with different settings side by side, in one pass: each row as if alone."""
    vocab, eos = 30, 29
    rows = [
        RowTokens(0, SamplingParams(allowed_token_ids=(2, 5, 7), logit_bias={5: 1.5}), [], []),
        RowTokens(1, SamplingParams(repetition_penalty=1.4), [3, 3, 9], [1, 2, 3]),
        RowTokens(2, SamplingParams(), [], []),
        RowTokens(3, SamplingParams(frequency_penalty=0.5, presence_penalty=0.3), [4, 4, 8], []),
        RowTokens(4, SamplingParams(max_tokens=9, min_tokens=4, stop_token_ids=(6,)), [1], []),
        RowTokens(5, SamplingParams(bad_words_token_ids=((1, 2),), logit_bias={0: -3.0}), [1], []),
    ]
    logits = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(5))
    stage = LogitsProcessor(vocab, (eos,))
    together = logits.clone()
    assert stage.apply(together, rows) == {}
    for r, row in enumerate(rows):
        alone = logits[r : r + 1].clone()
        assert stage.apply(alone, [row]) == {}
        torch.testing.assert_close(together[r], alone[0], rtol=0, atol=0)


def test_grammar_bits_of_some_rows_apply_in_one_pass() -> None:
    """The rows' bits together (the path off the CPU) equal the native op row by row."""
    vocab, gen = 70, torch.Generator().manual_seed(6)
    logits = torch.randn(4, vocab, generator=gen)
    bits = [torch.randint(-(2**31), 2**31 - 1, (1, 3), generator=gen).int() for _ in range(2)]
    batched, native = logits.clone(), logits.clone()
    apply_row_bits(batched, [1, 3], bits, None)
    kernel = token_mask()
    assert kernel is not None, "the native CPU kernels did not build"
    apply_row_bits(native, [1, 3], bits, kernel)
    assert torch.equal(batched, native)
    assert torch.equal(batched[[0, 2]], logits[[0, 2]]) and bool(batched[1].isinf().any())
