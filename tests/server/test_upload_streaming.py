"""POST /v1/files on a real uvicorn server: the multipart body streams straight into the data
directory (never the system temp directory), each byte written once; an upload refused midway
(413, 507) leaves nothing behind; uploads past `max_uploads` at once are answered 429.

The system temp directory is pointed at a folder that does not exist while the server runs:
an upload that spooled there (as starlette's form parser does past 1 MiB) would fail. An
empty folder would not show it: Linux's temporary files are unnamed (O_TMPFILE)."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.server.live import LiveServer, ServerFactory, wait_for
from tests.server.test_errors import assert_error

MiB = 1 << 20
BOUNDARY = "nanoflex-test-boundary"
HEADERS = {"content-type": f"multipart/form-data; boundary={BOUNDARY}"}


@pytest.fixture
def no_temp_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[], None]]:
    """Once called (after the engine has made its own offload folder): the process's temp
    directory (TMPDIR, as `tempfile` caches it) made unusable; checked untouched at the end."""
    absent = tmp_path / "no-temp-dir"
    yield lambda: monkeypatch.setattr(tempfile, "tempdir", str(absent))
    assert not absent.exists()


def _form_head() -> bytes:
    return (
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="in.jsonl"\r\n'
        "Content-Type: application/octet-stream\r\n\r\n"
    ).encode()


def _form_tail() -> bytes:
    return f"\r\n--{BOUNDARY}--\r\n".encode()


def _contents(num_bytes: int) -> bytes:
    line = b'{"custom_id": "x"}\n'
    return (line * (num_bytes // len(line) + 1))[:num_bytes]


def _chunked(data: bytes, hold: threading.Event | None = None) -> Iterator[bytes]:
    """The form around `data`, sent without a Content-Length; with `hold`, pauses after the
    first 1.5 MiB of the file until `hold` is set."""
    yield _form_head()
    cut = 3 * MiB // 2
    for start in range(0, len(data), 256 * 1024):
        if hold is not None and start == cut:
            assert hold.wait(60)
        yield data[start : start + 256 * 1024]
    yield _form_tail()


def _left_in(live: LiveServer) -> list[str]:
    return sorted(p.name for p in live.state.storage.files_dir.iterdir())


def _bytes_written() -> int:
    """Bytes this process (the server and its threads) has passed to write calls."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    raise AssertionError("no wchar in /proc/self/io")


_CLIENT = """
import sys, httpx
with open(sys.argv[3], "rb") as f:
    body = f.read()
r = httpx.post(sys.argv[1] + "/v1/files", content=body,
               headers={"content-type": sys.argv[2]}, timeout=120)
sys.stdout.write(r.text)
"""


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="needs Linux's /proc/self/io")
def test_upload_is_written_once_into_the_data_dir_and_refusals_leave_nothing(
    make_server: ServerFactory, no_temp_dir: Callable[[], None], tmp_path: Path
) -> None:
    live = make_server(max_file_bytes=4 * MiB, max_stored_bytes=6 * MiB)
    no_temp_dir()
    with live.http() as http:
        too_big = _contents(9 * MiB // 2)  # > 4 MiB, with no Content-Length to refuse at once
        response = http.post("/v1/files", content=_chunked(too_big), headers=HEADERS)
        assert_error(response, 413, "request_too_large")
    assert _left_in(live) == []  # the partial file is gone
    data = _contents(3 * MiB)
    body = tmp_path / "body"
    body.write_bytes(_form_head() + data + _form_tail())
    argv = [sys.executable, "-c", _CLIENT, live.base_url, HEADERS["content-type"], str(body)]
    before = _bytes_written()  # the client runs in its own process: its writes are not counted
    result = subprocess.run(argv, capture_output=True, timeout=120, check=True)
    written = _bytes_written() - before
    uploaded = httpx.Response(200, content=result.stdout).json()
    assert uploaded["bytes"] == len(data) and uploaded["object"] == "file", uploaded
    assert len(data) <= written < 1.25 * len(data), written  # once (a second copy: 2x)
    assert _left_in(live) == [uploaded["id"]]
    with live.http() as http:
        assert http.get(f"/v1/files/{uploaded['id']}/content").content == data
        too_much = _contents(7 * MiB // 2)  # 3 + 3.5 MiB > 6 MiB stored
        response = http.post("/v1/files", content=_chunked(too_much), headers=HEADERS)
        assert_error(response, 507, "insufficient_storage")
        assert [f["id"] for f in http.get("/v1/files").json()["data"]] == [uploaded["id"]]
    assert _left_in(live) == [uploaded["id"]]  # no partial file, no second copy


def test_uploads_past_the_bound_are_answered_429(
    make_server: ServerFactory, no_temp_dir: Callable[[], None]
) -> None:
    live = make_server(max_uploads=2)
    no_temp_dir()
    hold = threading.Event()
    data = _contents(2 * MiB)
    answers: list[httpx.Response] = []

    def send() -> None:
        with live.http() as http:
            answers.append(http.post("/v1/files", content=_chunked(data, hold), headers=HEADERS))

    senders = [threading.Thread(target=send) for _ in range(2)]
    for sender in senders:
        sender.start()
    try:  # both are being written into the data directory as they arrive
        wait_for(lambda: len([n for n in _left_in(live) if n.startswith(".tmp-")]) == 2, 20)
        with live.http() as http:
            response = http.post(
                "/v1/files", content=_form_head() + b"{}\n" + _form_tail(), headers=HEADERS
            )
            error = assert_error(response, 429, "too_many_uploads")
            assert error["type"] == "rate_limit_error" and response.headers["retry-after"]
    finally:
        hold.set()
        for sender in senders:
            sender.join(60)
    assert [a.status_code for a in answers] == [200, 200], [a.text for a in answers]
    assert sorted(_left_in(live)) == sorted(a.json()["id"] for a in answers)
    with live.http() as http:  # the bound is free again
        response = http.post(
            "/v1/files", content=_form_head() + b"{}\n" + _form_tail(), headers=HEADERS
        )
        assert response.status_code == 200 and response.json()["bytes"] == 3
