"""gpt-oss's harmony format: the published chat template renders as transformers renders it,
and the analysis and final channels come apart (reasoning_content, content) in whole and
streamed answers, over a real daemon on loopback.

The model is a tiny random gpt-oss whose tokenizer is the demo model's with harmony's markers
added as special tokens (`<|start|>`, `<|channel|>`, `<|message|>`, `<|return|>`, `<|call|>`,
`<|constrain|>`; the demo's `<|end|>` is one already) and the chat template gpt-oss publishes
(tests/fixtures/gpt-oss/chat_template.jinja: openai/gpt-oss-20b's chat_template.jinja as of
its revision "Update chat_template.jinja (#94)"). Its weights are random, so its answers are
made harmony by a grammar that spells the format with the special tokens themselves, as a
trained model writes it; the engine generates them token by token and the server reads them.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from engine.core.tokenizer import ChatOptions, Tokenizer
from engine.loading.demo import demo_model_dir
from server.http.settings import ServerSettings
from server.openai.parsers.harmony import HarmonySplitter
from server.openai.parsers.reasoning import HARMONY, parser_for_template, split_reasoning
from tests.engine.tiny_models import TINY_CONFIGS, build_from_spec
from tests.server.live import LiveServer, build_engine_client, engine_args, start_server
from tests.server.test_tools import (
    ASK,
    COMPACT,
    TIME,
    TOOLS,
    WEATHER,
    calls_of,
    chat,
    parsers,
)

TEMPLATE = Path(__file__).parents[1] / "fixtures" / "gpt-oss" / "chat_template.jinja"
MARKERS = ("<|start|>", "<|channel|>", "<|message|>", "<|return|>", "<|call|>", "<|constrain|>")
HARMONY_ANSWER = (
    'start: <|channel|> "analysis" <|message|> /[a-z ]{3,12}/ <|end|> <|start|> "assistant" '
    '<|channel|> "final" <|message|> ("yes" | "no")'
)
"""An answer thinking first, in harmony's special tokens (a Lark grammar applies as it is)."""


def harmony_tokenizer(dest: Path) -> Path:
    """The demo tokenizer with harmony's markers as special tokens and gpt-oss's published
    chat template, written into `dest`; <|return|> ends an answer."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer

    dest.mkdir(parents=True, exist_ok=True)
    tokenizer = HFTokenizer.from_file(str(demo_model_dir() / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken(m, special=True, normalized=False) for m in MARKERS])
    tokenizer.save(str(dest / "tokenizer.json"))
    config = json.loads((demo_model_dir() / "tokenizer_config.json").read_text())
    config.pop("chat_template")
    config["eos_token"] = "<|return|>"
    (dest / "tokenizer_config.json").write_text(json.dumps(config))
    shutil.copy(TEMPLATE, dest / "chat_template.jinja")
    return dest


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random gpt-oss with the harmony tokenizer."""
    dest = harmony_tokenizer(tmp_path_factory.mktemp("gpt-oss") / "model")
    tokenizer = Tokenizer(dest)
    end = tokenizer.token_to_id("<|return|>")
    # the context holds the published template's system and developer messages, tools too
    spec = {**TINY_CONFIGS["gpt_oss"], "vocab_size": tokenizer.vocab_size}
    rope = {**spec["rope_parameters"], "original_max_position_embeddings": 256}  # type: ignore[dict-item]
    spec |= {"max_position_embeddings": 1024, "rope_parameters": rope}
    build_from_spec(spec, dest, eos_token_id=end)
    return dest


@pytest.fixture(scope="module")
def live(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    engine = build_engine_client(engine_args(model=str(model_dir)))
    server = start_server(ServerSettings(data_dir=tmp_path_factory.mktemp("data")), engine)
    yield server
    server.stop()


CHATS: list[tuple[list[dict[str, Any]], dict[str, Any]]] = [
    ([{"role": "user", "content": "Weather in Paris?"}], {}),
    (
        [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "Time?"},
            {"role": "assistant", "content": "It is noon."},
            {"role": "user", "content": "And in CET?"},
        ],
        {"reasoning_effort": "high"},
    ),
    (
        [
            {"role": "user", "content": "Time in CET?"},
            {
                "role": "assistant",
                "tool_calls": [
                    {
                        "type": "function",
                        "function": {"name": "get_time", "arguments": {"zone": "CET"}},
                    }
                ],
            },
            {"role": "tool", "content": "12:00"},
        ],
        {
            "tools": [
                {**t, "function": {**t["function"], "description": "Look it up."}} for t in TOOLS
            ]
        },
    ),
]
"""(messages, options): a user turn; a developer message, an earlier answer and the
reasoning effort; a tool call and its result, with tools described (the template reads each
one's description)."""


