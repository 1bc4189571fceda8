"""The batch invariant under faults, on a real uvicorn server and the real engine: a batch
reaches a final state only with every input line in its output or error file exactly once.

Faults: lines the server fails on (an exception in the engine client or the tokenizer),
lines that are not acceptable JSON (deep nesting, a 5,000-digit integer, a lone surrogate),
an input file gone from disk, and a full data directory (a small tmpfs filled to the last
byte): the batch pauses, says why in its `errors`, and resumes once space is freed. kill -9
and an engine process death are in test_durability.py, with the same check.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from server.batch.files import FileStorage
from server.batch.store import Store
from server.http.settings import ServerSettings
from tests.server.batch_files import (
    URL,
    assert_accounted,
    greedy_lines,
    read_lines,
    request_line,
    upload,
    wait_batch,
    wait_completed,
)
from tests.server.faults import (
    FAIL_IN_ENGINE,
    FAIL_IN_TOKENIZER,
    HOLD,
    Disk,
    FaultyEngine,
    like_demo,
    small_disk,  # noqa: F401 (a fixture)
)
from tests.server.live import MODEL, Reference, ServerFactory, start_server, wait_for
from tests.server.test_errors import assert_error

NANOFLEX = Path(sys.executable).parent / "nanoflex"


def _raw_line(custom_id: str, body_json: str) -> str:
    return f'{{"custom_id": "{custom_id}", "method": "POST", "url": "{URL}", "body": {body_json}}}'


def test_every_line_accounted_when_lines_fail(
    make_server: ServerFactory, reference: Reference
) -> None:
    live = make_server(engine=like_demo(FaultyEngine))
    client = live.openai()
    surrogate = json.dumps({"model": MODEL, "prompt": "\ud800", "max_tokens": 2})
    lines = [
        request_line("good", "one"),
        request_line("engine", f"a {FAIL_IN_ENGINE}"),
        request_line("tokenizer", f"a {FAIL_IN_TOKENIZER}"),
        _raw_line("surrogate", surrogate),
        _raw_line("deep", "[" * 100_000 + "]" * 100_000),
        _raw_line("digits", '{"n": ' + "9" * 5000 + "}"),
        request_line("good2", "two"),
    ]
    batch = client.batches.create(
        input_file_id=upload(client, lines), endpoint=URL, completion_window="24h"
    )
    batch = wait_batch(client, batch.id)
    assert batch.status == "completed", batch
    assert_accounted(client, batch, lines)
    output = {line["custom_id"]: line for line in read_lines(client, batch.output_file_id)}
    for custom_id, prompt in (("good", "one"), ("good2", "two")):
        text = output[custom_id]["response"]["body"]["choices"][0]["text"]
        assert text == reference.greedy(prompt, 3).text
    errors = read_lines(client, batch.error_file_id)
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [
        ("engine", "server_error"),
        ("tokenizer", "server_error"),
        (None, "invalid_json_line"),
        (None, "invalid_json_line"),
        (None, "invalid_json_line"),
    ]
    assert "surrogate" in errors[2]["error"]["message"]


def test_input_file_gone_fails_the_batch(make_server: ServerFactory) -> None:
    live = make_server()
    client = live.openai()
    file_id = upload(client, [request_line("a", "x")])
    live.state.storage.path_for(file_id).unlink()
    batch = client.batches.create(input_file_id=file_id, endpoint=URL, completion_window="24h")
    batch = wait_batch(client, batch.id)
    assert batch.status == "failed" and batch.errors is not None and batch.errors.data
    assert batch.errors.data[0].code == "file_not_found"
    with live.http() as http:
        assert_error(http.get(f"/v1/files/{file_id}/content"), 404, "file_content_missing")


def _pause_code(batch: Any) -> str | None:
    data = batch.errors.data if batch.errors is not None and batch.errors.data else []
    return next((e.code for e in data if e.code == "storage_unavailable"), None)


def test_full_disk_pauses_the_batch_and_resumes(
    small_disk: Disk,  # noqa: F811 (set up first, so it is torn down after the server)
    make_server: ServerFactory,
    reference: Reference,
) -> None:
    live = make_server(storage_retry_s=0.1, batch_concurrency=2)
    small_disk.attach(live.state)
    client = live.openai()
    n, max_tokens = 12, 30
    prompts = [f"Item {i} of the list:" for i in range(n)]
    lines = greedy_lines(prompts, max_tokens)
    batch = client.batches.create(
        input_file_id=upload(client, lines), endpoint=URL, completion_window="24h"
    )
    wait_completed(client, batch.id, 1)
    small_disk.fill()
    num_files = len(client.files.list().data)
    with live.http() as http:  # an upload on a full disk: 507, nothing half-written
        files = {"file": ("in.jsonl", b'{"a": 1}\n' * 20_000)}
        response = http.post("/v1/files", files=files, data={"purpose": "batch"})
        assert_error(response, 507, "insufficient_storage")
    assert len(client.files.list().data) == num_files
    assert not list(live.state.storage.files_dir.glob(".tmp-*"))
    wait_for(lambda: _pause_code(client.batches.retrieve(batch.id)) is not None, 60)
    paused = client.batches.retrieve(batch.id)
    assert paused.status in ("in_progress", "finalizing"), paused
    assert paused.errors is not None and "resumes by itself" in paused.errors.data[-1].message  # type: ignore[index]
    small_disk.free()
    batch = wait_batch(client, batch.id, timeout_s=120)
    assert batch.status == "completed" and batch.errors is None, batch
    assert_accounted(client, batch, lines)
    output = read_lines(client, batch.output_file_id)
    expected = reference.greedy_many(prompts, max_tokens, ignore_eos=True)
    assert [line["response"]["body"]["choices"][0]["text"] for line in output] == [
        e.text for e in expected
    ]


# -- a data directory that cannot be served: one error line, before the model loads ---------


def _serve(data_dir: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "NANOFLEX_ENGINE_CLIENT"}
    argv = [str(NANOFLEX), "serve", "--model", MODEL, "--device", "cpu"]
    argv += ["--data-dir", str(data_dir), "--port", "9"]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)


def _assert_refused(result: subprocess.CompletedProcess[str], words: str) -> None:
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("nanoflex serve: error: "), result.stderr
    assert words in errors[0] and "Traceback" not in result.stderr


def _data_dir_with_a_file(data_dir: Path) -> None:
    store, storage = Store(data_dir / "nanoflex.db"), FileStorage(data_dir / "files")
    storage.write_lines("file-1", ['{"a": 1}'])
    store.insert_file(
        {
            "id": "file-1",
            "bytes": 9,
            "filename": "in.jsonl",
            "purpose": "batch",
            "created_at": 1,
            "status": "processed",
            "path": "file-1",
        }
    )
    store.close()


def test_an_engine_pause_ends_when_the_engine_is_ready(tmp_path: Path) -> None:
    """A batch whose lines met an engine still loading (or restarting) says so in its `errors`
    until the engine is ready, not until its first line finishes (20 s later, seen after a
    restart)."""
    engine = like_demo(FaultyEngine)
    engine.may_start.clear()  # the model loads until the test says
    live = start_server(ServerSettings(data_dir=tmp_path / "data"), engine, wait_ready=False)
    try:
        client = live.openai()
        file_id = upload(client, [request_line("held", f"{HOLD} a line that runs long")])
        batch = client.batches.create(input_file_id=file_id, endpoint=URL, completion_window="24h")

        def paused_for_the_engine() -> bool:
            errors = client.batches.retrieve(batch.id).errors
            return errors is not None and any(
                e.code == "engine_unavailable" for e in errors.data or []
            )

        wait_for(paused_for_the_engine)
        engine.may_start.set()
        wait_for(engine.is_ready, timeout_s=300)
        wait_for(engine.held.is_set)  # its line runs now (held before its first token)
        assert not paused_for_the_engine()
        engine.release.set()
        done = wait_batch(client, batch.id)
        assert done.status == "completed" and done.request_counts.completed == 1
    finally:
        engine.may_start.set()
        engine.release.set()
        live.stop()


def test_truncated_database_refuses_to_start(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    _data_dir_with_a_file(data_dir)
    os.truncate(data_dir / "nanoflex.db", 0)
    _assert_refused(_serve(data_dir), "has no record of the 1 files")
    assert (data_dir / "files" / "file-1").exists()  # nothing was touched


def test_corrupt_database_is_one_error_line(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    (data_dir / "nanoflex.db").write_bytes(b"this is not a database\n" * 500)
    _assert_refused(_serve(data_dir), "restore it from a backup")


def test_read_only_data_dir_is_one_error_line(small_disk: Disk) -> None:  # noqa: F811
    if not small_disk.mounted:
        pytest.skip("needs a tmpfs mount (root) to make a read-only file system")
    _data_dir_with_a_file(small_disk.data_dir)
    remount = ["mount", "-o", "remount,ro", str(small_disk.data_dir)]
    subprocess.run(remount, check=True)
    _assert_refused(_serve(small_disk.data_dir), "writable")
