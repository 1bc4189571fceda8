"""n choices from one prefill through the real executor: the first choice computes the
prompt, the others fork its pages and sample from its logits row; seeded and greedy outputs
equal the unforked path's (each choice sent alone, n = 1, with its seed), with the KV
resident and homed on the cpu tier (greedy equals transformers' in the slow test). The
off switch (no prefix caching: every choice computes its prompt) is counted in
tests/engine/core/test_prefix_order.py."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.core.protocol import StepPlan, StepResult
from policy import Policy
from tests.engine.fakes import prefill_tokens
from tests.engine.tiny_models import hf_greedy, random_prompts, vocab_size

PROMPT_LEN = 40  # 2.5 pages of 16: two full pages shared, the half page copied on write
SEEDED = SamplingParams(n=8, max_tokens=5, temperature=1.0, seed=11, ignore_eos=True)
GREEDY = SamplingParams(n=3, max_tokens=5, temperature=0.0, ignore_eos=True)
PENALIZED = SamplingParams(n=2, max_tokens=5, temperature=0.0, repetition_penalty=0.05)
"""Its settings read the prompt's tokens (a penalty below 1 favours them): a fork gets them
without computing the prompt, or it would pick other tokens."""


def alone(params: SamplingParams) -> list[SamplingParams]:
    """Each choice of `params` as a request of its own (choice i samples with seed + i)."""
    seed = params.seed
    return [
        dataclasses.replace(params, n=1, seed=None if seed is None else seed + i)
        for i in range(params.n)
    ]


@pytest.mark.parametrize("kv_tier", ["gpu", "cpu"])  # on the CPU the gpu tier is resident
def test_n_choices_fork_one_prefill_with_unchanged_outputs(
    tiny_model: Callable[[str], Path], kv_tier: str
) -> None:
    model_dir = tiny_model("llama")
    prompts = random_prompts(3, vocab_size("llama"), PROMPT_LEN, PROMPT_LEN, seed=3)
    kv_frac = (1.0, 0.0, 0.0) if kv_tier == "gpu" else (0.0, 1.0, 0.0)
    with LLM(str(model_dir), policy=Policy(kv_frac=kv_frac), device="cpu") as llm:
        plans: list[StepPlan] = []
        execute = llm.executor.execute

        def recording(plan: StepPlan) -> StepResult:  # the real executor runs every plan
            plans.append(plan)
            return execute(plan)

        llm.executor.execute = recording  # type: ignore[method-assign]
        forked = llm.generate(prompts, [SEEDED, GREEDY, PENALIZED])
        forked_plans = list(plans)
        singles = [*alone(SEEDED), *alone(GREEDY), *alone(PENALIZED)]
        unforked = llm.generate([prompts[0]] * 8 + [prompts[1]] * 3 + [prompts[2]] * 2, singles)
    choices = [c.token_ids for o in forked for c in o.outputs]
    assert choices == [o.outputs[0].token_ids for o in unforked]
    assert len(set(map(tuple, choices[:8]))) > 1  # the seeded choices differ from each other
    assert prefill_tokens(forked_plans, PROMPT_LEN) == 3 * PROMPT_LEN  # each prompt once
    assert all(c.kv_tier == kv_tier for plan in forked_plans for c in plan.chunks)
    copies = sum(len(plan.page_copies) for plan in forked_plans)
    assert copies == (8 - 1) + (3 - 1) + (2 - 1)  # the half page's last holder writes in place
    assert [len(o.prompt_token_ids) for o in forked] == [PROMPT_LEN] * 3


@pytest.mark.slow  # transformers' reference
def test_forked_greedy_choices_equal_transformers(tiny_model: Callable[[str], Path]) -> None:
    model_dir = tiny_model("llama")
    prompts = random_prompts(2, vocab_size("llama"), PROMPT_LEN, PROMPT_LEN, seed=3)
    with LLM(str(model_dir), policy=Policy(), device="cpu") as llm:
        out = llm.generate(prompts, [SEEDED, GREEDY])
    assert [c.token_ids for c in out[1].outputs] == [hf_greedy(model_dir, prompts[1], 5)] * 3
