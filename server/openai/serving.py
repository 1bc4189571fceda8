"""`Serving`: the OpenAI endpoints over one engine, one object per endpoint family, and the
path -> endpoint table the routes and the batch runners go through.

Used by the online routes and by the batch runners alike, so a batch line gets exactly the
body the online endpoint would return. A route takes its endpoint (`endpoint(path)`),
prepares the body there (in a worker thread: tokenizing a long prompt takes a while), then
runs or streams it; a batch line does the same through `prepare` and `run`.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from engine.core.outputs import ChoiceAccumulator
from engine.runtime.engine_client import EngineClient, EngineDeadError
from server.openai.embeddings import POOLING_ENDPOINTS
from server.openai.endpoints.base import MAX_SEQS_PER_REQUEST, Endpoint
from server.openai.endpoints.chat import ChatServing
from server.openai.endpoints.completions import CompletionServing
from server.openai.endpoints.generation import GenerateServing
from server.openai.endpoints.pooling import PoolingServing
from server.openai.endpoints.prepared import Prepared
from server.openai.endpoints.responses import ResponsesServing
from server.openai.endpoints.tokenization import TokenizationServing
from server.openai.errors import engine_unavailable
from server.openai.media import NO_LOCAL_MEDIA, MediaLimits
from server.openai.metrics import Metrics
from server.openai.responses import ChatCompletion, Completion
from server.openai.responses_api import Response

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
RESPONSES = "/v1/responses"


class Serving:
    """The endpoints of one engine, by path."""

    def __init__(
        self,
        engine: EngineClient,
        model_name: str,
        metrics: Metrics,
        max_seqs_per_request: int = MAX_SEQS_PER_REQUEST,
        *,
        tool_call_parser: str | None = None,
        reasoning_parser: str | None = None,
        media_limits: MediaLimits = NO_LOCAL_MEDIA,
    ) -> None:
        self.engine = engine
        self.model_name = model_name
        shared = (engine, model_name, metrics, max_seqs_per_request)
        self.completions = CompletionServing(*shared)
        self.chat = ChatServing(
            *shared,
            tool_call_parser=tool_call_parser,
            reasoning_parser=reasoning_parser,
            media_limits=media_limits,
        )
        self.responses = ResponsesServing(self.chat)
        self.tokenization = TokenizationServing(*shared)
        self._generating: dict[str, GenerateServing] = {
            COMPLETIONS: self.completions,
            CHAT: self.chat,
            RESPONSES: self.responses,
        }
        self._pooling = {
            path: PoolingServing(*shared, path) for path in (*POOLING_ENDPOINTS, *self._generating)
        }
        """Every path's pooling endpoint: a pooling model answers each path with it (a text
        path refused), a generating model its pooling paths (refused)."""

    @property
    def max_prompt_bytes(self) -> int:
        """The longest prompt text (UTF-8 bytes) that can fit the context window."""
        return self.chat.max_prompt_bytes

    @property
    def tool_call_parser(self) -> str | None:
        """The chat endpoint's `--tool-call-parser` (None: from the chat template)."""
        return self.chat.tool_call_parser

    @tool_call_parser.setter
    def tool_call_parser(self, name: str | None) -> None:
        self.chat.tool_call_parser = name

    @property
    def reasoning_parser(self) -> str | None:
        """The chat endpoint's `--reasoning-parser` (None: from the chat template)."""
        return self.chat.reasoning_parser

    @reasoning_parser.setter
    def reasoning_parser(self, name: str | None) -> None:
        self.chat.reasoning_parser = name

    def check_ready(self) -> None:
        """Raise the 503 a request meets now if the engine cannot take it."""
        self.chat.check_ready()

    def endpoint(self, path: str) -> Endpoint:
        """The endpoint that answers `path` (COMPLETIONS, CHAT, RESPONSES or a pooling path)
        on this model: a pooling model answers every path with a pooling endpoint, which
        refuses a text path (400), as a generating model's pooling endpoints refuse theirs."""
        try:
            is_pooling = self.engine.pooling_spec is not None
        except EngineDeadError as e:
            raise engine_unavailable() from e
        if path in POOLING_ENDPOINTS or is_pooling:
            return self._pooling[path]
        return self._generating[path]

    def endpoint_of(self, prep: Prepared) -> Endpoint:
        """The endpoint that prepared `prep`."""
        if prep.pooling is not None:
            return self._pooling[prep.pooling.endpoint]
        return self._generating_of(prep)

    def _generating_of(self, prep: Prepared) -> GenerateServing:
        if prep.responses is not None:
            return self.responses
        return self.chat if prep.is_chat else self.completions

    def prepare(self, path: str, body: Any) -> Prepared:
        """`body` validated and tokenized by the endpoint of `path`; raises `APIError` (400
        invalid, 404 unknown model, 503 while the model is still loading)."""
        return self.endpoint(path).prepare(body)

    async def run(self, prep: Prepared, priority: int) -> BaseModel:
        """The whole (non-streaming) response body."""
        return await self.endpoint_of(prep).run(prep, priority)

    async def run_choices(self, prep: Prepared, priority: int) -> list[ChoiceAccumulator]:
        """A generating request's choices run to their end, in choice order."""
        return await self._generating_of(prep).run_choices(prep, priority)

    def body(
        self, prep: Prepared, choices: list[ChoiceAccumulator]
    ) -> Completion | ChatCompletion | Response:
        """The non-streaming response body of a generating request's finished choices."""
        return self._generating_of(prep).body(prep, choices)
