"""`ToyExecutor`: a torch-free step executor for ExecutorProcess tests (TESTS ONLY).

Kept because test_engine_process.py checks the RPC surface itself (spawn, a step's exact
result, a start failure's traceback, restart) in well under a second per child; the real
executor's child imports torch and loads weights (seconds), and its death and restart are
covered end to end by test_durability.py on a real `nanoflex serve`.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from engine.core.protocol import EngineInfo, Placement, StepPlan, StepResult

NO_BYTES = {"gpu": 0, "cpu": 0, "disk": 0}
INFO = EngineInfo(
    page_tokens=16,
    kv_capacity_pages={"gpu": 128, "cpu": None, "disk": None},  # the demo model's context
    placement=Placement(
        (1.0, 0.0, 0.0), (1.0, 0.0, 0.0), NO_BYTES, NO_BYTES, NO_BYTES, (), "toy", "none"
    ),
)


class ToyExecutor:
    """Samples last input token + 1 for every chunk that asks for a token."""

    def describe(self) -> EngineInfo:
        return INFO

    def close(self) -> None:
        pass

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


class CrashingExecutor(ToyExecutor):
    """Starts as the toy does; its process exits in the middle of every step (a crash)."""

    def execute(self, plan: StepPlan) -> StepResult:
        os._exit(3)


def build_crashing_executor(**engine_kwargs: Any) -> CrashingExecutor:
    """Takes (and ignores) the real executor's keyword arguments, so that a real
    `StepLoopClient` can run it in its engine process."""
    return CrashingExecutor()


def build_cpu_executor() -> ToyExecutor:
    """The toy, reporting the CPU as its compute device (as a CPU engine does)."""
    executor = ToyExecutor()
    placement = dataclasses.replace(INFO.placement, device="cpu")
    executor.describe = lambda: dataclasses.replace(INFO, placement=placement)  # type: ignore[method-assign]
    return executor


def pid() -> int:
    return os.getpid()


class SlowExecutor(ToyExecutor):
    """A step that takes a minute: its process is mid-step whenever a test looks."""

    def execute(self, plan: StepPlan) -> StepResult:
        import time

        time.sleep(60)
        return super().execute(plan)


def build_slow_executor() -> SlowExecutor:
    return SlowExecutor()
