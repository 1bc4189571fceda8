"""`AppState`: the objects one daemon app owns, shared by its routes."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from fastapi import Request

from engine.runtime.engine_client import EngineClient
from server.batch.files import FileStorage
from server.batch.runner import BatchRunner
from server.batch.store import Store
from server.http.settings import ServerSettings
from server.openai.errors import APIError, invalid_request, queue_full
from server.openai.metrics import Metrics
from server.openai.serving import Serving


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
    """Sequences (prompts x n) of online requests admitted and not yet finished, bounded by
    settings.max_queue."""
    num_uploads: int = 0
    """Uploads to POST /v1/files being received, bounded by settings.max_uploads."""
    engine_error: str | None = field(default=None)
    """Why the engine failed to start, shown by GET /ready."""

    async def wait_ready(self, poll_s: float = 0.05) -> None:
        """Return once the engine can take a request; while it loads or restarts, wait up to
        `settings.ready_wait_s`, then raise its 503 (with Retry-After). At once when it has
        failed for good, or when its offload storage rests after a fault (a 503 of its own:
        the client retries after it)."""
        deadline = time.monotonic() + self.settings.ready_wait_s
        while True:
            try:
                self.serving.check_ready()
                return
            except APIError as e:
                waits = e.code == "engine_unavailable" and self.engine_error is None
                if not waits or time.monotonic() >= deadline:
                    raise
            await asyncio.sleep(poll_s)

    def admit(self, num_seqs: int) -> None:
        """Take `num_seqs` online slots, or refuse: 429 with Retry-After while the queue is
        full, 400 if the request alone is larger than the whole queue."""
        max_queue = self.settings.max_queue
        if num_seqs > max_queue:
            raise invalid_request(
                f"This request asks for {num_seqs} sequences (prompts x n), more than the "
                f"server queues at once ({max_queue}); split it.",
                code="too_many_sequences",
            )
        if self.num_online + num_seqs > max_queue:
            raise queue_full(self.settings.retry_after_s)
        self.num_online += num_seqs
        self.metrics.online_in_flight.set(self.num_online)

    def release(self, num_seqs: int) -> None:
        self.num_online -= num_seqs
        self.metrics.online_in_flight.set(self.num_online)


def get_state(request: Request) -> AppState:
    state: AppState = request.app.state.nanoflex
    return state
