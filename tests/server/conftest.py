"""Fixtures of the server tests (helpers live in tests/server/live.py)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.runtime.engine_client import EngineClient
from server.http.settings import ServerSettings
from tests.server.live import LiveServer, Reference, ServerFactory, demo_engine, start_server


@pytest.fixture
def make_server(tmp_path: Path) -> Iterator[ServerFactory]:
    """Start servers on `tmp_path/data` (the same data dir each time); stops them all.
    The engine defaults to the demo model with an in-process executor."""
    started: list[LiveServer] = []

    def make(engine: EngineClient | None = None, **overrides: Any) -> LiveServer:
        settings = replace(ServerSettings(data_dir=tmp_path / "data"), **overrides)
        live = start_server(settings, engine or demo_engine())
        started.append(live)
        return live

    yield make
    for live in started:
        live.stop()


@pytest.fixture(scope="module")
def shared_live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """One daemon per module (default settings, as `live`) for the tests that leave it as they
    found it: requests refused before the engine (400, 404) or answered to the end. A daemon
    start costs seconds; a parametrized test of refusals would pay it per case."""
    settings = ServerSettings(data_dir=tmp_path_factory.mktemp("shared") / "data")
    shared = start_server(settings, demo_engine())
    yield shared
    shared.stop()


@pytest.fixture
def shared_client(shared_live: LiveServer) -> Iterator[httpx.Client]:
    with shared_live.http() as c:
        yield c


@pytest.fixture
def live(make_server: ServerFactory) -> LiveServer:
    return make_server()


@pytest.fixture
def client(live: LiveServer) -> Iterator[httpx.Client]:
    with live.http() as c:
        yield c


@pytest.fixture(scope="session")
def reference() -> Iterator[Reference]:
    ref = Reference()
    yield ref
    ref.llm.close()