@pytest.mark.parametrize(("messages", "options"), CHATS, ids=["user", "multi-turn", "tools"])
def test_published_template_renders_as_transformers_renders_it(
    tmp_path: Path, messages: list[dict[str, Any]], options: dict[str, Any]
) -> None:
    from transformers import PreTrainedTokenizerFast

    dest = harmony_tokenizer(tmp_path / "tokenizer")
    assert parser_for_template(TEMPLATE.read_text()) == HARMONY
    theirs = PreTrainedTokenizerFast(
        tokenizer_file=str(dest / "tokenizer.json"), chat_template=TEMPLATE.read_text()
    ).apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **options)
    tools = options.pop("tools", None)
    ours = Tokenizer(dest).render_chat(messages, ChatOptions(tools=tools, template_kwargs=options))
    assert ours == theirs
    assert ours.startswith("<|start|>system<|message|>") and ours.endswith("<|start|>assistant")


ANSWERS = [
    (
        "<|channel|>analysis<|message|>Let me <think>.<|end|><|start|>assistant<|channel|>final"
        "<|message|>Paris <b>is</b> sunny.<|return|>",
        "Let me <think>.",
        "Paris <b>is</b> sunny.",
    ),
    ("<|channel|>final<|message|>Paris.<|return|>", None, "Paris."),
    ('{"zone": "UTC"}', None, '{"zone": "UTC"}'),  # not harmony (a constrained answer): content
    ("<|channel|>analysis<|message|>cut short by max_tok", "cut short by max_tok", ""),
    (
        "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>"
        "analysis<|message|>ok<|end|><|start|>assistant<|channel|>final<|message|>Done<|retu",
        "ok",
        "Checking.Done<|retu",
    ),
    ("<|channel|>analysis<|message|>x<|end|><|start|>assistant<|channel|>fin", "x", ""),
]
"""(answer text with its markers, reasoning_content, content): both channels (markup and a
`<` in each); final only; no harmony; cut in the analysis; a commentary preamble and an end
marker cut short; a header cut short (dropped)."""


@pytest.mark.parametrize(("text", "reasoning", "content"), ANSWERS)
def test_channels_come_apart_whole_and_a_character_at_a_time(
    text: str, reasoning: str | None, content: str
) -> None:
    assert split_reasoning(HARMONY, text) == (reasoning, content)
    splitter = HarmonySplitter()
    pieces = [splitter.feed(c) for c in text] + [splitter.finish()]
    assert "".join(r for r, _ in pieces) == (reasoning or "")
    assert "".join(c for _, c in pieces) == content


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_server_splits_the_analysis_channel_from_the_final_one(
    live: LiveServer, stream: bool
) -> None:
    """The template's own parser (none given): the answer's analysis message is
    reasoning_content, its final message the content, no marker in either."""
    client, served = live.openai(), live.state.serving.model_name
    grammar = {"grammar": HARMONY_ANSWER}
    answer = chat(client, stream, model=served, structured_outputs=grammar, max_tokens=30)
    message = answer["message"]
    assert message["content"] in ("yes", "no")
    assert re.fullmatch("[a-z ]{3,12}", message["reasoning_content"])
    assert answer["finish_reason"] == "stop"


def test_special_tokens_kept_on_request(live: LiveServer) -> None:
    """skip_special_tokens (vLLM's): false keeps harmony's markers in a completion's text,
    the default leaves them out."""
    grammar = {"grammar": 'start: <|channel|> "final" <|message|> ("yes" | "no")'}
    client, served = live.openai(), live.state.serving.model_name

    def text(**extra: Any) -> str:
        extra["structured_outputs"] = grammar
        done = client.completions.create(
            model=served, prompt="Hi", max_tokens=8, temperature=0, extra_body=extra
        )
        return done.choices[0].text

    assert re.fullmatch(r"<\|channel\|>final<\|message\|>(yes|no)", text(skip_special_tokens=False))
    assert re.fullmatch("final(yes|no)", text())


