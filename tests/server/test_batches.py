"""Files and Batch APIs through the official `openai` client against a live server on the real
engine (demo model); greedy batch outputs equal the offline `engine.LLM`."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.server.batch_files import URL, read_lines, request_line, upload, wait_batch
from tests.server.faults import HOLD, FaultyEngine, like_demo
from tests.server.live import MODEL, LiveServer, Reference, ServerFactory, engine_is_idle, wait_for
from tests.server.test_errors import assert_error


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


def test_batch_flow_with_bad_lines(live: LiveServer, reference: Reference) -> None:
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
    expected = {
        "r1": reference.greedy("one", 3),
        "r2": reference.greedy("two", 2),
        "r4": reference.greedy("four", 3),
    }
    for line in output:
        body = line["response"]["body"]
        want = expected[line["custom_id"]]
        assert body["object"] == "text_completion" and body["model"] == MODEL
        assert body["choices"][0]["text"] == want.text
        assert body["choices"][0]["finish_reason"] == want.finish_reason
        assert body["usage"]["completion_tokens"] == len(want.token_ids)
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
        {"endpoint": "/v1/moderations"},
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


def slow_line(custom_id: str, max_tokens: int) -> str:
    """A greedy request that runs exactly `max_tokens` steps (EOS ignored)."""
    return request_line(custom_id, "slow", max_tokens=max_tokens, ignore_eos=True)


def test_cancel_keeps_partial_output(make_server: ServerFactory) -> None:
    live = make_server(batch_concurrency=2)
    client = live.openai()
    n = 12
    lines = [slow_line(f"c{i}", 100) for i in range(n)]
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
    assert 2 <= len(output) < n
    for line in output:
        assert line["response"]["body"]["usage"]["completion_tokens"] == 100
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}
    seen = sorted(line["custom_id"] for line in output + errors)
    assert seen == sorted(f"c{i}" for i in range(n))
    assert batch.request_counts is not None
    counts = batch.request_counts
    assert (counts.completed, counts.failed) == (len(output), len(errors))
    wait_for(lambda: engine_is_idle(live.engine))  # the cancelled requests left the engine
    with pytest.raises(openai.BadRequestError):
        client.batches.cancel(wait_batch(client, _finished_batch(client)).id)


def _finished_batch(client: openai.OpenAI) -> str:
    file_id = upload(client, [request_line("z", "z", max_tokens=1)])
    batch = client.batches.create(input_file_id=file_id, endpoint=URL, completion_window="24h")
    return wait_batch(client, batch.id).id


def test_online_requests_run_before_batch_work(make_server: ServerFactory) -> None:
    """The engine runs 8 sequences at once (Policy() block size); 24 batch requests of equal
    length run in three waves. An online request sent during the first wave jumps the 16
    waiting batch requests: it is answered before the second wave is done."""
    live = make_server(batch_concurrency=64)
    client = live.openai()
    lines = [slow_line(f"b{i}", 40) for i in range(24)]
    batch = client.batches.create(
        input_file_id=upload(client, lines), endpoint=URL, completion_window="24h"
    )
    with live.http() as http:
        wait_for(lambda: "nanoflex_requests_waiting 16.0" in http.get("/metrics").text)
    result = client.completions.create(model=MODEL, prompt="now", max_tokens=1)
    assert result.choices[0].finish_reason in ("length", "stop")
    counts = client.batches.retrieve(batch.id).request_counts
    assert counts is not None and counts.completed < 16, counts
    assert wait_batch(client, batch.id).status == "completed"


def test_batches_at_once_and_stored_bytes_are_bounded(make_server: ServerFactory) -> None:
    """Past `--max-batches` unfinished batches a new one is 429, past `--max-stored-bytes` an
    upload is 507 with nothing stored; both in OpenAI's envelope, and both lift once work is
    done or files deleted."""
    engine = like_demo(FaultyEngine)
    live = make_server(engine, max_batches=1, max_stored_bytes=8192)
    client = live.openai()
    held = upload(client, [request_line("held", f"{HOLD} runs until released")])
    with live.http() as http:
        too_big = {"file": ("big.jsonl", b"x" * 9000), "purpose": (None, "batch")}
        assert_error(http.post("/v1/files", files=too_big), 507, "insufficient_storage")
        assert [f.id for f in client.files.list().data] == [held]  # nothing stored
        first = client.batches.create(input_file_id=held, endpoint=URL, completion_window="24h")
        assert engine.held.wait(60)
        body = {"input_file_id": held, "endpoint": URL, "completion_window": "24h"}
        assert_error(http.post("/v1/batches", json=body), 429, "too_many_batches")
        engine.release.set()
        assert wait_batch(client, first.id).status == "completed"
        assert http.post("/v1/batches", json=body).status_code == 200
