"""The ASGI types the server-side layers (hooks' observer, the guard) are written against."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def headers_of(raw: Iterable[tuple[bytes, bytes]]) -> dict[str, str]:
    """ASGI header pairs as a dict with lower-cased names (HTTP/1.1 headers are latin-1)."""
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in raw}
