"""`ExecutorProcess`: the step executor in a child process: `execute(StepPlan) -> StepResult`.

One of the two `ExecutorClient`s (engine/runtime/executor_client.py). The parent never
imports the executor's module (so never torch): the child is started with multiprocessing's
'spawn' method and builds the executor from a factory path such as
"engine.executor.executor:build_executor" and keyword arguments (the `EngineArgs` record
among them, pickled as it is).
Messages over one Pipe are pickled tuples:

    parent -> child: ("execute", StepPlan) | ("health",) | ("shutdown",)
    child -> parent: ("progress", text)* then ("ready", EngineInfo) | ("error", (line, traceback))
                     while starting; then ("result", StepResult) | ("ok",) | ("error", traceback)

A factory that takes an `on_progress` keyword gets one: its (done, total) calls become
"progress" messages ("loading weights: layer 3/30"), passed to the parent's `on_progress`.

The factory returns an executor with the surface of `engine.executor.executor.Executor`:
`describe() -> EngineInfo` once built, `execute(plan)` per step, `close()` at shutdown.

Once its executor is built, the child lowers its threads' CPU priority (`nice`; on a CPU
engine by default), so that the daemon's threads run as soon as they wake.

A dead child is detected on every call (`ExecutorDiedError`); `restart()`
starts a fresh one. The child holds the parent's offload-directory locks (the same open
files: engine/core/offload_dir.py) and exits as soon as its parent is gone, even in the
middle of a step (a daemon killed with -9 leaves no engine behind on the directory).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import shutil
import signal
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from engine.core.engine_args import ENGINE_NICE
from engine.core.offload_dir import InheritedLock, inherited_locks
from engine.core.protocol import StepPlan, StepResult
from engine.runtime.executor_client import (
    EXECUTOR_FACTORY,
    ExecutorClient,
    ExecutorDiedError,
    ExecutorStartError,
    build_from_path,
    start_error_line,
)

log = logging.getLogger("nanoflex.engine")

POLL_S = 0.1
"""How often a waiting call checks that the child is still alive (and the child, that its
parent is)."""


def _child_main(
    conn: Connection,
    factory: str,
    kwargs: dict[str, Any],
    parent_pid: int = 0,
    locks: list[InheritedLock] | None = None,
    nice: int | None = 0,
) -> None:
    """The child's loop: build the executor, then answer messages until shutdown. The
    executor is closed (its scratch files removed) on shutdown, when the parent is gone,
    and on SIGTERM. `locks`: the parent's offload-directory locks, held here too (adopted
    when they were unpickled). `nice`: `ExecutorProcess`'s."""
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    if parent_pid:
        _exit_with_parent(parent_pid)
    try:
        executor = build_from_path(factory, kwargs, lambda line: conn.send(("progress", line)))
        info = executor.describe()
    except BaseException as e:
        conn.send(("error", (start_error_line(e), traceback.format_exc())))
        return
    if nice is None:
        nice = ENGINE_NICE if info.placement.device == "cpu" else 0
    lower_priority(nice)
    conn.send(("ready", info))
    try:
        _serve(conn, executor)
    finally:
        executor.close()


def _serve(conn: Connection, executor: Any) -> None:
    while True:
        try:
            message = conn.recv()
        except EOFError:  # the parent is gone
            return
        kind = message[0]
        if kind == "shutdown":
            executor.close()
            conn.send(("ok",))
            return
        if kind == "health":
            conn.send(("ok",))
            continue
        try:
            conn.send(("result", executor.execute(message[1])))
        except Exception:
            conn.send(("error", traceback.format_exc()))


