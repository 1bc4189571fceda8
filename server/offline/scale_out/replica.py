"""`Replica`: one nanoflex engine on a private event loop, answering calls from any thread.

This is what a Ray actor holds, in `nanoflex run-batch --ray` (`server.offline.scale_out.driver`)
and in a Ray Data pipeline (`server.offline.scale_out.processor`), and it knows nothing of Ray:
the engine is the in-process `StepLoopClient` (the actor is already a process of its
own) behind the same `Serving` the daemon and the local run-batch use, so a line answered
here is byte for byte the line `nanoflex run-batch` writes. The policy is chosen in the
constructor, on the machine the replica runs on (`policy="auto"`: that box's cached
hardware profile, or a quick one measured there).
"""

from __future__ import annotations

import asyncio
import os
import queue
import socket
import threading
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from engine.core.engine_args import EngineArgs
from engine.core.model_files import served_model_name
from engine.core.sequence import BATCH_PRIORITY
from engine.runtime.step_loop_client import StepLoopClient
from server.offline.scale_out.rows import RowRequest, RowResult, error_result, row_result
from server.offline.work import BatchWork, Pending, answer_all
from server.openai.errors import APIError, invalid_request
from server.openai.metrics import Metrics
from server.openai.responses_api import Response
from server.openai.serving import Serving

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class ReplicaInfo:
    """What a replica reports once its engine is up."""

    host: str
    """The machine's host name."""
    pid: int
    model: str
    """The name the model is served under (a request's `model` must equal it)."""
    policy: dict[str, Any]
    """The policy this replica chose for its machine (`Policy.to_dict()`)."""
    block_size: int
    """Sequences the policy runs together per step: how much work keeps it busy."""


class Replica:
    """One engine, started in the constructor and stopped by `close()`; `model_name` is the
    id requests name (default: the model reference as given)."""

    def __init__(self, engine_args: EngineArgs, model_name: str | None = None) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="nanoflex-replica", daemon=True
        )
        self._thread.start()
        name = model_name or served_model_name(engine_args.model)
        self.client = StepLoopClient(
            engine_args, model_name=name, in_process=True, serves_online=False
        )
        self._call(self.client.start())
        self.serving = Serving(self.client, self.client.model_name, Metrics(self.client))

    def describe(self) -> ReplicaInfo:
        policy = self.client.policy
        assert policy is not None  # chosen when the client started
        return ReplicaInfo(
            host=socket.gethostname(),
            pid=os.getpid(),
            model=self.client.model_name,
            policy=policy.to_dict(),
            block_size=policy.block_size,
        )

    def answer(self, work: BatchWork) -> Iterator[tuple[str, bool, str]]:
        """(line_id, ran, output line) for every pending line of `work`, in the order they
        finish (a generator: over Ray, each one reaches the driver as soon as it is done).
        All lines are queued in the engine at once, so its block refills as they finish."""
        answers: queue.Queue[tuple[str, bool, str] | BaseException] = queue.Queue()

        def on_answer(item: Pending, ok: bool, line: str) -> None:
            answers.put((item.line_id, ok, line))

        async def run() -> None:
            try:
                await answer_all(self.serving, work, on_answer)
            except BaseException as e:  # the engine failed: the caller gets the error
                answers.put(e)
                raise

        future = asyncio.run_coroutine_threadsafe(run(), self._loop)
        try:
            for _ in work.todo:
                item = answers.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            future.cancel()  # a consumer that stopped early aborts what is left

    def process(self, rows: list[RowRequest]) -> list[RowResult]:
        """Run a Ray Data batch's requests together; one result per row, in row order. A
        request the endpoint refuses becomes a row with its error, never an exception."""

        async def one(row: RowRequest) -> RowResult:
            if row.problem is not None:
                return error_result(row.problem)
            try:
                prep = self.serving.prepare(row.endpoint, row.body)
                if prep.stream:
                    raise invalid_request("stream is not supported here", param="stream")
                if row.request_id is not None:
                    prep = replace(prep, request_id=row.request_id)
                states = await self.serving.run_choices(prep, BATCH_PRIORITY)
                body = self.serving.body(prep, states)
                assert not isinstance(body, Response), "rows run completions or chat"
                return row_result(states[0], body)
            except APIError as e:
                return error_result(e)

        async def run() -> list[RowResult]:
            return list(await asyncio.gather(*(one(row) for row in rows)))

        return self._call(run())

    def close(self) -> None:
        self._call(self.client.shutdown())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()
