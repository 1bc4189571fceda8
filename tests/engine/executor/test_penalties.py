"""Penalties and biases through the whole engine, greedy, against transformers' forward with
the same processing applied by hand (transformers' RepetitionPenaltyLogitsProcessor, vLLM's
presence and frequency penalties): token for token, with the prompt's first pages served
from the prefix cache the second time (the penalties still see the whole prompt)."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from engine import LLM, SamplingParams
from tests.engine.tiny_models import random_prompts

PARAMS = SamplingParams(
    max_tokens=10,
    temperature=0.0,
    ignore_eos=True,
    repetition_penalty=1.8,
    frequency_penalty=0.6,
    presence_penalty=0.4,
    logit_bias={7: 1.5, 9: -2.0},
)


def reference(model_dir, prompt: list[int], params: SamplingParams) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    repetition = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)
    out: list[int] = []
    for _ in range(params.max_tokens):
        ids = torch.tensor([prompt + out])
        with torch.no_grad():
            logits = model(ids).logits[:, -1].float()
        for token_id, bias in params.logit_bias.items():
            logits[0, token_id] += bias
        logits = repetition(ids, logits)
        for token_id in set(out):
            count = out.count(token_id)
            logits[0, token_id] -= params.frequency_penalty * count + params.presence_penalty
        out.append(int(logits.argmax()))
    return out


def test_penalties_and_bias_equal_transformers_with_a_cached_prefix(tiny_model):
    model_dir = tiny_model("llama")
    vocab = 300
    shared = random_prompts(1, vocab, 40, 40, seed=11)[0]  # 2 full pages and a bit
    prompts = [shared + tail for tail in random_prompts(3, vocab, 3, 9, seed=12)]
    want = [reference(model_dir, p, PARAMS) for p in prompts]
    with LLM(str(model_dir), device="cpu") as llm:
        first = [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS)]
        again = llm.generate(prompts, PARAMS)
    assert first == want
    assert [o.outputs[0].token_ids for o in again] == want
    assert all(o.num_cached_tokens >= 32 for o in again)  # the prefix came from the cache
