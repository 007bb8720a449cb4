"""What a slow or idle HTTP client may hold: a connection limit and header, idle (and, at ingest,
body) timeouts on the detector's uvicorn server.

uvicorn alone keeps a connection that never finishes its headers open for ever, and serves (with a
503) any number of connections past its concurrency limit: a few thousand slow sockets exhaust the
file limit and stop all service. Here a connection must send its request's headers within
``header_timeout_s`` of connecting (or of its previous response), and an idle keep-alive connection
is closed after ``idle_timeout_s``. At most ``max_connections`` are held: a new one takes the place
of the one that has waited longest for its headers (slow clients make way for prompt ones); only
when every connection is serving a request is the new one answered 503 and closed. The request
body's own timeout is the ingest handler's (``IngestLimits.body_timeout_s``).
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
    max_connections: int = 256  # HTTP connections held at once
    header_timeout_s: float = 10.0  # to send a request's headers, from connecting or the previous response
    idle_timeout_s: float = 30.0  # a keep-alive connection with no request (HTTP and gRPC)


def server_config(app: Any, host: str, port: int, limits: ConnectionLimits, **options: Any) -> uvicorn.Config:
    """A uvicorn config for ``app`` that holds to ``limits``."""
    return uvicorn.Config(app, host=host, port=port, http=_bounded_protocol(limits),
                          timeout_keep_alive=max(1, round(limits.idle_timeout_s)),
                          h11_max_incomplete_event_size=_MAX_HEADER_BYTES, **options)


def _bounded_protocol(limits: ConnectionLimits) -> type[H11Protocol]:
    class BoundedH11Protocol(H11Protocol):
        """uvicorn's h11 protocol with a header deadline and a hard connection limit."""

        _deadline: asyncio.TimerHandle | None = None
        _waiting_since = 0.0

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            if len(self.connections) >= limits.max_connections and not self._make_room():
                self.transport = transport
                transport.write(_BUSY)
                transport.close()
                return
            super().connection_made(transport)
            self._arm()

        def _make_room(self) -> bool:
            """Close the connection that has waited longest for its request's headers, if any."""
            waiting = [c for c in self.connections if isinstance(c, BoundedH11Protocol) and c._waiting()]
            if not waiting:
                return False
            oldest = min(waiting, key=lambda c: c._waiting_since)
            oldest.transport.close()
            oldest.connections.discard(oldest)  # its slot is free now, before the loop reports the loss
            return True

        def _waiting(self) -> bool:
            return (self.cycle is None or self.cycle.response_complete) and not self.transport.is_closing()

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
            self._waiting_since = self.loop.time()
            self._deadline = self.loop.call_later(limits.header_timeout_s, self._headers_late)

        def _headers_late(self) -> None:
            if self._waiting():  # no request being served: its headers never came
                self.transport.close()

    return BoundedH11Protocol
