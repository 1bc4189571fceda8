"""n choices from one prefill through the real executor: the first choice computes the
prompt, the others hit its pages; seeded and greedy outputs equal the ordering-off run's
(and greedy equals transformers')."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from policy import Policy
from tests.engine.tiny_models import hf_greedy, random_prompts, vocab_size


@pytest.mark.slow  # two engines and transformers' reference (test_prefix_order.py counts it fast)
def test_n_choices_prefill_once_with_unchanged_outputs(tiny_model: Callable[[str], Path]) -> None:
    model_dir = tiny_model("llama")
    vocab = vocab_size("llama")
    seeded_prompt, greedy_prompt = random_prompts(2, vocab, 40, 40, seed=3)  # 2.5 pages each
    seeded = SamplingParams(n=8, max_tokens=5, temperature=1.0, seed=11, ignore_eos=True)
    greedy = SamplingParams(n=3, max_tokens=5, temperature=0.0, ignore_eos=True)
    runs = {}
    for ordering in (True, False):
        with LLM(str(model_dir), policy=Policy(), device="cpu", prefix_ordering=ordering) as llm:
            out = llm.generate([seeded_prompt, greedy_prompt], [seeded, greedy])
            hits = llm.scheduler.page_manager.stats.hit_tokens
        runs[ordering] = ([[c.token_ids for c in o.outputs] for o in out], hits)
    assert runs[True][0] == runs[False][0]
    assert runs[True][0][1] == [hf_greedy(model_dir, greedy_prompt, 5)] * 3
    # every choice but each request's first read the prompt's two full pages back
    assert runs[True][1] == (7 + 2) * 32
    assert runs[False][1] < runs[True][1]
