"""What bulk users send, over a real daemon (demo model) with the `openai` client: the
sampling fields reach the engine as the offline `LLM` takes them, out-of-range values are
400s naming the field, structured outputs follow their constraint (online, in Batch API
lines and in run-batch), the model's generation_config fills what a request leaves out,
`max_tokens: 0` with echo scores the prompt only, /tokenizer_info tells the served
tokenizer, and a request that arrives before the engine is ready waits for it."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest

from engine.core.protocol import TokenLogprobs
from engine.core.tokenizer import Tokenizer
from engine.loading.demo import demo_model_dir
from server.http.settings import ServerSettings
from server.openai.logprobs import completion_logprobs
from tests.server.batch_files import read_lines, upload, wait_batch
from tests.server.live import (
    MODEL,
    LiveServer,
    Reference,
    ServerFactory,
    demo_engine,
    engine_args,
    start_server,
)
from tests.server.offline.test_run_batch import line, run_cli, write_input

PROMPT = "The quick brown fox"
SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "size": {"type": "integer", "minimum": 0, "maximum": 9},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["color", "size", "tags"],
    "additionalProperties": False,
}
JSON_SCHEMA_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True},
}
COMPACT = {"x-guidance": {"whitespace_flexible": False}}
"""llguidance's compact JSON: a tiny random model cannot pad the answer with blanks."""


def compact_schema() -> dict[str, Any]:
    return {**SCHEMA, **COMPACT}


@pytest.mark.parametrize(
    ("fields", "base"),
    [
        ({"presence_penalty": 1.5, "frequency_penalty": 0.7}, {}),
        ({"repetition_penalty": 1.8}, {}),
        ({"logit_bias": {"5": 100}}, {}),
        ({"min_tokens": 5}, {"stop": [" tak"]}),  # the greedy answer starts with " tak"
        ({"bad_words": ["tak"]}, {}),
        ({"allowed_token_ids": [5, 6, 7]}, {}),
    ],
)
def test_sampling_fields_give_the_offline_engines_tokens(
    live: LiveServer, reference: Reference, fields: dict[str, Any], base: dict[str, Any]
) -> None:
    """Each field changes the greedy answer (or it would go untested) and the daemon's
    answer equals the offline engine's with the same settings."""
    got = live.openai().completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, extra_body=fields | base
    )
    params = _engine_fields(fields | base)
    expected = reference.greedy(PROMPT, 12, **params)
    plain = reference.greedy(PROMPT, 12, **_engine_fields(base))
    assert got.choices[0].text == expected.text
    assert expected.token_ids != plain.token_ids, f"{fields} changed nothing on this prompt"


def _engine_fields(fields: dict[str, Any]) -> dict[str, Any]:
    """A request's fields as SamplingParams takes them."""
    params = dict(fields)
    if "logit_bias" in params:
        params["logit_bias"] = {int(k): v for k, v in params["logit_bias"].items()}
    for name in ("bad_words", "allowed_token_ids", "stop"):
        if name in params:
            params[name] = tuple(params[name])
    return params


@pytest.mark.parametrize(
    ("field", "value", "param"),
    [
        ("presence_penalty", 2.5, "presence_penalty"),
        ("frequency_penalty", -3, "frequency_penalty"),
        ("repetition_penalty", 0, "repetition_penalty"),
        ("min_p", 1.5, "min_p"),
        ("min_tokens", -1, "min_tokens"),
        ("logit_bias", {"abc": 1}, "logit_bias"),
        ("logit_bias", {"5": 101}, "logit_bias"),
        ("logit_bias", {str(10**7): 1}, None),
        ("allowed_token_ids", [], "allowed_token_ids"),
        ("bad_words", [""], None),
        ("response_format", {"type": "xml"}, "response_format.type"),
        ("response_format", {"type": "json_schema"}, "response_format"),
        (
            "response_format",
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}},
            "response_format",
        ),
        ("structured_outputs", {"regex": "(unclosed"}, "structured_outputs"),
        ("structured_outputs", {"regex": "a", "choice": ["b"]}, "structured_outputs"),
        ("structured_outputs", {"choice": []}, "structured_outputs"),
        ("structured_outputs", {"yaml": "x"}, "structured_outputs.yaml"),
        ("max_tokens", 0, "max_tokens"),
    ],
)
def test_out_of_range_values_are_400s_naming_the_field(
    shared_client: httpx.Client, field: str, value: Any, param: str | None
) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, field: value}
    response = shared_client.post("/v1/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    if param is None:  # named in the message instead
        assert field in error["message"] or "token" in error["message"], error


def test_json_schema_answers_validate_greedy_sampled_and_streamed(live: LiveServer) -> None:
    client = live.openai()
    messages = [{"role": "user", "content": "Describe a thing as JSON."}]
    fmt = {**JSON_SCHEMA_FORMAT, "json_schema": {"name": "thing", "schema": compact_schema()}}
    texts = []
    for temperature, seed in [(0.0, None), (1.0, 1), (1.0, 2)]:
        result = client.chat.completions.create(
            model=MODEL,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=80,
            temperature=temperature,
            seed=seed,
            response_format=fmt,  # type: ignore[arg-type]
        )
        choice = result.choices[0]
        assert choice.finish_reason == "stop", choice
        texts.append(choice.message.content or "")
        jsonschema.validate(json.loads(texts[-1]), SCHEMA)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=80,
        temperature=0,
        response_format=fmt,  # type: ignore[arg-type]
        stream=True,
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == texts[0]


def test_vllm_structured_outputs_on_both_routes(live: LiveServer) -> None:
    client = live.openai()
    cases: list[tuple[dict[str, Any], Any]] = [
        ({"choice": ["alpha", "beta", "gamma"]}, lambda t: t in ("alpha", "beta", "gamma")),
        ({"regex": r"[0-9]{3}-[a-z]{2}"}, lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2}", t)),
        ({"json": compact_schema()}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
        ({"grammar": 'root ::= "yes" | "no"'}, lambda t: t in ("yes", "no")),
    ]
    for spec, ok in cases:
        extra = {"structured_outputs": spec}
        completion = client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=80, temperature=0, extra_body=extra
        )
        chat = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Answer."}],
            max_tokens=80,
            temperature=0,
            extra_body=extra,
        )
        for text, finish in [
            (completion.choices[0].text, completion.choices[0].finish_reason),
            (chat.choices[0].message.content or "", chat.choices[0].finish_reason),
        ]:
            assert finish == "stop" and ok(text), (spec, text)
    obj = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "JSON please"}],
        max_tokens=60,
        temperature=0,
        response_format={"type": "json_object"},
    ).choices[0]
    if obj.finish_reason == "stop":  # an open object may run past max_tokens on this model
        assert isinstance(json.loads(obj.message.content or ""), dict)
    else:
        assert (obj.message.content or "").startswith("{")


