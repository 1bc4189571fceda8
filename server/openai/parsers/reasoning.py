"""The reasoning parsers' registry: a thinking model's reasoning apart from its answer, the
reasoning to `reasoning_content`, the rest to `content`, as vLLM's reasoning parsers split them.

- `qwen3`: the reasoning is what stands between `<think>` and `</think>`; an answer without
  `</think>` is all content (Qwen3 with `enable_thinking: false`, whose template writes an
  empty think block into the prompt).
- `deepseek_r1`: the template opens `<think>` in the prompt, so the answer starts inside the
  reasoning: everything before `</think>` is reasoning, and an answer cut off before it is
  all reasoning.
- `openai_gptoss`: gpt-oss's harmony channels (server/openai/parsers/harmony.py): the analysis
  channel is reasoning, the final one (and commentary preambles) the answer; its tool calls
  are the `openai` tool parser's (server/openai/parsers/tool_calls.py).

Each splits a stream a delta at a time (`ReasoningSplitter`, server/openai/parsers/think.py;
`HarmonySplitter`): text that might be the start of a marker is held back until the next
delta tells.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from server.openai.parsers.harmony import CHANNEL, HarmonySplitter
from server.openai.parsers.think import END, ReasoningSplitter

HARMONY = "openai_gptoss"
Splitter = ReasoningSplitter | HarmonySplitter


@dataclass(frozen=True, slots=True)
class ReasoningParser:
    """One reasoning format."""

    name: str
    splitter: Callable[[bool], Splitter]
    """A stream splitter; its argument (`reads_calls`): harmony's tool calls are read apart
    from the content (the harmony tool parser's)."""
    shows: Callable[[str], bool]
    """Whether a chat template's text shows this format."""


def _opens_think(template: str) -> bool:
    """A template that ends its generation prompt inside <think> (DeepSeek-R1 and distills)."""
    return END in template and ("<think>\\n' }}" in template or "<think>\\n'}}" in template)


REASONING_PARSERS = {
    parser.name: parser
    for parser in (
        ReasoningParser("qwen3", lambda _: ReasoningSplitter("qwen3"), lambda t: END in t),
        ReasoningParser("deepseek_r1", lambda _: ReasoningSplitter("deepseek_r1"), _opens_think),
        ReasoningParser(HARMONY, HarmonySplitter, lambda t: CHANNEL in t),
    )
}
"""Name -> format, from the most general to the most specific: a chat template is matched
against the most specific first."""
PARSERS = tuple(REASONING_PARSERS)


def parser_for_template(template: str | None) -> str | None:
    """The reasoning format a chat template shows (None: the model does not think aloud)."""
    text = template or ""
    for parser in reversed(REASONING_PARSERS.values()):
        if parser.shows(text):
            return parser.name
    return None


def splitter_for(parser: str, reads_calls: bool = False) -> Splitter:
    """The stream splitter of a reasoning format; `reads_calls`: harmony's tool calls are
    read apart from the content (the harmony tool parser's)."""
    return REASONING_PARSERS[parser].splitter(reads_calls)


def split_reasoning(parser: str, text: str, reads_calls: bool = False) -> tuple[str | None, str]:
    """(reasoning or None, content) of a whole answer (`reads_calls`: splitter_for's)."""
    splitter = splitter_for(parser, reads_calls)
    reasoning, content = splitter.feed(text)
    more_reasoning, more_content = splitter.finish()
    return (reasoning + more_reasoning if splitter.saw_reasoning else None), content + more_content
