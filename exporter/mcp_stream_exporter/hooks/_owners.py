"""Who opened each session, as the SDK tells principals apart: a 404 it gives another principal is no expiry.

The SDK's session manager answers a request naming a live session with 404 "Session not found" when the
request's principal (``authorization_context``: client id, issuer, subject) is not the one that opened the
session, exactly as if the session were gone. Read as the session's expiry, anyone who knows a session id
could make its calls in flight read as gone with it. The server's hooks keep each session's opener, in
process only, and mark such a 404 (``mcp_stream.session.owner``) so the detector does not take it for one.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Final

from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser, authorization_context

from mcp_stream_exporter.asgi import Scope

# sessions whose opener is kept (some 150 B each): past it the oldest are forgotten, and a 404 naming one of those
# reads as the session's expiry, as every 404 did before
_MAX_SESSIONS: Final = 10_000


def _principal(scope: Scope) -> int | None:
    """The request's principal as the SDK compares it (the token verifier's view, not the token), hashed: no
    identifier is kept, and this process alone compares them. None: no authenticated user."""
    user = scope.get("user")
    if not isinstance(user, AuthenticatedUser):
        return None
    context = authorization_context(user)
    return hash((context["client_id"], context["issuer"], context["subject"]))


class SessionOwners:
    """The principal that opened each session this server's hooks saw opened, newest ``_MAX_SESSIONS``."""

    def __init__(self) -> None:
        self._owners: OrderedDict[str, int | None] = OrderedDict()

    def opened(self, session_id: str, scope: Scope) -> None:
        """The response to ``scope``'s request opened ``session_id`` (its first answer names it)."""
        self._owners[session_id] = _principal(scope)
        if len(self._owners) > _MAX_SESSIONS:
            self._owners.popitem(last=False)

    def ended(self, session_id: str) -> None:
        """Its DELETE was accepted: the SDK forgot it, and a 404 naming it tells so whoever asks."""
        self._owners.pop(session_id, None)

    def same(self, session_id: str, scope: Scope) -> bool:
        """Whether ``scope``'s request is of the principal that opened ``session_id``, kept still: its 404 tells the
        session is gone (expired, or ended by its server), not that the request is of anyone else."""
        return session_id in self._owners and self._owners[session_id] == _principal(scope)

    def other(self, session_id: str, scope: Scope) -> bool:
        """Whether ``scope``'s request is of another principal than the one that opened ``session_id``: the SDK
        refuses it whether the session lives or not (False for a session not kept: its 404 reads as expiry)."""
        if session_id not in self._owners:
            return False
        return self._owners[session_id] != _principal(scope)
