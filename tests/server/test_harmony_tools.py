"""gpt-oss's tool calls in the harmony format, without a server: the `openai` parser on the
exact texts gpt-oss writes (markers kept), whole and split at every point; the streamed
chat deltas; the grammar of a forced call on the harmony tokenizer; a turn of several calls
and their results rendered by the published chat template. The daemon's side is in
tests/server/test_harmony.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from engine.core.structured import harmony_calls
from engine.core.tokenizer import ChatOptions, Tokenizer
from server.openai.chat_format import chat_for_template
from server.openai.parsers.harmony import HarmonySplitter, Header, read_header
from server.openai.parsers.reasoning import HARMONY, split_reasoning
from server.openai.parsers.tool_calls import parse_tool_calls, parser_for_template
from server.openai.parsers.tool_formats import ParsedAnswer, ParsedCall
from server.openai.responses import AssistantMessage, FunctionCallOut, ToolCall
from server.openai.stream_answer import AnswerStream
from server.openai.tools import ToolPlan
from tests.server.test_harmony import TEMPLATE, harmony_tokenizer
from tests.server.test_tools import TIME, TOOLS, WEATHER

GET_TIME = ParsedCall("get_time", '{"zone": "UTC"}')
GET_WEATHER = ParsedCall("get_weather", '{"city": "Paris"}')
CALL = "<|channel|>commentary to=functions.{} <|constrain|>json<|message|>{}<|call|>"

ANSWERS: list[tuple[str, str | None, str | None, list[ParsedCall]]] = [
    (
        "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant"
        + CALL.format("get_weather", '{"city":"Paris"}'),
        "Need the weather.",
        None,
        [GET_WEATHER],
    ),
    (' to=functions.get_time<|channel|>commentary json<|message|>{"zone": "UTC"}', None, None,
     [GET_TIME]),
    (
        "<|channel|>commentary<|message|>Checking <both>.<|end|><|start|>assistant"
        + CALL.format("get_weather", '{"city": "Paris"}')
        + '<|start|>assistant to=functions.get_time<|channel|>commentary<|message|>{"zone":"UTC"}'
        "<|call|>",
        None,
        "Checking <both>.",
        [GET_WEATHER, GET_TIME],
    ),
    ("<|channel|>final<|message|>Paris.<|return|>", None, "Paris.", []),
    ('<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{"zone": "U', None,
     None, [ParsedCall("get_time", '{"zone": "U')]),
    ("<|channel|>commentary to=functions.run code<|message|>print(1)<|call|>", None, None,
     [ParsedCall("run", "print(1)")]),
    (CALL.format("note", '{"text": "a<|b"}'), None, None, [ParsedCall("note", '{"text": "a<|b"}')]),
    (CALL.format("get_time", "{zone: UTC}"), None, None, [ParsedCall("get_time", "{zone: UTC}")]),
    ("<|channel|>analysis to=python code<|message|>1+1<|call|>", "1+1", None, []),
    ('{"zone": "UTC"}', None, '{"zone": "UTC"}', []),
]  # fmt: skip
"""(answer text, reasoning_content, content, calls): analysis then a call; the recipient
before the channel and the stop token <|call|> left out (as generated); a preamble and two
calls, one recipient each way; a final answer, no call; cut inside a call's JSON (the cut
call, its arguments as generated: finish_reason "length" tells the client); a call that is
not JSON; a marker's start inside the arguments; arguments that do not parse, ended by
<|call|> (kept as written, as vLLM keeps them); a built-in tool's call (no function: its
body stays on its channel); no harmony at all (content)."""


def _read_in_pieces(text: str, cuts: list[int]) -> tuple[str, str, list[ParsedCall]]:
    """(reasoning, content, calls) of `text` fed to a stream splitter cut at `cuts`."""
    splitter = HarmonySplitter(reads_calls=True)
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    read = [splitter.feed(piece) for piece in pieces] + [splitter.finish()]
    calls = [ParsedCall(name, arguments) for name, arguments in splitter.calls]
    return "".join(r for r, _ in read), "".join(c for _, c in read), calls


@pytest.mark.parametrize(("text", "reasoning", "content", "calls"), ANSWERS)
def test_calls_read_whole_and_split_at_every_point(
    text: str, reasoning: str | None, content: str | None, calls: list[ParsedCall]
) -> None:
    parsed = parse_tool_calls("openai", text)
    assert (parsed.content, parsed.calls) == (content, calls)
    assert split_reasoning(HARMONY, text, reads_calls=True) == (reasoning, content or "")
    expected = (reasoning or "", content or "", calls)
    for cut in range(len(text) + 1):
        assert _read_in_pieces(text, [cut]) == expected, cut
    assert _read_in_pieces(text, list(range(1, len(text)))) == expected


F_JSON = Header("commentary", "functions.f", "json")


@pytest.mark.parametrize(
    ("header", "read"),
    [
        ("<|channel|>analysis", Header("analysis", "", "")),
        ("assistant<|channel|>commentary to=functions.f <|constrain|>json", F_JSON),
        (" to=functions.f<|channel|>commentary json", F_JSON),
        ("assistant to=functions.f<|channel|>commentary<|constrain|>json", F_JSON),
        ("assistant<|channel|>commentary to=browser.search code",
         Header("commentary", "browser.search", "code")),
    ],
)  # fmt: skip
def test_headers_read_as_harmony_reads_them(header: str, read: Header) -> None:
    assert read_header(header) == read


def test_without_tools_a_call_stays_on_its_channel() -> None:
    """A request without tools reads no calls: a call's arguments are content, as before."""
    text, _, _, _ = ANSWERS[2]
    content = 'Checking <both>.{"city": "Paris"}{"zone":"UTC"}'
    assert split_reasoning(HARMONY, text) == (None, content)


