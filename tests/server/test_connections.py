"""Hostile and careless clients at the connection level, on a real uvicorn server on loopback
(the daemon's own listening socket) and the real engine: kept-alive connections without
Nagle's delay, slow header and body senders closed, streams abandoned before their first
chunk answered without a traceback."""

from __future__ import annotations

import json
import logging
import select
import socket
import time

from tests.server.faults import HOLD, FaultyEngine, like_demo
from tests.server.live import MODEL, LiveServer, ServerFactory, engine_is_idle, wait_for
from tests.server.test_errors import GOOD

HEALTH = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"


def connect(live: LiveServer, timeout_s: float = 30) -> socket.socket:
    host, port = live.base_url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=timeout_s)


def read_response(sock: socket.socket) -> bytes:
    """One response whose body is `Content-Length` bytes long."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed mid-response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length")
    )
    while len(body) < length:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body


def closed_by_server(sock: socket.socket) -> bytes:
    """What the server sent until it closed the connection (fails on the socket's timeout)."""
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def test_kept_alive_connections_have_nagles_algorithm_off(live: LiveServer) -> None:
    """Every request on one connection: with Nagle on, each response's body waited ~40 ms
    for the client's delayed ACK of its headers (44 ms median per request, measured)."""
    with connect(live) as sock:
        for _ in range(20):
            sock.sendall(HEALTH)
            assert read_response(sock).startswith(b"HTTP/1.1 200")
        connections = list(live.server.server_state.connections)
        assert len(connections) == 1  # the one kept-alive connection
        accepted = connections[0].transport.get_extra_info("socket")
        assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0


def test_slow_header_senders_are_closed(make_server: ServerFactory) -> None:
    live = make_server(header_timeout_s=0.5, keep_alive_s=30)
    start = time.monotonic()
    silent = connect(live, timeout_s=10)
    trickling = connect(live, timeout_s=10)
    for line in (b"GET /health HTTP/1.1\r\n", b"Host: 127.0.0.1\r\n", b"X-A: 1\r\n", b"X-B: 2\r\n"):
        trickling.sendall(line)  # one header line every 0.2 s, never the blank line
        time.sleep(0.2)
    assert closed_by_server(silent) == b""
    assert closed_by_server(trickling) == b""
    assert time.monotonic() - start < 5
    with connect(live, timeout_s=10) as kept:  # a kept-alive connection: the next request too
        kept.sendall(HEALTH)
        assert read_response(kept).startswith(b"HTTP/1.1 200")
        time.sleep(0.8)  # idle, within keep-alive: no header deadline runs yet
        kept.sendall(HEALTH)
        assert read_response(kept).startswith(b"HTTP/1.1 200")
        kept.sendall(b"GET /health HTTP/1.1\r\n")
        started = time.monotonic()
        assert closed_by_server(kept) == b""
        assert 0.3 < time.monotonic() - started < 5
    silent.close()
    trickling.close()


def test_a_body_trickling_past_its_total_time_is_408(make_server: ServerFactory) -> None:
    live = make_server(body_timeout_s=5, body_total_timeout_s=1.0)
    with connect(live, timeout_s=10) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
        )
        deadline = time.monotonic() + 8
        while time.monotonic() < deadline:  # a byte every 0.2 s: never a pause of 5 s
            sock.sendall(b" ")
            if select.select([sock], [], [], 0.2)[0]:  # the server answered
                break
        reply = closed_by_server(sock)
    assert reply.startswith(b"HTTP/1.1 408"), reply[:300]
    assert b"request_timeout" in reply and b"took over 1 s" in reply


class Records(logging.Handler):
    """Every record logged under the loggers it is attached to."""

    def __init__(self, *names: str) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        for name in names:
            logging.getLogger(name).addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_a_stream_abandoned_before_its_first_chunk_logs_no_traceback(
    make_server: ServerFactory,
) -> None:
    """Each such disconnect was an unhandled 500 with two tracebacks (7.7 KB) in the log."""
    engine = like_demo(FaultyEngine)
    live = make_server(engine)
    log = Records("uvicorn", "nanoflex")
    body = json.dumps({"model": MODEL, "prompt": HOLD, "max_tokens": 8, "stream": True})
    request = (
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n{body}"
    ).encode()
    try:
        with connect(live) as sock:
            sock.sendall(request)
            assert engine.held.wait(30)  # admitted, no chunk yet
        wait_for(lambda: live.state.num_online == 0)  # its sequences are released
        with connect(live) as sock:  # gone in the middle of a body
            sock.sendall(request[: len(request) - 5])
        engine.release.set()
        wait_for(lambda: engine_is_idle(live.engine))
        with live.http() as client:  # the daemon serves on
            assert client.post("/v1/completions", json=GOOD).status_code == 200
    finally:
        engine.release.set()
        for name in ("uvicorn", "nanoflex"):
            logging.getLogger(name).removeHandler(log)
    bad = [r for r in log.records if r.exc_info or r.levelno >= logging.ERROR]
    assert not bad, [r.getMessage() for r in bad]
