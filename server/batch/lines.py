"""The batch-line core, HTTP-free: one line of a Batch API input file parsed, answered through
the serving layer, and written as OpenAI's output or error line with the id its caller gives.

The daemon's Batch API (`server/batch/runner.py`: SQLite), `nanoflex run-batch`
(`server/offline/run_batch.py`: JSONL files, resumable) and the Ray replicas
(`server/offline/scale_out/`) all answer lines here and keep only their own durability.

A valid line is `{"custom_id": str, "method": "POST", "url": <the batch's endpoint>,
"body": {...}}`. Broken, duplicate and wrong-url lines become error lines, with OpenAI's
codes, while the other lines run. Each line is decoded once.

The daemon reads its input files one line at a time (`read_batch_lines`): a line is read in
one allocation, decoded, parsed, checked and dropped before the next, so validating holds at
most about twice the longest line (its text and its parsed value), never the file.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Generator, Iterable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from typing import Any, BinaryIO

from pydantic import BaseModel

from server.batch.order import prefix_key
from server.openai.embeddings import POOLING_ENDPOINTS
from server.openai.errors import APIError, invalid_request
from server.openai.json_body import JSONBodyError, decode_text, loads_json
from server.openai.responses import new_id
from server.openai.serving import CHAT, COMPLETIONS, RESPONSES, Serving

ENDPOINTS = (COMPLETIONS, CHAT, RESPONSES, *POOLING_ENDPOINTS)
SERVER_ERROR = "server_error"
"""Error-file code of a line the server failed on (an unexpected exception)."""
READ_CHUNK_BYTES = 1 << 20
"""`read_lines` reads this much at a time; a longer line is read again in one piece."""


@dataclass(frozen=True, slots=True)
class BatchLine:
    """A valid input line."""

    index: int
    """Its place among the file's non-blank lines, from 0."""
    custom_id: str
    body: dict[str, Any]
    """The request body, as `POST <endpoint>` takes it."""
    raw: bytes = b""
    """The line as read (what a store keeps to answer it after a restart)."""


@dataclass(frozen=True, slots=True)
class LineProblem:
    """An input line that cannot run, and why (OpenAI's batch error)."""

    index: int
    """Its place among the file's non-blank lines, from 0."""
    line_number: int
    """Its line in the file, from 1."""
    custom_id: str | None
    """The line's custom_id when it has a usable one."""
    code: str
    message: str

    def error(self) -> dict[str, Any]:
        """The entry of the batch's `errors` list."""
        return {"code": self.code, "message": self.message, "param": None, "line": self.line_number}


ParsedLine = BatchLine | LineProblem


@dataclass(frozen=True, slots=True)
class CheckedLine:
    """A valid input line as validation passes it on: its text, not its parsed body."""

    index: int
    """Its place among the file's non-blank lines, from 0."""
    custom_id: str
    text: str
    """The line as read, decoded (what a store keeps to answer it later)."""
    key: str
    """Its prompt's leading text (`order.prefix_key`), to run it in prefix order."""


def read_lines(
    f: BinaryIO, long_lines: AbstractContextManager[Any] | None = None
) -> Iterator[bytes]:
    """Each line of the seekable binary file `f`, without its newline. A line longer than
    `READ_CHUNK_BYTES` is found by reading ahead to its end, then read again in one
    allocation of its size (`readline` would join the chunks it read: twice the line), inside
    `long_lines` (entered from its read until the caller asks for the next line: a lock
    shared by readers keeps one long line in memory at a time)."""
    pending = b""  # the start of a line whose end is not read yet
    while True:
        chunk = f.read(READ_CHUNK_BYTES)
        if not chunk:
            if pending:
                yield pending
            return
        pieces = (pending + chunk).split(b"\n")
        pending = pieces.pop()
        yield from pieces
        del pieces
        if len(pending) >= READ_CHUNK_BYTES:
            start = f.tell() - len(pending)
            pending = b""
            end = _next_newline(f)
            with long_lines or nullcontext():
                f.seek(start)
                yield f.read(end - start)  # not bound to a name: the caller holds the only copy
            f.seek(end + 1)


