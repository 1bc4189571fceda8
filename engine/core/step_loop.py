"""`StepLoop`: drives a `Scheduler` and an executor step by step (torch-free).

Synchronous mode is the reference: schedule, execute, postprocess. Asynchronous
mode (NanoFlow 5.3) builds plan i+1 while step i runs: the plan's decodes whose
input is step i's token carry PENDING_TOKEN_ID until step i's result fills
them in, and a sequence that stopped in step i but was already planned in step
i+1 has that extra token dropped by the scheduler, never returned. A step the executor could
not run (`StepResult.failure`: its offload storage failed) goes to `Scheduler.recover`, with
the plan built after it, which then never runs.

The engine runs one choice per request and hands back deltas (`SequenceDelta`); `generate`
is the synchronous front `LLM` uses: it fans out n (`ParentRequest`) and adds up each
choice's deltas.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

from engine.core.outputs import RequestOutput, SequenceDelta
from engine.core.parent_request import ParentRequest
from engine.core.protocol import StepPlan, StepResult
from engine.core.scheduler import Scheduler
from engine.core.sequence import Request


class StepExecutor(Protocol):
    """Runs one plan on the model: `engine.executor.executor.Executor`, or the daemon's
    engine-process client. May also offer `submit(plan) -> Future[StepResult]`."""

    def execute(self, plan: StepPlan) -> StepResult: ...


class EngineStalledError(RuntimeError):
    """Requests remain but the scheduler plans nothing and no step is running (a bug)."""


class StepLoop:
    """One scheduler, one executor, and the step loop between them. Not thread-safe.

    `async_scheduling` overlaps planning with execution; it uses the executor's
    `submit` if it has one, else runs `execute` on one worker thread.
    """

    def __init__(
        self, scheduler: Scheduler, executor: StepExecutor, async_scheduling: bool = False
    ) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.async_scheduling = async_scheduling
        self._in_flight: tuple[StepPlan, Future[StepResult]] | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._stalled = False
        self._unrun: StepPlan | None = None
        """The plan built while a step that failed was running: not run (asynchronous)."""

    def add_request(self, request: Request) -> None:
        """Queue a request of one choice (n == 1). Raises a `UserError` subclass for one that
        can never run."""
        self.scheduler.add_request(request)

    def abort(self, request_id: str) -> SequenceDelta | None:
        """Drop a request wherever it is; its last delta ('abort'), or None if unknown."""
        return self.scheduler.abort_request(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    @property
    def is_stalled(self) -> bool:
        """The last `step` ran and planned nothing while requests remain (they wait for a
        tier that rests after a storage fault, or a bug)."""
        return self._stalled

    def step(self) -> list[SequenceDelta]:
        """Schedule, run, postprocess. Asynchronous: returns the previous step's deltas."""
        plan = self.scheduler.schedule()
        done = self._run(plan)
        self._stalled = plan is None and done is None and self.scheduler.has_unfinished()
        if done is None:
            return []
        failure = done[1].failure
        if failure is not None:
            unrun, self._unrun = self._unrun, None
            return self.scheduler.recover(done[0], failure, unrun)
        return self.scheduler.postprocess(*done)

    def _run(self, plan: StepPlan | None) -> tuple[StepPlan, StepResult] | None:
        """Run `plan`; the (plan, result) pair that is now complete, if any."""
        if not self.async_scheduling:
            return None if plan is None else (plan, self.executor.execute(plan))
        done = None
        if self._in_flight is not None:
            previous, future = self._in_flight
            done = (previous, future.result())
            self._in_flight = None
        if plan is not None and done is not None and done[1].failure is not None:
            self._unrun = plan  # built on a step that failed: recover() takes it back
        elif plan is not None:
            if plan.has_pending_tokens:
                assert done is not None, "pending tokens without a step in flight"
                plan.fill_pending_tokens(done[1])
            self._in_flight = (plan, self._submit(plan))
        return done

    def _submit(self, plan: StepPlan) -> Future[StepResult]:
        submit = getattr(self.executor, "submit", None)
        if submit is not None:
            future: Future[StepResult] = submit(plan)
            return future
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="nanoflex-step")
        return self._pool.submit(self.executor.execute, plan)

    def iter_deltas(self) -> Iterator[SequenceDelta]:
        """Step until every request finished, yielding each step's deltas."""
        while self.has_unfinished():
            yield from self.step()
            if self._stalled and self._in_flight is None:
                wait_s = self.scheduler.rest.left()
                if wait_s > 0:  # a tier rests after a storage fault: try it again then
                    time.sleep(min(wait_s, 0.05))
                    continue
                raise EngineStalledError(
                    f"{self.scheduler.num_waiting} sequence(s) wait but nothing can be scheduled"
                )

    def generate(self, requests: Iterable[Request]) -> list[RequestOutput]:
        """Add `requests` (any n), run them all, and return their outputs in the same order."""
        parents: list[ParentRequest] = []
        by_child: dict[str, ParentRequest] = {}
        try:
            for request in requests:  # only their ends are read here
                parent = ParentRequest(dataclasses.replace(request, final_only=True))
                for child in parent.children:
                    self.add_request(child)
                    by_child[child.request_id] = parent
                parents.append(parent)
        except Exception:  # a request that can never run: none of them runs
            for child_id in by_child:
                self.abort(child_id)
            raise
        for delta in self.iter_deltas():
            owner = by_child.get(delta.request_id)
            if owner is not None:  # not a request someone else added
                owner.add(delta)
        return [parent.output() for parent in parents]

    def close(self) -> None:
        """Wait for the step in flight (its outputs are dropped) and stop the worker thread."""
        if self._in_flight is not None:
            self._in_flight[1].result()
            self._in_flight = None
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
