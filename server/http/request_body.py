"""Reading a JSON request body: `application/json` only, decoded by `loads_json`.

Requiring the JSON media type keeps browsers from sending these requests cross-site
without a CORS preflight (a page may POST `text/plain` anywhere, never
`application/json`). Bodies are decoded in a worker thread when large, so a big one
does not stall the event loop.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import Request

from server.openai.errors import APIError, invalid_request
from server.openai.json_body import JSONBodyError, loads_json

JSON_MEDIA_TYPE = "application/json"
DECODE_INLINE_BYTES = 64 * 1024
"""Bodies up to this size are decoded on the event loop (a thread hop costs more)."""


def unsupported_media_type(content_type: str) -> APIError:
    """415: a JSON route got a body of another media type."""
    shown = content_type or "none"
    return APIError(
        415,
        f"Content-Type must be {JSON_MEDIA_TYPE} (got {shown}); send the body as JSON.",
        code="unsupported_media_type",
    )


async def read_body(request: Request) -> bytes:
    """The raw body of a JSON route, after checking its media type."""
    content_type = request.headers.get("content-type", "")
    if content_type.split(";")[0].strip().lower() != JSON_MEDIA_TYPE:
        raise unsupported_media_type(content_type)
    return await request.body()


def decode_json(raw: bytes) -> Any:
    """The decoded body, or a 400 that says why it is not acceptable JSON."""
    try:
        return loads_json(raw)
    except JSONBodyError as e:
        raise invalid_request(
            f"The request body is not valid JSON: {e}. Send a JSON object.", code="invalid_json"
        ) from e


async def read_json(request: Request) -> Any:
    """The decoded JSON body of a JSON route."""
    raw = await read_body(request)
    if len(raw) <= DECODE_INLINE_BYTES:
        return decode_json(raw)
    return await asyncio.to_thread(decode_json, raw)
