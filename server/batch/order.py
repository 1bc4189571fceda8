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
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from server.batch.lines import BatchLine

Item = TypeVar("Item")
FIELD, RECORD = "\x1f", "\x1e"  # separators that do not occur in text


def prompt_text(body: dict[str, Any]) -> str:
    """The text a request body's prompt starts with, in the order a chat template lays it
    out: tools, instructions, then each message's role and content (chat and responses), or
    the prompt (completions)."""
    parts = [_text(body.get("tools")), _text(body.get("instructions"))]
    messages = body.get("messages", body.get("input"))
    if isinstance(messages, list) and all(isinstance(m, dict) for m in messages):
        parts += [_text(m.get("role")) + FIELD + _text(m.get("content")) for m in messages]
    elif messages is not None:
        parts.append(_text(messages))
    else:
        parts.append(_text(body.get("prompt")))
    return RECORD.join(parts)


def _text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False)


def in_prefix_order(items: Sequence[Item], line_of: Callable[[Item], BatchLine]) -> list[Item]:
    """`items` sorted by their lines' prompt text, input order among equal prompts."""
    return sorted(items, key=lambda item: (prompt_text(line_of(item).body), line_of(item).index))
