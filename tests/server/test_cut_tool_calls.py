"""Tool calls cut short by max_tokens, over one real daemon (demo model) and the openai
client: a forced answer (required, named) or an "auto" answer the parser sees a call start
in comes back as `tool_calls` (the whole calls, then the cut one with its arguments as
generated) with finish_reason "length", streamed and not, and as function_call items of
status "incomplete" on /v1/responses; the parsers' cut forms read alike.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import openai
import pytest

from server.openai.parsers.tool_calls import cut_answer
from server.openai.parsers.tool_formats import ParsedCall
from tests.server import test_tools
from tests.server.live import MODEL
from tests.server.test_tools import COMPACT, HERMES_TWO_CALLS, TIME, TOOLS, chat

live, client = test_tools.live, test_tools.client
"""test_tools' fixtures: this module's own demo daemon and openai client."""
WEATHER_FIRST = {"type": "function", "function": {"name": "get_weather"}}


def calls(answer: dict[str, Any]) -> list[tuple[str, str]]:
    """(name, arguments text) of each call."""
    found = answer["message"].get("tool_calls", [])
    return [(c["function"]["name"], c["function"]["arguments"]) for c in found]


def is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


Uncut = Callable[..., tuple[dict[str, Any], int]]


@pytest.fixture(scope="module")
def uncut(client: openai.OpenAI) -> Uncut:
    """`uncut(text, max_tokens, **fields)`: the uncut greedy answer to `fields` (within
    `max_tokens`) and the tokens it takes to write `text`, asked once per module: the
    whole and the streamed case cut the same answer."""
    found: dict[str, tuple[dict[str, Any], int]] = {}

    def get(text: str, max_tokens: int, **fields: Any) -> tuple[dict[str, Any], int]:
        key = json.dumps([text, max_tokens, fields], sort_keys=True)
        if key not in found:
            answer = chat(client, max_tokens=max_tokens, **fields)
            found[key] = answer, tokens_until(client, text, **fields)
        return found[key]

    return get


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_forced_calls_cut_short(client: openai.OpenAI, uncut: Uncut, stream: bool) -> None:
    """required and named answers cut inside their arguments: the call, its arguments a
    prefix of the uncut answer's, finish_reason "length", no content."""
    for choice, inside in (("required", '"parameters":{"'), (WEATHER_FIRST, '{"')):
        fields: Any = {"tools": TOOLS, "tool_choice": choice}
        whole, budget = uncut(inside, 80, **fields)
        [(name, arguments), *_] = calls(whole)
        cut = chat(client, stream, max_tokens=budget, **fields)
        assert cut["finish_reason"] == "length" and "content" not in cut["message"]
        [(cut_name, cut_arguments)] = calls(cut)
        assert cut_name == name and not is_json(cut_arguments) and cut_arguments
        assert json.dumps(json.loads(arguments), separators=(",", ":")).startswith(cut_arguments)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_auto_keeps_whole_calls_and_the_cut_one(
    client: openai.OpenAI, uncut: Uncut, stream: bool
) -> None:
    """hermes' blocks: the first call whole, the second cut inside its arguments."""
    fields: Any = {"tools": TOOLS, "structured_outputs": {"regex": HERMES_TWO_CALLS}}
    whole, budget = uncut('"get_time", "arguments": {"zone": "', 160, **fields)
    answer = chat(client, stream, max_tokens=budget, **fields)
    assert answer["finish_reason"] == "length"
    assert answer["message"].get("content") == "Let me check."
    [first, second] = calls(answer)
    assert first == calls(whole)[0]
    assert second[0] == "get_time" and not is_json(second[1])
    assert second[1].startswith('{"zone": "') and '{"zone": "UTC"}'.startswith(second[1])


def tokens_until(client: openai.OpenAI, text: str, **fields: Any) -> int:
    """How many tokens the uncut answer (greedy) takes to write `text`."""
    known = {"tools", "tool_choice", "messages"}
    fields = {"messages": [{"role": "user", "content": "Weather in Paris?"}]} | fields
    answer = client.chat.completions.create(
        model=MODEL,
        max_tokens=160, temperature=0, logprobs=True,
        **{k: v for k, v in fields.items() if k in known},
        extra_body={k: v for k, v in fields.items() if k not in known},
    )  # fmt: skip
    logprobs = answer.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    written = ""
    for k, entry in enumerate(logprobs.content):
        written += entry.token
        if text in written:
            return k + 1
    raise AssertionError(f"{text!r} not in {written!r}")


def test_legacy_function_call_cut_short(client: openai.OpenAI) -> None:
    functions: Any = [{"name": "get_time", "parameters": {**TIME, **COMPACT}}]
    answer = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Time?"}], max_tokens=4,
        temperature=0, functions=functions, function_call={"name": "get_time"},
    )  # fmt: skip
    choice = answer.choices[0]
    assert choice.finish_reason == "length" and choice.message.function_call is not None
    assert choice.message.function_call.name == "get_time"
    assert not is_json(choice.message.function_call.arguments)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_responses_function_call_incomplete(client: openai.OpenAI, stream: bool) -> None:
    tool: Any = {"type": "function", "name": "get_time", "parameters": TIME}
    fields: Any = {"model": MODEL, "input": "Time?", "tools": [tool], "tool_choice": "required"}
    as_chat: Any = {"type": "function", "function": {"name": "get_time", "parameters": TIME}}
    asked = [{"role": "user", "content": "Time?"}]
    budget = tokens_until(
        client, '"parameters":{"', tools=[as_chat], messages=asked, tool_choice="required"
    )
    if stream:
        events = list(client.responses.create(**fields, max_output_tokens=budget, stream=True))
        assert events[-1].type == "response.incomplete"
        response: Any = events[-1].response  # type: ignore[union-attr]
    else:
        response = client.responses.create(**fields, max_output_tokens=budget)
    assert response.status == "incomplete"
    [item] = response.output
    assert item.type == "function_call" and item.name == "get_time"
    assert item.status == "incomplete" and not is_json(item.arguments)
    whole = client.responses.create(**fields, max_output_tokens=60)
    assert {i.status for i in whole.output if i.type == "function_call"} == {"completed"}


@pytest.mark.parametrize(
    ("parser", "text", "content", "expected"),
    [
        ("hermes", 'Hi<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
         '<tool_call>{"name": "g", "arguments": {"b": "x', "Hi",
         [ParsedCall("f", '{"a": 1}'), ParsedCall("g", '{"b": "x')]),
        ("hermes", '<tool_call>{"name": "g", ', None, [ParsedCall("g", "")]),
        ("hermes", '<tool_call>{"name": "g', None, None),
        ("llama3_json", '{"name": "f", "parameters": {}}; {"name": "g", "parameters": {"b',
         None, [ParsedCall("f", "{}"), ParsedCall("g", '{"b')]),
        ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {"a": [1, 2', None,
         [ParsedCall("f", '{"a": [1, 2')]),
        ("hermes", '<tool_call>{"name": "g", "arguments": {"b": 2}}</tool', None,
         [ParsedCall("g", '{"b": 2}')]),
        ("mistral", '[TOOL_CALLS]f[ARGS]{"a": 1}[TOOL_CALLS]g[ARGS]{"b"', None,
         [ParsedCall("f", '{"a": 1}'), ParsedCall("g", '{"b"')]),
    ],
)  # fmt: skip
def test_parsers_read_cut_calls(
    parser: str, text: str, content: str | None, expected: list[ParsedCall] | None
) -> None:
    answer = cut_answer(parser, text)
    if expected is None:
        assert answer is None
        return
    assert answer is not None and answer.calls == expected and answer.content == content
