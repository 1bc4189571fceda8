"""The logits stage alone: each setting does what vLLM's does to a row, touches only its own
row, and a row whose settings fail reports an error instead of failing the step."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from engine.core.sampling_params import SamplingError, SamplingParams
from engine.executor.logits import LogitsProcessor, RowTokens, apply_bits
from engine.executor.sampler import Sampler
from engine.kernels import token_mask

VOCAB, EOS = 12, 11
INF = float("-inf")


def run(
    params: SamplingParams,
    out: list[int] = (),
    prompt: list[int] = (),  # type: ignore[assignment]
) -> tuple[torch.Tensor, dict[int, str]]:
    """One row of distinct logits (0, 1, ..., 11) through the stage, beside a plain row."""
    logits = torch.arange(VOCAB, dtype=torch.float32).repeat(2, 1)
    rows = [RowTokens(0, params, list(out), list(prompt)), RowTokens(1, SamplingParams(), [], [])]
    errors = LogitsProcessor(VOCAB, (EOS,)).apply(logits, rows)
    assert torch.equal(logits[1], torch.arange(VOCAB, dtype=torch.float32))  # untouched
    return logits[0], errors


def test_allowed_tokens_bias_and_bans():
    x, errors = run(SamplingParams(allowed_token_ids=(2, 5, 7), logit_bias={5: 3.5, 7: -100}))
    assert not errors
    assert x.tolist() == [INF, INF, 2.0, INF, INF, 8.5, INF, -93.0, INF, INF, INF, INF]


def test_bad_words_ban_the_word_where_the_output_ends_with_its_start():
    params = SamplingParams(bad_words_token_ids=((4,), (1, 2, 9), (3, 6)))
    x, _ = run(params, out=[5, 1, 2])
    assert x[4] == INF and x[9] == INF and x[6] == 6.0  # (3, 6): the output does not end in 3
    x, _ = run(params, out=[5, 3])
    assert x[6] == INF and x[9] == 9.0


def test_min_tokens_ban_eos_and_stop_ids_until_reached():
    params = SamplingParams(max_tokens=8, min_tokens=3, stop_token_ids=(4,))
    x, _ = run(params, out=[1, 2])
    assert x[EOS] == INF and x[4] == INF
    x, _ = run(params, out=[1, 2, 3])
    assert x[EOS] == 11.0 and x[4] == 4.0


def test_penalties_follow_vllm_and_transformers():
    out, prompt = [3, 3, 5], [1, 3, 7]
    x, _ = run(SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), out=out)
    want = torch.arange(VOCAB, dtype=torch.float32)
    want[3] -= 2 * 0.5 + 0.25
    want[5] -= 1 * 0.5 + 0.25
    torch.testing.assert_close(x, want)
    # repetition: over prompt and output, as transformers' processor does over input_ids
    signed = torch.arange(VOCAB, dtype=torch.float32) - 4.0  # negative and positive logits
    logits = signed.clone()[None]
    rows = [RowTokens(0, SamplingParams(repetition_penalty=1.3), out, prompt)]
    assert not LogitsProcessor(VOCAB, (EOS,)).apply(logits, rows)
    reference = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([prompt + out]), signed[None])
    torch.testing.assert_close(logits, reference)


def test_a_bad_row_fails_alone():
    _, errors = run(SamplingParams(logit_bias={VOCAB + 3: 1.0}))
    assert list(errors) == [0] and "sampling settings failed" in errors[0]
    _, errors = run(SamplingParams(allowed_token_ids=(EOS,), min_tokens=1, max_tokens=4))
    assert errors == {0: "no token is allowed (the constraints exclude every token)"}


def test_out_of_range_settings_are_refused_by_name():
    for bad, name in [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
        ({"logit_bias": {3: 101.0}}, "logit_bias"),
        ({"allowed_token_ids": ()}, "allowed_token_ids"),
        ({"max_tokens": 0}, "max_tokens"),
    ]:
        with pytest.raises(SamplingError, match=name):
            SamplingParams(**bad)  # type: ignore[arg-type]
    with pytest.raises(SamplingError, match="logit_bias names token 99"):
        SamplingParams(logit_bias={99: 1.0}).check_vocab(VOCAB)


def test_logprobs_are_the_models_and_the_token_the_processed_ones():
    """vLLM's default: logprobs of the raw distribution; greedy picks after the stage."""
    logits = torch.arange(VOCAB, dtype=torch.float32)[None].clone()
    raw = torch.log_softmax(logits[0], -1)
    params = [SamplingParams(temperature=0.0, logprobs=2, logit_bias={3: 50.0})]
    stage = LogitsProcessor(VOCAB, (EOS,))
    rows = [RowTokens(0, params[0], [], [])]
    tokens, logprobs, errors = Sampler().sample(logits, params, [0], lambda x: stage.apply(x, rows))
    assert tokens == [3] and not errors and logprobs[0] is not None
    assert logprobs[0].logprob == pytest.approx(float(raw[3]))
    assert [t for t, _ in logprobs[0].top] == [11, 10]


def test_min_p_keeps_tokens_near_the_likeliest():
    logits = torch.tensor([[3.0, 2.9, 0.0, -5.0]])
    params = SamplingParams(temperature=1.0, min_p=0.5, seed=1)
    drawn = {Sampler().sample(logits, [params], [i])[0][0] for i in range(200)}
    assert drawn == {0, 1}


@pytest.mark.parametrize("native", [True, False])
def test_token_bits_mask_exactly_the_cleared_tokens(native):
    g = torch.Generator().manual_seed(0)
    vocab = 70  # the last word holds 6 tokens
    allowed = torch.rand(3, vocab, generator=g) < 0.3
    allowed[1] = True  # a row with every bit set
    padded = torch.zeros(3, 96, dtype=torch.bool)
    padded[:, :vocab] = allowed
    weights = 2 ** torch.arange(32, dtype=torch.int64)
    words = (padded.view(3, 3, 32).long() * weights).sum(-1)
    bits = (words - (words >= 2**31).long() * 2**32).to(torch.int32)  # as int32 words
    logits = torch.randn(3, vocab, generator=g)
    want = logits.masked_fill(~allowed, INF)
    kernel = token_mask() if native else None
    if native:
        assert kernel is not None, "the native CPU kernels did not build"
    apply_bits(logits, bits, kernel)
    assert torch.equal(logits, want)