def lower_priority(by: int) -> None:
    """Raise the nice value of every thread of this process by `by` (Linux keeps one per
    thread; threads started later take their starter's). Where /proc is missing, the
    process's."""
    if by <= 0:
        return
    try:
        tids = [int(tid) for tid in os.listdir("/proc/self/task")]
    except FileNotFoundError:
        os.nice(by)
        return
    for tid in tids:
        with contextlib.suppress(ProcessLookupError):  # a thread that has just ended
            os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + by)


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _exit_with_parent(parent_pid: int) -> None:
    """Watch the parent from a thread: once it is gone (the child is re-parented), SIGTERM
    this process, which closes the executor and exits, releasing the offload directory."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(POLL_S)
        log.warning("the daemon (pid %d) is gone: the engine process exits", parent_pid)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="nanoflex-parent-watch", daemon=True).start()


class ExecutorProcess(ExecutorClient):
    """The executor in a 'spawn'ed child; calls block the calling thread (run them in a
    worker thread from asyncio). Not thread-safe: one caller at a time."""

    def __init__(
        self,
        factory: str = EXECUTOR_FACTORY,
        kwargs: dict[str, Any] | None = None,
        *,
        start_timeout_s: float = 600.0,
        on_progress: Callable[[str], None] | None = None,
        nice: int | None = 0,
    ) -> None:
        super().__init__(factory, kwargs, on_progress=on_progress)
        self.start_timeout_s = start_timeout_s
        self.nice = nice
        """How far the child's threads' CPU priority goes below this process's, once its
        executor is built (`EngineArgs.engine_nice`); None: ENGINE_NICE if the executor
        computes on the CPU, else 0."""
        self._process: BaseProcess | None = None
        self._conn: Connection | None = None

    @property
    def is_alive(self) -> bool:
        return self._process is not None and self._process.is_alive()

    def start(self) -> None:
        """Spawn the child and wait until its executor is built (model loaded). Raises
        `ExecutorStartError` with one line when it cannot be built."""
        ctx = mp.get_context("spawn")
        parent_conn, child_conn = ctx.Pipe()
        process = ctx.Process(
            target=_child_main,
            args=(
                *(child_conn, self.factory, self.kwargs, os.getpid(), inherited_locks()),
                self.nice,
            ),
            name="nanoflex-engine",
            daemon=True,
        )
        process.start()
        child_conn.close()
        self._process, self._conn = process, parent_conn
        try:
            kind, payload = self._receive(self.start_timeout_s)
            while kind == "progress":
                if self.on_progress is not None:
                    self.on_progress(payload)
                kind, payload = self._receive(self.start_timeout_s)
        except ExecutorDiedError as e:
            code = process.exitcode
            self.kill()
            hint = " (killed: out of memory?)" if code == -signal.SIGKILL else ""
            raise ExecutorStartError(f"the engine process died while loading{hint}: {e}") from e
        if kind != "ready":
            self.kill()
            line, child_traceback = payload
            raise ExecutorStartError(line, child_traceback)
        self.info = payload

    def _receive(self, timeout_s: float | None = None) -> tuple[str, Any]:
        assert self._conn is not None and self._process is not None, "call start() first"
        waited = 0.0
        while not self._conn.poll(POLL_S):
            waited += POLL_S
            if not self._process.is_alive():
                raise ExecutorDiedError(
                    f"the engine process exited with code {self._process.exitcode}"
                )
            if timeout_s is not None and waited >= timeout_s:
                raise ExecutorDiedError(f"the engine process did not answer in {timeout_s} s")
        try:
            message: tuple[str, Any] = self._conn.recv()
        except (EOFError, OSError) as e:
            self._process.join(1.0)
            code = self._process.exitcode
            why = f"exited with code {code}" if code is not None else f"closed its pipe ({e!r})"
            raise ExecutorDiedError(f"the engine process {why}") from e
        if message[0] == "error" and self._process.is_alive() and self.info is not None:
            raise RuntimeError(f"the engine step failed:\n{message[1]}")
        return message[0], message[1] if len(message) > 1 else None

    def _send(self, message: tuple[Any, ...]) -> None:
        assert self._conn is not None, "call start() first"
        try:
            self._conn.send(message)
        except (BrokenPipeError, OSError) as e:
            raise ExecutorDiedError(f"the engine process is gone: {e}") from e

    def execute(self, plan: StepPlan) -> StepResult:
        """Run one step in the child. Raises `ExecutorDiedError` if it died."""
        self._send(("execute", plan))
        _, result = self._receive()
        return result

    def health(self, timeout_s: float = 5.0) -> bool:
        """True if the child answers within `timeout_s`."""
        try:
            self._send(("health",))
            return self._receive(timeout_s)[0] == "ok"
        except ExecutorDiedError:
            return False

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Ask the child to finish and exit; kill it if it does not within `timeout_s`."""
        if self._process is None:
            return
        if self._process.is_alive():
            try:
                self._send(("shutdown",))
                self._receive(timeout_s)
            except (ExecutorDiedError, RuntimeError):
                pass
            self._process.join(timeout_s)
        self.kill()

    def abort_start(self) -> None:
        """Kill a child that is still loading (from another thread: `start` then raises)."""
        process = self._process
        if process is not None and self.info is None and process.is_alive():
            process.kill()

    def kill(self) -> None:
        """Stop the child at once (used after a failure), and remove the scratch directory
        it could not remove itself."""
        if self._process is not None:
            if self._process.is_alive():
                self._process.kill()
            self._process.join()
        if self._conn is not None:
            self._conn.close()
        self._process, self._conn = None, None
        if self.info is not None and self.info.scratch_dir is not None:
            shutil.rmtree(self.info.scratch_dir, ignore_errors=True)
