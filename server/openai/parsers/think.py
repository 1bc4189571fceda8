"""`ReasoningSplitter`: a thinking model's `<think>...</think>` answer split into reasoning and
content, a delta at a time (the `qwen3` and `deepseek_r1` reasoning parsers: their registry
is server/openai/parsers/reasoning.py).

Text that might be the start of a marker is held back until the next delta tells.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from server.openai.parsers.markers import partial_marker

START, END = "<think>", "</think>"


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
