"""gpt-oss's harmony format read apart: the `analysis` channel is reasoning, the `final` one
(and `commentary`, its preambles) the answer, and a message to `functions.<name>` a call.

The chat template's generation prompt ends with `<|start|>assistant`, so an answer is one or
more messages, each a header up to `<|message|>` and a body up to `<|end|>`, `<|return|>` or
`<|call|>`, the later ones opened by `<|start|>`:

    <|channel|>analysis<|message|>Let me think.<|end|><|start|>assistant<|channel|>final
    <|message|>Paris.<|return|>

A header holds the role (after `<|start|>`), the channel (after `<|channel|>`), a recipient
(`to=functions.get_weather`, before or after the channel) and a content type (`json` or
`<|constrain|>json`, last), as openai/harmony reads it. A message to `functions.<name>` is a
tool call whose body is its arguments; it ends with `<|call|>`, a stop token, so the text
(which leaves a stop token out) may end with the body itself:

    <|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":
    "Paris"}<|call|>

The markers are special tokens, so the text read here keeps them (the request's
`skip_special_tokens` is turned off: server/openai/endpoints/generation.py); none reaches
`content` or `reasoning_content`. An answer that does not open with a header (a constrained
one, say) is all content. Calls are read apart only when asked (`reads_calls`: the request
has tools); otherwise a call's arguments are content (commentary) or reasoning (analysis).

`HarmonySplitter` reads a stream a delta at a time, as `ReasoningSplitter` does: text that
may be the start of a marker is held back until the next delta tells.
"""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass, field

from server.openai.parsers.markers import partial_marker

CHANNEL, MESSAGE, START = "<|channel|>", "<|message|>", "<|start|>"
CONSTRAIN = "<|constrain|>"
ENDS = ("<|end|>", "<|return|>", "<|call|>")
"""What ends a message's body."""
MARKERS = (CHANNEL, MESSAGE, START, CONSTRAIN, *ENDS)
REASONING_CHANNEL = "analysis"
FUNCTIONS = "functions."
"""The namespace the chat template puts a request's tools in: a call's recipient."""
OPENINGS = (CHANNEL, " to=")
"""What an answer that is harmony opens with: its first header (a channel, or a recipient
before it)."""
_RECIPIENT = re.compile(r"(?:^|\s)to=([^\s<]+)")


@dataclass(frozen=True, slots=True)
class Header:
    """What a message's header says (each '' when it is silent)."""

    channel: str
    recipient: str
    content_type: str

    @property
    def function(self) -> str | None:
        """The function a call message calls (None: the message is no call)."""
        if not self.recipient.startswith(FUNCTIONS):
            return None
        return self.recipient[len(FUNCTIONS) :] or None


def read_header(header: str) -> Header:
    """A header's channel, recipient and content type: the channel is the word after
    `<|channel|>`, the recipient the word after `to=`, the content type what remains after
    the role (`<|constrain|>` dropped)."""
    channel = channel_of(header)
    rest = header
    if channel:
        before, _, after = header.partition(CHANNEL)
        rest = before + " " + after.lstrip().removeprefix(channel)
    found = _RECIPIENT.search(rest)
    recipient = found.group(1) if found else ""
    if found:
        rest = rest[: found.start()] + " " + rest[found.end() :]
    words = rest.replace(CONSTRAIN, " ").split()
    if words and words[0] == "assistant":
        words = words[1:]
    return Header(channel, recipient, words[-1] if words else "")


@dataclass(slots=True)
class HarmonySplitter:
    """Splits a harmony answer's deltas into (reasoning, content) deltas, and, when it
    `reads_calls`, gathers its tool calls in `calls`. States: `opening` (nothing read yet),
    `header`, `body` (of a message on `channel`), `between` (after a message's end), `plain`
    (an answer that is not harmony: all content)."""

    reads_calls: bool = False
    state: str = "opening"
    channel: str = ""
    held: str = ""
    """A header not read to its end yet, or text that may be the start of a marker."""
    saw_reasoning: bool = False
    calls: list[tuple[str, str]] = field(default_factory=list)
    """(function name, arguments) of each call read to its end, in order."""
    call: Header | None = None
    """The header of the call message being read."""
    arguments: str = ""
    """The body of that message so far."""

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
                header = read_header(text[:at])
                self.channel = header.channel
                self.call = header if self.reads_calls and header.function else None
                self.saw_reasoning |= self.channel == REASONING_CHANNEL and self.call is None
                text, self.state = text[at + len(MESSAGE) :], "body"
            elif self.state == "body":
                body, end, text = _until_end(text)
                if self.call is not None:
                    self.arguments += body
                else:
                    (reasoning if self.channel == REASONING_CHANNEL else content).append(body)
                if end is None:  # the body goes on; `text` may begin a marker
                    self.held = text
                    break
                self._end_call()
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
        """What was held back, once the answer ended: a body's tail goes to its channel (or
        its call, ended by the stop token <|call|>, which the text leaves out), an
        unfinished header (cut by max_tokens) is dropped."""
        held, self.held = self.held, ""
        if self.state == "body":
            if self.call is not None:
                self.arguments += held
                self._end_call()
                return "", ""
            return (held, "") if self.channel == REASONING_CHANNEL else ("", held)
        if self.state in ("plain", "opening"):
            return "", held
        return "", ""

    def _end_call(self) -> None:
        """The call message just read, as a call. JSON arguments (the content type `json`,
        or none) are written compact; if they do not parse (the message ended early, or the
        answer was cut by max_tokens inside it) they stay as written."""
        call, arguments = self.call, self.arguments.strip()
        self.call, self.arguments = None, ""
        if call is None or call.function is None:
            return
        if not call.content_type or "json" in call.content_type:
            with contextlib.suppress(ValueError):  # else cut short: kept as generated
                arguments = json.dumps(json.loads(arguments), ensure_ascii=False)
        self.calls.append((call.function, arguments))


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
