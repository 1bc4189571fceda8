"""The served OpenAPI schema (`GET /openapi.json`): the real request and response models.

The routes read their bodies themselves (to refuse hostile input cheaply and answer
OpenAI's 400, never FastAPI's 422) and write their answers with the response models
(`server/openai/responses.py`, `server/batch/objects.py`), so FastAPI sees neither. This
module states, per operation, the request body, the success body (the very model the
route builds its answer with) and every error status the daemon can answer, and replaces
FastAPI's generated schema with that.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from server.batch import objects
from server.openai import embeddings, responses
from server.openai.requests import (
    BatchCreateRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from server.openai.responses_api import Response, ResponsesRequest

REF = "#/components/schemas/{model}"

ERRORS = {
    400: "Invalid request: malformed JSON, a wrong or unknown field, a prompt that cannot fit, "
    "too many sequences, or a Host header this daemon does not serve.",
    401: "Missing or wrong API key.",
    403: "A browser request from a web origin that is not allowed.",
    404: "No such model, file or batch.",
    408: "The request body stopped arriving.",
    413: "The body is larger than the daemon accepts.",
    415: "The body is not application/json.",
    429: "Too much at once (online queue, uploads, batches); retry after Retry-After seconds.",
    503: "The engine is starting or restarting; retry after the Retry-After header's seconds.",
    507: "The data directory is full or read-only; nothing was stored.",
}
COMMON_ERRORS = (400, 401, 403, 408, 413)
"""Any route may answer these (401 only when the daemon has an API key)."""


@dataclass(frozen=True)
class Operation:
    """What one route takes and answers."""

    ok: type[BaseModel] | str
    """The 200 body: a model (JSON) or a media type ('text/plain', ...)."""
    body: type[BaseModel] | None = None
    """The JSON request body."""
    errors: tuple[int, ...] = ()
    """Statuses besides the common ones (COMMON_ERRORS)."""
    streams: bool = False
    """`stream: true` answers server-sent events."""
    public: bool = False
    """No API key needed."""


POOLING_ERRORS = (404, 415, 429, 503)
"""A pooling route's statuses: 400 also when the model does not pool (or pools otherwise)."""
POOLING: dict[tuple[str, str], Operation] = {
    ("post", path): Operation(ok, body, POOLING_ERRORS)
    for paths, ok, body in (
        ((embeddings.EMBEDDINGS,), embeddings.EmbeddingList, embeddings.EmbeddingRequest),
        ((embeddings.SCORE, "/score"), embeddings.ScoreList, embeddings.ScoreRequest),
        (
            (embeddings.RERANK, "/rerank", "/v2/rerank"),
            embeddings.RerankList,
            embeddings.RerankRequest,
        ),
    )
    for path in paths
}
"""vLLM's pooling routes (served with and without /v1, as vLLM does)."""

OPERATIONS: dict[tuple[str, str], Operation] = {
    **POOLING,
    ("post", "/v1/completions"): Operation(
        responses.Completion, CompletionRequest, (404, 415, 429, 503), streams=True
    ),
    ("post", "/v1/chat/completions"): Operation(
        responses.ChatCompletion, ChatCompletionRequest, (404, 415, 429, 503), streams=True
    ),
    ("post", "/v1/responses"): Operation(
        Response, ResponsesRequest, (404, 415, 429, 503), streams=True
    ),
    ("get", "/v1/models"): Operation(responses.ModelList),
    ("get", "/v1/models/{model_id}"): Operation(responses.Model, errors=(404,)),
    ("post", "/v1/files"): Operation(objects.FileObject, errors=(429, 507)),
    ("get", "/v1/files"): Operation(objects.FileList),
    ("get", "/v1/files/{file_id}"): Operation(objects.FileObject, errors=(404,)),
    ("delete", "/v1/files/{file_id}"): Operation(objects.FileDeleted, errors=(404, 507)),
    ("get", "/v1/files/{file_id}/content"): Operation("application/octet-stream", errors=(404,)),
    ("post", "/v1/batches"): Operation(objects.Batch, BatchCreateRequest, (404, 415, 507)),
    ("get", "/v1/batches"): Operation(objects.BatchList),
    ("get", "/v1/batches/{batch_id}"): Operation(objects.Batch, errors=(404,)),
    ("post", "/v1/batches/{batch_id}/cancel"): Operation(objects.Batch, errors=(404, 507)),
    ("post", "/tokenize"): Operation(responses.Tokenized, TokenizeRequest, (404, 415, 503)),
    ("post", "/detokenize"): Operation(responses.Detokenized, DetokenizeRequest, (404, 415, 503)),
    ("get", "/tokenizer_info"): Operation(responses.TokenizerInfo, errors=(503,)),
    ("get", "/health"): Operation(responses.Health, public=True),
    ("get", "/ready"): Operation(responses.Ready, errors=(503,), public=True),
    ("get", "/metrics"): Operation("text/plain"),
}

