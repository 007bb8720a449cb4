"""Part 3 of the resume invariant on the client: a refused resume fails its pending calls at once.

The SDK client drops an ``event: error`` frame with a warning and reconnects with the same cursor until
the caller's timeout. ``RefusalResolver``, an ``httpx2`` transport, answers each ``tools/call`` still
pending on a stream that brings one with a JSON-RPC error ``wire.REFUSED_ERROR_CODE`` carrying the
frame's data (the cursor to resume from, what is required, what the token held) for
``resume.Refusal.from_data`` and ``resume.decide_resume``.

Turn it on around the client the SDK sends with, after the hooks' tap so the tap sees only the wire:
``http = resolve_refusals(instrument_client(auth=...))``, or ``resolve_refusals(auth=...)`` alone.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any, Final

import httpx2
from mcp.shared._httpx_utils import MCP_DEFAULT_SSE_READ_TIMEOUT, MCP_DEFAULT_TIMEOUT

from mcp_stream_exporter.exchange import (
    CONTENT_ENCODING,
    CONTENT_SSE,
    CONTENT_TYPE,
    LAST_EVENT_ID,
    REQUEST_HEADERS,
    RESPONSE_HEADERS,
    SESSION_ID,
    content_of,
    read_body,
)
from mcp_stream_exporter.headers import pick
from mcp_stream_exporter.sse import SSEFrame, SSEParser, render
from mcp_stream_exporter.wire import REFUSED_ERROR_CODE, classify_frame

_CallKey = tuple[str | None, str]  # (session id, JSON-RPC request id)
_MAX_PENDING: Final = 10_000
_MAX_CURSORS: Final = 50_000


class RefusalResolver(httpx2.AsyncBaseTransport):
    """Passes every exchange through ``inner``; after an ``event: error`` frame, adds an error response
    for each ``tools/call`` the stream carries that has no terminal event yet.

    Which calls a stream carries: a POST's own, and for a resume (``Last-Event-ID``) those whose stream
    delivered the cursor event. Both are kept bounded; a call forgotten is left to the SDK's timeout."""

    def __init__(self, inner: httpx2.AsyncBaseTransport) -> None:
        self.inner = inner
        self._pending: OrderedDict[_CallKey, None] = OrderedDict()
        self._carried: OrderedDict[tuple[str | None, str], tuple[str, ...]] = OrderedDict()

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        headers = pick(request.headers.raw, REQUEST_HEADERS)
        session_id = headers.get(SESSION_ID)
        try:
            body = request.content
        except httpx2.RequestNotRead:
            body = b""
        asked = read_body(body)
        carried = [msg.id for msg in asked.calls if msg.id is not None]
        for request_id in carried:
            self._pend((session_id, request_id))
        for request_id in asked.cancelled:
            self.answered(session_id, request_id)
        cursor = headers.get(LAST_EVENT_ID)
        if cursor:
            carried += self.pending(session_id, self._carried.get((session_id, cursor), ()))
        response = await self.inner.handle_async_request(request)
        response_headers = pick(response.headers.raw, RESPONSE_HEADERS)
        # a compressed answer (a proxy's gzip) is left as it is: the refusals it would add are not in its coding
        if (not carried or response.status_code >= 400 or CONTENT_ENCODING in response_headers
                or content_of(response_headers.get(CONTENT_TYPE, "")) != CONTENT_SSE):
            return response
        assert isinstance(response.stream, httpx2.AsyncByteStream)
        response.stream = _ResolvingStream(response.stream, self, session_id, tuple(carried))
        return response

    def _pend(self, key: _CallKey) -> None:
        self._pending[key] = None
        if len(self._pending) > _MAX_PENDING:
            self._pending.popitem(last=False)

    def delivered(self, session_id: str | None, event_id: str, carried: tuple[str, ...]) -> None:
        """Event ``event_id`` came on a stream carrying ``carried``: a resume from it carries them too."""
        self._carried[(session_id, event_id)] = carried
        if len(self._carried) > _MAX_CURSORS:
            self._carried.popitem(last=False)

    def answered(self, session_id: str | None, request_id: str) -> None:
        self._pending.pop((session_id, request_id), None)

    def pending(self, session_id: str | None, request_ids: tuple[str, ...]) -> list[str]:
        return [i for i in request_ids if (session_id, i) in self._pending]

    async def aclose(self) -> None:
        await self.inner.aclose()


