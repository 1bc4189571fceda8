"""Latency of small requests on one kept-alive connection, with Nagle's algorithm on and off.

    python -m bench.daemon.keep_alive [--requests 200] [--json FILE]

Serves the daemon's app (server/http/app.py, the demo model's engine client, not started:
`/health` and `/ready` answer without it) with uvicorn on loopback, twice: on the listening
socket `nanoflex serve` makes (`bind_socket`: the TCP protocol number, so every accepted
connection gets TCP_NODELAY) and on one made as before the fix (protocol 0: Nagle's algorithm
stays on). Each time `--requests` sequential `GET /health` go over one kept-alive connection,
then as many over fresh connections; the medians are printed and written as JSON.
"""

from __future__ import annotations

import argparse
import http.client
import json
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path

import uvicorn

from engine.runtime.step_loop_client import build_engine_client
from server.cli import build_parser
from server.http.app import create_app
from server.http.serve import bind_socket, uvicorn_config
from server.http.settings import ServerSettings


def nagle_socket() -> socket.socket:
    """A loopback listening socket made as `bind_socket` made it before: protocol 0."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    return sock


def timed(requests: int, port: int, keep_alive: bool) -> list[float]:
    """Milliseconds per `GET /health`, on one connection or a fresh one each."""
    times: list[float] = []
    conn = http.client.HTTPConnection("127.0.0.1", port)
    for _ in range(requests):
        if not keep_alive:
            conn.close()
            conn = http.client.HTTPConnection("127.0.0.1", port)
        start = time.perf_counter()
        conn.request("GET", "/health")
        response = conn.getresponse()
        response.read()
        times.append((time.perf_counter() - start) * 1000)
        assert response.status == 200
    conn.close()
    return times


def measure(sock: socket.socket, requests: int, data_dir: Path) -> dict[str, float]:
    args = build_parser("serve").parse_args(
        ["serve", "--model", "nanoflex-demo", "--device", "cpu"]
    )
    settings = ServerSettings(data_dir=data_dir)
    app = create_app(settings, build_engine_client(args), start_engine=False)
    port = int(sock.getsockname()[1])
    server = uvicorn.Server(uvicorn_config(app, settings, port, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        timed(10, port, keep_alive=True)  # warm-up
        kept = timed(requests, port, keep_alive=True)
        fresh = timed(requests, port, keep_alive=False)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
    return {
        "kept_alive_median_ms": round(statistics.median(kept), 2),
        "fresh_connection_median_ms": round(statistics.median(fresh), 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        before = measure(nagle_socket(), args.requests, Path(tmp) / "before")
        after = measure(bind_socket("127.0.0.1", 0), args.requests, Path(tmp) / "after")
    result = {
        "requests": args.requests,
        "nagle_on_before": before,
        "tcp_nodelay_after": after,
    }
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
