"""`AppState`: the objects one daemon app owns, shared by its routes."""

from __future__ import annotations

from dataclasses import dataclass, field

from fastapi import Request

from server.batches import BatchRunner
from server.engine_client import EngineClient
from server.errors import queue_full
from server.files import FileStorage
from server.metrics import Metrics
from server.serving import Serving
from server.settings import ServerSettings
from server.store import Store


@dataclass
class AppState:
    settings: ServerSettings
    engine: EngineClient
    store: Store
    storage: FileStorage
    metrics: Metrics
    serving: Serving
    runner: BatchRunner
    num_online: int = 0
    """Online requests admitted and not yet finished (bounded by settings.max_queue)."""
    engine_error: str | None = field(default=None)
    """Why the engine failed to start, shown by GET /ready."""

    def admit(self) -> None:
        """Take an online slot, or refuse with 429 and Retry-After."""
        if self.num_online >= self.settings.max_queue:
            self.metrics.rejected.inc()
            raise queue_full(self.settings.retry_after_s)
        self.num_online += 1
        self.metrics.online_in_flight.set(self.num_online)

    def release(self) -> None:
        self.num_online -= 1
        self.metrics.online_in_flight.set(self.num_online)


def get_state(request: Request) -> AppState:
    state: AppState = request.app.state.nanoflex
    return state
