"""Discrete batching (NanoFlow 4.2): every step runs at one of the chosen dense sizes, filled
with prefill while prompts wait and padded otherwise; padding never changes a token."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from engine import LLM, SamplingParams
from engine.core.protocol import StepPlan, StepResult
from engine.core.scheduler_config import discrete_sizes
from engine.executor.gpu_batch import GpuBatch
from policy import Policy
from policy.hardware import FLEXGEN_T4 as FLAT_T4
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


def test_sizes_come_from_the_flat_rows_of_the_profiled_table() -> None:
    """Powers of two while the profiled dense step stays within 10% of its fastest (padding
    is free there), then 8 sizes an octave: a step is padded by at most an eighth of its rows."""
    table = ((1, 1.0), (2, 1.0), (4, 1.01), (8, 1.05), (16, 1.4), (32, 2.5), (64, 5.0))
    hardware = type(FLAT_T4)(**{**FLAT_T4.to_dict(), "dense_step_table": table})
    assert hardware.dense_flat_rows() == 8  # 16 rows take 40% longer
    sizes = discrete_sizes(1024, hardware.dense_flat_rows(), block_size=48)
    assert sizes[:5] == (1, 2, 4, 8, 9) and 16 in sizes and 17 not in sizes and 18 in sizes
    assert 48 in sizes and sizes[-1] == 1024
    for rows in range(9, 1025):
        padded = next(size for size in sizes if size >= rows)
        assert padded - rows <= rows / 8
    assert discrete_sizes(20, None, 12) == (1, 2, 3, 4, 5, 6, 7, 8, *range(9, 16), 16, 18, 20)
