"""Tool calling as vLLM serves it: what a chat request's `tools` and `tool_choice` ask, the
grammar that enforces a forced call, the chat as the template takes it, and the answer's
tool calls.

- `tool_choice` "none": the tools reach the template, the answer is text.
- "auto": the model decides; its own format (a parser from server/openai/tool_parsers.py,
  chosen from the chat template or `--tool-call-parser`) is read into `tool_calls`.
- a named function: the answer is that function's arguments, a JSON object valid against
  its `parameters` schema (the structured-output engine enforces it); OpenAI answers
  `finish_reason: "stop"` then, and so do we.
- "required": the answer is a JSON list of `{"name", "parameters"}` calls, each valid
  against its tool's schema (one call when `parallel_tool_calls` is false).

gpt-oss (the `openai` parser) writes calls as harmony messages in every mode: a forced call
is such a message, its arguments held to the schema (`harmony_calls`), after an analysis
message if the model thinks first; the calls are read from the messages alike. Its template
renders one call per assistant message and names a tool result after the call before it,
so an assistant turn of several calls goes to it as one message per call, each followed by
its result (`one_call_each`).

The legacy `functions` / `function_call` fields are the same with `message.function_call`
in the answer (one call, finish_reason "function_call"), as OpenAI answered them.

A template that never mentions tools (SmolLM2's, the demo model's) would drop them: the
tools are then described in a system message in hermes' format, assistant calls are written
back as `<tool_call>` blocks and tool results as `<tool_response>` user turns, so any
instruct model can take part in a tool round trip.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from typing import Any

from engine.core.structured import StructuredOutput, closed_schema, harmony_calls
from server.openai.cut_calls import cut_answer, cut_list
from server.openai.errors import invalid_request
from server.openai.tool_parsers import HARMONY, ParsedAnswer, ParsedCall, parse_tool_calls

COMPACT = {"x-guidance": {"whitespace_flexible": False}}
"""A forced call's JSON is written without blanks between its tokens: clients read it as
JSON, and a blank is a token a small model could repeat until max_tokens."""
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """What one chat request asks of tools."""

    tools: list[dict[str, Any]]
    """OpenAI's tool objects (`{"type": "function", "function": {...}}`), for the template."""
    mode: str
    """none, auto, required or named."""
    named: str | None = None
    parallel: bool = True
    parser: str = "hermes"
    legacy: bool = False
    """Asked with `functions`: answered with `message.function_call`."""
    schemas: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Each function's parameters schema, undeclared keys closed (vLLM's default)."""

    @property
    def parses(self) -> bool:
        """The answer's text is read for calls (not plain content)."""
        return self.mode != "none"

    def constraint(self) -> StructuredOutput | None:
        """The grammar a forced call's answer follows (None for none and auto)."""
        if not self.forces:
            return None
        if self.parser == HARMONY:
            names = [self.named] if self.named is not None else list(self.schemas)
            schemas = {name: json.dumps({**self.schemas[name], **COMPACT}) for name in names}
            return harmony_calls(schemas, parallel=self.parallel and self.named is None)
        if self.mode == "named":
            assert self.named is not None
            return StructuredOutput("json", json.dumps({**self.schemas[self.named], **COMPACT}))
        calls = [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "parameters": schema},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for name, schema in self.schemas.items()
        ]
        array: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
        if not self.parallel:
            array["maxItems"] = 1
        return StructuredOutput("json", json.dumps({**array, **COMPACT}))

    @property
    def forces(self) -> bool:
        """The answer is constrained to calls (required, named): none of it is content."""
        return self.mode in ("named", "required")

    def answer(self, text: str, cut: bool = False) -> ParsedAnswer:
        """The finished answer as content and calls (harmony's: the whole text, markers
        and reasoning included). An answer `cut` by max_tokens inside a call keeps that
        call, its arguments as generated (server/openai/cut_calls.py)."""
        if self.mode == "none":
            return ParsedAnswer(text, [])
        if self.mode == "auto" or self.parser == HARMONY:
            parsed = parse_tool_calls(self.parser, text)
            cut_short = cut_answer(self.parser, text) if cut else None
            if cut_short is not None and len(cut_short.calls) > len(parsed.calls):
                parsed = cut_short
            if parsed.calls and not self.parallel:
                return ParsedAnswer(parsed.content, parsed.calls[:1])
            return parsed
        if self.mode == "named":
            assert self.named is not None
            return ParsedAnswer(None, [ParsedCall(self.named, _compact_json(text))])
        return _required_calls(text)


def _compact_json(text: str) -> str:
    """A forced call's arguments as sent (the grammar made them JSON); text cut short by
    max_tokens stays as it is."""
    try:
        return json.dumps(json.loads(text), ensure_ascii=False)
    except ValueError:
        return text


def _required_calls(text: str) -> ParsedAnswer:
    try:
        values = json.loads(text)
    except ValueError:  # cut short by max_tokens: the whole calls and the cut one
        return ParsedAnswer(None, cut_list(text, "parameters") or [])
    calls = [ParsedCall(v["name"], json.dumps(v["parameters"], ensure_ascii=False)) for v in values]
    return ParsedAnswer(None, calls)


