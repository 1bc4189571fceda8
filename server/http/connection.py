"""`DaemonProtocol`: uvicorn's HTTP/1.1 protocol with a deadline on reading request headers.

uvicorn closes a kept-alive connection that stays idle (`timeout_keep_alive`), but sets no
deadline on the headers of a request: a client that connects and sends nothing, or trickles
one header line every few seconds (slowloris), holds its connection, and the socket and
memory behind it, forever, without ever showing an API key. Here the headers of each request
must arrive whole within `header_timeout_s` of the connection being made, or of the first
byte after the previous response; otherwise the connection is closed (as nginx's
`client_header_timeout` does). The body has its own deadlines (server/http/middleware.py).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger("nanoflex.server")


class DaemonConfig(uvicorn.Config):
    """uvicorn's config plus what `DaemonProtocol` reads."""

    def __init__(self, app: Any, *, header_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(app, http=DaemonProtocol, **kwargs)
        self.header_timeout_s = header_timeout_s


class DaemonProtocol(H11Protocol):
    """H11Protocol that closes a connection whose request headers take too long."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self.header_deadline: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        self._arm_header_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_deadline()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.header_deadline is None and self._awaits_headers():
            self._arm_header_deadline()  # the first byte of the next request
        super().data_received(data)
        if not self._awaits_headers():
            self._cancel_header_deadline()

    def _awaits_headers(self) -> bool:
        """True while the next request's headers have not arrived whole."""
        return self.conn.their_state is h11.IDLE and self.conn.our_state is h11.IDLE

    def _arm_header_deadline(self) -> None:
        assert isinstance(self.config, DaemonConfig)
        timeout_s = self.config.header_timeout_s
        self.header_deadline = self.loop.call_later(timeout_s, self._headers_too_slow)

    def _cancel_header_deadline(self) -> None:
        if self.header_deadline is not None:
            self.header_deadline.cancel()
            self.header_deadline = None

    def _headers_too_slow(self) -> None:
        self.header_deadline = None
        if self.transport.is_closing() or not self._awaits_headers():
            return
        logger.debug("closing %s: request headers not received in time", self.client)
        self.transport.close()  # no response: h11 cannot answer a request it never got
