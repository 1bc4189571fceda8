"""echo + logprobs: the prompt's logprobs equal transformers' at every position, however the
prompt was split into prefill chunks."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from policy import Policy


@pytest.mark.parametrize("max_step_tokens", [2048, 8, 5], ids=["one-chunk", "chunks-of-8", "5"])
def test_prompt_logprobs_match_transformers(tiny_model, tmp_path, max_step_tokens):
    from transformers import AutoModelForCausalLM

    model_dir = tiny_model("llama")
    prompt = torch.randint(3, 300, (21,), generator=torch.Generator().manual_seed(1)).tolist()
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        expected = torch.log_softmax(reference(torch.tensor([prompt])).logits[0], dim=-1)
    params = SamplingParams(max_tokens=2, temperature=0.0, logprobs=3, echo=True)
    with LLM(
        str(model_dir),
        policy=Policy(gpu_batch_size=4, kv_frac=(0.0, 1.0, 0.0)),
        offload_dir=tmp_path,
        device="cpu",
        max_step_tokens=max_step_tokens,
    ) as llm:
        out = llm.generate([prompt], params)[0]
    got = out.prompt_logprobs
    assert got is not None and len(got) == len(prompt) - 1  # position 0 has none
    for position, entry in enumerate(got, start=1):
        assert entry.token_id == prompt[position]
        assert entry.logprob == pytest.approx(
            float(expected[position - 1, prompt[position]]), abs=1e-4
        )
        top_ids = [t for t, _ in entry.top]
        assert top_ids == expected[position - 1].topk(3).indices.tolist()


def test_no_prompt_logprobs_without_echo(tiny_model):
    params = SamplingParams(max_tokens=2, temperature=0.0, logprobs=2)
    with LLM(str(tiny_model("llama")), policy=Policy(), device="cpu") as llm:
        assert llm.generate([[5, 6, 7]], params)[0].prompt_logprobs is None


def test_prompt_logprobs_are_the_same_when_the_prefix_is_cached(tiny_model, tmp_path):
    """An evaluation harness scores questions that share a few-shot prefix of several pages:
    with the prefix cache on (the default) a later question finds that prefix cached, and
    its prompt logprobs must still cover every position, equal to a run without the cache
    (vLLM likewise does not reuse cached KV for a request that wants prompt logprobs)."""
    g = torch.Generator().manual_seed(3)
    shots = torch.randint(3, 300, (70,), generator=g).tolist()  # over 4 pages of 16
    questions = [shots + torch.randint(3, 300, (9,), generator=g).tolist() for _ in range(3)]
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=1, echo=True)

    def scores(caching: bool) -> list[list[float]]:
        with LLM(
            str(tiny_model("llama")),
            policy=Policy(),
            device="cpu",
            offload_dir=tmp_path / str(caching),
            enable_prefix_caching=caching,
        ) as llm:
            outs = [llm.generate([q], params)[0] for q in questions]  # one after another
        for out, q in zip(outs, questions, strict=True):
            assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(q) - 1
            assert [e.token_id for e in out.prompt_logprobs] == q[1:]
        return [[e.logprob for e in out.prompt_logprobs] for out in outs]  # type: ignore[union-attr]

    cold = scores(caching=False)
    for got, want in zip(scores(caching=True), cold, strict=True):
        assert got == pytest.approx(want, abs=1e-5)
