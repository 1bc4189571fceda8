"""Tool calls cut short by max_tokens: the calls an answer finished, then the one it was
writing when the budget ran out, its arguments as generated (a JSON text cut anywhere, so
it does not parse; empty when the cut came before them).

A client gets them as `tool_calls` with finish_reason "length" (server/openai/chat_answer.py),
so an agent sees the call it was about to make and can ask again with more tokens, rather
than take the call's JSON text for the answer. A call is kept once its name is whole; text
cut inside a name names no function and is dropped. One reader per format (the registry's:
server/openai/parsers/tool_calls.py); gpt-oss's harmony calls are kept alike by
server/openai/parsers/harmony.py.
"""

from __future__ import annotations

import json
import re

from server.openai.parsers.tool_formats import (
    MISTRAL_NAMED,
    ParsedAnswer,
    ParsedCall,
    call_of,
    json_values,
    parse_hermes,
    parse_mistral,
)

_NAMED = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"(.*)\Z', re.DOTALL)
_ARGUMENTS = re.compile(r'\s*,\s*"(?:arguments|parameters)"\s*:\s*(.*)\Z', re.DOTALL)


def cut_call(text: str) -> ParsedCall | None:
    """The call object cut short at the start of `text` (`{"name": "f", "arguments": {...`),
    None unless its name is whole."""
    named = _NAMED.match(text)
    if named is None:
        return None
    name = json.loads(f'"{named.group(1)}"')
    arguments = _ARGUMENTS.match(named.group(2))
    if arguments is None:
        return ParsedCall(name, "")
    text = arguments.group(1)
    try:  # whole arguments, the call cut after them: they end where their JSON ends
        value, _ = json.JSONDecoder().raw_decode(text)
    except ValueError:
        return ParsedCall(name, text.rstrip())
    return ParsedCall(name, json.dumps(value, ensure_ascii=False))


def cut_list(text: str, arguments_key: str) -> list[ParsedCall] | None:
    """A JSON list of call objects cut short (the "required" answer, Mistral's): its whole
    calls, then the cut one; None when `text` is no such list."""
    body = text.lstrip()
    if not body.startswith("["):
        return None
    found = _calls_then_cut(body[1:], arguments_key)
    if found is None:
        return None
    whole, cut = found
    return whole if cut is None else [*whole, cut]


def _calls_then_cut(
    body: str, arguments_key: str
) -> tuple[list[ParsedCall], ParsedCall | None] | None:
    """The whole call objects `body` starts with and the one cut short after them (None:
    none is); None when one of the whole values is no call."""
    values, end = json_values(body)
    calls = [call_of(value, arguments_key) for value in values]
    whole = [call for call in calls if call is not None]
    if len(whole) != len(calls):
        return None
    return whole, cut_call(body[end:])


def cut_llama3_json(text: str) -> ParsedAnswer | None:
    """A llama3_json answer cut inside a call: its whole calls and the cut one."""
    found = _calls_then_cut(text.lstrip().removeprefix("<|python_tag|>"), "parameters")
    if found is None or found[1] is None:
        return None
    return ParsedAnswer(None, [*found[0], found[1]])


def cut_hermes(text: str) -> ParsedAnswer | None:
    """A hermes answer cut inside its last `<tool_call>` block: the content before the
    blocks, the whole calls and the cut one."""
    marker = "<tool_call>"
    at = text.rfind(marker)
    if at < 0 or "</tool_call>" in text[at:]:
        return None
    cut = cut_call(text[at + len(marker) :])
    if cut is None:
        return None
    head = parse_hermes(text[:at])
    return ParsedAnswer((head.content or "").strip() or None, [*head.calls, cut])


def cut_mistral(text: str) -> ParsedAnswer | None:
    """A mistral answer cut inside its list of calls, or inside its last `name[ARGS]` call:
    the content before, the whole calls and the cut one."""
    marker = "[TOOL_CALLS]"
    at = text.rfind(marker)
    head, tail = (text[:at], text[at + len(marker) :]) if at >= 0 else ("", text)
    listed = cut_list(tail, "arguments")
    if listed:
        return ParsedAnswer(head.strip() or None, listed)
    named = MISTRAL_NAMED.match(tail)
    if at < 0 or named is None:
        return None
    before = parse_mistral(head) if head.strip() else ParsedAnswer(None, [])
    cut = ParsedCall(named.group(1), tail[named.end() :].strip())
    content = before.content if before.calls else head.strip() or None
    return ParsedAnswer(content, [*before.calls, cut])
