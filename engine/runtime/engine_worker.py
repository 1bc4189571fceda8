"""`EngineWorker`: the thread that owns the step loop and steps it, torch-free.

The `Scheduler` and `StepLoop` are not thread-safe: one worker thread owns them. The
asyncio side talks to it only through a command queue ("add": child requests and the future
that hears the scheduler's verdict; "abort": child request ids) and gets each step's deltas
back in one `call_soon_threadsafe`. If the engine process dies (or a step raises: an engine
bug), the worker fails the requests in flight with `EngineDeadError`, restarts the process
after a back-off (`RestartTracker`) and starts over with a fresh scheduler; past the restart
limit it gives up.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.core.outputs import SequenceDelta
from engine.core.sequence import Request
from engine.core.step_loop import StepLoop
from engine.runtime.engine_client import EngineDeadError, StepStats
from engine.runtime.executor_client import ExecutorClient, ExecutorDiedError
from engine.runtime.restarts import RestartTracker
from engine.runtime.step_metrics import EngineMetrics, StepCounter

log = logging.getLogger("nanoflex.engine")

IDLE_WAIT_S = 0.05
"""How long an idle worker waits for a command before it looks at the engine again."""

Command = tuple[str, Any]
"""("add", (child requests, future of the verdict)) or ("abort", child request ids)."""
Verdict = asyncio.Future[Exception | None]
"""What the scheduler said to an added request: None (queued) or the caller's error."""


@dataclass(frozen=True, slots=True)
class WorkerHooks:
    """What the worker calls outside itself, each from the worker thread."""

    build_step_loop: Callable[[StepCounter], StepLoop]
    """A fresh scheduler and step loop over the executor (at start and after a restart)."""
    check_restarted: Callable[[], None]
    """Raise if a restarted engine is not the one the daemon announced (its capacity)."""
    set_status: Callable[[str], None]
    """What the engine is doing now (GET /ready's detail)."""
    report: Callable[[StepStats], None]
    """A step's figures (`EngineClient.emit_step`)."""
    give_up: Callable[[str], None]
    """The engine is gone for good (`EngineClient.emit_fatal`)."""
    to_loop: Callable[..., None]
    """Run `fn(*args)` on the daemon's event loop."""
    deliver: Callable[[list[SequenceDelta]], None]
    """On the event loop: one step's deltas to their requests."""
    fail_all: Callable[[Exception], None]
    """On the event loop: end every request in flight with an error."""


