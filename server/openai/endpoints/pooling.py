"""`PoolingServing`: POST /v1/embeddings, /v1/score and /v1/rerank on a pooling model (an
embedding model or a cross-encoder: server/openai/embeddings.py); any other pairing of
path and model is refused (400)."""

from __future__ import annotations

import time
from typing import Any

from pydantic import BaseModel

from engine.runtime.engine_client import EngineClient
from server.openai.embeddings import EMBEDDINGS, POOLING_ENDPOINTS, pooling_job, run_job
from server.openai.endpoints.base import Endpoint, api_error
from server.openai.endpoints.prepared import Prepared
from server.openai.errors import invalid_request
from server.openai.metrics import Metrics
from server.openai.responses import new_id


class PoolingServing(Endpoint):
    """Prepare and run the requests of one pooling path (`path`)."""

    def __init__(
        self,
        engine: EngineClient,
        model_name: str,
        metrics: Metrics,
        max_seqs_per_request: int,
        path: str,
    ) -> None:
        super().__init__(engine, model_name, metrics, max_seqs_per_request)
        self.path = path
        """The path it answers; on a pooling model, a text path too (it refuses it)."""

    def _prepare(self, body: Any) -> Prepared:
        engine, endpoint = self.engine, self.path
        if engine.pooling_spec is None:
            raise invalid_request(
                f"{self.model_name} generates text: {endpoint} needs a pooling model (an "
                "embedding model or a cross-encoder) served by `nanoflex serve MODEL_DIR`",
                code="unsupported_task",
            )
        if endpoint not in POOLING_ENDPOINTS:
            raise invalid_request(
                f"{self.model_name} is a pooling model: it does not generate text ({endpoint}); "
                f"it serves {', '.join(POOLING_ENDPOINTS)} as its task allows",
                code="unsupported_task",
            )
        if isinstance(body, dict) and body.get("model") is not None:
            self._check_model(body["model"])
        job = pooling_job(engine, endpoint, body)
        return Prepared(
            is_chat=False, request_id=new_id("embd-" if endpoint == EMBEDDINGS else "score-"),
            created=int(time.time()), model=self.model_name, prompts=job.inputs, params=[],
            n=1, echo=False, num_logprobs=None, stream=False, include_usage=False, pooling=job,
        )  # fmt: skip

    async def run(self, prep: Prepared, priority: int) -> BaseModel:
        assert prep.pooling is not None
        try:
            return await run_job(self.engine, prep.pooling, prep.request_id, prep.created, priority)
        except Exception as e:
            raise api_error(e) from e
