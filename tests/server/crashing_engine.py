"""A `nanoflex serve` engine client whose engine process crashes on every step (TESTS ONLY):
`NANOFLEX_ENGINE_CLIENT=tests.server.crashing_engine:build_engine_client`. It starts as the
real client does (the demo model's tokenizer and scheduler), restarts quickly, and gives up
after two restarts."""

from __future__ import annotations

import argparse

from engine.core.engine_args import EngineArgs
from engine.core.model_files import DEMO_MODEL
from engine.runtime.restarts import RestartPolicy
from engine.runtime.step_loop_client import StepLoopClient
from policy import Policy

RESTARTS = RestartPolicy(max_restarts=2, window_s=120.0, first_backoff_s=0.5)


def build_engine_client(args: argparse.Namespace) -> StepLoopClient:
    return StepLoopClient(
        EngineArgs.from_cli_args(args, policy=Policy()),
        model_name=DEMO_MODEL,
        restarts=RESTARTS,
        executor_factory="tests.engine.runtime.toy_executor:build_crashing_executor",
    )