def test_a_constraint_applies_to_the_final_channel() -> None:
    """A json_schema (or choice, regex) on a harmony model holds the final message: any
    analysis message first, then the final channel's header, then the constrained answer
    (llguidance, the engine's matcher, on the harmony tokenizer)."""
    from llguidance import LLMatcher, LLTokenizer

    from engine.core.structured import StructuredOutput, after_harmony_analysis

    dest = harmony_tokenizer(Path(__file__).parent / ".harmony-tokenizer")
    try:
        tokenizer = Tokenizer(dest)
        vocab = (dest / "tokenizer.json").read_text()
        lltokenizer = LLTokenizer(vocab, n_vocab=tokenizer.vocab_size)
    finally:
        shutil.rmtree(dest)
    spec = StructuredOutput("json", json.dumps({**TIME, "additionalProperties": False}))
    grammar = after_harmony_analysis(spec).grammar

    def accepts(text: str) -> bool:
        matcher = LLMatcher(lltokenizer, grammar, log_level=0)
        ids = tokenizer.encode(text, add_special_tokens=False)
        return bool(matcher.consume_tokens(ids)) and matcher.is_accepting()

    final = '<|channel|>final<|message|>{"zone": "CET"}'
    assert accepts(f"<|channel|>analysis<|message|>UTC or <CET>?<|end|><|start|>assistant{final}")
    assert accepts(final)
    assert not accepts('<|channel|>final<|message|>{"zone": "GMT"}')
    assert not accepts('{"zone": "UTC"}')  # no final channel


WEATHER_ARGUMENTS = json.dumps({**WEATHER, "additionalProperties": False, **COMPACT})
HARMONY_CALLS = (
    'start: <|channel|> "analysis" <|message|> /[a-z ]{3,12}/ <|end|> <|start|> "assistant" '
    '<|channel|> "commentary" <|message|> "Checking." <|end|> <|start|> "assistant" '
    '" to=functions.get_weather" <|channel|> "commentary " <|constrain|> "json" <|message|> '
    f"%json {WEATHER_ARGUMENTS} <|call|> "
    '<|start|> "assistant" <|channel|> "commentary to=functions.get_time " <|constrain|> "json" '
    '<|message|> "{\\"zone\\": \\"UTC\\"}" <|call|>'
)
"""An answer that thinks, says what it will do (a preamble) and calls two functions, the
first with its recipient before the channel, in harmony's special tokens."""


def short_analysis(model_dir: Path) -> dict[str, Any]:
    """A logit_bias that ends an analysis message at once (<|end|> wherever a grammar allows
    it): a forced call's grammar lets the model think first, and a random model would think
    to max_tokens."""
    return {"logit_bias": {str(Tokenizer(model_dir).token_to_id("<|end|>")): 100}}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_auto_reads_harmony_calls(live: LiveServer, stream: bool) -> None:
    """tool_choice auto (the template's parser, openai): the analysis message is
    reasoning_content, the preamble content, each message to functions.<name> a call (with
    --reasoning-parser none too: the answer is read as harmony to find them)."""
    client, served = live.openai(), live.state.serving.model_name
    grammar = {"grammar": HARMONY_CALLS}
    answer = chat(
        client, stream, model=served, tools=TOOLS, structured_outputs=grammar, max_tokens=160
    )
    assert [name for name, _ in calls_of(answer)] == ["get_weather", "get_time"]
    assert calls_of(answer)[1] == ("get_time", {"zone": "UTC"})
    assert answer["message"]["content"] == "Checking."
    assert re.fullmatch("[a-z ]{3,12}", answer["message"]["reasoning_content"])
    assert answer["finish_reason"] == "tool_calls"
    single = chat(
        client, stream, model=served, tools=TOOLS, structured_outputs=grammar, max_tokens=160,
        parallel_tool_calls=False,
    )  # fmt: skip
    assert [name for name, _ in calls_of(single)] == ["get_weather"]
    with parsers(live, reasoning="none"):  # the calls are harmony messages all the same
        unsplit = chat(
            client, stream, model=served, tools=TOOLS, structured_outputs=grammar, max_tokens=160
        )
    assert calls_of(unsplit) == calls_of(answer)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_forced_calls_are_harmony_call_messages(
    live: LiveServer, model_dir: Path, stream: bool
) -> None:
    """tool_choice named and required: the grammar makes the answer a call message (after
    an analysis message), its arguments valid against the tool's schema."""
    client, served = live.openai(), live.state.serving.model_name
    fields = {"model": served, "tools": TOOLS, "max_tokens": 60, **short_analysis(model_dir)}
    named = {"type": "function", "function": {"name": "get_weather"}}
    forced = chat(client, stream, tool_choice=named, **fields)
    assert [name for name, _ in calls_of(forced)] == ["get_weather"]
    assert forced["finish_reason"] == "stop" and "content" not in forced["message"]
    required = chat(client, stream, tool_choice="required", **fields)
    assert len(calls_of(required)) >= 1 and required["finish_reason"] == "tool_calls"
    single = chat(client, stream, tool_choice="required", parallel_tool_calls=False, **fields)
    assert len(calls_of(single)) == 1


