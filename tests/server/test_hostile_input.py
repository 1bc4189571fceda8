"""Hostile input is refused cheaply with OpenAI's envelope, on a real uvicorn server and the
real engine (demo model): bodies Python's json cannot take back (deep nesting, huge integers,
lone surrogates, NaN), prompts too large to fit, requests of too many sequences, cross-site
and rebinding requests, slow clients; and the API key from the environment or a file."""

from __future__ import annotations

import json
import socket
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from base.errors import UserError
from server.cli import build_parser
from server.http.settings import ServerSettings, api_key_from
from tests.server.batch_files import URL, request_line, upload, wait_batch
from tests.server.faults import BLOCK, BlockingEngine, like_demo
from tests.server.live import MODEL, LiveServer, ServerFactory, engine_is_idle, wait_for
from tests.server.test_errors import GOOD, SLOW, assert_error

JSON = {"content-type": "application/json"}
DEEP = b'{"model": "x", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
HUGE_INT = b'{"model": "x", "prompt": "a", "max_tokens": ' + b"9" * 5000 + b"}"
NAN = b'{"model": "x", "prompt": "a", "temperature": NaN}'


@pytest.mark.parametrize("body", [DEEP, HUGE_INT, NAN], ids=["deep", "digits", "nan"])
def test_undecodable_json_is_400(shared_client: httpx.Client, body: bytes) -> None:
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/batches"):
        assert_error(shared_client.post(path, content=body, headers=JSON), 400, "invalid_json")


def test_lone_surrogates_are_400(shared_client: httpx.Client) -> None:
    bodies: list[dict[str, Any]] = [
        {"model": MODEL, "prompt": "\ud800", "max_tokens": 2},
        {"model": MODEL, "prompt": ["ok", "x\udfff"], "max_tokens": 2},
        {"model": MODEL, "messages": [{"role": "user", "content": "\ud800"}]},
        {
            "input_file_id": "f",
            "endpoint": URL,
            "completion_window": "24h",
            "metadata": {"k": "\udc00"},
        },
    ]
    paths = ["/v1/completions", "/v1/completions", "/v1/chat/completions", "/v1/batches"]
    for path, body in zip(paths, bodies, strict=True):
        escaped = json.dumps(body).encode()  # "\ud800" as a JSON escape, as clients send it
        error = assert_error(
            shared_client.post(path, content=escaped, headers=JSON), 400, "invalid_json"
        )
        assert "surrogate" in error["message"]
    emoji = {"model": MODEL, "prompt": "\U0001f600", "max_tokens": 1}  # a surrogate pair: fine
    escaped = json.dumps(emoji).encode()
    assert shared_client.post("/v1/completions", content=escaped, headers=JSON).status_code == 200


