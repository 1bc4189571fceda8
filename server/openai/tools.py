"""Tool calling as vLLM serves it: what a chat request's `tools` and `tool_choice` ask, the
grammar that enforces a forced call, and the answer's tool calls (the tools in the prompt:
server/openai/chat_format.py).

- `tool_choice` "none": the tools reach the template, the answer is text.
- "auto": the model decides; its own format (a parser of server/openai/parsers/tool_calls.py,
  chosen from the chat template or `--tool-call-parser`) is read into `tool_calls`.
- a named function: the answer is that function's arguments, a JSON object valid against
  its `parameters` schema (the structured-output engine enforces it); OpenAI answers
  `finish_reason: "stop"` then, and so do we.
- "required": the answer is a JSON list of `{"name", "parameters"}` calls, each valid
  against its tool's schema (one call when `parallel_tool_calls` is false).

gpt-oss (the `openai` parser) writes calls as harmony messages in every mode: a forced call
is such a message, its arguments held to the schema (`harmony_calls`), after an analysis
message if the model thinks first; the calls are read from the messages alike.

The legacy `functions` / `function_call` fields are the same with `message.function_call`
in the answer (one call, finish_reason "function_call"), as OpenAI answered them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from engine.core.structured import StructuredOutput, closed_schema, harmony_calls
from server.openai.errors import invalid_request
from server.openai.parsers.cut_calls import cut_list
from server.openai.parsers.tool_calls import HARMONY, cut_answer, parse_tool_calls
from server.openai.parsers.tool_formats import ParsedAnswer, ParsedCall

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
        call, its arguments as generated (server/openai/parsers/cut_calls.py)."""
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
