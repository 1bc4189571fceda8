"""What agent and extraction frameworks send, over one real daemon (demo model) and the real
clients (`openai`, instructor, LangChain): tools with every tool_choice, streamed and not,
parallel calls, a tool result round trip, the legacy `functions`, tool calls in Batch API
lines; reasoning kept apart; every field OpenAI or vLLM defines accepted; refusals that say
what is missing, logged and counted by reason.

The demo model's weights are random, so "auto" reads calls that a constraint made it write
(`structured_outputs.regex` in the model's format): the parser then reads the text the
engine generated, token by token, as it would read a trained model's. A forced call
(required, named) is the grammar engine's to enforce; its arguments are checked against the
tool's schema.
"""

from __future__ import annotations

import inspect
import json
import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from engine.core.tokenizer import Tokenizer
from engine.loading.demo import demo_model_dir
from tests.server.batch_files import read_lines, upload, wait_batch
from tests.server.live import MODEL, LiveServer

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Rome"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 5},
    },
    "required": ["city", "days"],
}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
HERMES_TWO_CALLS = (
    r'Let me check\.<tool_call>\{"name": "get_weather", "arguments": \{"city": "Paris", '
    r'"days": [1-5]\}\}</tool_call><tool_call>\{"name": "get_time", "arguments": '
    r'\{"zone": "UTC"\}\}</tool_call>'
)
COMPACT = {"x-guidance": {"whitespace_flexible": False}}
LLAMA3_CALL = r'\{"name": "get_time", "parameters": \{"zone": "(UTC|CET)"\}\}'


@pytest.fixture(scope="module")
def live(shared_live: LiveServer) -> LiveServer:
    return shared_live


@pytest.fixture(scope="module")
def client(live: LiveServer) -> openai.OpenAI:
    return live.openai()


@contextmanager
def parsers(
    live: LiveServer, tool: str | None = None, reasoning: str | None = None
) -> Iterator[None]:
    """The daemon's --tool-call-parser / --reasoning-parser for the block."""
    serving = live.state.serving
    before = serving.tool_call_parser, serving.reasoning_parser
    serving.tool_call_parser, serving.reasoning_parser = tool, reasoning
    try:
        yield
    finally:
        serving.tool_call_parser, serving.reasoning_parser = before


def chat(client: openai.OpenAI, stream: bool = False, **fields: Any) -> dict[str, Any]:
    """One choice's answer as a dict (message, finish_reason); a stream's deltas joined the
    way the openai client's users join them."""
    fields = {"model": MODEL, "messages": ASK, "temperature": 0, "max_tokens": 40} | fields
    known = inspect.signature(client.chat.completions.create).parameters
    extra = {k: fields.pop(k) for k in list(fields) if k not in known}  # vLLM's fields
    fields["extra_body"] = extra
    if not stream:
        choice = client.chat.completions.create(**fields).choices[0]
        message = choice.message.model_dump(exclude_none=True)
        return {"message": message, "finish_reason": choice.finish_reason}
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in client.chat.completions.create(stream=True, **fields):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        reasoning += getattr(delta, "reasoning_content", None) or ""
        for call in delta.tool_calls or []:
            entry = calls.setdefault(call.index, {"id": call.id, "name": "", "arguments": ""})
            entry["name"] += call.function.name or ""
            entry["arguments"] += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    message: dict[str, Any] = {"role": "assistant"}
    if content:
        message["content"] = content
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = [
            {
                "id": c["id"],
                "type": "function",
                "function": {"name": c["name"], "arguments": c["arguments"]},
            }
            for _, c in sorted(calls.items())
        ]
    return {"message": message, "finish_reason": finish}


