"""`AnswerStream`: one streamed chat choice's deltas when its answer is read, not just passed
on: reasoning split off as it comes (`reasoning_content` deltas), and, with tools, the text
from where a call may start held back until the answer ends, then sent as whole tool calls.

The calls come at the end, each in one delta (id, type, name and all its arguments), which
the OpenAI clients join as they join OpenAI's own finer deltas; content before the first
call streams as it comes. gpt-oss's calls are harmony messages apart from its content (the
`openai` parser): all its content streams, whatever comes between the calls too. The
finished choice is read by the same `chat_answer` as a request without `stream`, so both
give the same calls and finish reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from server.openai.parsers.markers import partial_marker
from server.openai.parsers.reasoning import Splitter, splitter_for
from server.openai.parsers.tool_calls import HARMONY, TOOL_PARSERS
from server.openai.responses import (
    AssistantMessage,
    ChatDelta,
    FunctionCallDelta,
    ToolCallDelta,
)
from server.openai.tools import ToolPlan

_AT_START = ("{", "[", "<|python_tag|>", "[TOOL_CALLS]")
"""How a llama3_json or mistral answer of calls begins."""


@dataclass(slots=True)
class AnswerStream:
    """The deltas of one choice (`feed` per engine delta, `finish` at its end)."""

    reasoning: str | None
    tools: ToolPlan | None
    splitter: Splitter | None = field(init=False)
    content: str = ""
    """The answer's content so far (reasoning split off)."""
    sent: int = 0
    """Characters of `content` sent."""

    def __post_init__(self) -> None:
        if self.reasoning is not None:
            self.splitter = splitter_for(self.reasoning, self._is_harmony)
        else:
            self.splitter = None

    @property
    def _is_harmony(self) -> bool:
        """gpt-oss's calls: harmony messages, read apart from the content as they come."""
        return self.tools is not None and self.tools.parser == HARMONY

    def feed(self, text: str) -> list[ChatDelta]:
        """The deltas that `text` (the engine's new text) makes ready."""
        reasoning, content = self.splitter.feed(text) if self.splitter else ("", text)
        out = [ChatDelta(reasoning_content=reasoning)] if reasoning else []
        self.content += content
        ready = self._safe_end()
        if ready > self.sent:
            out.append(ChatDelta(content=self.content[self.sent : ready]))
            self.sent = ready
        return out

    def _safe_end(self) -> int:
        """Where the content that cannot be part of a call ends."""
        plan, text = self.tools, self.content
        if plan is None or self._is_harmony:  # harmony's calls are not in the content
            return len(text)
        if plan.mode in ("named", "required"):
            return 0  # the whole answer is the call
        head = text.lstrip()
        if plan.parser != "hermes" and any(
            head.startswith(start) or start.startswith(head) for start in _AT_START
        ):
            return self.sent  # calls, or the start of them, or blanks before them
        marker = TOOL_PARSERS["hermes" if plan.parser == "hermes" else "mistral"].start_marker
        assert marker is not None
        at = text.find(marker, self.sent)
        if at >= 0:
            return at
        return len(text) - partial_marker(text, marker)

    def finish(self, message: AssistantMessage) -> list[ChatDelta]:
        """The last deltas, given the whole answer as `chat_answer` read it."""
        out: list[ChatDelta] = []
        if self.splitter is not None:
            reasoning, content = self.splitter.finish()
            if reasoning:
                out.append(ChatDelta(reasoning_content=reasoning))
            self.content += content
        called = message.function_call is not None or bool(message.tool_calls)
        if called and self._is_harmony and len(self.content) > self.sent:
            out.append(ChatDelta(content=self.content[self.sent :]))  # a body's held tail
            self.sent = len(self.content)
        if message.function_call is not None:
            call = message.function_call
            out.append(ChatDelta(function_call=FunctionCallDelta(**call.model_dump())))
        elif message.tool_calls:
            deltas = [
                ToolCallDelta(
                    index=k,
                    id=call.id,
                    type="function",
                    function=FunctionCallDelta(**call.function.model_dump()),
                )
                for k, call in enumerate(message.tool_calls)
            ]
            out.append(ChatDelta(tool_calls=deltas))
        elif len(self.content) > self.sent and message.content is not None:
            out.append(ChatDelta(content=self.content[self.sent :]))  # not a forced call's
        self.sent = len(self.content)
        return out
