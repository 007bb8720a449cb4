"""One POST to an ASGI app's MCP endpoint, its body in one message, then only a disconnect to receive; what
the app sends is dropped. The server hooks' unit tests drive the observer with it."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any


def post(app: Any, body: bytes, headers: Sequence[tuple[bytes, bytes]]) -> None:
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict[str, Any]:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        return None

    asyncio.run(app({"type": "http", "path": "/mcp", "method": "POST", "headers": list(headers)}, receive, send))
