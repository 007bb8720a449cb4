"""Server-Sent Events frames: an incremental parser for bytes off the wire, and a renderer.

Both hooks read the same bytes the peer reads (server: what the ASGI app sends; client: what httpx2
receives), so they share this parser; the guard renders its ``event: error`` frames with it.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any, NamedTuple

# A frame as the MCP SDK writes it (sse-starlette): ``id``, ``event``, one ``data`` line, a priming event's
# ``retry``, CRLF ends. The parser reads a run of them by this head and a search for the data's line end
# (a regex's character class walks a megabyte result byte by byte, ``bytes.find`` does not), and gives
# anything else to its line parser.
_SDK_HEAD = re.compile(rb"(?:id: ([^\r\n\0]*)\r\n)?(?:event: ([^\r\n]*)\r\n)?data: ")
# a longer retry goes to the line parser, which reads it as httpx2 does (past int's 4,300 digits: ignored)
_SDK_RETRY = re.compile(rb"\r\nretry: (\d{1,18})\r\n\r\n")


class SSEFrame(NamedTuple):
    """One dispatched event. ``id`` is None when the frame has no ``id:`` line (the cursor stays)."""

    data: str = ""
    event: str | None = None
    id: str | None = None
    retry: int | None = None

    @property
    def type(self) -> str:
        """The event type a client dispatches on: ``message`` when there is no ``event:`` line."""
        return self.event or "message"


# Builds an SSEFrame from all its fields in order, in one C call: a NamedTuple's own constructor is a
# Python function, and both hooks build one for every frame of every stream.
_sse_frame: Callable[[tuple[Any, ...]], SSEFrame] = functools.partial(tuple.__new__, SSEFrame)


def _sdk_frame_at(chunk: bytes, at: int) -> tuple[SSEFrame, int] | None:
    """The frame in the SDK's form that starts at ``at``, and where it ends; None if there is none."""
    head = _SDK_HEAD.match(chunk, at)
    if head is None:
        return None
    start = head.end()
    cr = chunk.find(b"\r", start)
    if cr < 0 or chunk.find(b"\n", start, cr) >= 0:
        return None
    retry = None
    if chunk.startswith(b"\r\n\r\n", cr):
        end = cr + 4
    else:
        tail = _SDK_RETRY.match(chunk, cr)
        if tail is None:
            return None
        end, retry = tail.end(), int(tail.group(1))
    id_, event = head.groups()
    return _sse_frame((chunk[start:cr].decode("utf-8", "replace"),
                       None if event is None else event.decode("utf-8", "replace"),
                       None if id_ is None else id_.decode("utf-8", "replace"), retry)), end


def whole_frame(chunk: bytes) -> SSEFrame | None:
    """The frame ``chunk`` is when it is exactly one frame in the SDK's form (the SDK sends each event as
    one chunk), as a parser at a frame boundary reads it; None for anything else, which only the parser
    reads right."""
    found = _sdk_frame_at(chunk, 0)
    return found[0] if found is not None and found[1] == len(chunk) else None


# A frame in the SDK's form of the default event type, up to its data: what ``message_frame`` reads
_SDK_MESSAGE_HEAD = re.compile(rb"(?:id: ([^\r\n\0]*)\r\n)?(?:event: message\r\n)?data: ")


def message_frame(chunk: bytes, at: int = 0) -> tuple[str | None, int] | None:
    """The event id of ``chunk`` (from ``at`` on), and where its data starts, when it is exactly one frame in the
    SDK's form of the default event type with no ``retry``: what ``whole_frame`` reads as such, known without
    decoding its data (a result can be megabytes). None for anything else."""
    head = _SDK_MESSAGE_HEAD.match(chunk, at)
    if head is None:
        return None
    start, end = head.end(), len(chunk) - 4
    if (end < start or not chunk.endswith(b"\r\n\r\n") or chunk.find(b"\r", start, end) >= 0
            or chunk.find(b"\n", start, end) >= 0):
        return None
    event_id = head.group(1)
    return None if event_id is None else event_id.decode("utf-8", "replace"), start


# A frame in the SDK's form with no data and the default event type: what a resumable stream opens with
# (its priming event), the usual frame before a call's result
_SDK_EMPTY = re.compile(rb"(?:id: [^\r\n\0]*\r\n)?(?:event: message\r\n)?data: \r\n(?:retry: \d{1,18}\r\n)?\r\n")