def test_a_choice_that_fails_in_a_step_fails_its_request_alone(live: LiveServer) -> None:
    """A grammar that leaves no allowed token: a 400 naming why (streamed or not), while a
    request in the same moment finishes and the daemon goes on."""
    body = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": 5,
        "structured_outputs": {"choice": ["yes", "no"]},
        "allowed_token_ids": [0],
    }
    answers: dict[str, Any] = {}

    def fine() -> None:
        with live.http() as c:
            answers["fine"] = c.post(
                "/v1/completions",
                json={"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0},
            )

    thread = threading.Thread(target=fine)
    thread.start()
    with live.http() as c:
        failed = c.post("/v1/completions", json=body)
        streamed = c.post("/v1/completions", json={**body, "stream": True})
    thread.join()
    for answer in (failed, streamed):  # it fails before its first token: an answer, no events
        assert answer.status_code == 400 and answer.json()["error"]["code"] == "sampling_failed"
        assert "no token is allowed" in answer.json()["error"]["message"]
    assert answers["fine"].status_code == 200
    assert answers["fine"].json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_max_tokens_zero_with_echo_scores_the_prompt_only(
    live: LiveServer, reference: Reference
) -> None:
    """lm-eval's loglikelihood request, without a generated token to throw away."""
    client = live.openai()
    ids = reference.tokenizer.encode(PROMPT)
    zero = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=1, temperature=0
    ).choices[0]
    one = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=1, echo=True, logprobs=1, temperature=0
    ).choices[0]
    assert zero.text == reference.tokenizer.decode(ids) and zero.finish_reason == "length"
    assert zero.logprobs is not None and one.logprobs is not None
    assert zero.logprobs.token_logprobs == one.logprobs.token_logprobs[: len(ids)]
    assert zero.logprobs.token_logprobs[0] is None and len(zero.logprobs.tokens or []) == len(ids)


def test_top_logprobs_of_tokens_with_the_same_text_do_not_collide() -> None:
    """Two tokens that decode to one text (pieces of a character, say): both stay, the
    lower ranked one under "token_id:<id>"."""
    text = {1: "a", 2: "\ufffd", 3: "\ufffd", 4: "b"}

    def decode(ids: Any) -> str:
        return "".join(text[i] for i in ids)

    entry = TokenLogprobs(1, -0.1, [(1, -0.1), (2, -1.0), (3, -2.0), (4, -3.0)])
    got = completion_logprobs(decode, [1], [entry], 4, 0)
    assert got.top_logprobs == [{"a": -0.1, "\ufffd": -1.0, "token_id:3": -2.0, "b": -3.0}]


def test_generation_config_fills_what_a_request_leaves_out(
    make_server: ServerFactory, reference: Reference, tmp_path: Path
) -> None:
    """A model whose generation_config.json says repetition_penalty 1.8 and max_new_tokens 7:
    a chat request without those fields gets them, one that gives them keeps its own."""
    model_dir = tmp_path / "model"
    shutil.copytree(demo_model_dir(), model_dir)
    (model_dir / "generation_config.json").write_text(
        json.dumps({"repetition_penalty": 1.8, "max_new_tokens": 7, "temperature": 0.0})
    )
    live = make_server(demo_engine_for(model_dir))
    client = live.openai()
    messages = [{"role": "user", "content": "Say something"}]
    prompt_ids = reference.chat_ids(messages)
    silent = client.chat.completions.create(model=MODEL, messages=messages)  # type: ignore[arg-type]
    expected = reference.greedy(prompt_ids, 7, repetition_penalty=1.8)
    assert silent.choices[0].message.content == expected.text
    assert silent.usage is not None and silent.usage.completion_tokens == 7
    own = client.chat.completions.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=5,
        extra_body={"repetition_penalty": 1.0},
    )
    assert own.choices[0].message.content == reference.greedy(prompt_ids, 5).text


