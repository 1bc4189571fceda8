"""The tool-call parsers' registry: each format vLLM's `--tool-call-parser` names, with its
reader, its reader of an answer cut short by max_tokens, where its first call starts (a
stream holds text back from there) and how a chat template shows it.

The formats' readers: server/openai/parsers/tool_formats.py; cut answers:
server/openai/parsers/cut_calls.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from server.openai.parsers.cut_calls import cut_hermes, cut_llama3_json, cut_mistral
from server.openai.parsers.harmony import CHANNEL
from server.openai.parsers.tool_formats import (
    ParsedAnswer,
    parse_harmony,
    parse_hermes,
    parse_llama3_json,
    parse_mistral,
)

HARMONY = "openai"


@dataclass(frozen=True, slots=True)
class ToolParser:
    """One tool-call format."""

    name: str
    parse: Callable[[str], ParsedAnswer]
    """A whole answer as its content and calls."""
    cut: Callable[[str], ParsedAnswer | None]
    """An answer cut inside a call: its content, whole calls and the cut one; None when the
    cut is not inside a call (the ordinary parse then stands)."""
    start_marker: str | None
    """Where the format's first call starts (None: its calls are not in the content)."""
    template_marks: tuple[str, ...]
    """Text a chat template that teaches this format shows (any of them); () for the
    fallback."""


def _no_cut(text: str) -> None:
    """harmony's cut calls are kept by its splitter (server/openai/parsers/harmony.py)."""
    return None


TOOL_PARSERS = {
    parser.name: parser
    for parser in (
        ToolParser("hermes", parse_hermes, cut_hermes, "<tool_call>", ()),
        ToolParser(
            "llama3_json", parse_llama3_json, cut_llama3_json, "{", ("<|python_tag|>", "ipython")
        ),
        ToolParser("mistral", parse_mistral, cut_mistral, "[TOOL_CALLS]", ("[TOOL_CALLS]",)),
        ToolParser(HARMONY, parse_harmony, _no_cut, None, (CHANNEL,)),
    )
}
"""Name -> format, from the most general (hermes, the fallback) to the most specific: a chat
template is matched against the most specific first."""
PARSERS = tuple(TOOL_PARSERS)


def parse_tool_calls(parser: str, text: str) -> ParsedAnswer:
    """`text` (a whole answer) read by the named parser (PARSERS)."""
    return TOOL_PARSERS[parser].parse(text)


def cut_answer(parser: str, text: str) -> ParsedAnswer | None:
    """An answer cut inside a call, read by the named parser: the content before the calls,
    the whole calls and the cut one. None when the cut is not inside a call the parser
    reads (the ordinary parse then stands)."""
    return TOOL_PARSERS[parser].cut(text)


def parser_for_template(template: str | None) -> str:
    """The format a chat template teaches its model (vLLM's parsers by name), hermes when
    it shows none: the tools are then described in hermes' format
    (server/openai/chat_format.py)."""
    text = template or ""
    for parser in reversed(TOOL_PARSERS.values()):
        if any(mark in text for mark in parser.template_marks):
            return parser.name
    return "hermes"
