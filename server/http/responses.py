"""Answers as HTTP responses: a response model as JSON, an `APIError` as OpenAI's envelope."""

from __future__ import annotations

from fastapi.responses import Response
from pydantic import BaseModel

from server.openai.errors import APIError


def json_response(
    body: BaseModel, status_code: int = 200, headers: dict[str, str] | None = None
) -> Response:
    """`body` as JSON, its unset optional fields left out."""
    content = body.model_dump_json(exclude_unset=True)
    return Response(content, status_code, headers, media_type="application/json")


def error_response(error: APIError) -> Response:
    """The error's envelope with its status and headers (Retry-After, ...)."""
    return json_response(error.body(), error.status_code, error.headers)
