"""`ResponsesServing`: POST /v1/responses, run as the chat it means (the chat endpoint's
prompts, sampling, tools and reasoning, once: server/openai/responses_api.py) and answered
as a `Response`, whole or as the Responses API's streaming events."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import replace
from typing import Any

from engine.core.outputs import ChoiceAccumulator
from server.openai.endpoints.chat import ChatServing
from server.openai.endpoints.generation import GenerateServing
from server.openai.endpoints.prepared import Prepared
from server.openai.requests import parse_body
from server.openai.responses import new_id
from server.openai.responses_api import (
    Response,
    ResponsesRequest,
    refuse_stored_state,
    response_body,
    response_events,
)
from server.openai.stream_answer import AnswerStream


class ResponsesServing(GenerateServing):
    """Prepare, run and write Responses API requests through `chat`."""

    def __init__(self, chat: ChatServing) -> None:
        super().__init__(chat.engine, chat.model_name, chat.metrics, chat.max_seqs_per_request)
        self.chat = chat

    def _prepare(self, body: Any) -> Prepared:
        refuse_stored_state(body)
        responses = parse_body(ResponsesRequest, body)
        prep = self.chat.prepare(responses.chat_body())
        return replace(
            prep, request_id=new_id("resp_"), stream=responses.stream, responses=responses
        )

    def body(self, prep: Prepared, choices: list[ChoiceAccumulator]) -> Response:
        assert prep.responses is not None
        chat = self.chat.body(prep, choices)
        return response_body(prep.responses, prep.request_id, prep.created, prep.model, chat)

    async def stream(self, prep: Prepared, priority: int) -> AsyncGenerator[bytes, None]:
        """The Responses API's events for one request (server/openai/responses_api.py): its
        reasoning and answer as deltas while they come, then its output items."""
        assert prep.responses is not None
        req = prep.responses
        head = response_body(req, prep.request_id, prep.created, prep.model, None, "in_progress")
        choices: dict[int, ChoiceAccumulator] = {}

        async def parts() -> AsyncGenerator[tuple[str, str], None]:
            answer = AnswerStream(prep.reasoning, prep.tools)
            async with aclosing(self.outputs(prep, priority)) as outputs:
                async for choice, delta in outputs:
                    choices[choice.index] = choice
                    for part in answer.feed(delta.new_text):
                        if part.reasoning_content:
                            yield "reasoning", part.reasoning_content
                        if part.content:
                            yield "content", part.content

        def finished() -> Response:
            return self.body(prep, [choices[i] for i in sorted(choices)])

        async for event in response_events(head, parts(), finished):
            yield event
