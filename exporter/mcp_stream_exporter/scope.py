"""The MCP session and token of the HTTP request a piece of server code runs for.

The SDK's ``EventStore`` API gets no session and no principal. An ASGI layer binds a ``RequestScope``
per request and fills in the session id when the response headers go out; the session's message
router runs in a copy of the initialize request's context, so ``store_event`` sees that request's
scope, and ``replay_events_after`` runs in the resuming GET's task and sees that request's.
"""

from __future__ import annotations

from contextvars import ContextVar, Token
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from mcp_stream_exporter.asgi import ASGIApp
from mcp_stream_exporter.auth import ABSENT, AuthView


@dataclass(slots=True)
class RequestScope:
    session_id: str | None = None
    auth: AuthView = ABSENT  # the token of *this* request; stale inside store_event (the opener's)


_current: ContextVar[RequestScope | None] = ContextVar("mcp_stream_request_scope", default=None)


def current() -> RequestScope | None:
    return _current.get()


def bind(scope: RequestScope) -> Token[RequestScope | None]:
    return _current.set(scope)


def unbind(token: Token[RequestScope | None]) -> None:
    _current.reset(token)


@runtime_checkable
class ExchangeAware(Protocol):
    """An EventStore that must also see the HTTP exchange (the guard does): ``asgi`` wraps the app.
    ``instrument_server`` applies it, inside the hooks' observer."""

    def asgi(self, app: ASGIApp) -> ASGIApp: ...
