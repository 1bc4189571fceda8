"""A batch over one huge input line: validated and read back at about twice its size (real
store and files, in this process), and on a real `nanoflex serve` process bounded memory, a
responsive event loop, and the line answered with its own error (slow)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import psutil
import pytest

from bench.daemon.batch_line_memory import CHAT, answers, input_file, reset_hwm, vm_hwm
from server.batch.files import FileStorage
from server.batch.runner import BatchConfig, BatchRunner
from server.batch.store import Store
from server.openai.memory import keep_heaps_trimmed, return_freed_memory
from tests.server.daemon import Daemon
from tests.server.daemon import daemons as daemons  # a fixture
from tests.server.live import free_port

LINE_MIB = 24
ROOT = Path(__file__).resolve().parents[2]


def test_validating_and_reading_back_a_huge_line_hold_it_about_twice(tmp_path: Path) -> None:
    """The daemon's validation of a file whose first line is 16 MiB, then the read of that line
    to answer it, each grow a fresh process's peak resident memory by less than 2.2x the line
    (its text and its parse; before, 5x: the line, its parse, its decoded copy and SQLite's
    two copies of it, all at once), and leave the store holding it as read. A process of its
    own: in the suite's, other tests' heaps and threads move the peak by a fraction of it."""
    code = f"from {__name__} import growths; print(growths({str(tmp_path)!r}))"
    run = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    validate, read_back = json.loads(run.stdout.strip().splitlines()[-1])
    assert validate < 2.2 and read_back < 2.2, (validate, read_back)


def validating_batch(store: Store, storage: FileStorage) -> BatchRunner:
    """Batch "batch_1" over the file "file-in" (written already), validating, and a runner of
    the two without an engine (validation and read-back need none)."""
    store.insert_file(
        {"id": "file-in", "bytes": 0, "filename": "in.jsonl", "purpose": "batch",
         "created_at": 1, "status": "processed", "path": "file-in"}
    )  # fmt: skip
    store.insert_batch(
        {"id": "batch_1", "endpoint": CHAT, "input_file_id": "file-in", "completion_window": "24h",
         "status": "validating", "created_at": 1, "expires_at": 2**40, "metadata": None}
    )  # fmt: skip
    runner = BatchRunner(store, storage, None, BatchConfig())  # type: ignore[arg-type]  # unused
    return runner


def growths(folder: str) -> str:
    """(validation, read back) peak growth of this process over the line's size, as JSON."""
    tmp_path = Path(folder)
    keep_heaps_trimmed()  # as the daemon does
    store, storage = Store(tmp_path / "db.sqlite"), FileStorage(tmp_path / "files")
    line_bytes = input_file(storage.path_for("file-in"), 16)
    runner = validating_batch(store, storage)

    def peak_growth(step: Callable[[], object]) -> float:
        return_freed_memory()
        before = psutil.Process().memory_info().rss
        reset_hwm(os.getpid())
        step()
        return (vm_hwm(os.getpid()) - before) / line_bytes

    validate = peak_growth(lambda: runner._validate("batch_1"))
    assert store.pending_requests("batch_1") == [(0, "big"), (1, "small")]
    read: list[object] = []
    read_back = peak_growth(lambda: read.append(runner._read_sized_line("batch_1", 0, "big")))
    [(line, num_bytes)] = read  # type: ignore[misc]
    assert num_bytes == line_bytes
    assert len(line.body["messages"][0]["content"]) > 16 * 2**20 - 100
    return json.dumps([validate, read_back])


@pytest.mark.slow
def test_two_batches_over_a_huge_line_hold_it_about_twice_and_health_answers(
    tmp_path: Path, daemons: list[Daemon]
) -> None:
    """Two batches at once over a file whose first line is a 24 MiB chat request: the daemon's
    peak resident memory grows by less than 3x the line (one long line is held at a time, as
    its text and its parse: 2x; before, 8x: every copy of the line from file to prompt, per
    batch), `/health` answers within 1 s throughout (the line is parsed in a worker thread,
    and the store's reads do not wait for its write of the line), the line is answered
    `context_length_exceeded` and the small line after it runs, and memory goes back."""
    daemon = Daemon(tmp_path / "data", free_port(), tmp_path / "daemon.log")
    daemons.append(daemon)
    path = tmp_path / "input.jsonl"
    line_bytes = input_file(path, LINE_MIB)
    with open(path, "rb") as f:
        files = {"file": ("input.jsonl", f)}
        upload = httpx.post(f"{daemon.url}/v1/files", data={"purpose": "batch"}, files=files)
    file_id = upload.json()["id"]
    pid = daemon.process.pid
    time.sleep(0.5)  # the upload's buffers freed
    before = psutil.Process(pid).memory_info().rss
    reset_hwm(pid)
    slowest = 0.0
    stop = threading.Event()

    def poll_health() -> None:
        nonlocal slowest
        with httpx.Client(base_url=daemon.url, timeout=30) as client:
            while not stop.is_set():
                start = time.perf_counter()
                assert client.get("/health").status_code == 200
                slowest = max(slowest, time.perf_counter() - start)
                time.sleep(0.01)

    poller = threading.Thread(target=poll_health)
    poller.start()
    try:
        with httpx.Client(base_url=daemon.url, timeout=60) as client:
            body = {"input_file_id": file_id, "endpoint": CHAT, "completion_window": "24h"}
            ids = [client.post("/v1/batches", json=body).json()["id"] for _ in range(2)]
            deadline = time.monotonic() + 120
            while True:
                batches = [client.get(f"/v1/batches/{i}").json() for i in ids]
                if all(b["status"] == "completed" for b in batches):
                    break
                assert time.monotonic() < deadline, [b["status"] for b in batches]
                time.sleep(0.05)
    finally:
        stop.set()
        poller.join()
    growth = vm_hwm(pid) - before
    for batch in batches:
        assert answers(daemon.url, batch) == {"big": "context_length_exceeded", "small": "200"}
    assert growth < 3 * line_bytes, f"peak growth {growth / line_bytes:.2f}x the line"
    assert slowest < 1.0, f"/health took {slowest:.2f} s"
    deadline = time.monotonic() + 10
    while psutil.Process(pid).memory_info().rss - before >= 20 * 2**20:
        assert time.monotonic() < deadline, "the batches' memory was not given back"
        time.sleep(0.1)


def test_a_cancel_during_validation_is_not_overwritten(tmp_path: Path) -> None:
    """A batch cancelled while its validation runs on a worker thread stays cancelling: the
    validation's move to in_progress happens only from validating, in one statement (the docs'
    create-then-cancel example found a read-then-write losing the cancel on a quiet box). The
    cancel is made to land in that window: the store's status reads see validating."""
    store, storage = Store(tmp_path / "db.sqlite"), FileStorage(tmp_path / "files")
    line = {"custom_id": "a", "method": "POST", "url": CHAT, "body": {"model": "m", "messages": []}}
    storage.path_for("file-in").write_text(json.dumps(line) + "\n")
    runner = validating_batch(store, storage)
    store.update_batch("batch_1", status="cancelling", cancelling_at=2)  # the cancel, mid-way
    runner._status = lambda batch_id: "validating"  # type: ignore[method-assign]  # read before it
    runner._validate("batch_1")
    batch = store.get_batch("batch_1")
    assert batch is not None and batch.status == "cancelling"