def calls_of(answer: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(name, arguments) of each call, the arguments checked against the tool's schema."""
    out = []
    for call in answer["message"].get("tool_calls", []):
        assert call["type"] == "function" and call["id"].startswith("call_")
        name, arguments = call["function"]["name"], json.loads(call["function"]["arguments"])
        jsonschema.validate(arguments, {**SCHEMAS[name], "additionalProperties": False})
        out.append((name, arguments))
    return out


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_every_tool_choice(client: openai.OpenAI, stream: bool) -> None:
    none = chat(client, stream, tools=TOOLS, tool_choice="none", max_tokens=4)
    assert "tool_calls" not in none["message"] and none["message"]["content"]
    assert none["finish_reason"] in ("stop", "length")

    named = {"type": "function", "function": {"name": "get_weather"}}
    forced = chat(client, stream, tools=TOOLS, tool_choice=named)
    assert [name for name, _ in calls_of(forced)] == ["get_weather"]
    assert forced["finish_reason"] == "stop"  # OpenAI's answer to a named choice
    assert "content" not in forced["message"]

    required = chat(client, stream, tools=TOOLS, tool_choice="required", max_tokens=80)
    assert len(calls_of(required)) >= 1 and required["finish_reason"] == "tool_calls"
    single = chat(client, stream, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert len(calls_of(single)) == 1

    auto = chat(
        client,
        stream,
        tools=TOOLS,
        tool_choice="auto",
        max_tokens=160,
        structured_outputs={"regex": HERMES_TWO_CALLS},
    )
    assert [name for name, _ in calls_of(auto)] == ["get_weather", "get_time"]
    assert auto["message"]["content"] == "Let me check."
    assert auto["finish_reason"] == "tool_calls"
    one = chat(
        client,
        stream,
        tools=TOOLS,
        max_tokens=160,  # tool_choice left out: auto
        parallel_tool_calls=False,
        structured_outputs={"regex": HERMES_TWO_CALLS},
    )
    assert [name for name, _ in calls_of(one)] == ["get_weather"]


def test_streamed_calls_equal_the_whole_answers(client: openai.OpenAI) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    for fields in (
        {"tool_choice": named},
        {"tool_choice": "required", "max_tokens": 80},
        {"structured_outputs": {"regex": HERMES_TWO_CALLS}, "max_tokens": 160},
    ):
        whole = chat(client, tools=TOOLS, **fields)
        streamed = chat(client, True, tools=TOOLS, **fields)
        assert calls_of(streamed) == calls_of(whole)
        assert streamed["finish_reason"] == whole["finish_reason"]


def test_llama3_json_and_mistral_formats(live: LiveServer, client: openai.OpenAI) -> None:
    with parsers(live, tool="llama3_json"):
        answer = chat(client, tools=TOOLS, structured_outputs={"regex": LLAMA3_CALL}, max_tokens=80)
    assert [name for name, _ in calls_of(answer)] == ["get_time"]
    assert answer["finish_reason"] == "tool_calls" and "content" not in answer["message"]
    mistral = r'\[TOOL_CALLS\]\[\{"name": "get_time", "arguments": \{"zone": "CET"\}\}\]'
    with parsers(live, tool="mistral"):
        answer = chat(client, tools=TOOLS, structured_outputs={"regex": mistral}, max_tokens=120)
    assert calls_of(answer) == [("get_time", {"zone": "CET"})]


def test_tool_result_round_trip(live: LiveServer, client: openai.OpenAI) -> None:
    """The call and its result go back into the chat; the template (which knows no tools)
    gets them in hermes' format, and the tools described in a system message."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    first = (
        client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            tools=TOOLS,
            tool_choice=named,
            max_tokens=40,  # type: ignore[arg-type]
        )
        .choices[0]
        .message
    )
    assert first.tool_calls
    call = first.tool_calls[0]
    messages: list[Any] = [
        *ASK,
        first.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature_c": 21}'},
    ]
    again = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=TOOLS,
        max_tokens=3,
        temperature=0,  # type: ignore[arg-type]
    )
    assert again.choices[0].message.content is not None
    ids = live.http().post("/tokenize", json={"model": MODEL, "messages": messages}).json()
    text = live.http().post("/detokenize", json={"tokens": ids["tokens"]}).json()["prompt"]
    assert call.function.arguments in text.replace("\n", "")
    assert '<tool_response>\n{"temperature_c": 21}\n</tool_response>' in text


def test_legacy_functions(client: openai.OpenAI) -> None:
    functions = [tool["function"] for tool in TOOLS]
    answer = chat(client, functions=functions, function_call={"name": "get_time"})
    call = answer["message"]["function_call"]
    assert call["name"] == "get_time"
    jsonschema.validate(json.loads(call["arguments"]), TIME)
    with pytest.raises(openai.BadRequestError, match="not among the tools"):
        chat(client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})


def test_tool_calls_in_batch_api_lines(client: openai.OpenAI) -> None:
    body = {
        "model": MODEL,
        "messages": ASK,
        "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "get_time"}},
        "max_tokens": 20,
    }
    line = {"custom_id": "t0", "method": "POST", "url": "/v1/chat/completions", "body": body}
    batch = client.batches.create(
        input_file_id=upload(client, [json.dumps(line)]),
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    done = wait_batch(client, batch.id)
    [output] = read_lines(client, done.output_file_id)
    message = output["response"]["body"]["choices"][0]["message"]
    assert message["tool_calls"][0]["function"]["name"] == "get_time"
    jsonschema.validate(json.loads(message["tool_calls"][0]["function"]["arguments"]), TIME)


class Weather(BaseModel):
    city: Literal["Paris", "Rome"]
    days: int = Field(ge=1, le=5)


def test_instructor_tools_and_json_schema_modes(client: openai.OpenAI) -> None:
    import instructor

    for mode in (instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA):
        patched = instructor.from_openai(client, mode=mode)
        weather = patched.chat.completions.create(
            model=MODEL,
            messages=ASK,
            response_model=Weather,
            max_tokens=60,
            seed=3,  # unseeded, the demo model's noise may pad the JSON past 60 tokens
            max_retries=0,  # type: ignore[arg-type]
        )
        assert isinstance(weather, Weather), mode


def test_langchain_bind_tools_and_function_calling(live: LiveServer) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        model=MODEL,
        base_url=f"{live.base_url}/v1",
        api_key="unused",
        max_tokens=60,
        max_retries=0,  # type: ignore[arg-type]
    )
    bound = llm.bind_tools([TOOLS[1]], tool_choice="get_time")
    message = bound.invoke("What time is it?")
    assert [c["name"] for c in message.tool_calls] == ["get_time"]  # type: ignore[attr-defined]
    assert message.tool_calls[0]["args"]["zone"] in ("UTC", "CET")  # type: ignore[attr-defined]
    structured = llm.with_structured_output(Weather, method="function_calling")
    assert isinstance(structured.invoke("Weather in Paris?"), Weather)


QWEN3_STYLE = 'start: "<think>\\n" /[a-z ]{3,12}/ "\\n</think>\\n\\n" ("yes" | "no")'
"""A Qwen3 answer, thinking first: a grammar that spells `</think>` holds the whole output,
so the demo model writes a think block."""


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_reasoning_apart_from_the_answer(
    live: LiveServer, client: openai.OpenAI, stream: bool
) -> None:
    with parsers(live, reasoning="qwen3"):
        answer = chat(client, stream, structured_outputs={"grammar": QWEN3_STYLE})
        [angle] = Tokenizer(demo_model_dir()).encode("<", add_special_tokens=False)
        plain = chat(  # no "<": no think block; the choice holds for the answer
            client, stream, structured_outputs={"choice": ["yes", "no"]},
            logit_bias={str(angle): -100},
        )  # fmt: skip
    message = answer["message"]
    assert message["content"] in ("yes", "no")
    assert re.fullmatch("\n[a-z ]{3,12}\n", message["reasoning_content"])
    assert "reasoning_content" not in plain["message"]
    assert plain["message"]["content"] in ("yes", "no")


def test_structured_output_applies_to_the_answer_after_the_think_block() -> None:
    """The grammar a thinking model's constraint becomes takes any think block, then holds
    the answer to the constraint (llguidance, the engine's matcher, on the demo tokenizer)."""
    from llguidance import LLMatcher, LLTokenizer

    from engine.core.structured import StructuredOutput, after_reasoning

    tokenizer = Tokenizer(demo_model_dir())
    vocab = (demo_model_dir() / "tokenizer.json").read_text()
    lltokenizer = LLTokenizer(vocab, n_vocab=tokenizer.vocab_size)
    spec = StructuredOutput("json", json.dumps({**TIME, "additionalProperties": False}))

    def accepts(text: str, opened: bool = False) -> bool:
        matcher = LLMatcher(lltokenizer, after_reasoning(spec, opened).grammar, log_level=0)
        ids = tokenizer.encode(text, add_special_tokens=False)
        return bool(matcher.consume_tokens(ids)) and matcher.is_accepting()

    assert accepts('<think>\nUTC or CET? {"zone"}\n</think>\n\n{"zone": "CET"}')
    assert accepts('{"zone": "UTC"}')  # no think block (enable_thinking false)
    assert accepts('the prompt opened it</think>{"zone": "UTC"}', opened=True)
    assert not accepts('<think>\nhmm\n</think>\n\n{"zone": "GMT"}')
    assert not accepts('Sure! {"zone": "UTC"}')


@pytest.mark.parametrize(
    "grammar",
    [
        'start: answer\nanswer: "zone=" zone\nzone: "UTC" | "CET"',  # Lark, rules of its own
        'root ::= "zone=" zone\nzone ::= "UTC" | "CET"',  # GBNF, as llama.cpp writes it
    ],
)
def test_a_grammar_applies_to_the_answer_after_the_think_block(grammar: str) -> None:
    """A Lark or GBNF grammar is nested whole after the think block: its rules (even one
    named like the wrapper's) hold the answer, the think block is free text."""
    from llguidance import LLMatcher, LLTokenizer

    from engine.core.structured import StructuredOutput, after_reasoning, check

    tokenizer = Tokenizer(demo_model_dir())
    vocab = (demo_model_dir() / "tokenizer.json").read_text()
    lltokenizer = LLTokenizer(vocab, n_vocab=tokenizer.vocab_size)
    spec = after_reasoning(StructuredOutput("grammar", grammar), opened=False)
    check(spec)

    def accepts(text: str) -> bool:
        matcher = LLMatcher(lltokenizer, spec.grammar, log_level=0)
        ids = tokenizer.encode(text, add_special_tokens=False)
        return bool(matcher.consume_tokens(ids)) and matcher.is_accepting()

    assert accepts("<think>\nzone=GMT? no: start: answer\n</think>\n\nzone=CET")
    assert accepts("zone=UTC")
    assert not accepts("<think>\nhmm\n</think>\n\nzone=GMT")
    assert not accepts("<think>\nhmm\n</think>\n\nSure: zone=UTC")


EVERY_FIELD: dict[str, Any] = {
    # OpenAI's chat fields
    "frequency_penalty": 0.0, "presence_penalty": 0.0, "logit_bias": {}, "logprobs": False,
    "max_completion_tokens": 2, "metadata": {"k": "v"}, "modalities": ["text"], "n": 1,
    "parallel_tool_calls": True, "prediction": {"type": "content", "content": "x"},
    "prompt_cache_key": "k", "prompt_cache_retention": "24h", "reasoning_effort": "low",
    "safety_identifier": "s", "seed": 1, "service_tier": "auto", "stop": None, "store": False,
    "stream": False, "temperature": 0, "top_p": 1.0, "user": "u", "verbosity": "low",
    "web_search_options": {}, "tool_choice": "none", "tools": TOOLS,
    "response_format": {"type": "text"},
    # vLLM's extra parameters
    "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, "length_penalty": 1.0,
    "stop_token_ids": [], "ignore_eos": False, "min_tokens": 0, "skip_special_tokens": True,
    "spaces_between_special_tokens": True, "use_beam_search": False,
    "include_stop_str_in_output": False, "echo": False, "add_generation_prompt": True,
    "continue_final_message": False, "add_special_tokens": False, "documents": None,
    "chat_template": None, "chat_template_kwargs": {"enable_thinking": False},
    "mm_processor_kwargs": {}, "guided_decoding_backend": "auto",
    "guided_whitespace_pattern": None, "priority": 0, "request_id": "r",
    "return_tokens_as_token_ids": False, "return_token_ids": False, "cache_salt": "s",
    "kv_transfer_params": None, "vllm_xargs": {}, "logits_processors": None,
    "bad_words": [], "prompt_logprobs": None, "truncate_prompt_tokens": None,
    "structural_tag": None, "media_io_kwargs": {},
}  # fmt: skip


def test_every_named_field_is_accepted(live: LiveServer, caplog: pytest.LogCaptureFixture) -> None:
    http = live.http()
    with caplog.at_level(logging.WARNING, logger="nanoflex.server"):
        response = http.post(
            "/v1/chat/completions", json={"model": MODEL, "messages": ASK, **EVERY_FIELD}
        )
    assert response.status_code == 200, response.text
    warned = " ".join(r.getMessage() for r in caplog.records if "ignored" in r.getMessage())
    assert "store" in warned and "service_tier" in warned
    guided_fields: list[dict[str, Any]] = [
        {"guided_json": TIME},
        {"guided_regex": "(UTC|CET)"},
        {"guided_choice": ["a", "b"]},
        {"guided_grammar": 'start: "x" | "y"'},
    ]
    for guided in guided_fields:
        body = {"model": MODEL, "messages": ASK, "max_tokens": 12, **guided}
        assert http.post("/v1/chat/completions", json=body).status_code == 200, guided
    completion = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "store": True, "metadata": {},
                  "use_beam_search": False, "priority": 0, "add_special_tokens": True}  # fmt: skip
    assert http.post("/v1/completions", json=completion).status_code == 200
    unknown = http.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, "bogus": 1})
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "bogus"
    beam = http.post(
        "/v1/chat/completions", json={"model": MODEL, "messages": ASK, "use_beam_search": True}
    )
    assert beam.status_code == 400 and beam.json()["error"]["param"] == "use_beam_search"