def tool_plan(
    tools: list[dict[str, Any]] | None,
    tool_choice: Any,
    parallel: bool | None,
    functions: list[dict[str, Any]] | None,
    function_call: Any,
    parser: str,
) -> ToolPlan | None:
    """The request's tool settings checked and resolved (None without tools)."""
    legacy = functions is not None
    if legacy:
        if tools is not None:
            raise invalid_request("give tools or functions, not both", param="functions")
        tools = [{"type": "function", "function": f} for f in functions or []]
        tool_choice = function_call
        if isinstance(function_call, dict):
            tool_choice = {"type": "function", "function": function_call}
        parallel = False
    param = "function_call" if legacy else "tool_choice"
    if not tools:
        if tool_choice not in (None, "none"):
            raise invalid_request(f"{param} needs tools to choose from", param=param)
        return None
    schemas: dict[str, dict[str, Any]] = {}
    for tool in tools:
        function = tool["function"]
        schemas[function["name"]] = closed_schema(function.get("parameters") or EMPTY_PARAMETERS)
    mode, named = "auto", None
    if isinstance(tool_choice, dict):
        mode, named = "named", tool_choice["function"]["name"]
        if named not in schemas:
            raise invalid_request(
                f"{param} names {named!r}, which is not among the tools ({', '.join(schemas)})",
                param=param,
            )
    elif tool_choice is not None:
        mode = tool_choice
    return ToolPlan(
        tools=tools,
        mode=mode,
        named=named,
        parallel=True if parallel is None else parallel,
        parser=parser,
        legacy=legacy,
        schemas=schemas,
    )


def template_knows_tools(template: str | None) -> bool:
    """The chat template renders `tools` itself (Qwen, Llama 3.1, Mistral, Hermes...)."""
    return bool(template) and "tools" in (template or "")


def chat_for_template(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    native: bool,
    harmony: bool = False,
) -> list[dict[str, Any]]:
    """The messages as the template takes them: assistant calls' arguments as objects (the
    templates write them with `tojson`); for a template that knows no tools (`native`
    False), tools, calls and results written into the text in hermes' format; for gpt-oss's
    (`harmony`), one call per assistant message (`one_call_each`)."""
    if harmony:
        messages = one_call_each(messages)
    out: list[dict[str, Any]] = []
    for message in messages:
        calls = message.get("tool_calls")
        if native:
            if calls:
                message = {**message, "tool_calls": [_call_for_template(c) for c in calls]}
            out.append(message)
            continue
        if message["role"] == "tool":
            text = f"<tool_response>\n{message.get('content') or ''}\n</tool_response>"
            out.append({"role": "user", "content": text})
        elif calls:
            blocks = [_hermes_block(_call_for_template(c)) for c in calls]
            text = "\n".join([message.get("content") or "", *blocks]).strip()
            out.append({"role": "assistant", "content": text})
        else:
            out.append({k: v for k, v in message.items() if k != "tool_calls"})
    if tools and not native:
        system = _tools_system_text(tools)
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{system}".strip()}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out


def one_call_each(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """gpt-oss's chat: an assistant message of several calls as one message per call, each
    followed by its result (the tool message whose `tool_call_id` is the call's id, else the
    next result whose id names no call). An assistant's reasoning sent back
    (`reasoning_content`) is the template's `thinking`, as transformers passes it; a call
    message's chain of thought goes with its first call only, in place of its content (the
    template renders one of them, as the analysis message harmony feeds back before a call)."""
    out: list[dict[str, Any]] = []
    at = 0
    while at < len(messages):
        message = _with_thinking(messages[at])
        at += 1
        calls = message.get("tool_calls") or []
        if message["role"] != "assistant" or not calls:
            out.append(message)
            continue
        results: list[dict[str, Any]] = []
        while at < len(messages) and messages[at]["role"] == "tool":
            results.append(messages[at])
            at += 1
        ids = {call.get("id") for call in calls}
        for k, call in enumerate(calls):
            single = {**message, "tool_calls": [call]}
            if k:
                single = {key: v for key, v in single.items() if key != "thinking"}
                single["content"] = ""
            elif "thinking" in single:
                single["content"] = ""
            out.append(single)
            mine = [r for r in results if r.get("tool_call_id") == call.get("id")]
            found = mine or [r for r in results if r.get("tool_call_id") not in ids]
            if found:
                out.append(found[0])
                results.remove(found[0])
        out.extend(results)
    return out


def described(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tools as gpt-oss's template takes them: it writes each function's description (as a
    `//` comment) and fails on one without, which OpenAI's tools may leave out ('' then)."""
    return [
        {
            **tool,
            "function": {
                **tool["function"],
                "description": tool["function"].get("description") or "",
            },
        }
        for tool in tools
    ]


def _with_thinking(message: dict[str, Any]) -> dict[str, Any]:
    reasoning = message.get("reasoning_content")
    if message["role"] != "assistant" or reasoning is None:
        return message
    rest = {key: v for key, v in message.items() if key != "reasoning_content"}
    return {"thinking": reasoning, **rest}


def _call_for_template(call: dict[str, Any]) -> dict[str, Any]:
    function = dict(call.get("function") or {})
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        with contextlib.suppress(ValueError):  # else the template gets the text as sent
            function["arguments"] = json.loads(arguments)
    return {**call, "function": function}


def _hermes_block(call: dict[str, Any]) -> str:
    value = {"name": call["function"].get("name"), "arguments": call["function"].get("arguments")}
    return f"<tool_call>\n{json.dumps(value, ensure_ascii=False)}\n</tool_call>"


def _tools_system_text(tools: list[dict[str, Any]]) -> str:
    signatures = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "You can call functions to answer. Their signatures, one JSON object a line, are "
        f"between <tools> and </tools>:\n<tools>\n{signatures}\n</tools>\n\n"
        "To call a function, answer with a JSON object of its name and arguments between "
        "<tool_call> and </tool_call>, one block per call:\n"
        '<tool_call>\n{"name": <function name>, "arguments": <arguments as a JSON object>}\n'
        "</tool_call>"
    )