class _ResolvingStream(httpx2.AsyncByteStream):
    """Passes every chunk through unchanged, then the error responses an ``event: error`` frame in it calls for.

    An iterator object rather than an async generator: the SDK stops reading at the response and closes
    it, and an abandoned async generator costs the event loop a finaliser task."""

    def __init__(self, inner: httpx2.AsyncByteStream, resolver: RefusalResolver, session_id: str | None,
                 carried: tuple[str, ...]) -> None:
        self._inner = inner
        self._chunks: AsyncIterator[bytes] | None = None
        self._resolver = resolver
        self._session_id = session_id
        self._carried = carried
        self._parser = SSEParser()
        self._extra = b""

    def __aiter__(self) -> AsyncIterator[bytes]:
        self._chunks = self._inner.__aiter__()
        return self

    async def __anext__(self) -> bytes:
        if self._extra:
            extra, self._extra = self._extra, b""
            return extra
        assert self._chunks is not None
        chunk = await self._chunks.__anext__()
        self._extra = self._feed(chunk)
        return chunk

    def _feed(self, chunk: bytes) -> bytes:
        resolver = self._resolver
        extra = b""
        for frame in self._parser.feed(chunk):
            if frame.id is not None:
                resolver.delivered(self._session_id, frame.id, self._carried)
            if frame.type == "error":
                extra += b"".join(_refused(i, frame.data) for i in resolver.pending(self._session_id, self._carried))
            elif frame.type == "message" and frame.data:
                for msg in classify_frame(frame.data):
                    if msg.id is not None and msg.is_terminal:
                        resolver.answered(self._session_id, msg.id)
        return extra

    async def aclose(self) -> None:
        await self._inner.aclose()


_REASON_CHARS: Final = 64
_DETAIL_CHARS: Final = 300
_MISSING: Final = "missing_resources"


def _refused(request_id: str, data: str) -> bytes:
    """A JSON-RPC error for a call whose resume the server refused with an ``event: error`` frame, with
    the frame's data. No ``id:`` line: the cursor stays where the server left it."""
    try:
        detail: Any = json.loads(data)
    except ValueError:
        detail = {"error": data}
    known = detail if isinstance(detail, dict) else {}
    reason, what = known.get("error", "error"), known.get("detail")
    # the server's own words for why (the guard's say what to do: re-authorise, or re-issue), bounded
    missing = f"; missing {str(known[_MISSING])[:_DETAIL_CHARS]}" if known.get(_MISSING) else ""
    message = (f"resume refused by the server ({str(reason)[:_REASON_CHARS]}): "
               f"{what[:_DETAIL_CHARS] if isinstance(what, str) else 'see the error data'}{missing}; "
               f"cursor {str(known.get('cursor'))[:_REASON_CHARS]}")
    error = {"jsonrpc": "2.0", "id": int(request_id) if request_id.isdigit() else request_id,
             "error": {"code": REFUSED_ERROR_CODE, "message": message, "data": detail}}
    return render(SSEFrame(json.dumps(error), event="message"))


def resolve_refusals(client: httpx2.AsyncClient | None = None, **client_options: Any) -> httpx2.AsyncClient:
    """An ``httpx2.AsyncClient`` for ``streamable_http_client(url, http_client=...)`` whose refused resumes
    fail their pending calls at once. Without ``client``, builds one with the MCP SDK's default timeouts
    (``client_options`` go to ``httpx2.AsyncClient``, e.g. ``auth=``, ``proxy=``), its transports as ``httpx2``
    builds them; with ``client`` (e.g. one ``instrument_client`` returned), wraps every transport it routes
    through in place, its own and its mounts' (a proxy's)."""
    if client is None:
        client_options.setdefault("timeout", httpx2.Timeout(MCP_DEFAULT_TIMEOUT, read=MCP_DEFAULT_SSE_READ_TIMEOUT))
        client = httpx2.AsyncClient(**client_options)
    client._transport = RefusalResolver(client._transport)
    client._mounts = {pattern: None if transport is None else RefusalResolver(transport)
                      for pattern, transport in client._mounts.items()}
    return client
