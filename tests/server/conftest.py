"""Fixtures: a real uvicorn server on loopback over the toy engine, and clients for it."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import uvicorn
from toy_engine import ToyEngineClient

from server.app import create_app
from server.settings import ServerSettings
from server.state import AppState

API_KEY = "test-key"


@dataclass
class LiveServer:
    """A daemon running in a thread; `state` is the app's shared state."""

    base_url: str
    engine: ToyEngineClient
    state: AppState
    server: uvicorn.Server
    thread: threading.Thread
    api_key: str | None

    def http(self) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return httpx.Client(base_url=self.base_url, headers=headers, timeout=30)

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.base_url}/v1", api_key=self.api_key or "unused", max_retries=0
        )

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(settings: ServerSettings, engine: ToyEngineClient) -> LiveServer:
    app = create_app(settings, engine)
    port = _free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    return LiveServer(
        f"http://127.0.0.1:{port}", engine, app.state.nanoflex, server, thread, settings.api_key
    )


ServerFactory = Callable[..., LiveServer]


@pytest.fixture
def make_server(tmp_path: Path) -> Iterator[ServerFactory]:
    """Start servers on `tmp_path/data` (the same data dir each time); stops them all."""
    started: list[LiveServer] = []

    def make(engine: ToyEngineClient | None = None, **overrides: Any) -> LiveServer:
        settings = replace(ServerSettings(data_dir=tmp_path / "data"), **overrides)
        live = start_server(settings, engine or ToyEngineClient())
        started.append(live)
        return live

    yield make
    for live in started:
        live.stop()


@pytest.fixture
def live(make_server: ServerFactory) -> LiveServer:
    return make_server()


@pytest.fixture
def client(live: LiveServer) -> Iterator[httpx.Client]:
    with live.http() as c:
        yield c


def wait_for(predicate: Callable[[], bool], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.02)