def test_too_long_prompt_text_is_refused_before_tokenizing(live: LiveServer) -> None:
    limit = live.state.serving.max_prompt_bytes
    assert limit == live.engine.max_model_len * live.engine.max_token_bytes
    calls: list[str] = []
    encode = live.engine.encode
    live.engine.encode = lambda text: calls.append(text) or encode(text)  # type: ignore[method-assign]
    with live.http() as client:
        body = {**GOOD, "prompt": "x" * (limit + 1)}
        error = assert_error(client.post("/v1/completions", json=body), 400)
        assert error["code"] == "context_length_exceeded" and str(limit) in error["message"]
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "é" * (limit // 2 + 1)}]}
        assert_error(client.post("/v1/chat/completions", json=chat), 400, "context_length_exceeded")
        ids = {**GOOD, "prompt": [5] * (live.engine.max_model_len + 1)}
        assert_error(client.post("/v1/completions", json=ids), 400, "context_length_exceeded")
    assert calls == []


def test_tokenizing_does_not_block_the_event_loop(make_server: ServerFactory) -> None:
    """A prompt whose tokenization never ends (until released) leaves /health answering."""
    live = make_server(engine=like_demo(BlockingEngine))
    engine = live.engine
    assert isinstance(engine, BlockingEngine)
    results: list[httpx.Response] = []
    body = {**GOOD, "prompt": f"{BLOCK} please"}
    sender = threading.Thread(
        target=lambda: results.append(httpx.post(f"{live.base_url}/v1/completions", json=body))
    )
    sender.start()
    assert engine.entered.wait(30)
    with live.http() as client:
        assert client.get("/health", timeout=10).json() == {"status": "ok"}
        assert client.post("/v1/completions", json=GOOD, timeout=30).status_code == 200
    assert not results  # still tokenizing
    engine.release.set()
    sender.join(30)
    assert results[0].status_code == 200, results[0].text


def test_sequences_count_against_the_queue(make_server: ServerFactory) -> None:
    live = make_server(max_queue=4)
    with live.http() as client:
        flood = {**GOOD, "prompt": [[5, 6]] * 2000, "n": 16}
        error = assert_error(client.post("/v1/completions", json=flood), 400, "too_many_sequences")
        assert "32000" in error["message"]
        over = {**GOOD, "prompt": ["a", "b"], "n": 3}  # 6 > max_queue 4: never admissible
        assert_error(client.post("/v1/completions", json=over), 400, "too_many_sequences")
        held = {**SLOW, "prompt": ["a", "b", "c"], "stream": True}  # 3 of the 4 slots
        with client.stream("POST", "/v1/completions", json=held) as stream:
            assert stream.status_code == 200
            wait_for(lambda: live.state.num_online == 3)
            two = {**GOOD, "n": 2}
            assert_error(client.post("/v1/completions", json=two), 429, "queue_full")
            assert client.post("/v1/completions", json=GOOD).status_code == 200  # 1 fits
        wait_for(lambda: live.state.num_online == 0 and engine_is_idle(live.engine))
        assert client.post("/v1/completions", json={**GOOD, "n": 4}).status_code == 200


def test_cross_site_requests_are_refused(live: LiveServer, client: httpx.Client) -> None:
    batch_body = (
        b'{"input_file_id": "f", "endpoint": "/v1/completions", "completion_window": "24h"}'
    )
    text = {"content-type": "text/plain"}
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/batches"):
        assert_error(client.post(path, content=batch_body, headers=text), 415)
    evil = {"Origin": "http://evil.example"}
    files = {"file": ("in.jsonl", request_line("a", "x").encode())}
    response = client.post("/v1/files", files=files, data={"purpose": "batch"}, headers=evil)
    assert_error(response, 403, "origin_not_allowed")
    assert live.openai().files.list().data == []  # nothing stored
    assert_error(client.get("/v1/models", headers=evil), 403, "origin_not_allowed")
    same = {"Origin": live.base_url}  # the daemon's own origin (e.g. its /docs page)
    assert client.get("/v1/models", headers=same).status_code == 200
    preflight = client.options(
        "/v1/completions",
        headers={**evil, "Access-Control-Request-Method": "POST"},
    )
    assert "access-control-allow-origin" not in preflight.headers
    port = live.base_url.rsplit(":", 1)[1]
    for host in (f"evil.example:{port}", "rebind.attacker.test"):
        assert_error(client.get("/health", headers={"Host": host}), 400, "host_not_allowed")
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "10.1.2.3"):
        assert client.get("/health", headers={"Host": host}).status_code == 200


def test_allowed_hosts_and_origins(make_server: ServerFactory) -> None:
    live = make_server(allowed_hosts=("gpu-box",), allowed_origins=("https://ui.example",))
    with live.http() as client:
        assert client.get("/health", headers={"Host": "gpu-box:8000"}).status_code == 200
        assert_error(client.get("/health", headers={"Host": "other-box"}), 400)
        ui = {"Origin": "https://ui.example"}
        preflight = client.options(
            "/v1/completions", headers={**ui, "Access-Control-Request-Method": "POST"}
        )
        assert preflight.headers["access-control-allow-origin"] == "https://ui.example"
        response = client.post("/v1/completions", json=GOOD, headers=ui)
        assert response.status_code == 200
        assert response.headers["access-control-allow-origin"] == "https://ui.example"


def test_api_key_from_environment_or_file(make_server: ServerFactory, tmp_path: Path) -> None:
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    assert api_key_from(None, str(key_file), {"NANOFLEX_API_KEY": "env"}) == "from-file"
    assert api_key_from("flag", None, {"NANOFLEX_API_KEY": "env"}) == "flag"
    assert api_key_from(None, None, {}) is None
    for flag, path, env in (
        ("flag", str(key_file), {}),
        (None, str(tmp_path / "missing"), {}),
        (None, None, {"NANOFLEX_API_KEY": " "}),
    ):
        with pytest.raises(UserError):
            api_key_from(flag, path, env)
    argv = ["serve", "--data-dir", str(tmp_path / "data")]
    args = build_parser("serve").parse_args(argv)
    settings = ServerSettings.from_args(args, {"NANOFLEX_API_KEY": "from-env"})
    assert settings.api_key == "from-env" and "from-env" not in " ".join(argv)
    live = make_server(api_key=settings.api_key)
    with httpx.Client(base_url=live.base_url) as anonymous:
        assert_error(anonymous.get("/v1/models"), 401, "invalid_api_key")
        authorized = {"Authorization": "Bearer from-env"}
        assert anonymous.get("/v1/models", headers=authorized).status_code == 200


def _connect(live: LiveServer) -> socket.socket:
    host, port = live.base_url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    return sock


