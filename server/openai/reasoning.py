"""Reasoning apart from the answer: a thinking model's `<think>...</think>` text goes to
`reasoning_content`, the rest to `content`, as vLLM's reasoning parsers split them.

- `qwen3`: the reasoning is what stands between `<think>` and `</think>`; an answer without
  `</think>` is all content (Qwen3 with `enable_thinking: false`, whose template writes an
  empty think block into the prompt).
- `deepseek_r1`: the template opens `<think>` in the prompt, so the answer starts inside the
  reasoning: everything before `</think>` is reasoning, and an answer cut off before it is
  all reasoning.

- `openai_gptoss`: gpt-oss's harmony channels (server/openai/harmony.py): the analysis
  channel is reasoning, the final one (and commentary preambles) the answer; its tool calls
  are the `openai` tool parser's (server/openai/tool_parsers.py).

`ReasoningSplitter` does the same on a stream, a delta at a time: text that might be the
start of a marker is held back until the next delta tells.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from server.openai.harmony import HarmonySplitter
from server.openai.markers import partial_marker

HARMONY = "openai_gptoss"
PARSERS = ("qwen3", "deepseek_r1", HARMONY)
START, END = "<think>", "</think>"


def parser_for_template(template: str | None) -> str | None:
    """The reasoning format a chat template shows (None: the model does not think aloud)."""
    text = template or ""
    if "<|channel|>" in text:
        return HARMONY
    if END not in text:
        return None
    # a template that ends its generation prompt inside <think> (DeepSeek-R1 and distills)
    return "deepseek_r1" if "<think>\\n' }}" in text or "<think>\\n'}}" in text else "qwen3"


def splitter_for(parser: str, reads_calls: bool = False) -> ReasoningSplitter | HarmonySplitter:
    """The stream splitter of a reasoning format; `reads_calls`: harmony's tool calls are
    read apart from the content (the harmony tool parser's)."""
    if parser == HARMONY:
        return HarmonySplitter(reads_calls)
    return ReasoningSplitter(parser)


def split_reasoning(parser: str, text: str, reads_calls: bool = False) -> tuple[str | None, str]:
    """(reasoning or None, content) of a whole answer (`reads_calls`: splitter_for's)."""
    splitter = splitter_for(parser, reads_calls)
    reasoning, content = splitter.feed(text)
    more_reasoning, more_content = splitter.finish()
    return (reasoning + more_reasoning if splitter.saw_reasoning else None), content + more_content


@dataclass(slots=True)
class ReasoningSplitter:
    """Splits an answer's deltas into (reasoning, content) deltas. States: `before` (qwen3:
    blanks so far, a `<think>` may come), `thinking`, `after` (just past `</think>`: the
    blank lines before the answer are dropped), `answering`."""

    parser: str
    state: str = field(init=False)
    held: str = ""
    """Text that may be the start of a marker, or the blanks before one."""
    saw_reasoning: bool = field(init=False)

    def __post_init__(self) -> None:
        thinking = self.parser == "deepseek_r1"
        self.state = "thinking" if thinking else "before"
        self.saw_reasoning = thinking

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) that `text` adds; what could start a marker is held back."""
        text, self.held = self.held + text, ""
        if self.state == "before":
            blanks = len(text) - len(text.lstrip())
            rest = text[blanks:]
            if rest.startswith(START):
                self.state, self.saw_reasoning = "thinking", True
                text = rest[len(START) :]
            elif START.startswith(rest):  # blanks, or the start of <think>: wait
                self.held = text
                return "", ""
            else:
                self.state = "answering"
        reasoning = ""
        if self.state == "thinking":
            at = text.find(END)
            if at < 0:
                keep = partial_marker(text, END)
                self.held = text[len(text) - keep :]
                return text[: len(text) - keep], ""
            reasoning, text = text[:at], text[at + len(END) :]
            self.state = "after"
        if self.state == "after":
            text = text.lstrip()
            if not text:
                return reasoning, ""
            self.state = "answering"
        return reasoning, text

    def finish(self) -> tuple[str, str]:
        """What was held back, once the answer ended (an unclosed `<think>`: reasoning)."""
        held, self.held = self.held, ""
        if self.state == "thinking":
            return held, ""
        return "", held
