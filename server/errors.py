"""OpenAI's error envelope, the typed `APIError`, and the handlers that make every failure use it.

Every error the daemon returns has the shape
`{"error": {"message": str, "type": str, "param": str | None, "code": str | None}}`.
Invalid requests are 400 (FastAPI's default 422 never escapes), unknown routes 404,
a full data directory 507.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.core.sampling_params import SamplingError
from server.storage_faults import StorageError

logger = logging.getLogger("nanoflex.server")


class APIError(Exception):
    """An error answered to the client with OpenAI's envelope and `status_code`."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def to_dict(self) -> dict[str, object]:
        """The JSON body: OpenAI's `{"error": {...}}` envelope."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def to_response(self) -> JSONResponse:
        return JSONResponse(self.to_dict(), status_code=self.status_code, headers=self.headers)


def invalid_request(
    message: str, param: str | None = None, code: str = "invalid_value"
) -> APIError:
    """400: the request cannot be served as sent."""
    return APIError(400, message, param=param, code=code)


_LIST_ROUTES = {"model": "/v1/models", "file": "/v1/files", "batch": "/v1/batches"}


def not_found(kind: str, object_id: str, param: str | None = None) -> APIError:
    """404 for an unknown model, file or batch; `kind` is 'model', 'file' or 'batch'."""
    return APIError(
        404,
        f"No such {kind}: {object_id!r}. List the available ones with GET {_LIST_ROUTES[kind]}.",
        param=param,
        code=f"{kind}_not_found",
    )


def payload_too_large(limit_bytes: int, what: str = "request body") -> APIError:
    """413: the body (or uploaded file) exceeds the configured limit."""
    return APIError(
        413,
        f"The {what} exceeds the limit of {limit_bytes} bytes; send less data per request.",
        code="request_too_large",
    )


def queue_full(retry_after_s: int) -> APIError:
    """429: the bounded request queue is full; the client should retry later."""
    return APIError(
        429,
        f"The server's request queue is full; retry after {retry_after_s} s.",
        type="rate_limit_error",
        code="queue_full",
        headers={"Retry-After": str(retry_after_s)},
    )


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


def unauthorized() -> APIError:
    """401: missing or wrong bearer API key."""
    return APIError(
        401,
        "Incorrect or missing API key. Send it as 'Authorization: Bearer <key>'.",
        code="invalid_api_key",
    )


def engine_unavailable() -> APIError:
    """503: the engine process is starting, restarting or stopped."""
    return APIError(
        503,
        "The engine is not ready (starting or restarting); retry shortly. See GET /ready.",
        type="server_error",
        code="engine_unavailable",
        headers={"Retry-After": "1"},
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


_STATUS_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}


def install_error_handlers(app: FastAPI) -> None:
    """Route every exception through OpenAI's envelope."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.to_response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc).to_response()

    @app.exception_handler(StorageError)
    async def _storage(_: Request, exc: StorageError) -> JSONResponse:
        logger.error("storage failure: %s", exc)
        return insufficient_storage(exc).to_response()

    @app.exception_handler(SamplingError)
    async def _sampling(_: Request, exc: SamplingError) -> JSONResponse:
        return invalid_request(str(exc)).to_response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        status = exc.status_code
        kind = "invalid_request_error" if status < 500 else "server_error"
        err = APIError(status, str(exc.detail), type=kind, code=_STATUS_CODES.get(status))
        err.headers = dict(exc.headers or {})
        return err.to_response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error", exc_info=exc)
        return APIError(
            500,
            "Internal server error; the daemon log has the details.",
            type="server_error",
            code="internal_error",
        ).to_response()
