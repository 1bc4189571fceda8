"""What `nanoflex run-batch` hands whoever answers its lines: one engine in this process, or the
Ray replicas (`scale_out/`). Both answer each line with the batch-line core
(`server.batch.lines`), so a line is byte for byte the same wherever it ran.

Ids are functions of the input, never drawn: a response's id (and its body's) of its
custom_id, an output line's of its index and custom_id, so a resumed greedy run writes the
same bytes per line as an uninterrupted one.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from base.errors import UserError
from engine.core.sequence import BATCH_PRIORITY
from server.batch.lines import BatchLine, answer_line
from server.openai.errors import APIError
from server.openai.serving import CHAT, RESPONSES, Serving

MAX_IN_FLIGHT = 256
"""Requests prepared and queued in the engine at once; more wait here, untokenized."""


class RunBatchError(UserError):
    """The batch cannot run (unreadable input, engine failure); rerun to resume."""


@dataclass(frozen=True, slots=True)
class Pending:
    """A valid input line that no earlier run answered."""

    line_id: str
    """The output line's id (`line_id`)."""
    line: BatchLine


@dataclass(frozen=True, slots=True)
class BatchWork:
    """What a runner answers: the pending lines of one batch and how to answer them."""

    endpoint: str
    """The batch's endpoint (COMPLETIONS or CHAT)."""
    created: int
    """`created` of every response body: the input file's mtime."""
    todo: list[Pending]


Record = Callable[[bool, str], None]
"""Takes one answered line (ran: output file; refused: error file) and makes it durable."""
Runner = Callable[[BatchWork, Record], Awaitable[None]]
"""Answers every line of the work, calling `record` once per line as soon as it is ready."""
Answered = Callable[[Pending, bool, str], None]
"""Takes one answered line: (the pending line, ran, its output line)."""


async def answer_all(serving: Serving, work: BatchWork, on_answer: Answered) -> None:
    """Queue every pending line in the engine (at most MAX_IN_FLIGHT prepared at once) and
    hand each answer to `on_answer` as it finishes. The engine's own failures raise
    `RunBatchError`."""
    window = asyncio.Semaphore(MAX_IN_FLIGHT)

    async def one(item: Pending) -> None:
        async with window:
            request_id = batch_request_id(item.line.custom_id, work.endpoint)
            try:
                ok, line = await answer_line(
                    serving,
                    work.endpoint,
                    item.line,
                    item.line_id,
                    BATCH_PRIORITY,
                    request_id=request_id,
                    created=work.created,
                    in_order=True,  # a resumed run writes the same bytes per line
                )
            except APIError as e:  # a 5xx: the engine failed
                raise RunBatchError(
                    f"the engine failed on {item.line.custom_id!r}: {e.message} "
                    "Rerun the same command to resume."
                ) from e
        on_answer(item, ok, line)

    await asyncio.gather(*(one(item) for item in work.todo))


def _digest(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:24]


def batch_request_id(custom_id: str, endpoint: str) -> str:
    """The response's request id (and body id), a function of custom_id alone."""
    prefix = {CHAT: "chatcmpl-", RESPONSES: "resp_"}.get(endpoint, "cmpl-")
    return prefix + _digest(custom_id)


def line_id(index: int, custom_id: str | None) -> str:
    """The output line's id; duplicate custom_ids differ by their line index."""
    return "batch_req_" + _digest(str(index), custom_id or "")