def _next_newline(f: BinaryIO) -> int:
    """The offset of the next newline at or after `f`'s position, or of the file's end."""
    while True:
        chunk = f.read(READ_CHUNK_BYTES)
        at = chunk.find(b"\n")
        if at >= 0:
            return f.tell() - len(chunk) + at
        if not chunk:
            return f.tell()


def read_batch_lines(
    f: BinaryIO, endpoint: str, long_lines: AbstractContextManager[Any] | None = None
) -> Generator[CheckedLine | LineProblem, None, None]:
    """Every non-blank line of the batch input `f`, in file order, one at a time: checked as
    `parse_lines` checks it for `endpoint`. Each line's bytes are dropped once decoded and its
    parsed value once checked, before the caller gets it; the caller should drop each line
    before asking for the next, and close the iterator if it stops early. `long_lines`: as
    `read_lines` takes it."""
    seen: set[str] = set()
    index = line_number = 0
    for raw in read_lines(f, long_lines):
        line_number += 1
        if not raw or raw.isspace():
            continue
        text, not_json = "", None
        value: Any = None
        try:
            text = decode_text(raw)
            raw = b""
            value = loads_json(text)
        except JSONBodyError as e:
            not_json = f"Line {line_number} is not valid JSON: {e}."
        raw = b""
        custom_id, problem = _verdict(value, not_json, endpoint, seen)
        if problem is None:
            assert custom_id is not None
            key = prefix_key(value["body"])
            value = None
            yield CheckedLine(index, custom_id, text, key)
        else:
            value, text = None, ""
            yield LineProblem(index, line_number, custom_id, *problem)
        text = ""
        index += 1


def parse_lines(raw_lines: Iterable[bytes], endpoint: str | None) -> tuple[str, list[ParsedLine]]:
    """(the batch's endpoint, every non-blank line in file order, valid or not). `endpoint`
    None: the url of the first line that names a supported one (`run-batch`, whose input
    says it itself), else COMPLETIONS."""
    decoded: list[tuple[int, bytes, Any, str | None]] = []  # (number, line, value, why not JSON)
    for line_number, raw in enumerate(raw_lines, start=1):
        if not raw.strip():
            continue
        try:
            decoded.append((line_number, raw, loads_json(raw), None))
        except JSONBodyError as e:
            decoded.append((line_number, raw, None, f"Line {line_number} is not valid JSON: {e}."))
    if endpoint is None:
        urls = (v.get("url") for _, _, v, _ in decoded if isinstance(v, dict))
        endpoint = next((url for url in urls if url in ENDPOINTS), COMPLETIONS)
    seen: set[str] = set()
    lines: list[ParsedLine] = []
    for index, (line_number, raw, value, not_json) in enumerate(decoded):
        custom_id, problem = _verdict(value, not_json, endpoint, seen)
        if problem is None:
            assert custom_id is not None
            lines.append(BatchLine(index, custom_id, value["body"], raw))
        else:
            lines.append(LineProblem(index, line_number, custom_id, *problem))
    return endpoint, lines


def stored_line(index: int, custom_id: str, stored: str) -> BatchLine:
    """A line a store kept as valid, parsed again: the line as read, or just its body (what
    stores written before kept). The line it returns keeps only the body (`raw` empty)."""
    value = loads_json(stored)
    body = value["body"] if "custom_id" in value and isinstance(value.get("body"), dict) else value
    return BatchLine(index, custom_id, body)