def demo_engine_for(model_dir: Path) -> Any:
    from engine.runtime.step_loop_client import build_engine_client

    args = engine_args(model=str(model_dir), served_model_name=MODEL)
    return build_engine_client(args)


def test_tokenizer_info_is_the_served_tokenizer(client: httpx.Client) -> None:
    """vLLM's GET /tokenizer_info, as lm-eval's remote tokenizer reads it."""
    info = client.get("/tokenizer_info").json()
    tokenizer = Tokenizer(demo_model_dir())
    assert info["eos_token"] == tokenizer.eos_token and info["bos_token"] == tokenizer.bos_token
    assert info["chat_template"] == tokenizer.chat_template
    assert info["model_max_length"] == 2048
    eos = client.post("/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False})
    assert eos.json()["tokens"] == [tokenizer.eos_token_id]


def test_a_request_before_the_engine_is_ready_waits_for_it(tmp_path: Path) -> None:
    """/health is liveness; a completion sent while the model loads is answered once it is
    loaded (--ready-wait), and one that waits past the bound gets 503 with Retry-After."""
    gate = threading.Event()
    engine = demo_engine()
    start = engine.start

    async def slow_start() -> None:
        while not gate.is_set():
            await asyncio.sleep(0.02)
        await start()

    engine.start = slow_start  # type: ignore[method-assign]
    settings = ServerSettings(data_dir=tmp_path / "data", ready_wait_s=60.0)
    live = start_server(settings, engine, wait_ready=False)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}
    try:
        with live.http() as c:
            assert c.get("/health").status_code == 200
            assert c.get("/ready").status_code == 503
            live.state.settings = replace(settings, ready_wait_s=0.3)
            refused = c.post("/v1/completions", json=body)
            assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"
            live.state.settings = settings
            answers: list[httpx.Response] = []
            waiter = threading.Thread(
                target=lambda: answers.append(c.post("/v1/completions", json=body))
            )
            waiter.start()
            time.sleep(0.5)
            assert not answers  # still waiting, not refused
            gate.set()
            waiter.join(60)
            assert answers[0].status_code == 200, answers[0].text
    finally:
        live.stop()


def test_batch_lines_and_run_batch_take_response_format(live: LiveServer, tmp_path: Path) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": compact_schema()}}
    messages = [{"role": "user", "content": "A thing as JSON"}]
    lines = [
        line(
            f"j{i}",
            url="/v1/chat/completions",
            messages=messages,
            max_tokens=80,
            temperature=0.0 if i == 0 else 1.0,
            seed=i,
            response_format=fmt,
        )
        for i in range(3)
    ]
    lines.append(line("bad", url="/v1/chat/completions", response_format={"type": "json_schema"}))
    client = live.openai()
    batch = client.batches.create(
        input_file_id=upload(client, lines),
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    batch = wait_batch(client, batch.id, timeout_s=120)
    outputs = {o["custom_id"]: o for o in read_lines(client, batch.output_file_id)}
    outputs |= {o["custom_id"]: o for o in read_lines(client, batch.error_file_id)}
    for i in range(3):
        body = outputs[f"j{i}"]["response"]["body"]
        jsonschema.validate(json.loads(body["choices"][0]["message"]["content"]), SCHEMA)
    bad = outputs["bad"]["response"]
    assert bad["status_code"] == 400 and bad["body"]["error"]["param"] == "response_format"
    named = {"type": "function", "function": {"name": "make_thing"}}
    tool = {"type": "function", "function": {"name": "make_thing", "parameters": SCHEMA}}
    call = line("call", url="/v1/chat/completions", messages=messages, max_tokens=80,
                tools=[tool], tool_choice=named)  # fmt: skip
    inp = write_input(tmp_path / "in.jsonl", [*lines[:3], call])
    out = tmp_path / "out.jsonl"
    run_cli(inp, out)
    answered = [json.loads(raw)["custom_id"] for raw in out.read_text().splitlines()]
    assert sorted(answered) == ["call", "j0", "j1", "j2"]
    for raw in out.read_text().splitlines():
        message = json.loads(raw)["response"]["body"]["choices"][0]["message"]
        if json.loads(raw)["custom_id"] == "call":  # a tool call, its arguments the schema's
            [made] = message["tool_calls"]
            assert made["function"]["name"] == "make_thing" and message["content"] is None
            jsonschema.validate(json.loads(made["function"]["arguments"]), SCHEMA)
        else:
            jsonschema.validate(json.loads(message["content"]), SCHEMA)
