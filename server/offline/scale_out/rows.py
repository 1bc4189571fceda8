"""Rows of a Ray Data pipeline as nanoflex requests, and results as rows.

A row is one request, in one of two shapes:
- an OpenAI batch line: `body` (a dict, or its JSON text), with `url` (default: chat when
  the body has `messages`, else completions) and `custom_id` (optional: with it, the
  response's id is the one `nanoflex run-batch` gives that custom_id);
- a plain row: `prompt` (completions) or `messages` (chat); the processor's `sampling`
  dict fills the other body fields and the served model name is filled in.

Arrow gives every row of a column the same keys, so a dict missing a key that another
row has arrives with it set to null: nulls in dicts are dropped (null means omitted in
OpenAI's API). Rows come from Arrow as Python values (`Table.to_pylist`), never through
numpy or pandas, where an integer column with a null turns into floats.

A result adds the columns of `RowResult` to its row (`OUTPUT_COLUMNS`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from engine.core.outputs import ChoiceAccumulator
from server.offline.work import batch_request_id
from server.openai.errors import APIError, invalid_request
from server.openai.responses import ChatChoice, ChatCompletion, Completion
from server.openai.serving import CHAT, COMPLETIONS


@dataclass(frozen=True, slots=True)
class RowRequest:
    """One row as a request, or why it is not one."""

    endpoint: str
    """COMPLETIONS or CHAT."""
    body: dict[str, Any]
    """The request body, as `POST endpoint` takes it."""
    request_id: str | None = None
    """The response id (a function of the row's custom_id); None: a fresh one."""
    problem: APIError | None = None
    """Set when the row cannot be a request; the result is then this error."""


@dataclass(frozen=True, slots=True)
class RowResult:
    """The columns a result adds to its row (one fixed schema, errors included)."""

    text: str
    """The first choice's text (chat: the message content); "" on an error."""
    token_ids: list[int]
    """The first choice's generated token ids."""
    finish_reason: str | None
    """The first choice's "stop" or "length"; None on an error."""
    prompt_tokens: int
    """usage.prompt_tokens of the whole request (0 on an error)."""
    completion_tokens: int
    """usage.completion_tokens of the whole request, every choice counted."""
    status_code: int
    """200, or the endpoint's refusal (400 invalid, 404 unknown model)."""
    response: str
    """The whole response body as JSON (every choice, logprobs), or the error envelope."""
    error: str | None
    """The error message; None when the request ran."""


OUTPUT_COLUMNS = tuple(f.name for f in fields(RowResult))


def without_nulls(value: Any) -> Any:
    """`value` with every null-valued key of every dict in it dropped."""
    if isinstance(value, Mapping):
        return {str(k): without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list | tuple):
        return [without_nulls(v) for v in value]
    return value


def row_request(row: Mapping[str, Any], model: str, sampling: Mapping[str, Any]) -> RowRequest:
    """The request a row asks for; `model` and `sampling` complete a plain row."""
    row = without_nulls(row)
    if row.get("body") is not None:
        return _batch_line(row)
    for key, endpoint in (("prompt", COMPLETIONS), ("messages", CHAT)):
        if row.get(key) is not None:
            return RowRequest(endpoint, {**sampling, "model": model, key: row[key]})
    problem = invalid_request(
        "A row needs 'body' (an OpenAI batch line's request), 'prompt' or 'messages'."
    )
    return RowRequest(COMPLETIONS, {}, problem=problem)


def _batch_line(row: Mapping[str, Any]) -> RowRequest:
    body = row["body"]
    if isinstance(body, str | bytes):
        try:
            body = json.loads(body)
        except json.JSONDecodeError as e:
            problem = invalid_request(f"'body' is not valid JSON: {e}.", param="body")
            return RowRequest(COMPLETIONS, {}, problem=problem)
    if not isinstance(body, dict):
        problem = invalid_request("'body' must be a JSON object.", param="body")
        return RowRequest(COMPLETIONS, {}, problem=problem)
    endpoint = row.get("url") or (CHAT if "messages" in body else COMPLETIONS)
    if endpoint not in (COMPLETIONS, CHAT):
        problem = invalid_request(
            f"'url' is {endpoint!r}; rows run {COMPLETIONS} or {CHAT}.",
            param="url",
            code="invalid_url",
        )
        return RowRequest(COMPLETIONS, {}, problem=problem)
    custom_id = row.get("custom_id")
    request_id = batch_request_id(str(custom_id), endpoint) if custom_id is not None else None
    return RowRequest(endpoint, body, request_id)


def row_result(first: ChoiceAccumulator, body: Completion | ChatCompletion) -> RowResult:
    """A request's result from its first choice and its response body."""
    choice = body.choices[0]
    text = choice.message.content if isinstance(choice, ChatChoice) else choice.text
    return RowResult(
        text=text or "",  # a chat answer of tool calls only has no content
        token_ids=list(first.token_ids),
        finish_reason=first.finish_reason,
        prompt_tokens=body.usage.prompt_tokens,
        completion_tokens=body.usage.completion_tokens,
        status_code=200,
        response=body.model_dump_json(),
        error=None,
    )


def error_result(error: APIError) -> RowResult:
    return RowResult(
        text="",
        token_ids=[],
        finish_reason=None,
        prompt_tokens=0,
        completion_tokens=0,
        status_code=error.status_code,
        response=error.body().model_dump_json(),
        error=error.message,
    )


def result_columns(results: Sequence[RowResult]) -> dict[str, list[Any]]:
    """The results as columns, one list per field of `RowResult`."""
    return {name: [getattr(r, name) for r in results] for name in OUTPUT_COLUMNS}
