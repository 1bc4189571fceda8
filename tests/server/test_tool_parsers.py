"""The tool-call and reasoning parsers on the texts models write (no server): what is a call,
what stays content, which format a chat template shows, and a stream split at every
character giving what the whole answer gives."""

from __future__ import annotations

import json

import pytest

from server.openai.parsers.reasoning import parser_for_template as reasoning_for_template
from server.openai.parsers.reasoning import split_reasoning
from server.openai.parsers.tool_calls import parse_tool_calls, parser_for_template
from server.openai.parsers.tool_formats import ParsedCall
from server.openai.stream_answer import AnswerStream
from server.openai.tools import ToolPlan

TIME = ParsedCall("get_time", '{"zone": "UTC"}')
WEATHER = ParsedCall("get_weather", '{"city": "Paris"}')


@pytest.mark.parametrize(
    ("parser", "text", "content", "calls"),
    [
        ("hermes", 'Sure.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n'
         "</tool_call>", "Sure.", [TIME]),
        ("hermes", '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'
         '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}',
         None, [TIME, WEATHER]),  # the second unclosed (EOS), its arguments a JSON string
        ("hermes", "<tool_call>not json</tool_call> hi", "<tool_call>not json</tool_call> hi", []),
        ("hermes", "No tools needed.", "No tools needed.", []),
        ("llama3_json", '<|python_tag|>{"name": "get_time", "parameters": {"zone": "UTC"}}; '
         '{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [TIME, WEATHER]),
        ("llama3_json", '{"name": "get_time", "parameters": {"zone": "UTC"}}', None, [TIME]),
        ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),
        ("llama3_json", 'The call is {"name": "x", "parameters": {}}',
         'The call is {"name": "x", "parameters": {}}', []),
        ("mistral", '[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "UTC"}}]', None,
         [TIME]),
        ("mistral", '[{"name": "get_time", "arguments": {"zone": "UTC"}}]', None, [TIME]),
        ("mistral", '[TOOL_CALLS]get_time[ARGS]{"zone": "UTC"}[TOOL_CALLS]get_weather[ARGS]'
         '{"city": "Paris"}', None, [TIME, WEATHER]),
        ("mistral", "[1, 2, 3]", "[1, 2, 3]", []),
    ],
)  # fmt: skip
def test_parsers(parser: str, text: str, content: str | None, calls: list[ParsedCall]) -> None:
    parsed = parse_tool_calls(parser, text)
    assert (parsed.content, parsed.calls) == (content, calls)
    plan = ToolPlan(tools=[], mode="auto", parser=parser)
    whole = plan.answer(text)
    stream = AnswerStream(None, plan)
    streamed = "".join(d.content or "" for ch in text for d in stream.feed(ch))
    if not calls:  # no call: all of it streams as content
        assert streamed + "".join(d.content or "" for d in stream.finish(_message(text))) == text
    else:  # the text before the first call streams; the calls come at the end
        assert (whole.content or "").startswith(streamed.strip())


def _message(text: str):  # type: ignore[no-untyped-def]
    from server.openai.responses import AssistantMessage

    return AssistantMessage(role="assistant", content=text)


@pytest.mark.parametrize(
    ("template", "tools", "reasoning"),
    [
        ("{{ '<tool_call>' }}{% if tools %}...{% endif %}<think></think>", "hermes", "qwen3"),
        ("<|python_tag|>{% if tools %}{% endif %}", "llama3_json", None),
        ("[AVAILABLE_TOOLS][TOOL_CALLS]", "mistral", None),
        ("{{'<｜Assistant｜><think>\\n'}}...</think>", "hermes", "deepseek_r1"),
        (None, "hermes", None),
    ],
)
def test_formats_from_the_template(template: str | None, tools: str, reasoning: str | None) -> None:
    assert parser_for_template(template) == tools
    assert reasoning_for_template(template) == reasoning


@pytest.mark.parametrize(
    ("parser", "text", "reasoning", "content"),
    [
        ("qwen3", "<think>\nLet me see.\n</think>\n\nParis.", "\nLet me see.\n", "Paris."),
        ("qwen3", "Paris.", None, "Paris."),
        ("qwen3", "  <think>cut short", "cut short", ""),
        ("deepseek_r1", "Hmm.</think>Paris.", "Hmm.", "Paris."),
        ("deepseek_r1", "Hmm, still thinking", "Hmm, still thinking", ""),
    ],
)
def test_reasoning_split_whole_and_streamed(
    parser: str, text: str, reasoning: str | None, content: str
) -> None:
    assert split_reasoning(parser, text) == (reasoning, content)
    stream = AnswerStream(parser, None)
    deltas = [d for ch in text for d in stream.feed(ch)]
    deltas += stream.finish(_message(content))
    assert "".join(d.reasoning_content or "" for d in deltas) == (reasoning or "")
    assert "".join(d.content or "" for d in deltas) == content


def test_required_and_named_answers() -> None:
    plan = ToolPlan(tools=[], mode="required", schemas={"get_time": {}})
    text = '[{"name":"get_time","parameters":{"zone":"UTC"}}]'
    assert plan.answer(text).calls == [TIME]
    named = ToolPlan(tools=[], mode="named", named="get_time", schemas={"get_time": {}})
    assert named.answer('{"zone":"UTC"}').calls == [TIME]
    assert json.loads(named.answer('{"zone":"UTC"}').calls[0].arguments) == {"zone": "UTC"}
