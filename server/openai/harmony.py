"""gpt-oss's harmony format read apart: the `analysis` channel is reasoning, the `final` one
(and `commentary`, its preambles) the answer.

The chat template's generation prompt ends with `<|start|>assistant`, so an answer is one or
more messages, each a header up to `<|message|>` and a body up to `<|end|>`, `<|return|>` or
`<|call|>`, the later ones opened by `<|start|>`:

    <|channel|>analysis<|message|>Let me think.<|end|><|start|>assistant<|channel|>final
    <|message|>Paris.<|return|>

The markers are special tokens, so the text read here keeps them (the request's
`skip_special_tokens` is turned off: server/openai/serving.py); none of them reaches
`content` or `reasoning_content`. An answer that does not open with a header (a constrained
one, say) is all content. Tool calls (a commentary message to `functions.<name>`) are not
read apart: their arguments are content.

`HarmonySplitter` reads a stream a delta at a time, as `ReasoningSplitter` does: text that
may be the start of a marker is held back until the next delta tells.
"""

from __future__ import annotations

from dataclasses import dataclass

from server.openai.markers import partial_marker

CHANNEL, MESSAGE, START = "<|channel|>", "<|message|>", "<|start|>"
ENDS = ("<|end|>", "<|return|>", "<|call|>")
"""What ends a message's body."""
MARKERS = (CHANNEL, MESSAGE, START, "<|constrain|>", *ENDS)
REASONING_CHANNEL = "analysis"
OPENINGS = (CHANNEL, " to=")
"""What an answer that is harmony opens with: its first header (a channel, or a recipient
before it)."""


@dataclass(slots=True)
class HarmonySplitter:
    """Splits a harmony answer's deltas into (reasoning, content) deltas. States: `opening`
    (nothing read yet), `header`, `body` (of a message on `channel`), `between` (after a
    message's end), `plain` (an answer that is not harmony: all content)."""

    state: str = "opening"
    channel: str = ""
    held: str = ""
    """A header not read to its end yet, or text that may be the start of a marker."""
    saw_reasoning: bool = False

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) that `text` adds; what could start a marker is held back."""
        text, self.held = self.held + text, ""
        reasoning: list[str] = []
        content: list[str] = []
        while text:
            if self.state == "opening":
                if text.startswith(OPENINGS):
                    self.state = "header"
                elif any(o.startswith(text) for o in OPENINGS):
                    self.held = text
                    break
                else:
                    self.state = "plain"
            elif self.state == "plain":
                content.append(text)
                break
            elif self.state == "header":
                at = text.find(MESSAGE)
                if at < 0:
                    self.held = text
                    break
                self.channel = channel_of(text[:at])
                self.saw_reasoning |= self.channel == REASONING_CHANNEL
                text, self.state = text[at + len(MESSAGE) :], "body"
            elif self.state == "body":
                body, end, text = _until_end(text)
                (reasoning if self.channel == REASONING_CHANNEL else content).append(body)
                if end is None:  # the body goes on; `text` may begin a marker
                    self.held = text
                    break
                self.state = "between"
            else:  # between messages: the next opens with <|start|>, anything else is kept
                if text.startswith(START):
                    text, self.state = text[len(START) :], "header"
                elif START.startswith(text):
                    self.held = text
                    break
                else:
                    self.state = "plain"
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """What was held back, once the answer ended: a body's tail goes to its channel, an
        unfinished header (cut by max_tokens) is dropped."""
        held, self.held = self.held, ""
        if self.state == "body":
            return (held, "") if self.channel == REASONING_CHANNEL else ("", held)
        if self.state in ("plain", "opening"):
            return "", held
        return "", ""


def channel_of(header: str) -> str:
    """A header's channel: the word after `<|channel|>` ('' without one)."""
    _, found, rest = header.partition(CHANNEL)
    if not found:
        return ""
    words = rest.split("<|", 1)[0].split()
    return words[0] if words else ""


def _until_end(text: str) -> tuple[str, str | None, str]:
    """(body text, the end marker or None, what follows): the body up to its first end
    marker; without one, up to a tail that may begin a marker (returned as what follows)."""
    found = [(text.find(end), end) for end in ENDS if end in text]
    if found:
        at, end = min(found)
        return text[:at], end, text[at + len(end) :]
    keep = max(partial_marker(text, marker) for marker in MARKERS)
    return text[: len(text) - keep], None, text[len(text) - keep :]
