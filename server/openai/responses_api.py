"""The Responses API (`POST /v1/responses`) as vLLM serves it: text, json_schema
(`text.format`), function tools and streaming events, over the chat path.

A Responses request becomes the chat request it means (`ResponsesRequest.chat_body`:
`instructions` a system message, input items messages, function-call items assistant tool
calls, their outputs tool messages, `text.format` the response_format), so prompts,
sampling, tools and reasoning are the chat endpoint's, once. The finished chat choice is
then written as a Response: reasoning, message and function_call output items.

Nothing is stored (`store` is accepted and ignored), so `previous_response_id` and
`conversation` are refused: send the whole input each time.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, Field

from engine.core.outputs import ChoiceAccumulator
from server.openai.errors import APIError, invalid_request
from server.openai.requests import IGNORED_FIELDS, _Strict
from server.openai.responses import AssistantMessage, ChatCompletion, Usage


class TextFormat(BaseModel):
    """`text.format`: text, json_object, or json_schema with its name and schema inline."""

    type: Literal["text", "json_object", "json_schema"]
    name: str = "response"
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextOptions(BaseModel):
    format: TextFormat | None = None
    verbosity: str | None = None
    """Accepted and ignored."""


class ResponsesRequest(_Strict):
    """POST /v1/responses (the fields vLLM reads; the rest accepted and ignored)."""

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextOptions | None = None
    reasoning: dict[str, Any] | None = None
    """`{"effort": ...}`: the template's `reasoning_effort`."""
    previous_response_id: None = None
    conversation: None = None
    background: Literal[False] = False
    chat_template_kwargs: dict[str, Any] | None = None

    IGNORED: ClassVar[frozenset[str]] = IGNORED_FIELDS | {
        "truncation", "include", "user", "max_tool_calls", "top_logprobs", "stream_options",
        "prompt", "store", "metadata",
    }  # fmt: skip
    NEUTRAL: ClassVar[dict[str, Any]] = {}

    def chat_body(self) -> dict[str, Any]:
        """The chat completions body this request means."""
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        items = (
            [{"role": "user", "content": self.input}] if isinstance(self.input, str) else self.input
        )
        for k, item in enumerate(items):
            messages.extend(_item_messages(item, k, messages))
        body: dict[str, Any] = {"model": self.model, "messages": messages}
        for name in ("temperature", "top_p", "top_k", "seed", "parallel_tool_calls"):
            if getattr(self, name) is not None:
                body[name] = getattr(self, name)
        if self.max_output_tokens is not None:
            body["max_completion_tokens"] = self.max_output_tokens
        if self.chat_template_kwargs is not None:
            body["chat_template_kwargs"] = self.chat_template_kwargs
        if self.reasoning and self.reasoning.get("effort"):
            body["reasoning_effort"] = self.reasoning["effort"]
        if self.tools:
            body["tools"] = [_chat_tool(t, k) for k, t in enumerate(self.tools)]
        if isinstance(self.tool_choice, dict):
            body["tool_choice"] = {
                "type": "function",
                "function": {"name": self.tool_choice.get("name")},
            }
        elif self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice
        fmt = self.text.format if self.text else None
        if fmt is not None and fmt.type == "json_schema":
            schema = {"name": fmt.name, "schema": fmt.schema_ or {}, "strict": fmt.strict}
            body["response_format"] = {"type": "json_schema", "json_schema": schema}
        elif fmt is not None:
            body["response_format"] = {"type": fmt.type}
        return body


MESSAGE_ROLES = ("user", "system", "developer", "assistant")