def test_undeclared_keys_are_closed_as_vllm_does(client: openai.OpenAI) -> None:
    """A schema that does not state additionalProperties (instructor's) gets its declared
    keys only: with "," pushed hard by logit_bias, the answer still ends after its one key,
    where a schema open to more keys gets another."""
    [comma] = Tokenizer(demo_model_dir()).encode(",", add_special_tokens=False)
    zone = {
        "type": "object",
        "properties": {"zone": {"enum": ["UTC", "CET"]}},
        "required": ["zone"],
    }

    def keys(schema: dict[str, Any]) -> set[str]:
        text = chat(
            client,
            response_format={"type": "json_schema", "json_schema": {"name": "z", "schema": schema}},
            logit_bias={str(comma): 100},
            max_tokens=60,
        )["message"]["content"]
        try:
            return set(json.loads(text))
        except ValueError:  # an open object cut short by max_tokens
            return {"zone", "..."}

    assert keys({**zone, **COMPACT}) == {"zone"}
    assert len(keys({**zone, **COMPACT, "additionalProperties": True})) > 1


def test_refusals_say_what_is_missing(live: LiveServer, caplog: pytest.LogCaptureFixture) -> None:
    http = live.http()
    with caplog.at_level(logging.INFO, logger="nanoflex.server"):
        for part in (
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
            {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
        ):
            content = [{"type": "text", "text": "What is this?"}, part]
            body = {"model": MODEL, "messages": [{"role": "user", "content": content}]}
            response = http.post("/v1/chat/completions", json=body)
            assert response.status_code == 400
            error = response.json()["error"]
            assert "text only" in error["message"] and error["param"] == "messages.0.content.1"
        for path in ("/v1/moderations", "/v1/audio/transcriptions", "/v1/images/generations"):
            response = http.post(path, json={"model": MODEL, "input": "x"})
            assert response.status_code == 404
            assert response.json()["error"]["code"] == "route_not_served"
            assert "does not serve" in response.json()["error"]["message"]
    refused = [r.getMessage() for r in caplog.records if r.getMessage().startswith("refused")]
    assert any("/v1/moderations" in m and "route_not_served" in m for m in refused)
    assert sum("unsupported_content_type" in m for m in refused) == 2
    metrics = http.get("/metrics").text
    assert 'nanoflex_requests_rejected_total{reason="route_not_served"} 3.0' in metrics
    assert 'nanoflex_requests_rejected_total{reason="unsupported_content_type"} 2.0' in metrics


def test_template_options_reach_the_template(tmp_path: Path) -> None:
    """chat_template_kwargs, tools and continue_final_message as a Qwen3-style template
    reads them; the template's formats are detected from it."""
    from engine.core.tokenizer import ChatOptions
    from server.openai.parsers.reasoning import parser_for_template as reasoning_for
    from server.openai.parsers.tool_calls import parser_for_template as tools_for

    template = (
        "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}"
        "</tools>{% endif %}"
        "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}"
        "{% for c in m.tool_calls or [] %}"
        "<tool_call>{{ c.function.arguments | tojson }}</tool_call>"
        "{% endfor %}<|end|>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>"
        "{% if enable_thinking is defined and not enable_thinking %}"
        "<think>\n\n</think>\n\n{% endif %}"
        "{% endif %}"
    )
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((demo_model_dir() / name).read_bytes())
    (tmp_path / "chat_template.jinja").write_text(template)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = Tokenizer(tmp_path)
    assert (tools_for(template), reasoning_for(template)) == ("hermes", "qwen3")
    text = tokenizer.render_chat(
        ASK, ChatOptions(tools=TOOLS, template_kwargs={"enable_thinking": False})
    )
    assert text.startswith("<tools>get_weather;get_time;</tools>")
    assert text.endswith("<|assistant|><think>\n\n</think>\n\n")
    call = {"type": "function", "function": {"name": "get_time", "arguments": {"zone": "UTC"}}}
    chat = [*ASK, {"role": "assistant", "content": "It is", "tool_calls": [call]}]
    assert '<tool_call>{"zone": "UTC"}</tool_call>' in tokenizer.render_chat(
        chat, ChatOptions(False)
    )
    cont = [*ASK, {"role": "assistant", "content": "The weather is"}]
    options = ChatOptions(add_generation_prompt=False, continue_final_message=True)
    assert tokenizer.render_chat(cont, options).endswith("<|assistant|>The weather is")


def test_responses_api(client: openai.OpenAI) -> None:
    """/v1/responses: text, json_schema in text.format, a forced function call and its
    output fed back, and the streamed events, with the openai client."""
    text = client.responses.create(model=MODEL, input="Hello", max_output_tokens=4)
    assert text.object == "response" and text.id.startswith("resp_")
    assert text.output_text and text.status == "incomplete"  # cut at max_output_tokens
    assert text.usage is not None and text.usage.output_tokens == 4

    fmt: Any = {"type": "json_schema", "name": "time", "schema": {**TIME, **COMPACT}}
    shaped = client.responses.create(
        model=MODEL, input=[{"role": "user", "content": "Time?"}], text={"format": fmt},
        max_output_tokens=40, instructions="Answer in JSON.",
    )  # fmt: skip
    jsonschema.validate(json.loads(shaped.output_text), TIME)

    tool: Any = {"type": "function", "name": "get_time", "parameters": TIME}
    choice: Any = {"type": "function", "name": "get_time"}
    called = client.responses.create(
        model=MODEL, input="What time is it?", tools=[tool], tool_choice=choice,
        max_output_tokens=40,
    )  # fmt: skip
    calls: list[Any] = [item for item in called.output if item.type == "function_call"]
    [call] = calls
    assert call.name == "get_time"
    jsonschema.validate(json.loads(call.arguments), TIME)
    follow: Any = [
        {"role": "user", "content": "What time is it?"},
        {"type": "function_call", "call_id": call.call_id, "name": "get_time",
         "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "12:00"},
    ]  # fmt: skip
    again = client.responses.create(model=MODEL, input=follow, tools=[tool], max_output_tokens=3)
    assert again.status == "incomplete" and again.output_text

    events = list(
        client.responses.create(model=MODEL, input="Hello", max_output_tokens=5, stream=True)
    )
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.incomplete"
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")  # type: ignore[union-attr]
    assert deltas and deltas == events[-1].response.output_text  # type: ignore[union-attr]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    with pytest.raises(openai.BadRequestError, match="stores none"):
        client.responses.create(model=MODEL, input="Hi", previous_response_id="resp_x")
    for item, says in [
        ({"x": {}}, "needs its content"),
        ({"role": "tool", "content": "x"}, "role"),
    ]:
        with pytest.raises(openai.BadRequestError, match=says) as refused:
            client.responses.create(model=MODEL, input=[item])  # type: ignore[list-item]
        assert refused.value.body["param"].startswith("input.0")  # type: ignore[index]


def test_responses_stream_reasoning_as_its_own_item(
    live: LiveServer, client: openai.OpenAI
) -> None:
    """With a reasoning parser whose think block the prompt opens (deepseek_r1), an answer
    cut before `</think>` is all reasoning: it streams as `reasoning_text` deltas of a
    reasoning item, which the final Response holds whole."""
    with parsers(live, reasoning="deepseek_r1"):
        events = list(
            client.responses.create(model=MODEL, input="Hello", max_output_tokens=6, stream=True)
        )
    kinds = [e.type for e in events]
    assert "response.output_text.delta" not in kinds
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")  # type: ignore[union-attr]
    final = events[-1].response  # type: ignore[union-attr]
    [item] = final.output
    assert item.type == "reasoning" and deltas and item.content[0].text == deltas  # type: ignore[union-attr,index]
    done = [e for e in events if e.type == "response.reasoning_text.done"]
    assert [e.text for e in done] == [deltas]  # type: ignore[union-attr]


def test_responses_stream_events_in_order() -> None:
    """The events of a streamed Response whose answer reasons, answers and calls a tool:
    each item opened at its first text with its final output_index, closed before the next
    opens, the text held back (a call's start) sent as a last delta, and every event one the
    openai client's own types read."""
    import asyncio

    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter

    from server.openai.responses import AssistantMessage, FunctionCallOut, ToolCall
    from server.openai.responses_api import (
        ResponsesRequest,
        output_items,
        response_body,
        response_events,
    )

    req = ResponsesRequest(model=MODEL, input="Hi", stream=True)
    head = response_body(req, "resp_1", 0, MODEL, None, "in_progress")
    call = ToolCall(
        id="call_1", type="function", function=FunctionCallOut(name="f", arguments="{}")
    )
    message = AssistantMessage(
        role="assistant", content="Hello!", reasoning_content="abc", tool_calls=[call]
    )
    final = head.model_copy(
        update={"status": "completed", "output": output_items("resp_1", message)}
    )

    async def deltas() -> Any:
        for part in [
            ("reasoning", "ab"),
            ("reasoning", "c"),
            ("content", "Hel"),
            ("content", "lo"),
        ]:
            yield part

    async def collect() -> list[Any]:
        return [e async for e in response_events(head, deltas(), lambda: final)]

    raw = asyncio.run(collect())
    adapter: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
    events = [adapter.validate_json(chunk.decode().split("data: ", 1)[1].strip()) for chunk in raw]
    where = [(e.type, getattr(e, "output_index", None)) for e in events]
    assert where == [
        ("response.created", None), ("response.in_progress", None),
        ("response.output_item.added", 0), ("response.content_part.added", 0),
        ("response.reasoning_text.delta", 0), ("response.reasoning_text.delta", 0),
        ("response.reasoning_text.done", 0), ("response.content_part.done", 0),
        ("response.output_item.done", 0),
        ("response.output_item.added", 1), ("response.content_part.added", 1),
        ("response.output_text.delta", 1), ("response.output_text.delta", 1),
        ("response.output_text.delta", 1),  # "!", held back until the answer was read whole
        ("response.output_text.done", 1), ("response.content_part.done", 1),
        ("response.output_item.done", 1),
        ("response.output_item.added", 2), ("response.function_call_arguments.delta", 2),
        ("response.function_call_arguments.done", 2), ("response.output_item.done", 2),
        ("response.completed", None),
    ]  # fmt: skip
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == "Hello!" and events[14].text == "Hello!"
    assert events[6].text == "abc" and events[8].item.content[0].text == "abc"
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_legacy_function_call_streamed(client: openai.OpenAI) -> None:
    """The legacy `functions` / `function_call` request, streamed: the call arrives as
    `delta.function_call`, the same as the whole answer's `message.function_call`."""
    fields: Any = {
        "model": MODEL, "messages": ASK, "temperature": 0, "max_tokens": 40,
        "functions": [{"name": "get_time", "parameters": TIME}],
        "function_call": {"name": "get_time"},
    }  # fmt: skip
    whole = client.chat.completions.create(**fields).choices[0]
    name, arguments, finish = "", "", None
    for chunk in client.chat.completions.create(stream=True, **fields):
        if chunk.choices:
            call = chunk.choices[0].delta.function_call
            name += (call.name or "") if call else ""
            arguments += (call.arguments or "") if call else ""
            finish = chunk.choices[0].finish_reason or finish
    assert whole.message.function_call is not None and whole.message.tool_calls is None
    assert (name, arguments) == (
        whole.message.function_call.name,
        whole.message.function_call.arguments,
    )
    jsonschema.validate(json.loads(arguments), TIME)
    assert finish == whole.finish_reason


def test_responses_in_batch_api_lines(client: openai.OpenAI) -> None:
    body = {"model": MODEL, "input": "Hello", "max_output_tokens": 3}
    line = {"custom_id": "r0", "method": "POST", "url": "/v1/responses", "body": body}
    batch = client.batches.create(
        input_file_id=upload(client, [json.dumps(line)]),
        endpoint="/v1/responses",  # type: ignore[arg-type]
        completion_window="24h",
    )
    [output] = read_lines(client, wait_batch(client, batch.id).output_file_id)
    answer = output["response"]["body"]
    assert answer["object"] == "response" and answer["output"][0]["type"] == "message"
    assert answer["usage"]["output_tokens"] == 3
