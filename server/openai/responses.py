"""The response bodies of the OpenAI API, one definition each: the serving layer builds its
answers with these models and `/openapi.json` documents them (server/http/openapi.py), so
what a client is told is what it gets (`tests/server/test_fuzz.py` checks every answer
against the schema). Bodies whose every field is set are built with all of them; a chunk's
optional parts (`usage`, a delta's `role`) are left unset where OpenAI leaves them out, and
it is written with `exclude_unset`.
"""

from __future__ import annotations

import secrets
import time
from typing import Literal

from pydantic import BaseModel

FinishReason = Literal["stop", "length", "tool_calls", "function_call"]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error envelope: every 4xx and 5xx answer."""

    error: ErrorBody


class PromptTokensDetails(BaseModel):
    cached_tokens: int
    """Prompt tokens whose KV came from the prefix cache instead of being computed."""


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None


class _Head(BaseModel):
    """What every completion and chat answer and chunk starts with."""

    id: str
    """The request's id ("cmpl-..." or "chatcmpl-...")."""
    created: int
    model: str
    system_fingerprint: None


class Completion(_Head):
    """POST /v1/completions (without `stream`)."""

    object: Literal["text_completion"]
    choices: list[CompletionChoice]
    usage: Usage


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class FunctionCallOut(BaseModel):
    name: str
    arguments: str
    """The arguments as a JSON object's text."""


class ToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionCallOut


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    """The answer's text; null when it is only tool calls."""
    reasoning_content: str | None = None
    """What a thinking model reasoned before its answer (vLLM's field); set only then."""
    tool_calls: list[ToolCall] | None = None
    """Set only when the answer calls tools."""
    function_call: FunctionCallOut | None = None
    """The legacy `functions` request's call; set only then."""


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None


class ChatCompletion(_Head):
    """POST /v1/chat/completions (without `stream`)."""

    object: Literal["chat.completion"]
    choices: list[ChatChoice]
    usage: Usage


class Model(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int | None = None
    """The context window (vLLM's extension), once the model is loaded."""


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[Model]


class Health(BaseModel):
    status: Literal["ok"]


class Ready(BaseModel):
    status: Literal["ready"]
    model: str


class NotReady(BaseModel):
    status: Literal["not_ready", "failed"]
    """not_ready while the engine loads or restarts; failed when it cannot run."""
    detail: str


class Tokenized(BaseModel):
    """POST /tokenize's answer (vLLM's shape)."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: None = None


class TokenizerInfo(BaseModel):
    """GET /tokenizer_info's answer (vLLM's shape): what a client needs to tokenize and
    render chats as the server does."""

    tokenizer_class: str
    bos_token: str | None
    eos_token: str | None
    pad_token: str | None
    unk_token: str | None
    add_bos_token: bool
    """Whether a completion prompt's text gets the BOS token."""
    chat_template: str | None
    model_max_length: int
    """The served context window in tokens."""


class Detokenized(BaseModel):
    """POST /detokenize's answer (vLLM's shape)."""

    prompt: str


class CompletionChunk(_Head):
    """One server-sent event of POST /v1/completions with `stream`: what some choice gained
    (text, its tokens' logprobs, the finish reason), or, last, the usage alone."""

    object: Literal["text_completion"]
    choices: list[CompletionChoice]
    usage: Usage | None = None
    """With `stream_options.include_usage`: null on every chunk but the last."""


class FunctionCallDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    """A tool call in a stream: its first delta has the id, type and name."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    """On a choice's first chunk only."""
    content: str | None = None
    """New text; absent on a last chunk without any."""
    reasoning_content: str | None = None
    """New reasoning of a thinking model; absent otherwise."""
    tool_calls: list[ToolCallDelta] | None = None
    """Calls, whole, once the answer has them (absent otherwise)."""
    function_call: FunctionCallDelta | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None


class ChatCompletionChunk(_Head):
    """One server-sent event of POST /v1/chat/completions with `stream`."""

    object: Literal["chat.completion.chunk"]
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    """With `stream_options.include_usage`: null on every chunk but the last."""


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> Usage:
    """OpenAI's usage object; `cached_tokens`: prompt tokens whose KV came from the prefix
    cache (docs/api.md, "Prefix caching")."""
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
    )


def sse(data: BaseModel | str) -> bytes:
    """One server-sent event: `data: <json>` (unset fields left out) and a blank line."""
    text = data if isinstance(data, str) else data.model_dump_json(exclude_unset=True)
    return f"data: {text}\n\n".encode()


def new_id(prefix: str) -> str:
    """A fresh OpenAI-style id: 'file-…', 'batch_…', 'cmpl-…', 'chatcmpl-…'."""
    return f"{prefix}{secrets.token_hex(12)}"


def now() -> int:
    """Unix seconds, as OpenAI's *_at fields use."""
    return int(time.time())
