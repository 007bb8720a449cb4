"""What a slow or idle HTTP client may hold: a connection limit and header, idle (and, at ingest,
body) timeouts on the detector's uvicorn server.

uvicorn alone keeps a connection that never finishes its headers open for ever, and serves (with a
503) any number of connections past its concurrency limit: a few thousand slow sockets exhaust the
file limit and stop all service. Here a connection must send its request's headers within
``header_timeout_s`` of connecting (or of its previous response), an idle keep-alive connection is
closed after ``idle_timeout_s``, and connections past ``max_connections`` are answered 503 and closed
at once. The request body's own timeout is the ingest handler's (``IngestLimits.body_timeout_s``).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

_MAX_HEADER_BYTES = 16 * 1024  # h11 refuses (400) a request whose headers are larger
_BUSY = b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    max_connections: int = 256  # HTTP connections at once; beyond, 503 and closed
    header_timeout_s: float = 10.0  # to send a request's headers, from connecting or the previous response
    idle_timeout_s: float = 30.0  # a keep-alive connection with no request (HTTP and gRPC)


def server_config(app: Any, host: str, port: int, limits: ConnectionLimits, **options: Any) -> uvicorn.Config:
    """A uvicorn config for ``app`` that holds to ``limits``."""
    return uvicorn.Config(app, host=host, port=port, http=_bounded_protocol(limits),
                          timeout_keep_alive=max(1, round(limits.idle_timeout_s)),
                          limit_concurrency=limits.max_connections,
                          h11_max_incomplete_event_size=_MAX_HEADER_BYTES, **options)


def _bounded_protocol(limits: ConnectionLimits) -> type[H11Protocol]:
    class BoundedH11Protocol(H11Protocol):
        """uvicorn's h11 protocol with a header deadline and a hard connection limit."""

        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            if len(self.connections) >= limits.max_connections:
                self.transport = transport
                transport.write(_BUSY)
                transport.close()
                return
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            self._deadline = self.loop.call_later(limits.header_timeout_s, self._headers_late)

        def _headers_late(self) -> None:
            waiting = self.cycle is None or self.cycle.response_complete  # no request being served
            if waiting and not self.transport.is_closing():
                self.transport.close()

    return BoundedH11Protocol
