"""A batch job's lines in prefix order: sorted by the text their prompts start with.

The engine orders the lines it holds by their tokenized prompts (`engine.core.prefix_order`),
but a daemon hands it a job `batch_concurrency` lines at a time. Sorting the whole job by
its prompts' text first (a trie's depth-first order: lines whose prompts share a text
prefix are adjacent) lets each window hold whole groups, so a group's shared system prompt
is computed once while it is cached. Text that shares a prefix tokenizes to token ids that
share a prefix (but for the last token or so), so the two orders agree.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, TypeVar

Item = TypeVar("Item")
FIELD, RECORD = "\x1f", "\x1e"  # separators that do not occur in text
PREFIX_KEY_CHARS = 4096
"""How much of a prompt's text the daemon sorts a job by (`prefix_key`): lines that share
more than this keep their input order among themselves."""


def prompt_text(body: dict[str, Any]) -> str:
    """The text a request body's prompt starts with, in the order a chat template lays it
    out: tools, instructions, then each message's role and content (chat and responses), or
    the prompt (completions)."""
    return "".join(_prompt_parts(body))


def prefix_key(body: dict[str, Any]) -> str:
    """The first `PREFIX_KEY_CHARS` characters of `prompt_text(body)`, built without copying
    the rest (a job's keys are held while it runs; its prompts need not be)."""
    parts: list[str] = []
    size = 0
    for part in _prompt_parts(body):
        parts.append(part[: PREFIX_KEY_CHARS - size])
        size += len(parts[-1])
        if size >= PREFIX_KEY_CHARS:
            break
    return "".join(parts)


def _prompt_parts(body: dict[str, Any]) -> Iterator[str]:
    """`prompt_text(body)` in pieces: the separators, and each field's text."""
    yield _text(body.get("tools"))
    yield RECORD
    yield _text(body.get("instructions"))
    messages = body.get("messages", body.get("input"))
    if isinstance(messages, list) and all(isinstance(m, dict) for m in messages):
        for m in messages:
            yield RECORD
            yield _text(m.get("role"))
            yield FIELD
            yield _text(m.get("content"))
    else:
        yield RECORD
        yield _text(body.get("prompt") if messages is None else messages)


def _text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False)


class Line(Protocol):
    """What sorting needs of a job's line (a `server.batch.lines.BatchLine`)."""

    @property
    def index(self) -> int: ...

    @property
    def body(self) -> dict[str, Any]: ...


def in_prefix_order(items: Sequence[Item], line_of: Callable[[Item], Line]) -> list[Item]:
    """`items` sorted by their lines' prompt text, input order among equal prompts."""
    return sorted(items, key=lambda item: (prompt_text(line_of(item).body), line_of(item).index))
