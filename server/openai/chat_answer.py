"""`chat_answer`: a finished chat choice read as OpenAI's message, by the request's parsers:
reasoning apart, tool calls read from the rest, the finish reason they make. A request with
`stream` reads its deltas alike (server/openai/stream_answer.py) and ends with this."""

from __future__ import annotations

import hashlib

from engine.core.outputs import ChoiceAccumulator
from server.openai.endpoints.prepared import Prepared
from server.openai.parsers.reasoning import split_reasoning
from server.openai.parsers.tool_calls import HARMONY as HARMONY_TOOLS
from server.openai.responses import AssistantMessage, FunctionCallOut, ToolCall


def chat_answer(
    prep: Prepared, choice: ChoiceAccumulator, finish_reason: str | None
) -> tuple[AssistantMessage, str | None]:
    """A chat choice's whole answer as OpenAI's message: reasoning apart (when the model
    thinks aloud), tool calls read from the rest (when the request has tools), and the
    finish reason they make ("tool_calls"; "function_call" for the legacy `functions`).
    An answer cut by max_tokens keeps its whole calls and the cut one (its arguments as
    generated) with finish_reason "length" (server/openai/parsers/cut_calls.py).
    A call's id is a function of the request's id, so a batch line rerun writes the same."""
    text, plan = choice.text, prep.tools
    message = AssistantMessage(role="assistant", content=text)
    harmony = plan is not None and plan.parser == HARMONY_TOOLS
    if prep.reasoning is not None:
        split = split_reasoning(prep.reasoning, text, reads_calls=harmony)
        message.reasoning_content, message.content = split
    if plan is None:
        return message, finish_reason
    cut = finish_reason == "length"
    parsed = plan.answer(text if harmony else message.content or "", cut)
    if not parsed.calls and not plan.forces:
        return message, finish_reason
    message.content = parsed.content  # a forced answer cut inside its first name: none
    if not parsed.calls:
        return message, finish_reason
    if plan.legacy:
        first = parsed.calls[0]
        message.function_call = FunctionCallOut(name=first.name, arguments=first.arguments)
        return message, "function_call" if plan.mode != "named" and not cut else finish_reason
    message.tool_calls = [
        ToolCall(
            id=_call_id(prep.request_id, choice.index, k),
            type="function",
            function=FunctionCallOut(name=call.name, arguments=call.arguments),
        )
        for k, call in enumerate(parsed.calls)
    ]
    if plan.mode == "named" or finish_reason == "length":
        return message, finish_reason  # OpenAI's answer to a named choice: "stop"
    return message, "tool_calls"


def _call_id(request_id: str, index: int, k: int) -> str:
    digest = hashlib.sha256(f"{request_id}/{index}/{k}".encode()).hexdigest()
    return f"call_{digest[:24]}"