UPLOAD_FORM = {
    "type": "object",
    "properties": {
        "file": {"type": "string", "format": "binary", "description": "a JSONL file"},
        "purpose": {"type": "string", "enum": ["batch"]},
    },
    "required": ["file", "purpose"],
}


SSE_EVENT = {
    "type": "object",
    "description": "One server-sent event of `stream: true`: a JSON chunk (CompletionChunk or "
    "ChatCompletionChunk), or [DONE] last; /v1/responses sends Responses events (`event:` "
    "and `data:` lines, the last response.completed or response.incomplete).",
    "properties": {"data": {"type": "string"}},
    "required": ["data"],
}


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": REF.format(model=model.__name__)}


def _responses(path: str, op: Operation, secured: bool) -> dict[str, Any]:
    content: dict[str, Any]
    if isinstance(op.ok, str):
        content = {op.ok: {"schema": {"type": "string"}}}
    else:
        content = _json(_ref(op.ok))
    if op.streams:
        content["text/event-stream"] = {"schema": SSE_EVENT}
    answers: dict[str, Any] = {"200": {"description": "OK", "content": content}}
    unauthorized = {401} if op.public or not secured else set()
    for status in sorted({*COMMON_ERRORS, *op.errors} - unauthorized):
        error = _json(_ref(responses.ErrorResponse))
        if path == "/ready" and status == 503:
            error = _json(_ref(responses.NotReady))
        answers[str(status)] = {"description": ERRORS[status], "content": error}
    return answers


def build_schema(app: FastAPI, secured: bool) -> dict[str, Any]:
    """FastAPI's schema (paths, parameters) with the bodies and statuses stated above;
    `secured`: the daemon has an API key, so every route but the probes needs it."""
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    models = {op.body for op in OPERATIONS.values() if op.body is not None}
    for module in (responses, objects):
        found = [m for name, m in vars(module).items() if not name.startswith("_")]
        models |= {m for m in found if isinstance(m, type) and issubclass(m, BaseModel)}
    models.discard(BaseModel)
    _, defs = models_json_schema(
        [(m, "validation") for m in sorted(models, key=lambda m: m.__name__)], ref_template=REF
    )
    components = schema.setdefault("components", {})
    components["schemas"] = defs.get("$defs", {})
    if secured:
        components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    for (method, path), op in OPERATIONS.items():
        spec = schema["paths"][path][method]
        spec["responses"] = _responses(path, op, secured)
        if secured and not op.public:
            spec["security"] = [{"bearer": []}]
        if op.body is not None:
            spec["requestBody"] = {"required": True, "content": _json(_ref(op.body))}
        elif (method, path) == ("post", "/v1/files"):
            spec["requestBody"] = {
                "required": True,
                "content": {"multipart/form-data": {"schema": UPLOAD_FORM}},
            }
    return schema


def install_openapi(app: FastAPI, secured: bool) -> None:
    """Serve `build_schema(app)` (built once, on the first request) at /openapi.json."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build_schema(app, secured)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
