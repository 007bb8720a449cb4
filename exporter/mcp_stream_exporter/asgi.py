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
    """The request's path within the app, as Starlette routes it (``starlette._utils.get_route_path``): a ``Mount``
    (and a server's ``--root-path``) keeps the whole path in ``path`` and its prefix in ``root_path``, which is taken
    off only where a ``/`` follows it (``/mcp`` under the root ``/m`` is routed as ``/mcp``)."""
    path: str = scope.get("path", "")
    root: str = scope.get("root_path", "")
    if not root or not path.startswith(root):
        return path
    if path == root:
        return ""
    return path[len(root):] if path[len(root)] == "/" else path
