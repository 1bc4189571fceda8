"""`Guard`: ASGI middleware for the bearer API key and request-size limits, before any route.

Sizes are enforced without buffering: a declared Content-Length over the limit
is refused at once, and the body is counted as it streams in, so an upload that
lies about (or omits) its length is cut off at the limit.
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.errors import APIError, payload_too_large, unauthorized

OPEN_PATHS = ("/health", "/ready")
"""Paths that never need the API key (liveness and readiness probes)."""


class BodyTooLarge(APIError):
    """The request body streamed past its limit."""

    def __init__(self, limit_bytes: int, what: str) -> None:
        err = payload_too_large(limit_bytes, what)
        super().__init__(413, err.message, code=err.code)


class Guard:
    """Checks `Authorization: Bearer <key>` (constant-time) and caps body sizes."""

    def __init__(
        self,
        app: ASGIApp,
        api_key: str | None,
        max_body_bytes: int,
        max_file_bytes: int,
    ) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self.max_file_bytes = max_file_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = _headers(scope)
        path: str = scope["path"]
        if self.api_key is not None and path not in OPEN_PATHS and not self._authorized(headers):
            await unauthorized().to_response()(scope, receive, send)
            return
        is_upload = path == "/v1/files" and scope["method"] == "POST"
        limit = self.max_file_bytes if is_upload else self.max_body_bytes
        what = "uploaded file" if is_upload else "request body"
        declared = headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            await payload_too_large(limit, what).to_response()(scope, receive, send)
            return

        received = 0
        response_started = False

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(limit, what)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal response_started
            if message["type"] == "http.response.start":
                response_started = True
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except BodyTooLarge as e:
            if response_started:
                raise
            await e.to_response()(scope, receive, send)

    def _authorized(self, headers: dict[str, str]) -> bool:
        assert self.api_key is not None
        scheme, _, token = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            return False
        return hmac.compare_digest(token.strip().encode(), self.api_key)


def _headers(scope: Scope) -> dict[str, str]:
    return {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
