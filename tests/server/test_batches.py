"""Files and Batch APIs through the official `openai` client against a live server (toy engine).

LEAD: switch the generation-dependent ones to the real demo model once it is wired.
"""

from __future__ import annotations

import io
import json
import time
from typing import Any, Literal

import httpx
import openai
import pytest
from conftest import LiveServer, ServerFactory, wait_for
from toy_engine import ToyEngineClient

URL: Literal["/v1/completions"] = "/v1/completions"


def request_line(custom_id: str, prompt: str, max_tokens: int = 3, **extra: Any) -> str:
    body = {"model": "toy-model", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    body.update(extra)
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": URL, "body": body})


def upload(client: openai.OpenAI, lines: list[str]) -> str:
    data = ("\n".join(lines) + "\n").encode()
    return client.files.create(file=("input.jsonl", io.BytesIO(data)), purpose="batch").id


def wait_batch(client: openai.OpenAI, batch_id: str, timeout_s: float = 30) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "cancelled", "expired"):
            return batch
        assert time.monotonic() < deadline, f"batch stuck in {batch.status}"
        time.sleep(0.05)


def read_lines(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def test_files_api(live: LiveServer) -> None:
    client = live.openai()
    first = upload(client, [request_line("a", "x")])
    second = upload(client, [request_line("b", "y")])
    info = client.files.retrieve(first)
    assert (info.purpose, info.filename, info.object) == ("batch", "input.jsonl", "file")
    assert client.files.content(first).text == request_line("a", "x") + "\n"
    listed = client.files.list()
    assert [f.id for f in listed.data][:2] == [second, first]
    assert client.files.delete(first).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(first)
    assert [f.id for f in client.files.list(purpose="batch").data] == [second]


def test_upload_validation(client: httpx.Client) -> None:
    files = {"file": ("in.jsonl", b"{}\n")}
    response = client.post("/v1/files", files=files, data={"purpose": "fine-tune"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "purpose"
    response = client.post("/v1/files", files={"file": ("e.jsonl", b"")}, data={"purpose": "batch"})
    assert response.status_code == 400 and response.json()["error"]["code"] == "empty_file"
    response = client.post("/v1/files", data={"purpose": "batch"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "file"


def test_batch_flow_with_bad_lines(live: LiveServer) -> None:
    client = live.openai()
    lines = [
        request_line("r1", "one"),
        "{not json",
        request_line("r2", "two", max_tokens=2),
        request_line("r1", "dup"),
        json.dumps({"custom_id": "w", "method": "POST", "url": "/v1/embeddings", "body": {}}),
        json.dumps({"method": "POST", "url": URL, "body": {}}),
        request_line("r3", "three", max_tokens=0),
        request_line("r4", "four"),
    ]
    file_id = upload(client, lines)
    batch = client.batches.create(
        input_file_id=file_id,
        endpoint=URL,
        completion_window="24h",
        metadata={"job": "test"},
    )
    assert batch.status == "validating" and batch.metadata == {"job": "test"}
    batch = wait_batch(client, batch.id)
    assert batch.status == "completed", batch
    assert batch.request_counts is not None
    assert batch.request_counts.total == 8
    assert (batch.request_counts.completed, batch.request_counts.failed) == (3, 5)
    assert batch.completed_at and batch.in_progress_at and batch.finalizing_at
    output = read_lines(client, batch.output_file_id)
    assert [line["custom_id"] for line in output] == ["r1", "r2", "r4"]
    for line in output:
        assert line["error"] is None and line["response"]["status_code"] == 200
        assert line["id"].startswith("batch_req_")
    assert output[1]["response"]["body"]["choices"][0]["text"] == "ef"
    assert output[1]["response"]["body"]["usage"]["completion_tokens"] == 2
    errors = read_lines(client, batch.error_file_id)
    codes = [(e["custom_id"], (e["error"] or {}).get("code")) for e in errors]
    assert codes == [
        (None, "invalid_json_line"),
        ("r1", "duplicate_custom_id"),
        ("w", "invalid_url"),
        (None, "missing_custom_id"),
        ("r3", None),
    ]
    refused = errors[-1]["response"]
    assert refused["status_code"] == 400 and refused["body"]["error"]["param"] == "max_tokens"
    assert client.files.retrieve(batch.output_file_id).purpose == "batch_output"


def test_batch_create_validation(live: LiveServer, client: httpx.Client) -> None:
    file_id = upload(live.openai(), [request_line("a", "x")])
    base = {"input_file_id": file_id, "endpoint": URL, "completion_window": "24h"}
    for change in (
        {"endpoint": "/v1/embeddings"},
        {"completion_window": "1h"},
        {"metadata": {"k": 5}},
        {"input_file_id": 7},
    ):
        response = client.post("/v1/batches", json={**base, **change})
        assert response.status_code == 400, change


def test_batch_without_valid_lines_fails(live: LiveServer) -> None:
    client = live.openai()
    file_id = upload(client, ["nope", json.dumps({"custom_id": "x"})])
    batch = client.batches.create(input_file_id=file_id, endpoint=URL, completion_window="24h")
    batch = wait_batch(client, batch.id)
    assert batch.status == "failed" and batch.failed_at
    assert batch.errors is not None and batch.errors.data is not None
    assert [e.line for e in batch.errors.data] == [1, 2]


def test_list_batches_paginates(live: LiveServer) -> None:
    client = live.openai()
    file_id = upload(client, [request_line("a", "x")])
    ids = [
        client.batches.create(input_file_id=file_id, endpoint=URL, completion_window="24h").id
        for _ in range(3)
    ]
    page = client.batches.list(limit=2)
    assert [b.id for b in page.data] == [ids[2], ids[1]] and page.has_more
    page = client.batches.list(limit=2, after=ids[1])
    assert [b.id for b in page.data] == [ids[0]] and not page.has_more
    for batch_id in ids:
        wait_batch(client, batch_id)


def test_cancel_keeps_partial_output(make_server: ServerFactory) -> None:
    live = make_server(ToyEngineClient(step_s=0.02, max_running=2), batch_concurrency=2)
    client = live.openai()
    lines = [request_line(f"c{i}", f"p{i}", max_tokens=10) for i in range(10)]
    batch = client.batches.create(
        input_file_id=upload(client, lines), endpoint=URL, completion_window="24h"
    )
    wait_for(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 2)
    cancelled = client.batches.cancel(batch.id)
    assert cancelled.status in ("cancelling", "cancelled") and cancelled.cancelling_at
    batch = wait_batch(client, batch.id)
    assert batch.status == "cancelled" and batch.cancelled_at
    output = read_lines(client, batch.output_file_id)
    errors = read_lines(client, batch.error_file_id)
    assert 2 <= len(output) < 10
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}
    seen = sorted(line["custom_id"] for line in output + errors)
    assert seen == sorted(f"c{i}" for i in range(10))
    with pytest.raises(openai.BadRequestError):
        client.batches.cancel(wait_batch(client, _finished_batch(client)).id)


def _finished_batch(client: openai.OpenAI) -> str:
    file_id = upload(client, [request_line("z", "z", max_tokens=1)])
    batch = client.batches.create(input_file_id=file_id, endpoint=URL, completion_window="24h")
    return wait_batch(client, batch.id).id


def test_online_requests_run_before_batch_work(make_server: ServerFactory) -> None:
    engine = ToyEngineClient(step_s=0.02, max_running=1)
    live = make_server(engine, batch_concurrency=4)
    client = live.openai()
    lines = [request_line(f"b{i}", "x", max_tokens=3) for i in range(8)]
    client.batches.create(
        input_file_id=upload(client, lines), endpoint=URL, completion_window="24h"
    )
    wait_for(lambda: len(engine.started) >= 1 and len(engine._waiting) >= 2)
    client.completions.create(model="toy-model", prompt="now", max_tokens=1)
    online = next(s for s in engine.started if s[1] == 0)

    def overtaken() -> bool:
        later = engine.started[engine.started.index(online) + 1 :]
        return any(s[2] < online[2] for s in later)

    wait_for(overtaken)  # batch requests queued before it started after it


def test_batch_survives_engine_restart(make_server: ServerFactory) -> None:
    engine = ToyEngineClient(step_s=0.01, max_running=2)
    live = make_server(engine, batch_concurrency=2)
    client = live.openai()
    lines = [request_line(f"k{i}", f"q{i}", max_tokens=5) for i in range(8)]
    batch = client.batches.create(
        input_file_id=upload(client, lines), endpoint=URL, completion_window="24h"
    )
    wait_for(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 1)
    engine.kill()
    time.sleep(0.3)
    engine.revive()
    batch = wait_batch(client, batch.id)
    assert batch.status == "completed"
    output = read_lines(client, batch.output_file_id)
    assert [line["custom_id"] for line in output] == [f"k{i}" for i in range(8)]
