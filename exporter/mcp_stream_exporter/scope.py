"""The MCP session and token of the HTTP request a piece of server code runs for.

The SDK's ``EventStore`` API gets no session and no principal. An ASGI layer binds a ``RequestScope``
per request and fills in the session id when the response headers go out; the session's message
router runs in a copy of the initialize request's context, so ``store_event`` sees that request's
scope, and ``replay_events_after`` runs in the resuming GET's task and sees that request's.
"""

from __future__ import annotations

from collections.abc import Callable
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

# The context variable's own methods, not functions around them: the server's hooks read the scope on
# every event stored and bind one to every request, and a call of ours around each is a Python frame.
current: Callable[[], RequestScope | None] = _current.get
bind: Callable[[RequestScope | None], Token[RequestScope | None]] = _current.set
unbind: Callable[[Token[RequestScope | None]], None] = _current.reset


@runtime_checkable
class ExchangeAware(Protocol):
    """An EventStore that must also see the HTTP exchange (the guard does): ``asgi`` wraps the app, whose MCP
    endpoint is at ``path``. ``instrument_server`` applies it, inside the hooks' observer."""

    def asgi(self, app: ASGIApp, path: str) -> ASGIApp: ...