def test_plan_answers_in_every_mode() -> None:
    """auto, required and named all read the calls from the harmony messages; one call when
    parallel_tool_calls is false; none reads no calls."""
    text = ANSWERS[2][0]
    schemas: dict[str, Any] = {"get_weather": WEATHER, "get_time": TIME}
    for mode, named in (("auto", None), ("required", None), ("named", "get_weather")):
        plan = ToolPlan(tools=TOOLS, mode=mode, named=named, parser="openai", schemas=schemas)
        assert plan.answer(text).calls == [GET_WEATHER, GET_TIME]
        single = ToolPlan(tools=TOOLS, mode=mode, parallel=False, parser="openai", schemas=schemas)
        assert single.answer(text).calls == [GET_WEATHER]
    none = ToolPlan(tools=TOOLS, mode="none", parser="openai")
    assert none.answer(text).calls == []
    assert parser_for_template(TEMPLATE.read_text()) == "openai"


STREAMED = [
    ("<|channel|>analysis<|message|>Hmm.<|end|><|start|>assistant" + ANSWERS[2][0],
     "Checking <both>.", [GET_WEATHER, GET_TIME]),
    ("<|channel|>analysis<|message|>Hmm.<|end|><|start|>assistant"
     + CALL.format("get_time", '{"zone": "UTC"}')
     + "<|start|>assistant<|channel|>final<|message|>It is <|", "It is <|", [GET_TIME]),
]  # fmt: skip
"""(answer, content, calls): a preamble and two calls; a call and then a final message whose
tail (the start of a marker, maybe) is held back until the answer ends."""


@pytest.mark.parametrize(("text", "content", "calls"), STREAMED)
def test_streamed_deltas_hold_no_call(text: str, content: str, calls: list[ParsedCall]) -> None:
    """A stream's content deltas are the preamble and final text (never a call's
    arguments), the reasoning its own deltas, and the calls come whole in the last delta."""
    assert parse_tool_calls("openai", text) == ParsedAnswer(content, calls)
    plan = ToolPlan(tools=TOOLS, mode="auto", parser="openai")
    stream = AnswerStream(HARMONY, plan)
    deltas = [d for ch in text for d in stream.feed(ch)]
    out = [FunctionCallOut(name=c.name, arguments=c.arguments) for c in calls]
    made = [ToolCall(id=f"call_{k}", type="function", function=f) for k, f in enumerate(out)]
    last = stream.finish(AssistantMessage(role="assistant", content=content, tool_calls=made))
    assert "".join(d.reasoning_content or "" for d in deltas + last) == "Hmm."
    assert "".join(d.content or "" for d in deltas + last) == content
    streamed = [call.function for d in last for call in d.tool_calls or []]
    assert [(f.name, f.arguments) for f in streamed if f] == [(c.name, c.arguments) for c in calls]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return harmony_tokenizer(tmp_path_factory.mktemp("harmony") / "tokenizer")


