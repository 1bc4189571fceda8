"""Durability on the real engine: atomic result commits, resume after a graceful restart,
kill -9 of a `nanoflex serve` daemon mid-batch, kill -9 of its engine process, SIGTERM."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil

from engine.core.engine_args import ENGINE_NICE
from server.batch.store import Store
from tests.engine.runtime.threads import thread_nice
from tests.server.batch_files import (
    URL,
    assert_accounted,
    read_lines,
    request_line,
    upload,
    wait_batch,
)
from tests.server.daemon import Daemon
from tests.server.daemon import daemons as daemons  # a fixture
from tests.server.live import MODEL, Reference, ServerFactory, free_port, wait_for


def _batch_record(batch_id: str) -> dict[str, Any]:
    return {
        "id": batch_id,
        "endpoint": URL,
        "input_file_id": "file-x",
        "completion_window": "24h",
        "status": "in_progress",
        "created_at": 1,
        "expires_at": 2,
        "metadata": None,
    }


def test_result_commit_is_atomic_and_once(tmp_path: Path) -> None:
    store = Store(tmp_path / "db.sqlite")
    store.insert_batch(_batch_record("batch_1"))
    rows: list[tuple[int, str | None, str | None, str, str | None]] = [
        (0, "a", "{}", "pending", None),
        (1, "b", "{}", "pending", None),
    ]
    store.clear_requests("batch_1")
    store.add_requests("batch_1", rows)
    assert store.commit_result("batch_1", 0, True, '{"line": 0}')
    assert not store.commit_result("batch_1", 0, True, '{"line": "again"}')
    store.close()
    reopened = Store(tmp_path / "db.sqlite")
    batch = reopened.get_batch("batch_1")
    assert batch is not None and batch.request_counts.model_dump() == {
        "total": 2,
        "completed": 1,
        "failed": 0,
    }
    assert list(reopened.results("batch_1", "done")) == ['{"line": 0}']
    assert [r[1] for r in reopened.pending_requests("batch_1")] == ["b"]
    assert reopened.unfinished_batch_ids() == ["batch_1"]


def _prompt(i: int) -> str:
    return f"Item {i} of the list:"


def _lines(n: int, max_tokens: int) -> list[str]:
    """Greedy requests of exactly `max_tokens` tokens (EOS ignored, so timing is predictable)."""
    return [
        request_line(f"c{i}", _prompt(i), max_tokens=max_tokens, ignore_eos=True) for i in range(n)
    ]


def _check_output(
    client: openai.OpenAI, batch_id: str, reference: Reference, n: int, max_tokens: int
) -> None:
    """Completed with every line accounted for (the batch invariant), one line per custom_id
    in input order, each equal to the uninterrupted offline greedy run (`engine.LLM`)."""
    batch = wait_batch(client, batch_id, timeout_s=120)
    assert batch.status == "completed", batch
    assert_accounted(client, batch, _lines(n, max_tokens))
    assert batch.error_file_id is None
    output = read_lines(client, batch.output_file_id)
    assert [line["custom_id"] for line in output] == [f"c{i}" for i in range(n)]
    expected = reference.greedy_many([_prompt(i) for i in range(n)], max_tokens, ignore_eos=True)
    for line, want in zip(output, expected, strict=True):
        body = line["response"]["body"]
        assert line["response"]["status_code"] == 200 and body["model"] == MODEL
        assert body["choices"][0]["text"] == want.text, line["custom_id"]
        assert body["choices"][0]["finish_reason"] == want.finish_reason == "length"
        assert body["usage"]["completion_tokens"] == max_tokens


def test_graceful_restart_resumes(make_server: ServerFactory, reference: Reference) -> None:
    n, max_tokens = 12, 40
    first = make_server(batch_concurrency=2)
    client = first.openai()
    batch = client.batches.create(
        input_file_id=upload(client, _lines(n, max_tokens)), endpoint=URL, completion_window="24h"
    )
    wait_for(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 3)
    first.stop()
    store = Store(first.state.settings.db_path)
    assert store.pending_requests(batch.id), "the stop should land mid-batch"
    store.close()
    second = make_server()
    _check_output(second.openai(), batch.id, reference, n, max_tokens)


# -- a real `nanoflex serve` process ---------------------------------------------------------


def test_kill_9_mid_batch_then_resume_then_sigterm(
    tmp_path: Path, daemons: list[Daemon], reference: Reference
) -> None:
    # 24 lines run as three blocks of 8 (`Policy()`): the kill after the first lands mid-batch
    n, max_tokens, port = 24, 32, free_port()
    data_dir, log = tmp_path / "data", tmp_path / "daemon.log"
    daemons.append(Daemon(data_dir, port, log))
    client = daemons[0].openai()
    batch = client.batches.create(
        input_file_id=upload(client, _lines(n, max_tokens)), endpoint=URL, completion_window="24h"
    )
    wait_for(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 1, 60)  # type: ignore[union-attr]
    daemons[0].process.send_signal(signal.SIGKILL)
    daemons[0].process.wait(timeout=30)
    store = Store(data_dir / "nanoflex.db")
    assert store.pending_requests(batch.id), "the kill should land mid-batch"
    store.close()
    daemons.append(Daemon(data_dir, port, log))
    _check_output(client, batch.id, reference, n, max_tokens)
    # SIGTERM: graceful shutdown (uvicorn re-raises it afterwards, so the exit reads as -15)
    daemons[1].process.send_signal(signal.SIGTERM)
    assert daemons[1].process.wait(timeout=60) in (0, -signal.SIGTERM)
    text = log.read_text()
    assert "Application shutdown complete" in text and "nanoflex stopped" in text


def test_engine_process_death_restarts_and_batch_completes(
    tmp_path: Path, daemons: list[Daemon], reference: Reference
) -> None:
    n, max_tokens = 24, 32
    daemon = Daemon(tmp_path / "data", free_port(), tmp_path / "daemon.log")
    daemons.append(daemon)
    client = daemon.openai()
    batch = client.batches.create(
        input_file_id=upload(client, _lines(n, max_tokens)), endpoint=URL, completion_window="24h"
    )
    wait_for(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 1, 60)  # type: ignore[union-attr]
    online: list[httpx.Response] = []
    body = {"model": MODEL, "prompt": "long", "max_tokens": 1500, "ignore_eos": True}
    url = f"{daemon.url}/v1/completions"
    sender = threading.Thread(target=lambda: online.append(httpx.post(url, json=body, timeout=120)))
    sender.start()
    engine = daemon.engine_process()
    # a CPU engine yields the cores to the daemon's threads (EngineArgs.engine_nice)
    assert set(thread_nice(engine.pid).values()) == {ENGINE_NICE}
    assert set(thread_nice(daemon.process.pid).values()) == {0}
    time.sleep(0.3)  # the online request is in the engine by now (1500 steps take seconds)
    engine.send_signal(signal.SIGKILL)
    wait_for(lambda: not daemon.is_ready(), 10)  # not ready while the engine restarts
    sender.join(timeout=60)
    assert online[0].status_code == 503, online[0].text  # in flight when it died: retry later
    assert online[0].json()["error"]["code"] == "engine_unavailable"
    daemon.wait_ready(120)
    assert daemon.engine_process().pid != engine.pid
    _check_output(client, batch.id, reference, n, max_tokens)
    assert client.completions.create(model=MODEL, prompt="again", max_tokens=2).usage


def test_large_bodies_are_refused_and_memory_returned(
    tmp_path: Path, daemons: list[Daemon]
) -> None:
    """Four concurrent 15 MiB prompts (text, then token ids) on a real `nanoflex serve`: each
    is a 400 that names the limit, /health keeps answering, and the daemon's resident memory
    ends within 20 MB of where it stood before them, once it settles (it grew by 2 GB before
    the limits, and by 25-80 MB while worker threads had heap arenas of their own)."""
    daemon = Daemon(tmp_path / "data", free_port(), tmp_path / "daemon.log")
    daemons.append(daemon)
    rss = psutil.Process(daemon.process.pid).memory_info
    # The baseline is a daemon that has served: one answer and one small refusal first, so
    # that what it loads on first use (the tokenizer, lazy imports) is not counted as kept.
    small = {"model": MODEL, "prompt": "warm up", "max_tokens": 2}
    assert httpx.post(f"{daemon.url}/v1/completions", json=small, timeout=120).status_code == 200
    refused = {**small, "prompt": [5] * 100_000}
    assert httpx.post(f"{daemon.url}/v1/completions", json=refused, timeout=120).status_code == 400
    start = rss().rss
    bodies = [
        {"model": MODEL, "prompt": "lorem ipsum " * (15 * 2**20 // 12), "max_tokens": 2},
        {"model": MODEL, "prompt": [5] * (15 * 2**20 // 3), "max_tokens": 2},
    ]
    for body in bodies:
        results: list[httpx.Response] = []

        def send(body: dict[str, Any] = body, results: list[httpx.Response] = results) -> None:
            results.append(httpx.post(f"{daemon.url}/v1/completions", json=body, timeout=120))

        senders = [threading.Thread(target=send) for _ in range(4)]
        for sender in senders:
            sender.start()
        while any(sender.is_alive() for sender in senders):
            assert httpx.get(f"{daemon.url}/health", timeout=30).status_code == 200
        assert [r.status_code for r in results] == [400] * 4
        assert all(r.json()["error"]["code"] == "context_length_exceeded" for r in results)
    # Memory is freed (and the heap trimmed) after each response has gone out, so the size
    # read right after the last answer can still hold a request's parse: let it settle.
    deadline = time.monotonic() + 10
    while rss().rss - start >= 20 * 2**20 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert rss().rss - start < 20 * 2**20, (start >> 20, rss().rss >> 20)
