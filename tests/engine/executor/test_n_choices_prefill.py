"""n choices from one prefill through the real executor: the first choice computes the
prompt, the others fork its pages and sample from its logits row; seeded and greedy outputs
equal the off switch's (no prefix caching: every choice computes its prompt), with the KV
resident and homed on the cpu tier (greedy equals transformers' in the slow test)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.core.protocol import StepPlan, StepResult
from policy import Policy
from tests.engine.tiny_models import hf_greedy, random_prompts, vocab_size

PROMPT_LEN = 40  # 2.5 pages of 16: two full pages shared, the half page copied on write
SEEDED = SamplingParams(n=8, max_tokens=5, temperature=1.0, seed=11, ignore_eos=True)
GREEDY = SamplingParams(n=3, max_tokens=5, temperature=0.0, ignore_eos=True)


Run = tuple[list[list[list[int]]], int, int, list[tuple[int, int]]]


def run(model_dir: Path, prompts: list[list[int]], policy: Policy, caching: bool) -> Run:
    """The two requests' choices, the prompt positions the executor computed, and the
    partial pages it copied."""
    with LLM(str(model_dir), policy=policy, device="cpu", enable_prefix_caching=caching) as llm:
        plans: list[StepPlan] = []
        execute = llm.executor.execute

        def recording(plan: StepPlan) -> StepResult:  # the real executor runs every plan
            plans.append(plan)
            return execute(plan)

        llm.executor.execute = recording  # type: ignore[method-assign]
        out = llm.generate(prompts, [SEEDED, GREEDY])
    computed = sum(
        max(0, min(c.start_pos + len(c.token_ids), PROMPT_LEN) - c.start_pos)
        for plan in plans
        for c in plan.chunks
    )
    copies = sum(len(plan.page_copies) for plan in plans)
    usage = [(len(o.prompt_token_ids), len(o.outputs)) for o in out]
    return [[c.token_ids for c in o.outputs] for o in out], computed, copies, usage


@pytest.mark.parametrize("kv_tier", ["gpu", "cpu"])  # on the CPU the gpu tier is resident
def test_n_choices_fork_one_prefill_with_unchanged_outputs(
    tiny_model: Callable[[str], Path], kv_tier: str
) -> None:
    model_dir = tiny_model("llama")
    prompts = random_prompts(2, vocab_size("llama"), PROMPT_LEN, PROMPT_LEN, seed=3)
    kv_frac = (1.0, 0.0, 0.0) if kv_tier == "gpu" else (0.0, 1.0, 0.0)
    policy = Policy(kv_frac=kv_frac)
    forked = run(model_dir, prompts, policy, caching=True)
    unforked = run(model_dir, prompts, policy, caching=False)
    assert forked[0] == unforked[0]
    assert len(set(map(tuple, forked[0][0]))) > 1  # the seeded choices differ from each other
    assert forked[1] == 2 * PROMPT_LEN  # each request's prompt once
    assert unforked[1] == (8 + 3) * PROMPT_LEN
    assert forked[2] == (8 - 1) + (3 - 1)  # the last holder of the half page writes in place
    assert unforked[2] == 0
    assert forked[3] == unforked[3] == [(PROMPT_LEN, 8), (PROMPT_LEN, 3)]


@pytest.mark.slow  # transformers' reference
def test_forked_greedy_choices_equal_transformers(tiny_model: Callable[[str], Path]) -> None:
    model_dir = tiny_model("llama")
    prompts = random_prompts(2, vocab_size("llama"), PROMPT_LEN, PROMPT_LEN, seed=3)
    outputs = run(model_dir, prompts, Policy(), caching=True)[0]
    assert outputs[1] == [hf_greedy(model_dir, prompts[1], 5)] * 3
