"""The ASGI types the server-side layers (hooks' observer, the guard) are written against."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def route_path(scope: Scope) -> str:
    """The request's path within the app, as Starlette routes it: a ``Mount`` (and a server's ``--root-path``)
    keeps the whole path in ``path`` and its prefix in ``root_path``."""
    path: str = scope.get("path", "")
    root: str = scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path
