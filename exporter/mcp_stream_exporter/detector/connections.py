"""What a slow or idle HTTP client may hold: a connection limit, a bound on a request's head, header
and idle (and, at ingest, body) timeouts on the detector's uvicorn server.

uvicorn alone keeps a connection that never finishes its headers open for ever, and serves (with a
503) any number of connections past its concurrency limit: a few thousand slow sockets exhaust the
file limit and stop all service. Here a connection must send its request's headers within
``header_timeout_s`` of connecting (or of its previous response), and an idle keep-alive connection
is closed after ``idle_timeout_s``. At most ``max_connections`` are held: a new one takes the place
of the one that has waited longest for its headers (slow clients make way for prompt ones); only
when every connection is serving a request is the new one answered 503 and closed. The request
body's own timeout is the ingest handler's (``IngestLimits.body_timeout_s``).

HTTP/1.1 is parsed by httptools (llhttp, in C: a fifth of what h11 cost a request). It buffers a
header until the header is complete, without a bound of its own: here a request line and headers
larger than ``_MAX_HEAD_BYTES``, or that many bytes received without the parser completing a piece
of the head, are a 400 and the connection closes (what h11 did past its incomplete-event size).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

_MAX_HEAD_BYTES = 16 * 1024  # a request line and headers
_BUSY = b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    max_connections: int = 256  # HTTP connections held at once
    header_timeout_s: float = 10.0  # to send a request's headers, from connecting or the previous response
    idle_timeout_s: float = 30.0  # a keep-alive connection with no request (HTTP and gRPC)


def server_config(app: Any, host: str, port: int, limits: ConnectionLimits, **options: Any) -> uvicorn.Config:
    """A uvicorn config for ``app`` that holds to ``limits``."""
    return uvicorn.Config(app, host=host, port=port, http=_bounded_protocol(limits),
                          timeout_keep_alive=max(1, round(limits.idle_timeout_s)), **options)


class _HeadTooLarge(Exception):
    """Raised from a parser callback: httptools stops, and uvicorn answers 400 and closes."""


def _bounded_protocol(limits: ConnectionLimits) -> type[HttpToolsProtocol]:
    class BoundedHttpToolsProtocol(HttpToolsProtocol):
        """uvicorn's httptools protocol with a bounded head, a header deadline and a hard connection limit."""

        _deadline: asyncio.TimerHandle | None = None
        _waiting_since = 0.0
        _head = 0  # bytes of the current request's line and headers, as the parser reports them
        _unparsed = 0  # bytes received since the parser last reported a piece of a head
        _silent = False  # no piece reported while the current read was parsed
        _in_body = False

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
            waiting = [c for c in self.connections if isinstance(c, BoundedHttpToolsProtocol) and c._waiting()]
            if not waiting:
                return False
            oldest = min(waiting, key=lambda c: c._waiting_since)
            oldest.transport.close()
            oldest.connections.discard(oldest)  # its slot is free now, before the loop reports the loss
            return True

        def _waiting(self) -> bool:
            return (self.cycle is None or self.cycle.response_complete) and not self.transport.is_closing()

        def data_received(self, data: bytes) -> None:
            self._silent = True
            super().data_received(data)
            if self._in_body or not self._silent or self.transport.is_closing():
                self._unparsed = 0
                return
            self._unparsed += len(data)  # held in the parser's buffer, a header not yet complete
            if self._unparsed > _MAX_HEAD_BYTES:
                self.send_400_response("Request headers too large.")

        def on_message_begin(self) -> None:
            self._head = 0
            self._silent = False
            super().on_message_begin()

        def on_url(self, url: bytes) -> None:
            self._took(len(url))
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._took(len(name) + len(value) + 4)  # ": " and CRLF
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self._in_body = True
            self._silent = False
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self._in_body = False
            self._silent = False
            super().on_message_complete()

        def _took(self, size: int) -> None:
            self._silent = False
            self._head += size
            if self._head > _MAX_HEAD_BYTES:
                raise _HeadTooLarge

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

    return BoundedHttpToolsProtocol
