"""`ToyExecutor`: a torch-free step executor for ExecutorProcess tests (TESTS ONLY)."""

from __future__ import annotations

import os

from engine.protocol import StepPlan, StepResult


class ToyExecutor:
    """Samples last input token + 1 for every chunk that asks for a token."""

    def execute(self, plan: StepPlan) -> StepResult:
        sampled = [c for c in plan.chunks if c.do_sample]
        return StepResult(
            step_id=plan.step_id,
            seq_ids=[c.seq_id for c in sampled],
            token_ids=[c.token_ids[-1] + 1 for c in sampled],
            logprobs=[None for _ in sampled],
        )


def build_executor(fail: bool = False) -> ToyExecutor:
    if fail:
        raise ValueError("toy executor asked to fail")
    return ToyExecutor()


def pid() -> int:
    return os.getpid()