class EngineWorker:
    """Steps the step loop on its own thread; restarts the engine process if it dies.

    `ready` is set while the engine steps (cleared from a crash until its restart);
    `stopping` ends the loop after the running step."""

    def __init__(
        self,
        executor: ExecutorClient,
        commands: queue.Queue[Command],
        restarts: RestartTracker,
        metrics: EngineMetrics,
        events: tuple[threading.Event, threading.Event],
        hooks: WorkerHooks,
    ) -> None:
        """`events`: (ready, stopping), shared with the client."""
        self.executor, self.commands, self.restarts = executor, commands, restarts
        self.metrics, self.hooks = metrics, hooks
        self.ready, self.stopping = events
        self.step_loop: StepLoop | None = None
        """The step loop now stepping (None after the end or between a crash and its
        restart); read from the event loop too, as a snapshot."""
        self.counter: StepCounter | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Build the first step loop, report its figures and start stepping."""
        self.step_loop = self._new_step_loop()
        self._report(self.step_loop, 0.0, batch_size=0)  # every series from the start
        self._thread = threading.Thread(target=self._run, name="nanoflex-core", daemon=True)
        self._thread.start()

    def join(self) -> None:
        """Wait for the thread to end (after `stopping` is set or it gave up)."""
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        while not self.stopping.is_set():
            core = self.step_loop
            assert core is not None
            # idle, or every request waits for a tier resting after a storage fault
            self._drain_commands(core, block=not core.has_unfinished() or core.is_stalled)
            if not core.has_unfinished():
                if self.metrics.reported_busy:  # drained by aborts, not by a step: zero gauges
                    self._report(core, 0.0, batch_size=0)
                continue
            start = time.perf_counter()
            try:
                deltas = core.step()
            except ExecutorDiedError as e:
                if not self._recover(e):
                    break
                continue
            except Exception as e:  # an engine bug: its state may no longer match the plan
                log.exception("engine step failed")
                self.executor.kill()
                if not self._recover(e):
                    break
                continue
            assert self.counter is not None
            ran = 0 if core.is_stalled else self.counter.num_seqs  # stalled: nothing ran
            self._report(core, time.perf_counter() - start, ran)
            if deltas:
                self.hooks.to_loop(self.hooks.deliver, deltas)
        self._close_core()

    def _drain_commands(self, core: StepLoop, block: bool) -> None:
        try:
            command = (
                self.commands.get(timeout=IDLE_WAIT_S) if block else self.commands.get_nowait()
            )
        except queue.Empty:
            return
        while True:
            kind, payload = command
            if kind == "add":
                children, reply = payload
                self.hooks.to_loop(_resolve, reply, self._add(core, children))
            elif kind == "abort":
                for child_id in payload:
                    core.abort(child_id)
            try:
                command = self.commands.get_nowait()
            except queue.Empty:
                return

    def _add(self, core: StepLoop, children: list[Request]) -> Exception | None:
        """Queue the choices of one request: all of them, or none and the caller's error."""
        added: list[str] = []
        try:
            for child in children:
                core.add_request(child)
                added.append(child.request_id)
        except ValueError as e:  # PromptTooLongError, RequestError: the caller's 400
            for child_id in added:  # the choices run together or not at all
                core.abort(child_id)
            return e
        return None

    def _recover(self, error: Exception) -> bool:
        """The engine process died: fail what was in flight, restart it after a back-off and
        start over clean. False: stopping, or the restart limit is reached (fatal)."""
        log.error("engine process died (%s)", one_line(error))
        self.ready.clear()
        self.hooks.to_loop(self.hooks.fail_all, EngineDeadError("the engine process died; retry"))
        while not self.stopping.is_set():
            delay = self.restarts.next_delay(time.monotonic())
            if delay is None:
                policy = self.restarts.policy
                message = (
                    f"the engine crashed {policy.max_restarts + 1} times within "
                    f"{policy.window_s:.0f} s; giving up (last: {one_line(error)})"
                )
                self.hooks.set_status(message)
                self._close_core()
                self.hooks.give_up(message)
                return False
            self.hooks.set_status(
                f"restarting the engine in {delay:.0f} s after a crash (restart "
                f"{self.restarts.num_recent} of at most {self.restarts.policy.max_restarts})"
            )
            if self.stopping.wait(delay):
                return False
            try:
                self.executor.restart()
                self.metrics.num_restarts += 1
                self.hooks.check_restarted()
                break
            except Exception as e:
                log.error("engine restart failed: %s", one_line(e))
                error = e
        self._close_core()
        if self.stopping.is_set():
            return False
        self.step_loop = self._new_step_loop()
        self._report(self.step_loop, 0.0, batch_size=0)
        self.hooks.set_status("ready")
        self.ready.set()
        return True

    def _new_step_loop(self) -> StepLoop:
        self.counter = StepCounter(self.executor)
        return self.hooks.build_step_loop(self.counter)

    def _close_core(self) -> None:
        """Close the step loop (after a crash, or at the end), keeping its counts."""
        core, self.step_loop = self.step_loop, None
        if core is not None:
            self.metrics.closed(core)
            with contextlib.suppress(Exception):  # the failed step's error: already handled
                core.close()

    def _report(self, core: StepLoop, step_seconds: float, batch_size: int) -> None:
        page_bytes = self.executor.describe().page_bytes
        self.hooks.report(
            self.metrics.stats(core, self.counter, page_bytes, step_seconds, batch_size)
        )


def _resolve(future: Verdict, error: Exception | None) -> None:
    if not future.done():
        future.set_result(error)


def one_line(e: Exception) -> str:
    """The first line of an error's message (its type's name when it has none)."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0]
