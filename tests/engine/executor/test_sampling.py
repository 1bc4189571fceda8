"""Sampling through the whole engine: seeds, top-k/top-p, logprobs, stops, bad input."""

from __future__ import annotations

import math

import pytest
import torch

from base.errors import UserError
from engine import LLM, SamplingError, SamplingParams
from engine.core.model_files import DEMO_MODEL
from engine.executor.draws import draw_rows
from engine.executor.sampler import Sampler
from policy import Policy


@pytest.fixture(scope="module")
def llm():
    with LLM(DEMO_MODEL, policy=Policy(gpu_batch_size=4, num_gpu_batches=2), device="cpu") as llm:
        yield llm


def test_seeded_sampling_ignores_batch_neighbours(llm):
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=1234, ignore_eos=True)
    alone = llm.generate(["The river"], params)[0].outputs[0].token_ids
    crowd = llm.generate(
        ["Once upon a time", "The river", "Numbers: 1 2 3"],
        [SamplingParams(max_tokens=5, temperature=0.7), params, SamplingParams(max_tokens=9)],
    )
    assert crowd[1].outputs[0].token_ids == alone
    other_seed = SamplingParams(max_tokens=12, temperature=1.0, seed=99, ignore_eos=True)
    assert llm.generate(["The river"], other_seed)[0].outputs[0].token_ids != alone


def test_top_k_one_is_greedy(llm):
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    top1 = SamplingParams(max_tokens=10, temperature=1.3, top_k=1, seed=5, ignore_eos=True)
    a, b = llm.generate(["Good morning", "Good morning"], [greedy, top1])
    assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_greedy_takes_the_first_of_tied_maxima():
    """Greedy rows pick what `argmax` picks, ties included (the first maximal id)."""
    logits = torch.tensor([[1.0, 5.0, 5.0, 0.0], [2.0, 2.0, 2.0, 2.0], [0.0, -1.0, 3.0, 3.0]])
    greedy = [SamplingParams(temperature=0.0)] * 3
    token_ids, _, _ = Sampler(seed=0).sample(logits, greedy, [0, 0, 0])
    assert token_ids == logits.argmax(dim=-1).tolist() == [1, 0, 2]


def test_top_p_keeps_the_nucleus():
    logits = torch.tensor([[4.0, 3.9, 0.0, -1.0, -2.0]])  # probabilities .51 .46 .02 .01 .00
    sampler = Sampler(seed=0)

    def drawn(top_p: float) -> set[int]:
        params = SamplingParams(temperature=1.0, top_p=top_p, seed=3)
        return {sampler.sample(logits, [params], [i])[0][0] for i in range(200)}

    assert drawn(0.5) == {0}  # the top token alone reaches 0.5
    assert drawn(0.8) == {0, 1}


def test_logprobs_match_log_softmax(llm):
    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=5, ignore_eos=True)
    out = llm.generate(["The sky is"], params)[0].outputs[0]
    assert out.logprobs is not None and len(out.logprobs) == 4
    for token_id, entry in zip(out.token_ids, out.logprobs, strict=True):
        assert entry.token_id == token_id and len(entry.top) == 5
        assert entry.top[0][0] == token_id  # greedy picks the most likely token
        assert entry.logprob == pytest.approx(entry.top[0][1])
        assert all(lp <= 0.0 for _, lp in entry.top)
        assert sum(math.exp(lp) for _, lp in entry.top) <= 1.0 + 1e-5


def test_stop_string_is_cut_and_never_returned(llm):
    base = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    full = llm.generate(["Hello there"], base)[0].outputs[0].text
    assert len(full) > 6
    stop = full[3:6]
    out = llm.generate(
        ["Hello there"],
        SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop]),
    )[0]
    assert out.outputs[0].text == full[: full.index(stop)]
    assert out.outputs[0].finish_reason == "stop"


def test_max_tokens_and_length_finish(llm):
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))[
        0
    ].outputs[0]
    assert len(out.token_ids) == 3 and out.finish_reason == "length"


def test_bad_input_is_a_clear_error(llm, tmp_path):
    with pytest.raises(SamplingError, match="temperature"):
        SamplingParams(temperature=-1.0)
    with pytest.raises(SamplingError, match="token ids"):
        llm.generate([[1, 2, 10**9]])
    with pytest.raises(SamplingError, match="2 sampling params for 1 prompts"):
        llm.generate(["a"], [SamplingParams(), SamplingParams()])
    with pytest.raises(UserError, match="dtype must be one of"):
        LLM(DEMO_MODEL, policy=Policy(), device="cpu", dtype="fp8")
    policy_file = tmp_path / "policy.json"
    policy_file.write_text('{"num_nano_batches": 3}')
    with pytest.raises(UserError, match="num_nano_batches must be 1, 2 or 4"):
        LLM(DEMO_MODEL, policy=str(policy_file), device="cpu")


def test_draw_follows_the_distribution_and_never_takes_an_impossible_token() -> None:
    """The inverse-CDF draw: each token as often as its probability (within 4 standard
    deviations over 20,000 draws, all drawn as the rows of one batch), never one of
    probability 0, also where u is at the ends."""
    probs = torch.tensor([0.1, 0.0, 0.6, 0.0, 0.3, 0.0])
    num = 20_000
    u = torch.rand(num, generator=torch.Generator().manual_seed(0))
    counts = torch.bincount(draw_rows(probs.expand(num, -1), u), minlength=6)
    assert counts[1] == counts[3] == counts[5] == 0
    for i in (0, 2, 4):
        p = float(probs[i])
        assert abs(counts[i] / num - p) < 4 * (p * (1 - p) / num) ** 0.5
    ends = draw_rows(probs.expand(2, -1), torch.tensor([0.0, 1.0 - 1e-9]))
    assert ends.tolist() == [0, 4]
