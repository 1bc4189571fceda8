"""Answers as HTTP responses: a response model as JSON, an `APIError` as OpenAI's envelope.

Every refusal (4xx) passes through `error_response`: logged once at info with its reason, and
counted in `nanoflex_requests_rejected_total` by its code."""

from __future__ import annotations

import logging
from typing import Any

from fastapi.responses import Response
from pydantic import BaseModel

from server.openai.errors import APIError

logger = logging.getLogger("nanoflex.server")


def json_response(
    body: BaseModel, status_code: int = 200, headers: dict[str, str] | None = None
) -> Response:
    """`body` as JSON, its unset optional fields left out."""
    content = body.model_dump_json(exclude_unset=True)
    return Response(content, status_code, headers, media_type="application/json")


def error_response(error: APIError, scope: Any = None) -> Response:
    """The error's envelope with its status and headers (Retry-After, ...). A refusal (4xx)
    is logged at info with what was asked (`scope`: the request's ASGI scope) and counted
    by reason in the app's metrics."""
    if 400 <= error.status_code < 500:
        where = f"{scope.get('method')} {scope.get('path')}" if scope else "request"
        param = f" (param {error.param})" if error.param else ""
        logger.info(
            "refused %s: %d %s%s: %s",
            where,
            error.status_code,
            error.code or error.type,
            param,
            error.message,
        )
        app = scope.get("app") if scope else None
        state = getattr(getattr(app, "state", None), "nanoflex", None)
        if state is not None:
            reason = error.code or f"http_{error.status_code}"
            state.metrics.rejected.labels(reason).inc()
    return json_response(error.body(), error.status_code, error.headers)
