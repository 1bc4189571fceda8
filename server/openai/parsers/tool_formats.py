"""Each tool-call format's reader: a model's answer text as the content around its calls and
the calls (OpenAI's), one function per format that vLLM's `--tool-call-parser` names
(the registry: server/openai/parsers/tool_calls.py):
- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call
  (Qwen 2.5 and 3, SmolLM3, Hermes and many fine-tunes);
- `llama3_json`: the answer is `{"name": ..., "parameters": {...}}` objects, several joined
  by `;`, after an optional `<|python_tag|>` (Llama 3.1 and up);
- `mistral`: `[TOOL_CALLS]` then a JSON list of `{"name", "arguments"}` objects, or (newer
  tokenizers) `[TOOL_CALLS]name[ARGS]{...}` per call;
- `openai`: gpt-oss's harmony messages to `functions.<name>`, one call each
  (server/openai/parsers/harmony.py); its content is the answer's final and commentary
  messages (preambles, in order), its reasoning the reasoning parser's. The text keeps the
  special tokens for this one (server/openai/endpoints/generation.py).

The daemon decodes with special tokens skipped, so a marker that is a special token of the
model (`<|python_tag|>`, Mistral's `[TOOL_CALLS]`) may be missing from the text: llama3_json
and mistral then read a JSON answer at the start of the text without it.

A reader returns the content around the calls and the calls; text it cannot read as a call
stays content, as vLLM's parsers leave it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from server.openai.parsers.harmony import HarmonySplitter


@dataclass(frozen=True, slots=True)
class ParsedCall:
    """One call: the function's name and its arguments as a JSON object text."""

    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class ParsedAnswer:
    content: str | None
    """The text outside the calls (None when there is none)."""
    calls: list[ParsedCall]


def call_of(value: Any, arguments_key: str) -> ParsedCall | None:
    """A call from a decoded `{"name": str, <arguments_key>: object}`, else None."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get(arguments_key, value.get("arguments", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def json_values(text: str) -> tuple[list[Any], int]:
    """The JSON values at the start of `text`, separated by blanks, `;` or `,`, and where
    the readable part ends."""
    decoder, at = json.JSONDecoder(), 0
    values: list[Any] = []
    while True:
        while at < len(text) and text[at] in " \t\r\n;,":
            at += 1
        if at >= len(text) or text[at] not in "{[":
            return values, at
        try:
            value, at = decoder.raw_decode(text, at)
        except ValueError:
            return values, at
        values.append(value)


def _content(*parts: str) -> str | None:
    text = "".join(parts).strip()
    return text or None


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def parse_hermes(text: str) -> ParsedAnswer:
    calls: list[ParsedCall] = []
    outside: list[str] = []
    at = 0
    for match in _HERMES.finditer(text):
        values, _ = json_values(match.group(1))
        call = call_of(values[0], "arguments") if len(values) == 1 else None
        if call is None:
            continue  # not a call: it stays content
        outside.append(text[at : match.start()])
        at = match.end()
        calls.append(call)
    outside.append(text[at:])
    return ParsedAnswer(_content(*outside) if calls else text, calls)


def parse_llama3_json(text: str) -> ParsedAnswer:
    body = text.lstrip()
    body = body.removeprefix("<|python_tag|>")
    values, end = json_values(body)
    calls = [call_of(v, "parameters") for v in values]
    if not values or any(c is None for c in calls) or body[end:].strip():
        return ParsedAnswer(text, [])
    return ParsedAnswer(None, [c for c in calls if c is not None])


MISTRAL_NAMED = re.compile(r"\s*([A-Za-z0-9_.\-]+)\[ARGS\]")


def parse_mistral(text: str) -> ParsedAnswer:
    before, marker, after = text.partition("[TOOL_CALLS]")
    if not marker:  # the marker was a skipped special token: a JSON list at the start
        before, after = "", text
        if not text.lstrip().startswith("[{"):
            return ParsedAnswer(text, [])
    calls: list[ParsedCall] = []
    values, end = json_values(after)
    if values and isinstance(values[0], list):
        read = [call_of(v, "arguments") for v in values[0]]
        calls = [c for c in read if c is not None]
        if len(calls) != len(read):
            calls = []
        rest = after[end:]
    else:  # name[ARGS]{...}, repeated (after [TOOL_CALLS] each)
        rest = after
        while match := MISTRAL_NAMED.match(rest):
            arguments, end = json_values(rest[match.end() :])
            if (
                not arguments
                or (
                    call := call_of(
                        {"name": match.group(1), "arguments": arguments[0]}, "arguments"
                    )
                )
                is None
            ):
                break
            calls.append(call)
            rest = rest[match.end() + end :].removeprefix("[TOOL_CALLS]")
    if not calls:
        return ParsedAnswer(text, [])
    return ParsedAnswer(_content(before, rest), calls)


def parse_harmony(text: str) -> ParsedAnswer:
    splitter = HarmonySplitter(reads_calls=True)
    _, content = splitter.feed(text)
    content += splitter.finish()[1]
    calls = [ParsedCall(name, arguments) for name, arguments in splitter.calls]
    return ParsedAnswer(content or None, calls)
