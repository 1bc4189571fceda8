"""`Guard`: ASGI middleware that checks every request before any route sees it.

In order: the Host header (DNS rebinding), the Origin header (cross-site requests
from browsers), the bearer API key, then the body as it streams in: its size and
how long it takes to arrive.

- Host: an IP address, `localhost` (or `*.localhost`), the bound address, or a
  name in `--allowed-hosts` ('*' accepts any). A rebinding attack reaches the daemon
  under the attacker's own name, which is none of these: 400 `host_not_allowed`.
- Origin: browsers send it with cross-site requests; one that is neither the
  request's own origin nor in `--allowed-origins` is refused: 403 `origin_not_allowed`.
- Sizes are enforced without buffering: a declared Content-Length over the limit
  is refused at once, and the body is counted as it streams in, so an upload that
  lies about (or omits) its length is cut off at the limit (413).
- A body that stops arriving for `body_timeout_s`, or still arrives `body_total_timeout_s`
  after the request began, is answered 408 and the connection closed, so a slow client
  cannot hold a request open (the headers' deadline is server/http/connection.py's).
- After a large body, the heap pages it freed go back to the OS (`server.openai.memory`).
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.http.responses import error_response
from server.openai.errors import APIError, payload_too_large, unauthorized
from server.openai.memory import LARGE_BODY_BYTES, return_freed_memory

OPEN_PATHS = ("/health", "/ready")
"""Paths that never need the API key (liveness and readiness probes)."""


class BodyTooLarge(APIError):
    """The request body streamed past its limit."""

    def __init__(self, limit_bytes: int, what: str) -> None:
        err = payload_too_large(limit_bytes, what)
        super().__init__(413, err.message, code=err.code)


class BodyTimeout(APIError):
    """The request body stopped arriving."""

    def __init__(self, why: str) -> None:
        super().__init__(
            408,
            f"The request body did not arrive in time ({why}); send it faster, without pauses.",
            code="request_timeout",
            headers={"Connection": "close"},
        )


def host_not_allowed(host: str) -> APIError:
    return APIError(
        400,
        f"Host {host!r} is not served here; start the daemon with --allowed-hosts {host} "
        "to accept it.",
        code="host_not_allowed",
    )


def origin_not_allowed(origin: str) -> APIError:
    return APIError(
        403,
        f"Requests from the web origin {origin!r} are not allowed; start the daemon with "
        f"--allowed-origins {origin} to allow them.",
        type="permission_error",
        code="origin_not_allowed",
    )


class Guard:
    """Host and Origin checks, `Authorization: Bearer <key>` (constant-time), body limits."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        api_key: str | None,
        max_body_bytes: int,
        max_file_bytes: int,
        body_timeout_s: float,
        body_total_timeout_s: float,
        bind_host: str,
        allowed_hosts: tuple[str, ...],
        allowed_origins: tuple[str, ...],
    ) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self.max_file_bytes = max_file_bytes
        self.body_timeout_s = body_timeout_s
        self.body_total_timeout_s = body_total_timeout_s
        self.hosts = {h.lower().rstrip(".") for h in (*allowed_hosts, bind_host)}
        self.origins = {o.lower().rstrip("/") for o in allowed_origins}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = _headers(scope)
        refusal = self._refusal(scope, headers)
        if refusal is not None:
            await error_response(refusal, scope)(scope, receive, send)
            return
        path: str = scope["path"]
        is_upload = path == "/v1/files" and scope["method"] == "POST"
        limit = self.max_body_bytes if not is_upload else self.max_file_bytes
        what = "uploaded file" if is_upload else "request body"
        declared = headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            await error_response(payload_too_large(limit, what), scope)(scope, receive, send)
            return

        received = 0
        body_done = False
        response_started = False
        loop = asyncio.get_running_loop()
        body_deadline = loop.time() + self.body_total_timeout_s

        async def guarded_receive() -> Message:
            nonlocal received, body_done
            if body_done:  # after the body only a disconnect can come: no deadline
                return await receive()
            left_s = body_deadline - loop.time()
            try:
                message = await asyncio.wait_for(receive(), min(self.body_timeout_s, left_s))
            except asyncio.TimeoutError:
                if left_s <= self.body_timeout_s:
                    raise BodyTimeout(f"it took over {self.body_total_timeout_s:g} s") from None
                raise BodyTimeout(f"it paused over {self.body_timeout_s:g} s") from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                body_done = not message.get("more_body", False)
                if received > limit:
                    raise BodyTooLarge(limit, what)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal response_started
            if message["type"] == "http.response.start":
                response_started = True
            await send(message)

        try:
            await self.app(scope, guarded_receive, tracking_send)
        except (BodyTooLarge, BodyTimeout) as e:
            if response_started:
                raise
            await error_response(e, scope)(scope, receive, send)
        finally:
            if received >= LARGE_BODY_BYTES:  # its body and what was parsed from it are freed
                await asyncio.to_thread(return_freed_memory)

    def _refusal(self, scope: Scope, headers: dict[str, str]) -> APIError | None:
        """Why this request is refused before it runs, or None."""
        host = headers.get("host")
        if host is not None and not self._host_allowed(_hostname(host)):
            return host_not_allowed(_hostname(host))
        origin = headers.get("origin")
        if origin is not None and not self._origin_allowed(origin, host):
            return origin_not_allowed(origin)
        if (
            self.api_key is not None
            and scope["path"] not in OPEN_PATHS
            and not self._authorized(headers)
        ):
            return unauthorized()
        return None

    def _host_allowed(self, name: str) -> bool:
        if "*" in self.hosts or name in self.hosts:
            return True
        if name == "localhost" or name.endswith(".localhost"):
            return True
        try:
            ipaddress.ip_address(name)  # rebinding needs a DNS name; an address is safe
        except ValueError:
            return any(h.startswith(".") and name.endswith(h) for h in self.hosts)
        return True

    def _origin_allowed(self, origin: str, host: str | None) -> bool:
        origin = origin.lower().rstrip("/")
        if "*" in self.origins or origin in self.origins:
            return True
        _, sep, netloc = origin.partition("://")
        return bool(sep) and host is not None and netloc == host.lower()  # same origin

    def _authorized(self, headers: dict[str, str]) -> bool:
        assert self.api_key is not None
        scheme, _, token = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            return False
        return hmac.compare_digest(token.strip().encode(), self.api_key)


def _hostname(host: str) -> str:
    """The name or address of a Host header, without the port: '[::1]:8000' -> '::1'."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    name, sep, port = host.rpartition(":")
    name = name if sep and port.isdigit() else host
    return name.rstrip(".")


def _headers(scope: Scope) -> dict[str, str]:
    return {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
