"""`ExecutorClient`: the one interface the engine runtime drives an executor through, with its
lifecycle: `start()` (build it: load the model), `describe()`, `execute(plan)` per step,
`health()`, `shutdown()`, `kill()` and `restart()` after a crash.

Two implementations: `ExecutorProcess` (engine/runtime/engine_process.py: the executor in a
child process, so the daemon never imports torch) and `InProcessExecutor` (here: the same
surface without a process, for tests, `--in-process`, `run-batch` and the Ray replicas).
Either builds the executor with a factory named 'package.module:function' called with
keyword arguments, by default `engine.executor.executor:build_executor(args, model_dir,
policy)`: the `EngineArgs` record itself, the resolved model directory and `Policy`.
"""

from __future__ import annotations

import abc
import importlib
import inspect
import traceback
from collections.abc import Callable
from typing import Any

from base.errors import UserError
from engine.core.protocol import EngineInfo, StepPlan, StepResult

EXECUTOR_FACTORY = "engine.executor.executor:build_executor"


class ExecutorDiedError(RuntimeError):
    """The executor process exited or stopped answering; restart it and re-queue the work."""


class ExecutorStartError(UserError):
    """The executor could not be built (no device, bad model, out of memory): a cause that a
    restart does not change. The message is one line; `traceback` is the child's."""

    def __init__(self, message: str, traceback: str = "") -> None:
        super().__init__(message)
        self.traceback = traceback


def start_error_line(e: BaseException) -> str:
    """One line saying why the executor could not be built."""
    text = (str(e).strip().splitlines() or [""])[0]
    if isinstance(e, UserError):
        return text
    if isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError":
        return (
            f"out of memory while loading the model ({text or type(e).__name__}); lower "
            "--gpu-mem/--cpu-mem or give a policy that offloads more (nanoflex plan)"
        )
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def build_from_path(
    factory: str, kwargs: dict[str, Any], report: Callable[[str], None] | None = None
) -> Any:
    """Call the function named 'package.module:function' with `kwargs`; one that takes
    `on_progress` reports its loading through `report`."""
    module_name, _, attr = factory.partition(":")
    build = getattr(importlib.import_module(module_name), attr)
    if report is not None and "on_progress" in inspect.signature(build).parameters:

        def on_progress(done: int, total: int) -> None:
            report(f"loading weights: layer {done}/{total}")

        kwargs = {**kwargs, "on_progress": on_progress}
    return build(**kwargs)


class ExecutorClient(abc.ABC):
    """An executor to drive step by step, wherever it runs. Not thread-safe: one caller."""

    def __init__(
        self,
        factory: str = EXECUTOR_FACTORY,
        kwargs: dict[str, Any] | None = None,
        *,
        on_progress: Callable[[str], None] | None = None,
    ) -> None:
        self.factory = factory
        """'package.module:function' building the executor from `kwargs`."""
        self.kwargs = dict(kwargs or {})
        self.on_progress = on_progress
        """Called with each progress line while the executor is built."""
        self.info: EngineInfo | None = None
        """What the executor reported when it was built (set by `start`)."""

    @property
    @abc.abstractmethod
    def is_alive(self) -> bool: ...

    @abc.abstractmethod
    def start(self) -> None:
        """Build the executor (load the model). Raises `ExecutorStartError` with one line
        when it cannot be built."""

    def abort_start(self) -> None:  # noqa: B027 (most builds cannot be stopped: nothing)
        """Stop a `start` still under way, from another thread (it then raises)."""

    def describe(self) -> EngineInfo:
        """What the executor reported when it was built."""
        assert self.info is not None, "call start() first"
        return self.info

    @abc.abstractmethod
    def execute(self, plan: StepPlan) -> StepResult:
        """Run one step. Raises `ExecutorDiedError` when the executor is gone."""

    @abc.abstractmethod
    def health(self, timeout_s: float = 5.0) -> bool:
        """True if the executor answers within `timeout_s`."""

    @abc.abstractmethod
    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Close the executor (its scratch files removed) and release it."""

    @abc.abstractmethod
    def kill(self) -> None:
        """Drop the executor at once (after a failure)."""

    def restart(self) -> None:
        self.kill()
        self.start()


class InProcessExecutor(ExecutorClient):
    """The executor in this process (tests, `--in-process`, `run-batch`, the Ray replicas).
    Importing the factory here may import torch."""

    _executor: Any = None
    """The executor, once built."""

    @property
    def is_alive(self) -> bool:
        return self._executor is not None

    def start(self) -> None:
        try:
            self._executor = build_from_path(self.factory, self.kwargs, self.on_progress)
        except UserError:
            raise
        except Exception as e:
            raise ExecutorStartError(start_error_line(e), traceback.format_exc()) from e
        self.info = self._executor.describe()

    def execute(self, plan: StepPlan) -> StepResult:
        return self._executor.execute(plan)

    def health(self, timeout_s: float = 5.0) -> bool:
        return self.is_alive

    def shutdown(self, timeout_s: float = 30.0) -> None:
        if self._executor is not None:
            self._executor.close()
        self._executor = None

    def kill(self) -> None:
        self._executor = None
