"""Every failure as OpenAI's error envelope: the handlers that turn `APIError` and every other
exception into an answer. Invalid requests are 400 (FastAPI's default 422 never escapes),
unknown routes 404, a full data directory 507."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from engine.core.sampling_params import SamplingError
from server.batch.storage_faults import StorageError
from server.http.responses import error_response
from server.openai.errors import APIError, invalid_request

logger = logging.getLogger("nanoflex.server")


def insufficient_storage(error: StorageError) -> APIError:
    """507: the data directory cannot take the write (disk full, read-only); nothing was
    stored, so the same request can be sent again once space is freed."""
    return APIError(
        507,
        f"The server cannot store this request's data ({error}). Nothing was stored; "
        "retry once the server's operator has freed space in its data directory.",
        type="server_error",
        code="insufficient_storage",
    )


def _validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    if not errors:
        return invalid_request("Invalid request.")
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ()) if part not in ("body", "query", "path")]
    if first.get("type") == "json_invalid":
        return invalid_request(
            "The request body is not valid JSON; send a JSON object.", code="invalid_json"
        )
    param = ".".join(loc) or None
    where = f" at '{param}'" if param else ""
    return invalid_request(f"{first.get('msg', 'invalid value')}{where}.", param=param)


SERVED = (
    "POST /v1/chat/completions, POST /v1/completions, POST /v1/responses, GET /v1/models, "
    "the Batch API (/v1/files, /v1/batches), POST /tokenize, POST /detokenize, and for a "
    "pooling model POST /v1/embeddings, POST /v1/score, POST /v1/rerank"
)
OTHER_OPENAI_ROUTES = {
    "/v1/audio": "audio",
    "/v1/images": "images",
    "/v1/moderations": "moderations",
    "/v1/fine_tuning": "fine-tuning",
    "/v1/assistants": "assistants",
    "/v1/threads": "threads",
    "/v1/vector_stores": "vector stores",
    "/v1/uploads": "uploads",
    "/v1/realtime": "realtime sessions",
    "/v1/evals": "evals",
    "/v1/containers": "containers",
    "/v1/conversations": "conversations",
    "/pooling": "pooling",
}


def not_served(method: str, path: str) -> APIError:
    """404 in OpenAI's envelope for a route nanoflex does not serve, saying what it does."""
    what = next((w for p, w in OTHER_OPENAI_ROUTES.items() if path.startswith(p)), None)
    head = f"{method} {path} is not served"
    if what is not None:
        head = f"nanoflex does not serve {what} ({method} {path}): it serves text generation"
    return APIError(404, f"{head}. Served routes: {SERVED}.", code="route_not_served")


CLIENT_CLOSED_REQUEST = 499
"""nginx's status for a request whose client went away before its answer (never seen by it)."""

_STATUS_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}


def install_error_handlers(app: FastAPI) -> None:
    """Route every exception through OpenAI's envelope."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> Response:
        return error_response(exc, request.scope)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> Response:
        return error_response(_validation_error(exc), request.scope)

    @app.exception_handler(StorageError)
    async def _storage(request: Request, exc: StorageError) -> Response:
        logger.error("storage failure: %s", exc)
        return error_response(insufficient_storage(exc), request.scope)

    @app.exception_handler(SamplingError)
    async def _sampling(request: Request, exc: SamplingError) -> Response:
        return error_response(invalid_request(str(exc)), request.scope)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        status = exc.status_code
        if status == 404 and exc.detail == "Not Found":  # no such route
            return error_response(not_served(request.method, request.url.path), request.scope)
        kind = "invalid_request_error" if status < 500 else "server_error"
        err = APIError(status, str(exc.detail), type=kind, code=_STATUS_CODES.get(status))
        err.headers = dict(exc.headers or {})
        return error_response(err, request.scope)

    @app.exception_handler(ClientDisconnect)
    async def _gone(_: Request, exc: ClientDisconnect) -> Response:
        return Response(status_code=CLIENT_CLOSED_REQUEST)  # closed mid-body: nothing to log

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> Response:
        logger.exception("unhandled error", exc_info=exc)
        return error_response(
            APIError(
                500,
                "Internal server error; the daemon log has the details.",
                type="server_error",
                code="internal_error",
            )
        )
