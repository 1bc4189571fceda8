"""Error envelopes and status codes: 400 (never 422), 401, 404, 413, 429, aborts, and a bounded
load test, all against the real engine (demo model, context 2048 tokens)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.server.live import API_KEY, MODEL, LiveServer, ServerFactory, engine_is_idle, wait_for

GOOD = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
SLOW = {**GOOD, "max_tokens": 1500, "ignore_eos": True}
"""Runs 1500 engine steps: seconds on CPU, long enough to hold a queue slot."""


def assert_error(response: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if code is not None:
        assert error["code"] == code
    return dict(error)


def test_malformed_json_and_non_object(shared_client: httpx.Client) -> None:
    headers = {"content-type": "application/json"}
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/batches"):
        response = shared_client.post(path, content=b'{"model": ', headers=headers)
        assert_error(response, 400, "invalid_json")
        assert_error(shared_client.post(path, json=[1, 2]), 400, "invalid_json")


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
        ({"logprobs": 21}, "logprobs"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"stop": [f"s{i}" for i in range(65)]}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"frobnicate": 1}, "frobnicate"),
    ],
)
def test_bad_completion_params_are_400(
    shared_client: httpx.Client, change: dict[str, Any], param: str
) -> None:
    error = assert_error(shared_client.post("/v1/completions", json={**GOOD, **change}), 400)
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"


def test_missing_required_fields(shared_client: httpx.Client) -> None:
    error = assert_error(shared_client.post("/v1/completions", json={"model": MODEL}), 400)
    assert error["param"] == "prompt"
    chat: dict[str, Any] = {"model": MODEL, "messages": []}
    assert (
        assert_error(shared_client.post("/v1/chat/completions", json=chat), 400)["param"]
        == "messages"
    )
    chat = {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}
    assert_error(shared_client.post("/v1/chat/completions", json=chat), 400)


def test_prompt_problems(live: LiveServer, client: httpx.Client) -> None:
    prompt: Any
    for prompt in ("", [], [[]], ["ok", ""]):
        response = client.post("/v1/completions", json={**GOOD, "prompt": prompt})
        assert_error(response, 400, "empty_prompt")
    for prompt in ([5, 2048], [-1], [[1, 2], [100000]], [5, 99999]):
        response = client.post("/v1/completions", json={**GOOD, "prompt": prompt})
        assert_error(response, 400, "invalid_token_ids")
    too_long = {**GOOD, "prompt": [5] * 2049}
    assert_error(client.post("/v1/completions", json=too_long), 400, "context_length_exceeded")
    fits_not = {**GOOD, "prompt": [5] * 2000, "max_tokens": 100}
    assert_error(client.post("/v1/completions", json=fits_not), 400, "context_length_exceeded")
    text = "lorem ipsum dolor " * 1500
    assert len(live.engine.encode(text)) > 2048
    assert_error(client.post("/v1/completions", json={**GOOD, "prompt": text}), 400)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": text}]}
    assert_error(client.post("/v1/chat/completions", json=chat), 400, "context_length_exceeded")
    fits = {**GOOD, "prompt": [5] * 2040, "max_tokens": 8}  # exactly the whole context
    assert client.post("/v1/completions", json=fits).json()["usage"]["total_tokens"] == 2048


def test_unknown_ids_are_404(shared_client: httpx.Client) -> None:
    assert_error(shared_client.post("/v1/completions", json={**GOOD, "model": "gpt-9"}), 404)
    assert_error(shared_client.get("/v1/models/gpt-9"), 404, "model_not_found")
    assert_error(shared_client.get("/v1/files/file-nope"), 404, "file_not_found")
    assert_error(shared_client.get("/v1/files/file-nope/content"), 404, "file_not_found")
    assert_error(shared_client.delete("/v1/files/file-nope"), 404, "file_not_found")
    assert_error(shared_client.get("/v1/batches/batch_nope"), 404, "batch_not_found")
    assert_error(shared_client.post("/v1/batches/batch_nope/cancel"), 404, "batch_not_found")
    body = {"input_file_id": "file-nope", "endpoint": "/v1/completions", "completion_window": "24h"}
    assert_error(shared_client.post("/v1/batches", json=body), 404, "file_not_found")
    assert_error(shared_client.get("/v1/nothing-here"), 404)


def test_bad_query_params_are_400(shared_client: httpx.Client) -> None:
    assert_error(shared_client.get("/v1/batches", params={"limit": "many"}), 400)
    assert_error(shared_client.get("/v1/batches", params={"limit": 1000}), 400)


@pytest.fixture
def small(make_server: ServerFactory) -> Iterator[httpx.Client]:
    live = make_server(max_body_bytes=1000, max_file_bytes=2000)
    with live.http() as c:
        yield c


def test_oversized_bodies_are_413(small: httpx.Client) -> None:
    big = {**GOOD, "prompt": "x" * 5000}
    assert_error(small.post("/v1/completions", json=big), 413, "request_too_large")

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted while streaming
        yield b'{"model": MODEL, "prompt": "'
        for _ in range(50):
            yield b"x" * 100
        yield b'"}'

    headers = {"content-type": "application/json"}
    response = small.post("/v1/completions", content=chunks(), headers=headers)
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
    live = make_server(max_queue=1)
    with live.http() as client:
        with client.stream("POST", "/v1/completions", json={**SLOW, "stream": True}) as held:
            assert held.status_code == 200
            response = client.post("/v1/completions", json=GOOD)
            assert_error(response, 429, "queue_full")
            assert response.headers["retry-after"] == "1"
        wait_for(lambda: live.state.num_online == 0)
        assert client.post("/v1/completions", json=GOOD).status_code == 200
    wait_for(lambda: engine_is_idle(live.engine))  # closing the stream aborted its request


def test_client_disconnect_aborts_and_frees_kv(make_server: ServerFactory) -> None:
    live = make_server()
    with live.http() as client, pytest.raises(httpx.ReadTimeout):
        client.post("/v1/completions", json=SLOW, timeout=0.5)
    wait_for(lambda: live.state.num_online == 0 and engine_is_idle(live.engine))
    stream = {**SLOW, "stream": True}
    with live.http() as client, client.stream("POST", "/v1/completions", json=stream) as r:
        next(r.iter_lines())
        assert not engine_is_idle(live.engine)
    wait_for(lambda: live.state.num_online == 0 and engine_is_idle(live.engine))
    with live.http() as client:  # the gauges drop to 0 without another step
        wait_for(lambda: "nanoflex_requests_running 0.0" in client.get("/metrics").text)


LOAD_REQUESTS, LOAD_QUEUE, LOAD_TOKENS = 200, 16, 16


def test_bounded_load_every_request_answered(make_server: ServerFactory) -> None:
    """200 concurrent completions against a queue of 16: each gets 200 or 429, none lost.
    Prints the figures recorded in docs/benchmarks.md ("Daemon load test")."""
    live = make_server(max_queue=LOAD_QUEUE)
    body = {**GOOD, "max_tokens": LOAD_TOKENS, "ignore_eos": True}

    async def one(c: httpx.AsyncClient) -> tuple[httpx.Response, float]:
        start = time.perf_counter()
        response = await c.post("/v1/completions", json=body)
        return response, time.perf_counter() - start

    async def fire() -> list[tuple[httpx.Response, float]]:
        limits = httpx.Limits(max_connections=LOAD_REQUESTS)
        async with httpx.AsyncClient(base_url=live.base_url, timeout=120, limits=limits) as c:
            return await asyncio.gather(*(one(c) for _ in range(LOAD_REQUESTS)))

    start = time.perf_counter()
    results = asyncio.run(fire())
    wall_s = time.perf_counter() - start
    served = [seconds for r, seconds in results if r.status_code == 200]
    for response, _ in results:
        if response.status_code == 200:
            assert response.json()["usage"]["completion_tokens"] == LOAD_TOKENS
        else:
            assert_error(response, 429, "queue_full")
            assert response.headers["retry-after"] == "1"
    assert len(results) == LOAD_REQUESTS
    assert len(served) >= LOAD_QUEUE
    wait_for(lambda: live.state.num_online == 0 and engine_is_idle(live.engine))
    metrics = live.http().get("/metrics").text
    refused = LOAD_REQUESTS - len(served)
    assert f'nanoflex_requests_rejected_total{{reason="queue_full"}} {float(refused)}' in metrics
    served.sort()
    print(
        f"\nload: {LOAD_REQUESTS} concurrent, max_queue {LOAD_QUEUE}, {LOAD_TOKENS} tokens each: "
        f"{len(served)} served, {refused} refused with 429, 0 lost; wall {wall_s:.2f} s; "
        f"served latency p50 {served[len(served) // 2]:.2f} s, max {served[-1]:.2f} s; "
        f"{len(served) * LOAD_TOKENS / wall_s:.0f} generated tok/s"
    )


@pytest.mark.slow
def test_load_with_clients_that_retry(make_server: ServerFactory) -> None:
    """The same 200 concurrent completions, each client retrying after Retry-After on 429:
    every one is served in the end, none lost (about half a minute on 2 CPU cores)."""
    live = make_server(max_queue=LOAD_QUEUE)
    body = {**GOOD, "max_tokens": LOAD_TOKENS, "ignore_eos": True}

    async def one(c: httpx.AsyncClient) -> int:
        refusals = 0
        while True:
            response = await c.post("/v1/completions", json=body)
            if response.status_code == 200:
                assert response.json()["usage"]["completion_tokens"] == LOAD_TOKENS
                return refusals
            assert_error(response, 429, "queue_full")
            refusals += 1
            await asyncio.sleep(float(response.headers["retry-after"]))

    async def fire() -> list[int]:
        limits = httpx.Limits(max_connections=LOAD_REQUESTS)
        async with httpx.AsyncClient(base_url=live.base_url, timeout=120, limits=limits) as c:
            return await asyncio.gather(*(one(c) for _ in range(LOAD_REQUESTS)))

    start = time.perf_counter()
    refusals = asyncio.run(fire())
    wall_s = time.perf_counter() - start
    assert len(refusals) == LOAD_REQUESTS
    wait_for(lambda: live.state.num_online == 0 and engine_is_idle(live.engine))
    print(
        f"\nload with retries: {LOAD_REQUESTS} served, {sum(refusals)} 429s on the way "
        f"(max {max(refusals)} for one client); wall {wall_s:.2f} s; "
        f"{LOAD_REQUESTS * LOAD_TOKENS / wall_s:.0f} generated tok/s"
    )
