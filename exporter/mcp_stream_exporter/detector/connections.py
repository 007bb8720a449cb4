"""What a slow or idle HTTP client may hold: a connection limit and header, idle (and, at ingest,
body) timeouts on the detector's uvicorn server.

uvicorn alone keeps a connection that never finishes its headers open for ever, and serves (with a
503) any number of connections past its concurrency limit: a few thousand slow sockets exhaust the
file limit and stop all service. Here a connection must send its request's headers within
``header_timeout_s`` of connecting (or of its previous response), and an idle keep-alive connection
is closed after ``idle_timeout_s``. At most ``max_connections`` are held: a new one takes the place
of the one that has waited longest for its headers, or else of the one whose request body has been
coming longest, past ``body_grace_s`` (answered 408): slow clients make way for prompt ones. Only when
every connection is serving a request that is not slow is the new one answered 503 and closed. The
request body's own timeout is the ingest handler's (``IngestLimits.body_timeout_s``). Each connection
closed so, before it reached the app, is counted (``mcp_stream_detector_http_connections_closed_total``).
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass
from typing import Any

import h11
import uvicorn
from prometheus_client import CollectorRegistry, Counter
from uvicorn.protocols.http.h11_impl import H11Protocol

_MAX_HEADER_BYTES = 16 * 1024  # a request whose head is larger is refused (400)
_HEAD_END = re.compile(rb"\n\r?\n")  # where h11 finds a head's end
_BUSY_REASON = b"busy: every connection is serving a request (--max-connections); retry\n"
# as ingest's own overload answers: a Retry-After a sender's exporter waits out, and the reason
_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain; charset=utf-8\r\nretry-after: 1\r\n"
         b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(_BUSY_REASON), _BUSY_REASON))
_TOO_SLOW = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
# why a connection was closed before the app answered its request, or while it waited idle for the next
# (the metric's label values)
_REASONS = ("bad_request", "busy", "header_timeout", "slow_headers", "slow_body", "idle")
_BAD_REQUEST, _FULL, _HEADER_TIMEOUT, _SLOW_HEADERS, _SLOW_BODY, _IDLE = _REASONS


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    max_connections: int = 256  # HTTP connections held at once
    header_timeout_s: float = 10.0  # to send a request's headers, from connecting or the previous response
    idle_timeout_s: float = 30.0  # a keep-alive connection with no request (HTTP and gRPC)
    body_grace_s: float = 1.0  # a body still coming after this long makes way for a new connection at the limit


def server_config(app: Any, host: str, port: int, limits: ConnectionLimits, registry: CollectorRegistry,
                  **options: Any) -> uvicorn.Config:
    """A uvicorn config for ``app`` that holds to ``limits``, counting the connections it closes in
    ``registry``."""
    closed = Counter(
        "mcp_stream_detector_http_connections_closed", "HTTP connections the detector closed with a request "
        "unanswered, by reason: bad_request (400, a malformed or oversized head), header_timeout (a head not "
        "complete in time), slow_headers or slow_body (a slow client made way for a new connection at "
        "--max-connections), busy (503: every connection was serving a request); and idle (a keep-alive "
        "connection made way). A steady busy or slow_body rate means slow senders hold the slots: find them, "
        "or raise --max-connections.",
        ["reason"], registry=registry)
    for reason in _REASONS:
        closed.labels(reason)  # each shows as 0 before its first
    return uvicorn.Config(app, host=host, port=port, http=_bounded_protocol(limits, closed),
                          timeout_keep_alive=max(1, round(limits.idle_timeout_s)),
                          h11_max_incomplete_event_size=_MAX_HEADER_BYTES, **options)


def _bounded_protocol(limits: ConnectionLimits, closed: Counter) -> type[H11Protocol]:
    class BoundedH11Protocol(H11Protocol):
        """uvicorn's h11 protocol with a header deadline and a hard connection limit."""

        _deadline: asyncio.TimerHandle | None = None
        _waiting_since = 0.0
        _request_since = 0.0  # when the current request's head came
        _served = False  # a response went out: with nothing of a next request yet, it is an idle keep-alive

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            if len(self.connections) >= limits.max_connections and not self._make_room():
                self.transport = transport
                transport.write(_BUSY)
                transport.close()
                closed.labels(_FULL).inc()
                return
            super().connection_made(transport)
            self._arm()

        def handle_events(self) -> None:
            if self._head_too_large():
                self.send_400_response(f"Request head larger than {_MAX_HEADER_BYTES} bytes.")
                return
            cycle = self.cycle
            super().handle_events()
            if self.cycle is not cycle:
                self._request_since = self.loop.time()

        def _head_too_large(self) -> bool:
            """A request head past the limit that came whole: h11 bounds only a head still incomplete."""
            if self.conn.their_state is not h11.IDLE:
                return False
            buffered = self.conn.trailing_data[0]
            return len(buffered) > _MAX_HEADER_BYTES and _HEAD_END.search(buffered, 0, _MAX_HEADER_BYTES) is None

        def send_400_response(self, msg: str) -> None:
            super().send_400_response(msg)
            closed.labels(_BAD_REQUEST).inc()

        def _make_room(self) -> bool:
            """Close the connection that has waited longest for its request's headers, or else the one whose
            body has been coming longest, past the grace; False if there is none."""
            ours = [c for c in self.connections if isinstance(c, BoundedH11Protocol)]
            waiting = [c for c in ours if c._waiting()]
            if waiting:
                oldest = min(waiting, key=lambda c: c._waiting_since)
                oldest._close(_IDLE if oldest._idle() else _SLOW_HEADERS)
                return True
            slow_since = self.loop.time() - limits.body_grace_s
            slow = [c for c in ours if c._request_since <= slow_since and c._receiving_body()]
            if slow:
                oldest = min(slow, key=lambda c: c._request_since)
                oldest.transport.write(_TOO_SLOW)
                oldest._close(_SLOW_BODY)
                return True
            return False

        def _close(self, reason: str) -> None:
            self.transport.close()
            self.connections.discard(self)  # its slot is free now, before the loop reports the loss
            closed.labels(reason).inc()

        def _waiting(self) -> bool:
            return (self.cycle is None or self.cycle.response_complete) and not self.transport.is_closing()

        def _idle(self) -> bool:
            return self._served and not self.conn.trailing_data[0]

        def _receiving_body(self) -> bool:
            cycle = self.cycle
            return (cycle is not None and cycle.more_body and not cycle.response_complete
                    and not self.transport.is_closing())

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._served = True
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
            if not self._waiting():
                return  # a request is being served
            if self._idle():  # nothing of a next request: uvicorn's keep-alive timeout closes it, unless a
                # head starts meanwhile, which must then be in within the header timeout
                self._deadline = self.loop.call_later(limits.header_timeout_s, self._headers_late)
                return
            self.transport.close()
            closed.labels(_HEADER_TIMEOUT).inc()

    return BoundedH11Protocol
