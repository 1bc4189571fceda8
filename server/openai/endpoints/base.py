"""`ServingBase`: what every endpoint shares (the engine handle, the served model's name, the
metrics, the request limits, the checks a request meets), and `Endpoint`, the face of one
that runs requests: `prepare` a body, then `run` it or `stream` it.

Hostile sizes are refused before any costly work: a request of more than
`max_seqs_per_request` sequences (prompts x n) before tokenizing, a prompt text longer than
`max_prompt_bytes` (no such text fits the context window) before tokenizing it, a token-id
prompt longer than the context before scanning it.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncGenerator
from typing import Any

from pydantic import BaseModel

from engine.core.sampling_params import SamplingError
from engine.runtime.engine_client import EngineClient, EngineDeadError, StorageUnavailableError
from server.openai.endpoints.prepared import Prepared
from server.openai.errors import (
    APIError,
    engine_unavailable,
    invalid_request,
    not_found,
    offload_unavailable,
)
from server.openai.json_body import utf8_size
from server.openai.metrics import Metrics

MAX_SEQS_PER_REQUEST = 256
"""Most sequences (prompts x n) one request may ask for."""


class ServingBase:
    """One engine as the endpoints see it, with the checks they share."""

    def __init__(
        self,
        engine: EngineClient,
        model_name: str,
        metrics: Metrics,
        max_seqs_per_request: int = MAX_SEQS_PER_REQUEST,
    ) -> None:
        self.engine = engine
        self.model_name = model_name
        self.metrics = metrics
        self.max_seqs_per_request = max_seqs_per_request

    @property
    def max_prompt_bytes(self) -> int:
        """The longest prompt text (UTF-8 bytes) that can fit the context window: no token
        stands for more than `engine.max_token_bytes` bytes of text."""
        return self.engine.max_model_len * self.engine.max_token_bytes

    def check_ready(self) -> None:
        """Raise the 503 a request meets now if the engine cannot take it (loading,
        restarting, its offload storage resting after a fault)."""
        try:
            self.engine.check_ready()
        except Exception as e:
            raise api_error(e) from e

    def _check_model(self, model: str) -> None:
        if model != self.model_name:
            raise not_found("model", model, param="model")

    def _check_num_seqs(self, num_prompts: int, n: int) -> None:
        if num_prompts * n > self.max_seqs_per_request:
            raise invalid_request(
                f"This request asks for {num_prompts * n} sequences ({num_prompts} prompts x "
                f"n={n}); the limit is {self.max_seqs_per_request} per request. Split it.",
                param="prompt" if num_prompts > 1 else "n",
                code="too_many_sequences",
            )

    def _check_text_bytes(self, texts: list[str], param: str) -> None:
        """Refuse a prompt text that cannot fit the context, before tokenizing it."""
        limit = self.max_prompt_bytes
        if 4 * sum(len(t) for t in texts) <= limit:  # a character is at most 4 bytes
            return
        num_bytes = sum(utf8_size(t) for t in texts)  # no copy of a long text
        if num_bytes > limit:
            raise invalid_request(
                f"The prompt is {num_bytes} bytes of text; no text over {limit} bytes fits "
                f"this model's context of {self.engine.max_model_len} tokens. Shorten it.",
                param=param,
                code="context_length_exceeded",
            )

    def _check_token_ids(self, ids: list[int], param: str) -> None:
        bad = [t for t in ids if not 0 <= t < self.engine.vocab_size]
        if bad:
            raise invalid_request(
                f"token ids must be in [0, {self.engine.vocab_size}); got {bad[:5]}",
                param=param,
                code="invalid_token_ids",
            )

    def _check_num_tokens(self, num_tokens: int) -> None:
        if num_tokens > self.engine.max_model_len:
            raise invalid_request(
                f"This model's maximum context length is {self.engine.max_model_len} tokens; "
                f"the prompt has {num_tokens}. Shorten it.",
                param="prompt",
                code="context_length_exceeded",
            )


class Endpoint(ServingBase, abc.ABC):
    """An endpoint that runs requests. `prepare` is synchronous and may take a while on a
    long prompt: callers run it in a worker thread."""

    def prepare(self, body: Any) -> Prepared:
        """Validate and tokenize; raises `APIError` (400 invalid, 404 unknown model, 503 while
        the model is still loading)."""
        try:
            return self._prepare(body)
        except SamplingError as e:
            raise invalid_request(str(e)) from e
        except EngineDeadError as e:
            raise engine_unavailable() from e

    @abc.abstractmethod
    def _prepare(self, body: Any) -> Prepared:
        """The request body validated and tokenized."""

    @abc.abstractmethod
    async def run(self, prep: Prepared, priority: int) -> BaseModel:
        """The whole (non-streaming) response body."""

    def stream(self, prep: Prepared, priority: int) -> AsyncGenerator[bytes, None]:
        """The response as server-sent events (`prep.stream`)."""
        raise NotImplementedError(f"{type(self).__name__} does not stream")


def api_error(e: Exception) -> APIError:
    """Engine-side failures as API errors."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, EngineDeadError):
        return engine_unavailable()
    if isinstance(e, StorageUnavailableError):
        return offload_unavailable(str(e))
    if isinstance(e, ValueError):  # the scheduler's RequestError: the caller's 400
        return invalid_request(str(e))
    return APIError(500, f"generation failed: {e}", type="server_error", code="internal_error")
