"""Error envelopes and status codes: 400 (never 422), 401, 404, 413, 429, and aborts."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from conftest import API_KEY, ServerFactory, wait_for
from toy_engine import ToyEngineClient

GOOD = {"model": "toy-model", "prompt": "hello", "max_tokens": 2}


def assert_error(response: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if code is not None:
        assert error["code"] == code
    return dict(error)


def test_malformed_json_and_non_object(client: httpx.Client) -> None:
    headers = {"content-type": "application/json"}
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/batches"):
        response = client.post(path, content=b'{"model": ', headers=headers)
        assert_error(response, 400, "invalid_json")
        assert_error(client.post(path, json=[1, 2]), 400, "invalid_json")


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"max_tokens": "5"}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"temperature": "hot"}, "temperature"),
        ({"prompt": {"text": "x"}}, "prompt"),
        ({"stop": 5}, "stop"),
        ({"stream": "yes"}, "stream"),
        ({"temperature": 2.5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"n": 0}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"logprobs": 9}, "logprobs"),
        ({"presence_penalty": 1.0}, "presence_penalty"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"frobnicate": 1}, "frobnicate"),
    ],
)
def test_bad_completion_params_are_400(
    client: httpx.Client, change: dict[str, Any], param: str
) -> None:
    error = assert_error(client.post("/v1/completions", json={**GOOD, **change}), 400)
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"


def test_missing_required_fields(client: httpx.Client) -> None:
    error = assert_error(client.post("/v1/completions", json={"model": "toy-model"}), 400)
    assert error["param"] == "prompt"
    chat: dict[str, Any] = {"model": "toy-model", "messages": []}
    assert assert_error(client.post("/v1/chat/completions", json=chat), 400)["param"] == "messages"
    chat = {"model": "toy-model", "messages": [{"role": "wizard", "content": "x"}]}
    assert_error(client.post("/v1/chat/completions", json=chat), 400)


def test_prompt_problems(client: httpx.Client) -> None:
    prompt: Any
    for prompt in ("", [], [[]], ["ok", ""]):
        response = client.post("/v1/completions", json={**GOOD, "prompt": prompt})
        assert_error(response, 400, "empty_prompt")
    for prompt in ([5, 99999], [-1], [[1, 2], [100000]]):
        response = client.post("/v1/completions", json={**GOOD, "prompt": prompt})
        assert_error(response, 400, "invalid_token_ids")
    too_long = {**GOOD, "prompt": "x" * 300}
    assert_error(client.post("/v1/completions", json=too_long), 400, "context_length_exceeded")
    fits_not = {**GOOD, "prompt": "x" * 200, "max_tokens": 100}
    assert_error(client.post("/v1/completions", json=fits_not), 400, "context_length_exceeded")
    chat = {"model": "toy-model", "messages": [{"role": "user", "content": "y" * 300}]}
    assert_error(client.post("/v1/chat/completions", json=chat), 400, "context_length_exceeded")


def test_unknown_ids_are_404(client: httpx.Client) -> None:
    assert_error(client.post("/v1/completions", json={**GOOD, "model": "gpt-9"}), 404)
    assert_error(client.get("/v1/models/gpt-9"), 404, "model_not_found")
    assert_error(client.get("/v1/files/file-nope"), 404, "file_not_found")
    assert_error(client.get("/v1/files/file-nope/content"), 404, "file_not_found")
    assert_error(client.delete("/v1/files/file-nope"), 404, "file_not_found")
    assert_error(client.get("/v1/batches/batch_nope"), 404, "batch_not_found")
    assert_error(client.post("/v1/batches/batch_nope/cancel"), 404, "batch_not_found")
    body = {"input_file_id": "file-nope", "endpoint": "/v1/completions", "completion_window": "24h"}
    assert_error(client.post("/v1/batches", json=body), 404, "file_not_found")
    assert_error(client.get("/v1/nothing-here"), 404)


def test_bad_query_params_are_400(client: httpx.Client) -> None:
    assert_error(client.get("/v1/batches", params={"limit": "many"}), 400)
    assert_error(client.get("/v1/batches", params={"limit": 1000}), 400)


@pytest.fixture
def small(make_server: ServerFactory) -> Iterator[httpx.Client]:
    live = make_server(max_body_bytes=1000, max_file_bytes=2000)
    with live.http() as c:
        yield c


def test_oversized_bodies_are_413(small: httpx.Client) -> None:
    big = {**GOOD, "prompt": "x" * 5000}
    assert_error(small.post("/v1/completions", json=big), 413, "request_too_large")

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted while streaming
        yield b'{"model": "toy-model", "prompt": "'
        for _ in range(50):
            yield b"x" * 100
        yield b'"}'

    response = small.post("/v1/completions", content=chunks())
    assert_error(response, 413, "request_too_large")
    files = {"file": ("in.jsonl", b"y" * 5000)}
    response = small.post("/v1/files", files=files, data={"purpose": "batch"})
    assert_error(response, 413, "request_too_large")
    files = {"file": ("in.jsonl", b'{"a": 1}\n')}
    assert small.post("/v1/files", files=files, data={"purpose": "batch"}).status_code == 200


def test_api_key(make_server: ServerFactory) -> None:
    live = make_server(api_key=API_KEY)
    with httpx.Client(base_url=live.base_url) as anonymous:
        assert anonymous.get("/health").status_code == 200
        assert anonymous.get("/ready").status_code == 200
        assert_error(anonymous.get("/v1/models"), 401, "invalid_api_key")
        wrong = {"Authorization": "Bearer nope"}
        assert_error(anonymous.post("/v1/completions", json=GOOD, headers=wrong), 401)
        assert_error(anonymous.get("/metrics", headers={"Authorization": API_KEY}), 401)
    with live.http() as authorized:
        assert authorized.post("/v1/completions", json=GOOD).status_code == 200


def test_full_queue_is_429_with_retry_after(make_server: ServerFactory) -> None:
    live = make_server(ToyEngineClient(step_s=0.05), max_queue=1)
    with live.http() as client:
        slow = {**GOOD, "max_tokens": 100, "stream": True}
        with client.stream("POST", "/v1/completions", json=slow) as held:
            assert held.status_code == 200
            response = client.post("/v1/completions", json=GOOD)
            assert_error(response, 429, "queue_full")
            assert response.headers["retry-after"] == "1"
        wait_for(lambda: live.state.num_online == 0)
        assert client.post("/v1/completions", json=GOOD).status_code == 200


def test_client_disconnect_aborts(make_server: ServerFactory) -> None:
    engine = ToyEngineClient(step_s=0.05)
    live = make_server(engine)
    slow = {**GOOD, "max_tokens": 200}
    with live.http() as client, pytest.raises(httpx.ReadTimeout):
        client.post("/v1/completions", json=slow, timeout=0.3)
    wait_for(lambda: len(engine.aborted) == 1)
    with live.http() as client:
        with client.stream("POST", "/v1/completions", json={**slow, "stream": True}) as r:
            next(r.iter_lines())
        wait_for(lambda: len(engine.aborted) == 2)
    wait_for(lambda: live.state.num_online == 0 and not engine._running)


def test_bounded_load_every_request_answered(make_server: ServerFactory) -> None:
    """200 concurrent completions against a queue of 16: each gets 200 or 429, none lost."""
    live = make_server(ToyEngineClient(step_s=0.005, max_running=8), max_queue=16)

    async def fire() -> list[int]:
        limits = httpx.Limits(max_connections=200)
        async with httpx.AsyncClient(base_url=live.base_url, timeout=60, limits=limits) as c:
            body = {**GOOD, "max_tokens": 8}
            responses = await asyncio.gather(
                *(c.post("/v1/completions", json=body) for _ in range(200))
            )
        for r in responses:
            if r.status_code == 200:
                assert r.json()["usage"]["completion_tokens"] == 8
            else:
                assert_error(r, 429, "queue_full")
        return [r.status_code for r in responses]

    codes = asyncio.run(fire())
    assert len(codes) == 200 and set(codes) <= {200, 429}
    assert codes.count(200) >= 16
    wait_for(lambda: live.state.num_online == 0)
    print(f"load: {codes.count(200)} served, {codes.count(429)} refused with 429")
