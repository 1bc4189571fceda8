"""Discrete batching (NanoFlow 4.2): every step runs at one of the chosen dense sizes, filled
with prefill while prompts wait and padded otherwise; padding never changes a token."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine import LLM, SamplingParams
from engine.core.protocol import StepPlan, StepResult
from engine.core.scheduler import discrete_sizes
from engine.executor.gpu_batch import GpuBatch
from policy import Policy
from policy.hardware import FLEXGEN_T4
from tests.engine.tiny_models import TINY_CONFIGS, hf_greedy, random_prompts

SIZES = (1, 2, 4, 8, 12, 16, 24, 32)
POLICY = Policy(gpu_batch_size=6, num_gpu_batches=2)  # a block of 12: decodes fill size 12


def workload() -> tuple[list[list[int]], list[SamplingParams]]:
    vocab = int(TINY_CONFIGS["llama"]["vocab_size"])  # type: ignore[call-overload]
    prompts = random_prompts(20, vocab, 2, 40, seed=7)
    g = torch.Generator().manual_seed(8)
    lengths = torch.randint(1, 12, (20,), generator=g).tolist()
    return prompts, [
        SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths
    ]


def run(model_dir: Path, **engine: Any) -> tuple[list[list[int]], list[tuple[int, int, int]]]:
    """Tokens, and per step (scheduled tokens, plan.dense_size, rows the pipeline ran)."""
    steps: list[tuple[int, int, int]] = []
    with LLM(str(model_dir), policy=POLICY, device="cpu", **engine) as llm:
        execute, pipeline_run = llm.executor.execute, llm.executor.pipeline.run
        planned: list[StepPlan] = []

        def record_plan(plan: StepPlan) -> StepResult:
            planned.append(plan)
            return execute(plan)

        def record_rows(batches: list[GpuBatch], moves: Any = ()) -> list[torch.Tensor]:
            plan = planned[-1]
            steps.append((plan.num_tokens, plan.dense_size, sum(b.num_tokens for b in batches)))
            return pipeline_run(batches, moves)

        llm.executor.execute = record_plan  # type: ignore[method-assign]
        llm.executor.pipeline.run = record_rows  # type: ignore[method-assign]
        prompts, params = workload()
        outputs = llm.generate(prompts, params)
    return [o.outputs[0].token_ids for o in outputs], steps


def test_the_executor_runs_exactly_the_chosen_sizes_and_tokens_do_not_change(tiny_model) -> None:
    model_dir = tiny_model("llama")
    on, steps = run(model_dir, batch_sizes=SIZES, max_step_tokens=32)
    off, plain = run(model_dir, discrete_batching=False, max_step_tokens=32)
    prompts, params = workload()
    assert on == off == [hf_greedy(model_dir, p, s.max_tokens) for p, s in zip(prompts, params)]
    for tokens, dense, rows in steps:
        assert rows == dense and dense in SIZES and dense >= tokens
    assert any(rows > tokens for tokens, _, rows in steps), "some step should be padded"
    assert sum(1 for tokens, _, _ in steps if tokens == 32) >= 5, "prefill should fill steps"
    assert all(rows == tokens for tokens, _, rows in plain)  # off: exactly what was scheduled
    assert any(rows not in SIZES for _, _, rows in plain)


def test_sizes_come_from_the_knee_of_the_profiled_table() -> None:
    table = ((1, 1.0), (2, 1.0), (4, 1.01), (8, 1.05), (16, 1.4), (32, 2.5), (64, 5.0))
    hardware = type(FLEXGEN_T4)(**{**FLEXGEN_T4.to_dict(), "dense_step_table": table})
    assert hardware.dense_knee_rows() == 32  # 64/5.0 is the best rows/s; 32/2.5 is 100%
    sizes = discrete_sizes(1024, hardware.dense_knee_rows(), block_size=48)
    assert sizes[:6] == (1, 2, 4, 8, 16, 32)  # powers of two below the knee
    assert {64, 96, 128, 160, 512} <= set(sizes) and 48 in sizes  # knee multiples, the block
    assert 544 not in sizes and sizes[-1] == 1024  # beyond 16 knees: powers of two
    assert discrete_sizes(100, None, 12) == (1, 2, 4, 8, 12, 16, 32, 64, 100)


@pytest.mark.parametrize("max_step_tokens", [None, 4096])
def test_a_step_always_holds_the_block(max_step_tokens: int | None) -> None:
    from engine.core.engine_args import EngineArgs

    big = Policy(gpu_batch_size=1024, num_gpu_batches=32, weights_frac=(0.0, 1.0, 0.0))
    args = EngineArgs(max_step_tokens=max_step_tokens)
    if max_step_tokens is not None and max_step_tokens < big.block_size:
        with pytest.raises(Exception, match="cannot hold one decode"):
            args.step_tokens(big)
    else:
        assert args.step_tokens(big) >= big.block_size * 512  # a whole block's prompts