def test_forced_call_grammar(tokenizer_dir: Path) -> None:
    """A forced call's grammar on the harmony tokenizer (llguidance, the engine's matcher):
    a call message to one of the functions, its JSON held to the schema, ended by <|call|>,
    after an optional analysis message; more calls only when parallel."""
    from llguidance import LLMatcher, LLTokenizer

    tokenizer = Tokenizer(tokenizer_dir)
    vocab = (tokenizer_dir / "tokenizer.json").read_text()
    lltokenizer = LLTokenizer(vocab, n_vocab=tokenizer.vocab_size)
    schemas = {"get_time": TIME, "get_weather": WEATHER}

    def accepts(text: str, parallel: bool = True, names: tuple[str, ...] = tuple(schemas)) -> bool:
        closed = {n: json.dumps({**schemas[n], "additionalProperties": False}) for n in names}
        matcher = LLMatcher(lltokenizer, harmony_calls(closed, parallel).grammar, log_level=0)
        ids = tokenizer.encode(text, add_special_tokens=False)
        return bool(matcher.consume_tokens(ids)) and matcher.is_accepting()

    time_call = CALL.format("get_time", '{"zone":"CET"}')
    two = time_call + "<|start|>assistant" + CALL.format("get_weather", '{"city":"Rome","days":2}')
    thinking = "<|channel|>analysis<|message|>Which <zone>?<|end|><|start|>assistant"
    assert accepts(time_call) and accepts(thinking + time_call)
    assert accepts(two) and not accepts(two, parallel=False)
    assert not accepts(time_call, names=("get_weather",))
    assert not accepts(CALL.format("get_time", '{"zone":"GMT"}'))
    assert not accepts(time_call.removesuffix("<|call|>"))
    assert not accepts("<|channel|>final<|message|>It is noon.")


def test_several_calls_and_their_results_render_one_call_each(tokenizer_dir: Path) -> None:
    """An assistant turn of two calls (its results sent in the other order, matched by id)
    goes to the template as two call messages, each followed by its own result, its
    reasoning as the analysis message before the first, as transformers renders them."""
    from transformers import PreTrainedTokenizerFast

    calls = [
        {"id": f"call_{k}", "type": "function", "function": {"name": name, "arguments": arguments}}
        for k, (name, arguments) in enumerate(
            [("get_weather", '{"city": "Paris", "days": 1}'), ("get_time", '{"zone": "UTC"}')]
        )
    ]
    thought = {"content": "", "reasoning_content": "Two lookups."}
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "Weather and time in Paris?"},
        {"role": "assistant", **thought, "tool_calls": calls},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
        {"role": "tool", "tool_call_id": "call_0", "content": "sunny"},
    ]
    tools: list[Any] = [
        {**t, "function": {**t["function"], "description": "Look it up."}} for t in TOOLS
    ]
    chat = chat_for_template(messages, tools, native=True, harmony=True)
    ours = Tokenizer(tokenizer_dir).render_chat(chat, ChatOptions(tools=tools))
    theirs = PreTrainedTokenizerFast(
        tokenizer_file=str(tokenizer_dir / "tokenizer.json"), chat_template=TEMPLATE.read_text()
    ).apply_chat_template(chat, tools=tools, add_generation_prompt=True, tokenize=False)
    assert ours == theirs
    call = "<|start|>assistant to=functions.{}<|channel|>commentary json<|message|>{}<|call|>"
    result = "<|start|>functions.{} to=assistant<|channel|>commentary<|message|>{}<|end|>"
    assert ours.endswith(
        "<|start|>assistant<|channel|>analysis<|message|>Two lookups.<|end|>"
        + call.format("get_weather", '{"city": "Paris", "days": 1}')
        + result.format("get_weather", '"sunny"')
        + call.format("get_time", '{"zone": "UTC"}')
        + result.format("get_time", '"12:00"')
        + "<|start|>assistant"
    )