def _read_all(sock: socket.socket) -> bytes:
    """Everything until the server closes the connection."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_slow_body_is_408_and_idle_connections_close(make_server: ServerFactory) -> None:
    live = make_server(body_timeout_s=0.5, keep_alive_s=1)
    with _connect(live) as sock:  # declares 100 bytes, sends 7, then nothing
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b'Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"a": 1'
        )
        reply = _read_all(sock)  # the server answers and closes
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert b"request_timeout" in reply
    with _connect(live) as sock:  # a kept-alive connection left idle is closed
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        reply = _read_all(sock)
    assert reply.startswith(b"HTTP/1.1 200") and reply.endswith(b'{"status":"ok"}')


def test_not_found_names_the_list_route_and_file_names_are_safe(
    live: LiveServer, client: httpx.Client
) -> None:
    error = assert_error(client.get("/v1/batches/batch_x"), 404, "batch_not_found")
    assert "GET /v1/batches." in error["message"]
    boundary = "b0undary"
    form = (  # raw multipart: clients would escape this name, an attacker need not
        f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; '
        f'filename="../../etc/evil\tname\x7f.jsonl"\r\n\r\n{request_line("a", "x")}\n\r\n'
        f"--{boundary}--\r\n"
    ).encode()
    headers = {"content-type": f"multipart/form-data; boundary={boundary}"}
    uploaded = client.post("/v1/files", content=form, headers=headers).json()
    assert uploaded["filename"] == "evil_name_.jsonl"
    response = client.get(f"/v1/files/{uploaded['id']}/content")
    assert response.headers["content-disposition"] == 'attachment; filename="evil_name_.jsonl"'


def test_openapi_schema_describes_the_real_api(live: LiveServer, client: httpx.Client) -> None:
    schema = client.get("/openapi.json").json()
    operations = {
        (method, path): spec
        for path, methods in schema["paths"].items()
        for method, spec in methods.items()
    }
    assert set(operations) == {
        ("post", "/v1/completions"),
        ("post", "/v1/chat/completions"),
        ("post", "/v1/responses"),
        ("post", "/v1/embeddings"),
        ("post", "/v1/score"),
        ("post", "/score"),
        ("post", "/v1/rerank"),
        ("post", "/rerank"),
        ("post", "/v2/rerank"),
        ("get", "/v1/models"),
        ("get", "/v1/models/{model_id}"),
        ("post", "/v1/files"),
        ("get", "/v1/files"),
        ("get", "/v1/files/{file_id}"),
        ("delete", "/v1/files/{file_id}"),
        ("get", "/v1/files/{file_id}/content"),
        ("post", "/v1/batches"),
        ("get", "/v1/batches"),
        ("get", "/v1/batches/{batch_id}"),
        ("post", "/v1/batches/{batch_id}/cancel"),
        ("post", "/tokenize"),
        ("post", "/detokenize"),
        ("get", "/tokenizer_info"),
        ("get", "/health"),
        ("get", "/ready"),
        ("get", "/metrics"),
    }
    for (method, path), spec in operations.items():
        assert "422" not in spec["responses"], (method, path)
        assert {"400", "413"} <= set(spec["responses"]), (method, path)
        if method == "post" and "cancel" not in path:
            assert spec["requestBody"]["required"], path
    completions = operations[("post", "/v1/completions")]
    body_ref = completions["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    assert body_ref.endswith("/CompletionRequest")
    assert {"404", "415", "429", "503"} <= set(completions["responses"])
    assert "text/event-stream" in completions["responses"]["200"]["content"]
    assert "507" in operations[("post", "/v1/files")]["responses"]
    assert list(operations[("get", "/metrics")]["responses"]["200"]["content"]) == ["text/plain"]
    assert schema["components"]["schemas"]["CompletionRequest"]["additionalProperties"] is False


def test_batch_lines_that_cannot_be_decoded_do_not_stall_validation(live: LiveServer) -> None:
    client = live.openai()
    lines = [
        request_line("ok", "x"),
        '{"custom_id": "deep", "body": ' + "[" * 100_000 + "]" * 100_000 + "}",
        '{"custom_id": "big", "body": {"n": ' + "9" * 5000 + "}}",
    ]
    batch = client.batches.create(
        input_file_id=upload(client, lines), endpoint=URL, completion_window="24h"
    )
    batch = wait_batch(client, batch.id)
    assert batch.status == "completed" and batch.request_counts is not None
    assert (batch.request_counts.completed, batch.request_counts.failed) == (1, 2)


@pytest.mark.parametrize(
    "change", [{"top_p": 6.920603198957656e-112}, {"temperature": 2.2250738585072014e-308}]
)
def test_tiny_top_p_or_temperature_samples_the_top_token(
    client: httpx.Client, change: dict[str, float]
) -> None:
    """Found by the fuzz test: top_p = 7e-112 is 0 in float32, and logits / 2e-308 overflow;
    either made every probability NaN, the engine step failed and the engine restarted
    (503 for every request in flight)."""
    tiny = client.post("/v1/completions", json={**GOOD, **change, "max_tokens": 3, "seed": 1})
    assert tiny.status_code == 200, tiny.text
    greedy = client.post("/v1/completions", json={**GOOD, "max_tokens": 3, "temperature": 0})
    assert tiny.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]