def test_a_call_ended_by_its_stop_token(live: LiveServer, model_dir: Path) -> None:
    """gpt-oss stops at <|call|> (a stop token, left out of the text): the call is read from
    a text that ends with its arguments, the same call as when the text keeps <|call|>."""
    client, served = live.openai(), live.state.serving.model_name
    call_id = Tokenizer(model_dir).token_to_id("<|call|>")
    named = {"type": "function", "function": {"name": "get_time"}}
    fields = {"model": served, "tools": TOOLS, "tool_choice": named, "max_tokens": 60}
    fields |= short_analysis(model_dir)
    kept = chat(client, **fields)
    stopped = chat(client, stop_token_ids=[call_id], **fields)
    assert calls_of(stopped) == calls_of(kept) and len(calls_of(kept)) == 1


def test_tool_result_round_trip_and_responses_api(live: LiveServer, model_dir: Path) -> None:
    """A forced call, its result sent back as a `tool` message: the template renders both
    (the call message, then the result from functions.<name>) and a second turn answers;
    the Responses API gives the call as a function_call item (a call the model reaches
    within max_output_tokens: an analysis message is free text, which a random model may
    not end)."""
    client, served = live.openai(), live.state.serving.model_name
    named: Any = {"type": "function", "function": {"name": "get_weather"}}
    first = client.chat.completions.create(
        model=served, messages=ASK, tools=TOOLS, tool_choice=named, max_tokens=60,
        temperature=0, extra_body=short_analysis(model_dir),
    ).choices[0].message  # fmt: skip
    assert first.tool_calls
    call: Any = first.tool_calls[0]
    messages: list[Any] = [
        *ASK,
        first.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature_c": 21}'},
    ]
    again = client.chat.completions.create(
        model=served, messages=messages, tools=TOOLS, max_tokens=3, temperature=0
    )
    assert again.choices[0].finish_reason == "length"
    ids = live.http().post("/tokenize", json={"model": served, "messages": messages}).json()
    text = Tokenizer(model_dir).decode(ids["tokens"], skip_special_tokens=False)
    arguments = json.dumps(json.loads(call.function.arguments))
    assert text.endswith(
        f"<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
        f"{arguments}<|call|><|start|>functions.get_weather to=assistant<|channel|>commentary"
        '<|message|>"{\\"temperature_c\\": 21}"<|end|><|start|>assistant'
    )

    tool: Any = {"type": "function", "name": "get_time", "parameters": TIME}
    called = []
    for seed in range(6):  # the Responses API takes no logit_bias: some seeds think first
        answer = client.responses.create(
            model=served, input="What time is it?", tools=[tool], tool_choice="required",
            parallel_tool_calls=False, max_output_tokens=60, temperature=1,
            extra_body={"seed": seed},
        )  # fmt: skip
        items: list[Any] = [item for item in answer.output if item.type == "function_call"]
        assert [item.name for item in items] in ([], ["get_time"])
        assert bool(items) == (answer.status == "completed")
        called += [json.loads(item.arguments) for item in items]
    assert called
    for arguments in called:
        jsonschema.validate(arguments, TIME)
