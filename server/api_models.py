"""Response bodies of the API as pydantic models, for the served OpenAPI schema only.

The routes build plain dicts (`server.responses`, `server.files`, `server.store`);
these models describe them field for field, so that clients and fuzzers can check
every answer against `/openapi.json` (`tests/server/test_fuzz.py` does).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel


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
    finish_reason: Literal["stop", "length"] | None


class Completion(BaseModel):
    """POST /v1/completions (without `stream`)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    system_fingerprint: None
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


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length"] | None


class ChatCompletion(BaseModel):
    """POST /v1/chat/completions (without `stream`)."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    system_fingerprint: None
    choices: list[ChatChoice]
    usage: Usage


class Model(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[Model]


class FileObject(BaseModel):
    id: str
    object: Literal["file"]
    bytes: int
    created_at: int
    filename: str
    purpose: Literal["batch", "batch_output"]
    status: Literal["processed"]
    status_details: None
    expires_at: None


class FileList(BaseModel):
    object: Literal["list"]
    data: list[FileObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"]
    deleted: bool


class BatchError(BaseModel):
    code: str
    message: str
    param: str | None
    line: int | None


class BatchErrors(BaseModel):
    object: Literal["list"]
    data: list[BatchError]


class RequestCounts(BaseModel):
    total: int
    completed: int
    failed: int


class Batch(BaseModel):
    id: str
    object: Literal["batch"]
    endpoint: Literal["/v1/completions", "/v1/chat/completions"]
    errors: BatchErrors | None
    input_file_id: str
    completion_window: Literal["24h"]
    status: Literal[
        "validating",
        "failed",
        "in_progress",
        "finalizing",
        "completed",
        "expired",
        "cancelling",
        "cancelled",
    ]
    output_file_id: str | None
    error_file_id: str | None
    created_at: int
    in_progress_at: int | None
    finalizing_at: int | None
    completed_at: int | None
    cancelling_at: int | None
    cancelled_at: int | None
    failed_at: int | None
    expired_at: int | None
    expires_at: int | None
    request_counts: RequestCounts
    metadata: dict[str, str] | None


class BatchList(BaseModel):
    object: Literal["list"]
    data: list[Batch]
    first_id: str | None
    last_id: str | None
    has_more: bool


class Health(BaseModel):
    status: Literal["ok"]


class Ready(BaseModel):
    status: Literal["ready"]
    model: str


class NotReady(BaseModel):
    status: Literal["not_ready"]
    detail: str


class Tokenized(BaseModel):
    """POST /tokenize's answer (vLLM's shape)."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: None = None


class Detokenized(BaseModel):
    """POST /detokenize's answer (vLLM's shape)."""

    prompt: str