def _item_messages(
    item: dict[str, Any], k: int, before: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """One input item as chat messages (a function call joins the assistant turn before)."""
    kind = item.get("type", "message")
    where = f"input.{k}"
    if kind == "message":
        content = item.get("content")
        role = item.get("role", "user")
        if role not in MESSAGE_ROLES:
            raise invalid_request(
                f"a message item's role must be one of {', '.join(MESSAGE_ROLES)}", param=where
            )
        if not isinstance(content, (str, list)):
            raise invalid_request(
                "a message item needs its content: a string or a list of content parts",
                param=f"{where}.content",
            )
        if isinstance(content, list):
            texts = ("input_text", "output_text")
            content = [
                {**part, "type": "text"}
                if isinstance(part, dict) and part.get("type") in texts
                else part
                for part in content
            ]
        return [{"role": role, "content": content}]
    if kind == "function_call":
        call = {
            "id": item.get("call_id"),
            "type": "function",
            "function": {"name": item.get("name"), "arguments": item.get("arguments", "")},
        }
        last = before[-1] if before else None
        if last is not None and last["role"] == "assistant" and "tool_calls" in last:
            last["tool_calls"].append(call)
            return []
        return [{"role": "assistant", "content": None, "tool_calls": [call]}]
    if kind == "function_call_output":
        output = item.get("output")
        text = output if isinstance(output, str) else json.dumps(output)
        return [{"role": "tool", "tool_call_id": item.get("call_id"), "content": text}]
    if kind == "reasoning":
        return []  # the model's earlier reasoning is not fed back, as chat templates drop it
    raise invalid_request(f"input items of type {kind!r} are not served", param=where)


def _chat_tool(tool: dict[str, Any], k: int) -> dict[str, Any]:
    if tool.get("type") != "function":
        raise invalid_request(
            f"only function tools are served; tools.{k} is of type {tool.get('type')!r}",
            param=f"tools.{k}",
        )
    function = {
        key: tool[key] for key in ("name", "description", "parameters", "strict") if key in tool
    }
    return {"type": "function", "function": function}


def refuse_stored_state(body: Any) -> None:
    """400 for a request that needs a stored response (none is stored)."""
    if isinstance(body, dict):
        for name in ("previous_response_id", "conversation"):
            if body.get(name) is not None:
                raise invalid_request(
                    f"{name} needs stored responses, and nanoflex stores none: send the whole "
                    "input (earlier items included) each time",
                    param=name,
                    code="unsupported_parameter",
                )


# -- the answer ---------------------------------------------------------------------------


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: dict[str, int]
    output_tokens: int
    output_tokens_details: dict[str, int]
    total_tokens: int


class Response(BaseModel):
    """POST /v1/responses' answer (OpenAI's `response` object)."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete", "in_progress"]
    model: str
    output: list[dict[str, Any]]
    """reasoning, message and function_call items, in that order."""
    usage: ResponseUsage | None
    incomplete_details: dict[str, str] | None
    error: None
    instructions: str | None
    max_output_tokens: int | None
    parallel_tool_calls: bool
    temperature: float | None
    top_p: float | None
    tool_choice: Any
    tools: list[dict[str, Any]]
    text: dict[str, Any]
    metadata: dict[str, Any]


def output_items(
    response_id: str, message: AssistantMessage, index: int = 0
) -> list[dict[str, Any]]:
    """A chat choice's message as Response output items."""
    base = response_id.removeprefix("resp_")
    items: list[dict[str, Any]] = []
    if message.reasoning_content:
        text = {"type": "reasoning_text", "text": message.reasoning_content}
        items.append({"type": "reasoning", "id": f"rs_{base}", "summary": [], "content": [text]})
    if message.content:
        part = {"type": "output_text", "text": message.content, "annotations": [], "logprobs": []}
        items.append(
            {
                "type": "message",
                "id": f"msg_{base}",
                "status": "completed",
                "role": "assistant",
                "content": [part],
            }
        )
    for k, call in enumerate(message.tool_calls or []):
        items.append(
            {
                "type": "function_call",
                "id": f"fc_{base}_{k}",
                "call_id": call.id,
                "name": call.function.name,
                "arguments": call.function.arguments,
                "status": "completed" if _whole(call.function.arguments) else "incomplete",
            }
        )
    return items


def _whole(arguments: str) -> bool:
    """A call's arguments were written to their end (a call cut by max_output_tokens keeps
    them as generated: a JSON object's text cut short, which never parses)."""
    try:
        json.loads(arguments)
    except ValueError:
        return False
    return True


def response_body(
    req: ResponsesRequest,
    response_id: str,
    created: int,
    model: str,
    chat: ChatCompletion | None,
    status: str = "completed",
) -> Response:
    """The Response for a finished chat completion (`chat`), or its head while it runs."""
    output: list[dict[str, Any]] = []
    usage = None
    incomplete = None
    if chat is not None:
        choice = chat.choices[0]
        output = output_items(response_id, choice.message)
        usage = response_usage(chat.usage)
        if choice.finish_reason == "length":
            status, incomplete = "incomplete", {"reason": "max_output_tokens"}
    fmt = req.text.format if req.text and req.text.format else TextFormat(type="text")
    return Response(
        id=response_id,
        object="response",
        created_at=created,
        status=status,  # type: ignore[arg-type]
        model=model,
        output=output,
        usage=usage,
        incomplete_details=incomplete,
        error=None,
        instructions=req.instructions,
        max_output_tokens=req.max_output_tokens,
        parallel_tool_calls=req.parallel_tool_calls is not False,
        temperature=req.temperature,
        top_p=req.top_p,
        tool_choice=req.tool_choice or "auto",
        tools=req.tools or [],
        text={"format": fmt.model_dump(by_alias=True, exclude_none=True)},
        metadata={},
    )


def response_usage(usage: Usage) -> ResponseUsage:
    return ResponseUsage(
        input_tokens=usage.prompt_tokens,
        input_tokens_details={"cached_tokens": usage.prompt_tokens_details.cached_tokens},
        output_tokens=usage.completion_tokens,
        output_tokens_details={"reasoning_tokens": 0},
        total_tokens=usage.total_tokens,
    )


def event(kind: str, number: int, **fields: Any) -> bytes:
    """One server-sent event of a Responses stream."""
    data = json.dumps({"type": kind, "sequence_number": number, **fields})
    return f"event: {kind}\ndata: {data}\n\n".encode()


async def response_events(
    head: Response,
    deltas: AsyncGenerator[tuple[str, str], None],
    finished: Any,
) -> AsyncGenerator[bytes, None]:
    """A Responses stream: created and in_progress; the reasoning as `reasoning_text` deltas
    and the answer as `output_text` deltas while they come (`deltas` yields ("reasoning" |
    "content", text)), each in its own output item opened at its first text; then every
    output item of the final Response (`finished()`) closed in order (a streamed item's done
    events carry its whole text, after a last delta with what was held back), the others
    (function calls) added and done whole; then completed or incomplete."""
    number = 0

    def next_event(kind: str, **fields: Any) -> bytes:
        nonlocal number
        number += 1
        return event(kind, number - 1, **fields)

    yield next_event("response.created", response=head.model_dump())
    yield next_event("response.in_progress", response=head.model_dump())
    base = head.id.removeprefix("resp_")
    streamed: dict[str, _StreamedItem] = {}
    try:
        async with aclosing(deltas) as parts:
            async for kind, text in parts:
                if not text:
                    continue
                item = streamed.get(kind)
                if item is None:
                    for other in streamed.values():  # reasoning ends where the answer starts
                        for done in other.close(next_event, None):
                            yield done
                    item = streamed[kind] = _StreamedItem(kind, base, len(streamed))
                    for opened in item.open(next_event):
                        yield opened
                yield item.delta(next_event, text)
    except APIError as e:
        yield next_event("error", code=e.code, message=e.message, param=e.param)
        return
    final: Response = finished()
    for index, out in enumerate(final.output):
        streams_as = {"reasoning": "reasoning", "message": "content"}.get(out["type"])
        item = streamed.get(streams_as) if streams_as else None
        if item is not None:
            for done in item.close(next_event, out):
                yield done
            continue
        yield next_event("response.output_item.added", output_index=index, item=out)
        if out["type"] == "function_call":
            yield next_event("response.function_call_arguments.delta", item_id=out["id"],
                             output_index=index, delta=out["arguments"])  # fmt: skip
            yield next_event("response.function_call_arguments.done", item_id=out["id"],
                             output_index=index, name=out["name"],
                             arguments=out["arguments"])  # fmt: skip
        yield next_event("response.output_item.done", output_index=index, item=out)
    kind = "response.completed" if final.status == "completed" else "response.incomplete"
    yield next_event(kind, response=final.model_dump())


@dataclass(slots=True)
class _StreamedItem:
    """A reasoning or message output item streamed as its text comes."""

    kind: str
    """"reasoning" or "content"."""
    base: str
    index: int
    text: str = ""
    closed: bool = False

    @property
    def id(self) -> str:
        return f"{'rs' if self.kind == 'reasoning' else 'msg'}_{self.base}"

    def _part(self, text: str) -> dict[str, Any]:
        if self.kind == "reasoning":
            return {"type": "reasoning_text", "text": text}
        return {"type": "output_text", "text": text, "annotations": []}

    def _item(self, status: str, content: list[dict[str, Any]]) -> dict[str, Any]:
        if self.kind == "reasoning":
            return {"type": "reasoning", "id": self.id, "summary": [], "content": content}
        return {
            "type": "message",
            "id": self.id,
            "status": status,
            "role": "assistant",
            "content": content,
        }

    def _text_event(self, next_event: Any, what: str, **fields: Any) -> bytes:
        """`response.{output_text|reasoning_text}.{delta|done}`."""
        if self.kind == "content":
            fields["logprobs"] = []
        kind = f"response.{self._part('')['type']}.{what}"
        return next_event(kind, item_id=self.id, output_index=self.index, content_index=0, **fields)

    def open(self, next_event: Any) -> list[bytes]:
        item = self._item("in_progress", [])
        return [
            next_event("response.output_item.added", output_index=self.index, item=item),
            next_event(
                "response.content_part.added",
                item_id=self.id,
                output_index=self.index,
                content_index=0,
                part=self._part(""),
            ),
        ]

    def delta(self, next_event: Any, text: str) -> bytes:
        self.text += text
        return self._text_event(next_event, "delta", delta=text)

    def close(self, next_event: Any, final: dict[str, Any] | None) -> list[bytes]:
        """Its done events, once: `final` is the item as the Response has it (its text may
        end with what was held back, sent first as a last delta), or None where the answer's
        start closes the reasoning before the Response is whole."""
        if self.closed:
            return []
        self.closed = True
        out: list[bytes] = []
        if final is not None:
            whole = final["content"][0]["text"]
            if whole.startswith(self.text) and len(whole) > len(self.text):
                out.append(self.delta(next_event, whole[len(self.text) :]))
        text = self.text if final is None else final["content"][0]["text"]
        part = self._part(text)
        out.append(self._text_event(next_event, "done", text=text))
        out.append(
            next_event(
                "response.content_part.done",
                item_id=self.id,
                output_index=self.index,
                content_index=0,
                part=part,
            )
        )
        item = final if final is not None else self._item("completed", [part])
        out.append(next_event("response.output_item.done", output_index=self.index, item=item))
        return out


def first_choice(choices: dict[int, ChoiceAccumulator]) -> list[ChoiceAccumulator]:
    return [choices[i] for i in sorted(choices)]