def empty_frames(chunk: bytes) -> int:
    """Where the run of frames at the start of ``chunk`` ends that are each in the SDK's form with no data and no
    event type but ``message`` (or none), known without building them: ``len(chunk)`` when it holds nothing
    else (a priming event, the SDK's one frame a chunk; a client may read more in one)."""
    at = 0
    while (empty := _SDK_EMPTY.match(chunk, at)) is not None:
        at = empty.end()
    return at


class SSEParser:
    """Feed it chunks in any split; it returns each complete frame once. Comments (pings) are counted.

    Both hooks run it on every chunk of every stream, so a chunk that starts at a frame boundary is
    read frame by frame in the SDK's own form (``_sdk_frame_at``), as far as it goes; the rest is split into
    its complete lines at once (``bytes.splitlines`` breaks at exactly SSE's line ends: CRLF, LF, CR)
    and only field values are decoded.
    """

    __slots__ = ("_data", "_event", "_id", "_kept", "_retry", "_seen_field", "comments")

    def __init__(self) -> None:
        self._kept = bytearray()  # a partial line
        self.comments = 0
        self._data: list[str] = []
        self._event: str | None = None
        self._id: str | None = None
        self._retry: int | None = None
        self._seen_field = False

    def feed(self, chunk: bytes) -> list[SSEFrame]:
        if self._kept or self._seen_field:
            return self._feed_lines(chunk)
        frames: list[SSEFrame] = []
        at, end = 0, len(chunk)
        while at < end and (found := _sdk_frame_at(chunk, at)) is not None:
            frame, at = found
            frames.append(frame)
        if at < end:
            frames += self._feed_lines(chunk[at:] if at else chunk)
        return frames

    def _feed_lines(self, chunk: bytes) -> list[SSEFrame]:
        # Only the new chunk is searched for a line end: what is kept has none, bar a last CR, and grows
        # in place, so a line that comes in many chunks costs its length once, whatever their sizes.
        end = len(chunk) - 1 if chunk.endswith(b"\r") else len(chunk)  # a last CR may be half of a CRLF
        cut = max(chunk.rfind(b"\n", 0, end), chunk.rfind(b"\r", 0, end)) + 1
        kept = self._kept
        if cut == 0:
            if kept.endswith(b"\r") and chunk:  # that CR was a line end after all
                self._kept = bytearray(chunk)
                return self._lines(bytes(kept).splitlines())
            kept += chunk
            return []
        if kept:
            kept += chunk[:cut]
            lines = bytes(kept).splitlines()
        else:
            lines = chunk[:cut].splitlines()
        self._kept = bytearray(chunk[cut:])
        return self._lines(lines)

    def close(self) -> list[SSEFrame]:
        """End of input: a trailing frame without its blank line is not dispatched (as browsers do), but
        one whose last line a CR ended is, as the MCP SDK's client (httpx2) reads the CR at the end."""
        kept = self._kept
        frames = self._lines([bytes(kept[:-1]), b""]) if kept.endswith(b"\r") else []
        self._kept = bytearray()
        self._data, self._event, self._id, self._retry, self._seen_field = [], None, None, None, False
        return frames

    def _lines(self, lines: list[bytes]) -> list[SSEFrame]:
        frames: list[SSEFrame] = []
        data, event, id_, retry, seen = self._data, self._event, self._id, self._retry, self._seen_field
        for line in lines:
            if not line:  # a blank line dispatches the frame, if any field was seen
                if seen:
                    frames.append(SSEFrame("\n".join(data), event, id_, retry))
                    data, event, id_, retry, seen = [], None, None, None, False
                continue
            name, colon, value = line.partition(b":")
            if not name:
                self.comments += 1
                continue
            if colon and value[:1] == b" ":
                value = value[1:]
            if name == b"data":
                data.append(value.decode("utf-8", "replace"))
            elif name == b"event":
                event = value.decode("utf-8", "replace")
            elif name == b"id":
                if b"\0" in value:  # ignored, as if absent: a block of nothing else dispatches no frame
                    continue
                id_ = value.decode("utf-8", "replace")
            elif name == b"retry":
                try:  # what the SDK's client (httpx2) reads as one, from text; anything else is ignored, as above
                    retry = int(value.decode("utf-8", "replace"))
                except ValueError:
                    continue
            else:
                continue
            seen = True
        self._data, self._event, self._id, self._retry, self._seen_field = data, event, id_, retry, seen
        return frames


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
