"""`ChatServing`: POST /v1/chat/completions, a chat rendered with the model's template (its
tools, options and images: server/openai/chat_format.py) and answered as a `ChatCompletion`,
its answer read by the request's tool-call and reasoning parsers
(server/openai/chat_answer.py)."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

from engine.core.outputs import ChoiceAccumulator
from engine.runtime.engine_client import EngineClient
from server.openai.chat_answer import chat_answer
from server.openai.chat_format import chat_ids, chat_media, template_messages
from server.openai.endpoints.base import MAX_SEQS_PER_REQUEST
from server.openai.endpoints.generation import GenerateServing
from server.openai.endpoints.prepared import Prepared
from server.openai.logprobs import chat_logprobs
from server.openai.media import NO_LOCAL_MEDIA, MediaLimits
from server.openai.metrics import Metrics
from server.openai.parsers.reasoning import HARMONY
from server.openai.parsers.reasoning import parser_for_template as reasoning_for_template
from server.openai.parsers.tool_calls import HARMONY as HARMONY_TOOLS
from server.openai.parsers.tool_calls import parser_for_template as tools_for_template
from server.openai.requests import ChatCompletionRequest, parse_body
from server.openai.responses import ChatChoice, ChatCompletion, new_id, now
from server.openai.streaming import stream_chunks
from server.openai.tools import ToolPlan, tool_plan


class ChatServing(GenerateServing):
    """Prepare, run and write chat requests."""

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
        super().__init__(engine, model_name, metrics, max_seqs_per_request)
        self.tool_call_parser = tool_call_parser
        """The model's tool-call format; None: the one its chat template shows."""
        self.reasoning_parser = reasoning_parser
        """qwen3, deepseek_r1 or "none"; None: the one its chat template shows."""
        self.media_limits = media_limits
        """What a request may send of images, and where local image files may be read."""

    def _prepare(self, body: Any) -> Prepared:
        req = parse_body(ChatCompletionRequest, body)
        self._check_model(req.model)
        self._check_num_seqs(1, req.n)
        template = self.engine.tokenizer_info().get("chat_template")
        tools = tool_plan(
            [t.model_dump(exclude_none=True) for t in req.tools or []] or None,
            _dump(req.tool_choice),
            req.parallel_tool_calls,
            None if req.functions is None else [_dump(f) for f in req.functions],
            _dump(req.function_call),
            self.tool_call_parser or tools_for_template(template),
        )
        reasoning = self.reasoning_parser or reasoning_for_template(template)
        reasoning = None if reasoning == "none" else reasoning
        if tools is not None and tools.parses and tools.parser == HARMONY_TOOLS:
            reasoning = HARMONY  # harmony's calls are messages: the answer is read as one
        spec = self.engine.vision
        images: list[tuple[str, str]] | None = [] if spec else None
        messages = template_messages(req.messages, images)
        prompt = chat_ids(self.engine, messages, template, self._check_text_bytes, req, tools)
        media = None
        if images:
            assert spec is not None
            media = [chat_media(spec, self.media_limits, prompt, images)]
        num_logprobs = req.num_logprobs()
        forced = None if tools is None else tools.constraint()
        max_tokens = req.max_completion_tokens or req.max_tokens
        params = self._sampling_params(
            req, [prompt], max_tokens, num_logprobs, False, forced, reasoning
        )
        return Prepared(
            is_chat=True,
            request_id=new_id("chatcmpl-"),
            created=now(),
            model=self.model_name,
            prompts=[prompt],
            params=params,
            n=req.n,
            echo=False,
            num_logprobs=num_logprobs,
            stream=req.stream,
            include_usage=req.include_usage(),
            tokens_as_ids=req.return_tokens_as_token_ids,
            tools=_parsed(tools),
            reasoning=reasoning,
            media=media,
        )

    def body(self, prep: Prepared, choices: list[ChoiceAccumulator]) -> ChatCompletion:
        return ChatCompletion(
            id=prep.request_id,
            created=prep.created,
            model=prep.model,
            system_fingerprint=None,
            object="chat.completion",
            choices=[self.choice(prep, choice) for choice in choices],
            usage=self._usage(prep, choices),
        )

    def choice(self, prep: Prepared, choice: ChoiceAccumulator) -> ChatChoice:
        logprobs = None
        if prep.num_logprobs is not None:
            names, entries = self.token_names(prep), choice.logprobs or []
            logprobs = chat_logprobs(names, choice.token_ids, entries, prep.num_logprobs)
        message, finish_reason = chat_answer(prep, choice, choice.finish_reason)
        return ChatChoice(
            index=choice.index,
            message=message,
            logprobs=logprobs,
            finish_reason=finish_reason,  # type: ignore[arg-type]
        )

    def stream(self, prep: Prepared, priority: int) -> AsyncGenerator[bytes, None]:
        return stream_chunks(self, prep, priority)


def _parsed(tools: ToolPlan | None) -> ToolPlan | None:
    """The tools whose answer is read for calls (tool_choice none: plain content)."""
    return tools if tools is not None and tools.parses else None


def _dump(value: Any) -> Any:
    """A request model's value as JSON values (None and plain values as they are)."""
    if isinstance(value, list):
        return [_dump(v) for v in value]
    return value.model_dump(exclude_none=True) if hasattr(value, "model_dump") else value
