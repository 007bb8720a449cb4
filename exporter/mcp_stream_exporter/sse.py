"""Server-Sent Events frames: an incremental parser for bytes off the wire, and a renderer.

Both hooks read the same bytes the peer reads (server: what the ASGI app sends; client: what httpx2
receives), so they share this parser; the guard renders its ``event: error`` frames with it.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

_LINE_END = re.compile(rb"\r\n|\r|\n")


@dataclass(frozen=True, slots=True)
class SSEFrame:
    """One dispatched event. ``id`` is None when the frame has no ``id:`` line (the cursor stays)."""

    data: str = ""
    event: str | None = None
    id: str | None = None
    retry: int | None = None

    @property
    def type(self) -> str:
        """The event type a client dispatches on: ``message`` when there is no ``event:`` line."""
        return self.event or "message"


class SSEParser:
    """Feed it chunks in any split; it yields each complete frame once. Comments (pings) are counted."""

    __slots__ = ("_buf", "_data", "_event", "_id", "_retry", "_seen_field", "comments")

    def __init__(self) -> None:
        self._buf = b""
        self.comments = 0
        self._reset()

    def _reset(self) -> None:
        self._data: list[str] = []
        self._event: str | None = None
        self._id: str | None = None
        self._retry: int | None = None
        self._seen_field = False

    def feed(self, chunk: bytes) -> Iterator[SSEFrame]:
        buf = self._buf + chunk if self._buf else chunk
        pos = 0
        for m in _LINE_END.finditer(buf):
            if m.group() == b"\r" and m.end() == len(buf):
                break  # may be the first half of a CRLF split across chunks
            frame = self._line(buf[pos : m.start()])
            pos = m.end()
            if frame is not None:
                yield frame
        self._buf = buf[pos:]

    def close(self) -> Iterator[SSEFrame]:
        """End of input: a trailing frame without its blank line is not dispatched (as browsers do)."""
        if self._buf.endswith(b"\r"):
            frame = self._line(self._buf[:-1])
            if frame is not None:
                yield frame
        self._buf = b""
        self._reset()

    def _line(self, raw: bytes) -> SSEFrame | None:
        if not raw:
            if not self._seen_field:
                return None
            frame = SSEFrame("\n".join(self._data), self._event, self._id, self._retry)
            self._reset()
            return frame
        line = raw.decode("utf-8", errors="replace")
        if line.startswith(":"):
            self.comments += 1
            return None
        name, colon, value = line.partition(":")
        if colon and value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
        elif name == "id":
            if "\0" not in value:
                self._id = value
        elif name == "retry":
            if value.isdigit():
                self._retry = int(value)
        else:
            return None
        self._seen_field = True
        return None


def render(frame: SSEFrame) -> bytes:
    """The wire form of a frame, CRLF line ends as the MCP SDK writes them."""
    lines: list[str] = []
    if frame.id is not None:
        lines.append(f"id: {frame.id}")
    if frame.event is not None:
        lines.append(f"event: {frame.event}")
    lines.extend(f"data: {part}" for part in frame.data.split("\n"))
    if frame.retry is not None:
        lines.append(f"retry: {frame.retry}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()