def _verdict(
    value: Any, not_json: str | None, endpoint: str, seen: set[str]
) -> tuple[str | None, tuple[str, str] | None]:
    """(the line's custom_id if it has a usable one, (code, message) of its problem or None
    if it is valid); a valid line's custom_id joins `seen`. `not_json`: why it did not decode."""
    problem = ("invalid_json_line", not_json) if not_json else _check(value, endpoint, seen)
    custom_id = value.get("custom_id") if isinstance(value, dict) else None
    custom_id = custom_id if isinstance(custom_id, str) else None
    if problem is None:
        assert custom_id is not None
        seen.add(custom_id)
    return custom_id, problem


def _check(value: Any, endpoint: str, seen: set[str]) -> tuple[str, str] | None:
    """(code, message) of the first problem with a decoded line, None if it is valid."""
    if not isinstance(value, dict):
        return "invalid_request", "Each line must be a JSON object."
    custom_id = value.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return "missing_custom_id", "Each line needs a non-empty string 'custom_id'."
    if custom_id in seen:
        return (
            "duplicate_custom_id",
            f"custom_id {custom_id!r} is used by an earlier line; custom_ids must be unique.",
        )
    if value.get("method") != "POST":
        return "invalid_method", "'method' must be 'POST'."
    if value.get("url") != endpoint:
        return (
            "invalid_url",
            f"'url' is {value.get('url')!r}, but this batch's endpoint is {endpoint!r}.",
        )
    if not isinstance(value.get("body"), dict):
        return "invalid_body", "'body' must be a JSON object with the request."
    return None


# -- answering -----------------------------------------------------------------------------


async def answer_line(
    serving: Serving,
    endpoint: str,
    line: BatchLine,
    line_id: str,
    priority: int,
    *,
    request_id: str | None = None,
    created: int | None = None,
    in_order: bool = False,
) -> tuple[bool, str]:
    """(ran, output line with id `line_id`): the endpoint's answer (200), or its refusal
    (4xx) with its error envelope, as OpenAI's batch output line. `request_id` and `created`:
    the response's (default: fresh ones; a refusal then gets a fresh `req_` id). `in_order`:
    tokenize on the event loop and let every line started with it tokenize too before any
    reaches the engine, so that they reach it together and in order (what makes prefix-cache
    hits, and so `cached_tokens`, repeat from run to run); else in a worker thread, so that a
    long prompt does not stall the loop. A failure of the
    server (a 5xx `APIError`, or any other exception) propagates: the caller retries or
    records it."""
    try:
        if in_order:
            prep = serving.prepare(endpoint, line.body)
            await asyncio.sleep(0)  # the other lines started with this one tokenize now
        else:
            prep = await asyncio.to_thread(serving.prepare, endpoint, line.body)
        if prep.stream:
            raise invalid_request("stream is not supported in a batch", param="stream")
        if request_id is not None:
            prep = replace(prep, request_id=request_id)
        if created is not None:
            prep = replace(prep, created=created)
        body = await serving.run(prep, priority)
        return True, output_line(line_id, line.custom_id, prep.request_id, 200, body)
    except APIError as e:
        if e.status_code >= 500:
            raise
        refusal_id = request_id or new_id("req_")
        return False, output_line(line_id, line.custom_id, refusal_id, e.status_code, e.body())


def output_line(
    line_id: str, custom_id: str, request_id: str, status_code: int, body: BaseModel
) -> str:
    """OpenAI's line for a request that ran (status 200) or was refused by the endpoint
    (`body`: the response, or the error envelope)."""
    response = {"status_code": status_code, "request_id": request_id, "body": body.model_dump()}
    return json.dumps({"id": line_id, "custom_id": custom_id, "response": response, "error": None})


def error_line(line_id: str, custom_id: str | None, code: str, message: str) -> str:
    """OpenAI's line for a request that did not run (invalid, cancelled, server failure)."""
    error = {"code": code, "message": message}
    return json.dumps({"id": line_id, "custom_id": custom_id, "response": None, "error": error})


def problem_line(line_id: str, problem: LineProblem) -> str:
    """The error line of an input line that cannot run."""
    return error_line(line_id, problem.custom_id, problem.code, problem.message)
