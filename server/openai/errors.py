"""OpenAI's error envelope and the typed `APIError` every refusal is raised as (no HTTP here:
server/http/errors.py turns them into answers).

Every error the daemon returns has the shape
`{"error": {"message": str, "type": str, "param": str | None, "code": str | None}}`.
"""

from __future__ import annotations

from typing import Any

from server.openai.responses import ErrorBody, ErrorResponse


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

    def body(self) -> ErrorResponse:
        """OpenAI's `{"error": {...}}` envelope."""
        error = ErrorBody(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=error)

    def to_dict(self) -> dict[str, Any]:
        """The envelope as JSON values."""
        return self.body().model_dump()


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


def too_many_batches(limit: int) -> APIError:
    """429: `limit` batches are unfinished already; nothing was created."""
    return APIError(
        429,
        f"{limit} batches are running or waiting already (the server's limit); create this one "
        "once one of them has finished, or cancel one.",
        type="rate_limit_error",
        code="too_many_batches",
    )


def too_many_uploads(limit: int, retry_after_s: int) -> APIError:
    """429: `limit` uploads are arriving already; this one was not read."""
    return APIError(
        429,
        f"{limit} uploads are in progress already (the server's limit); retry after "
        f"{retry_after_s} s.",
        type="rate_limit_error",
        code="too_many_uploads",
        headers={"Retry-After": str(retry_after_s)},
    )


def storage_limit_reached(limit_bytes: int, stored_bytes: int) -> APIError:
    """507: an upload would take the data directory's files past their byte limit."""
    return APIError(
        507,
        f"The server stores at most {limit_bytes} bytes of files and holds {stored_bytes}; "
        "this upload does not fit. Nothing was stored; delete files you no longer need "
        "(DELETE /v1/files/{file_id}) and retry.",
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


OFFLOAD_UNAVAILABLE = "offload_storage_unavailable"


def offload_unavailable(reason: str) -> APIError:
    """503: the engine's offload directory failed the request (disk full, I/O error), or rests
    after such a failure; `reason` says which. Nothing was wrong with the request."""
    return APIError(
        503,
        f"{reason[:1].upper()}{reason[1:]}. Nothing is wrong with the request; retry shortly.",
        type="server_error",
        code=OFFLOAD_UNAVAILABLE,
        headers={"Retry-After": "2"},
    )
