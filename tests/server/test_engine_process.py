"""`ExecutorProcess`: spawn, execute, health, crash detection, restart, shutdown."""

from __future__ import annotations

import os
import signal
import sys

import pytest

from engine.core.protocol import SeqChunk, StepPlan
from server.engine_process import (
    ExecutorDiedError,
    ExecutorProcess,
    ExecutorStartError,
    InProcessExecutor,
)

FACTORY = "tests.server.toy_executor:build_executor"


def plan(step_id: int) -> StepPlan:
    chunk = SeqChunk(
        seq_id=7,
        token_ids=[5, 9],
        start_pos=0,
        gpu_batch=0,
        new_page_ids=[0],
        kv_tier="gpu",
        act_tier="gpu",
        do_sample=True,
    )
    return StepPlan(step_id=step_id, chunks=[chunk])


def test_child_process_lifecycle() -> None:
    executor = ExecutorProcess(FACTORY, start_timeout_s=60)
    executor.start()
    try:
        assert executor.describe().placement.device == "toy"  # the child's own report
        assert "tests.server.toy_executor" not in sys.modules, (
            "the parent must not import the factory"
        )
        result = executor.execute(plan(3))
        assert (result.step_id, result.seq_ids, result.token_ids) == (3, [7], [10])
        assert executor.health()
        assert executor._process is not None and executor._process.pid
        os.kill(executor._process.pid, signal.SIGKILL)
        with pytest.raises(ExecutorDiedError):
            executor.execute(plan(4))
        assert not executor.health()
        executor.restart()
        assert executor.execute(plan(5)).token_ids == [10]
    finally:
        executor.shutdown(timeout_s=10)
    assert not executor.is_alive


def test_start_failure_reports_child_traceback() -> None:
    executor = ExecutorProcess(FACTORY, {"fail": True}, start_timeout_s=60)
    with pytest.raises(ExecutorStartError, match="toy executor asked to fail"):
        executor.start()
    assert not executor.is_alive


def test_in_process_executor_has_same_surface() -> None:
    executor = InProcessExecutor(FACTORY)
    executor.start()
    assert executor.health() and executor.execute(plan(1)).token_ids == [10]
    executor.shutdown()
    assert not executor.is_alive
