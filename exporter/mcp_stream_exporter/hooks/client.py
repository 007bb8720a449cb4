"""Client hooks: what an MCP client on the SDK sends and receives, as spans.

A tap on the ``httpx2`` transport sees the final request (the ``Authorization`` an auth flow set, the
``Last-Event-ID`` of a resume) and every byte of every response before the SDK parses it: each SSE
frame, ``event: error`` frames the SDK drops with a warning, the wire JSON-RPC id the SDK rewrites,
and how each stream ended (the server ended it, the connection broke, or the client closed it).
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx2
from mcp.shared._httpx_utils import MCP_DEFAULT_SSE_READ_TIMEOUT, MCP_DEFAULT_TIMEOUT
from opentelemetry import trace
from opentelemetry.util.types import AttributeValue

from mcp_stream_exporter import semconv as sc
from mcp_stream_exporter.auth import AuthView, TokenReader, ToolPolicy
from mcp_stream_exporter.headers import pick
from mcp_stream_exporter.hooks._tracking import (
    Call,
    DeviationTracer,
    SdkSpans,
    Stream,
    Tracker,
    era_of,
    known_missing,
    stream_kind,
)
from mcp_stream_exporter.sse import SSEFrame, SSEParser, render
from mcp_stream_exporter.wire import (
    CANCELLED,
    INITIALIZE,
    MAX_PARSED_BODY,
    REFUSED_ERROR_CODE,
    TOOLS_CALL,
    classify,
    classify_frame,
)

_REQUEST_HEADERS = frozenset({b"mcp-session-id", b"authorization", b"mcp-protocol-version", b"last-event-id"})
_RESPONSE_HEADERS = frozenset({b"mcp-session-id", b"content-type"})
_FINGERPRINT_CHARS = 16


class ClientInstrumentation:
    """The client side of the span model, shared by every request of one ``httpx2`` client."""

    def __init__(
        self,
        *,
        policy: ToolPolicy | None = None,
        token_reader: TokenReader | None = None,
        tracer_provider: trace.TracerProvider | None = None,
        max_calls: int = 10_000,
        resolve_error_frames: bool = True,
    ) -> None:
        self.policy = policy
        self.resolve_error_frames = resolve_error_frames
        self.tokens = token_reader or TokenReader()
        self.tracker = Tracker(DeviationTracer(tracer_provider), sc.ROLE_CLIENT, max_calls=max_calls)
        self._sdk_spans = SdkSpans.of_global_provider()
        self._protocol_version: str | None = None

    def _request_calls(self, request: httpx2.Request, session_id: str | None,
                       protocol_version: str | None, view: AuthView, start: int) -> list[Call]:
        try:
            body = request.content
        except httpx2.RequestNotRead:
            return []
        if not body or len(body) > MAX_PARSED_BODY:
            return []
        calls: list[Call] = []
        for msg in classify(body):
            if msg.method == INITIALIZE and msg.protocol_version is not None:
                self._protocol_version = msg.protocol_version
            elif msg.method == TOOLS_CALL and msg.id is not None:
                stateless = era_of(protocol_version) == sc.ERA_STATELESS
                # a fingerprint matches a re-issue to the call it repeats: only the stateless era re-issues
                identify = (functools.partial(_fingerprint, self.tokens.subject_salt, msg.tool, msg.arguments)
                            if stateless else None)
                call = self.tracker.start_call(session_id, msg, protocol_version, view, stateless=stateless,
                                               start_time=start, identify=identify)
                if self._sdk_spans is not None:
                    call.sdk_span = self._sdk_spans.get(msg.traceparent)
                self._annotate_requirement(call, msg.tool, view)
                calls.append(call)
            elif msg.method == CANCELLED and msg.cancelled_id is not None:
                self.tracker.cancel((session_id, msg.cancelled_id))
        return calls

    def _annotate_requirement(self, call: Call, tool: str | None, view: AuthView) -> None:
        requirement = self.policy.requirement(tool) if self.policy is not None else None
        if requirement is None:
            return
        missing = known_missing(view, requirement)
        call.require(requirement, missing)
        if missing[0] or missing[1]:
            self.tracker.span_of(call)  # calling with a token that lacks what the tool requires: a deviation

    async def handle(self, inner: httpx2.AsyncBaseTransport, request: httpx2.Request) -> httpx2.Response:
        start = time.time_ns()
        headers = pick(request.headers.raw, _REQUEST_HEADERS)
        session_id = headers.get("mcp-session-id")
        protocol_version = headers.get("mcp-protocol-version") or self._protocol_version
        view = self.tokens.from_authorization(headers.get("authorization"))
        calls = self._request_calls(request, session_id, protocol_version, view, start)
        cursor = headers.get("last-event-id")
        if cursor:
            calls.extend(self.tracker.calls_of_cursor(session_id, cursor))
        try:
            response = await inner.handle_async_request(request)
        except BaseException:
            stream = self._open(request, session_id, protocol_version, calls, view, cursor, start, None, "none")
            if stream is not None:
                self.tracker.end_stream(stream, sc.END_DROPPED)
            raise
        response_headers = pick(response.headers.raw, _RESPONSE_HEADERS)
        if session_id is None:
            session_id = response_headers.get("mcp-session-id")
        content_type = response_headers.get("content-type", "")
        content = "sse" if content_type.startswith("text/event-stream") else (
            "json" if content_type.startswith("application/json") else "none")
        stream = self._open(request, session_id, protocol_version, calls, view, cursor, start,
                            response.status_code, content)
        if stream is None:
            return response
        if content == "none" or response.status_code >= 400:
            self.tracker.end_stream(stream, sc.END_HTTP_ERROR if response.status_code >= 400 else sc.END_CLEAN,
                                    response.status_code)
            return response
        assert isinstance(response.stream, httpx2.AsyncByteStream)
        response.stream = _TapStream(response.stream, self.tracker, stream, sse=content == "sse",
                                     status=response.status_code, resolve_error_frames=self.resolve_error_frames)
        return response

    def _open(self, request: httpx2.Request, session_id: str | None, protocol_version: str | None,
              calls: list[Call], auth: AuthView, cursor: str | None, start: int,
              status: int | None, content: str) -> Stream | None:
        method = request.method
        kind = stream_kind(method, cursor)
        attrs: dict[str, AttributeValue] = {sc.HTTP_REQUEST_METHOD: method, sc.STREAM_CONTENT: content,
                                            sc.ERA: era_of(protocol_version)}
        if protocol_version is not None:
            attrs[sc.MCP_PROTOCOL_VERSION] = protocol_version
        if cursor:
            attrs[sc.RESUME_CURSOR] = cursor
        return self.tracker.open_stream(kind, session_id, calls, attrs, auth, status, start_time=start)


class _TapStream(httpx2.AsyncByteStream):
    """Passes every chunk through unchanged, parsing a copy; notes how the stream ended.

    An iterator object rather than an async generator: the SDK stops reading at the response and
    closes the response, and an abandoned async generator costs the event loop a finaliser task."""

    def __init__(self, inner: httpx2.AsyncByteStream, tracker: Tracker, stream: Stream, *, sse: bool,
                 status: int, resolve_error_frames: bool) -> None:
        self._inner = inner
        self._chunks: AsyncIterator[bytes] | None = None
        self._resolve_error_frames = resolve_error_frames
        self._tracker = tracker
        self._stream = stream
        self._parser = SSEParser() if sse else None
        self._json = bytearray()
        self._status = status
        self._extra = b""

    def __aiter__(self) -> AsyncIterator[bytes]:
        self._chunks = self._inner.__aiter__()
        return self

    async def __anext__(self) -> bytes:
        if self._extra:
            extra, self._extra = self._extra, b""
            return extra
        assert self._chunks is not None
        try:
            chunk = await self._chunks.__anext__()
        except StopAsyncIteration:
            if self._json:
                self._tracker.frame(self._stream, None, classify_frame(self._json.decode("utf-8", "replace")))
            self._tracker.end_stream(self._stream, sc.END_CLEAN, self._status)
            raise
        except Exception:
            self._tracker.end_stream(self._stream, sc.END_DROPPED, self._status)
            raise
        except BaseException:  # cancelled while reading: the client gave up on it
            self._tracker.end_stream(self._stream, sc.END_CLOSED, self._status)
            raise
        if self._parser is not None:
            self._extra = self._feed(chunk)
        elif len(self._json) <= MAX_PARSED_BODY:
            self._json += chunk
        return chunk

    def _feed(self, chunk: bytes) -> bytes:
        """Observe an SSE chunk; returns the frames to add after it (see ``resolve_error_frames``)."""
        assert self._parser is not None
        if self._stream.ended:
            return b""
        extra = b""
        for frame in self._parser.feed(chunk):
            self._tracker.frame(self._stream, frame, classify_frame(frame.data) if frame.data else ())
            if frame.type == "error" and self._resolve_error_frames:
                extra += b"".join(_refused(call.key[1], frame.data) for call in self._stream.pending())
        return extra

    async def aclose(self) -> None:
        self._tracker.end_stream(self._stream, sc.END_CLOSED, self._status)
        await self._inner.aclose()


def _fingerprint(salt: bytes, tool: str | None, arguments: Any) -> str:
    """Which call this is, for matching a re-issue to the call it repeats: a salted hash of the tool
    and its canonical arguments (sorted keys, no whitespace), never the arguments themselves."""
    canonical = json.dumps(arguments, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    digest = hmac.new(salt, f"{tool}\x00{canonical}".encode(), hashlib.sha256)
    return digest.hexdigest()[:_FINGERPRINT_CHARS]


def _refused(request_id: str, data: str) -> bytes:
    """A JSON-RPC error for a call whose resume the server refused with an ``event: error`` frame.

    The SDK drops such frames and reconnects with the same cursor until its timeout; this resolves
    the pending call at once instead, with the frame's data (the cursor to
    resume from, what is required, what the token held) for ``resume.decide_resume``. No ``id:``
    line: the cursor stays where the server left it."""
    try:
        detail: Any = json.loads(data)
    except ValueError:
        detail = {"error": data}
    reason = detail.get("error", "error") if isinstance(detail, dict) else "error"
    message = (f"resume refused by the server ({reason}): "
               f"required {detail.get('missing_resources', []) if isinstance(detail, dict) else []} "
               f"not in the token's audience; re-authorise and resume from cursor "
               f"{detail.get('cursor') if isinstance(detail, dict) else None}, or re-issue the call")
    error = {"jsonrpc": "2.0", "id": int(request_id) if request_id.isdigit() else request_id,
             "error": {"code": REFUSED_ERROR_CODE, "message": message, "data": detail}}
    return render(SSEFrame(json.dumps(error), event="message"))


class ClientTap(httpx2.AsyncBaseTransport):
    """An ``httpx2`` transport that observes the MCP exchanges going through ``inner``."""

    def __init__(self, inner: httpx2.AsyncBaseTransport, instrumentation: ClientInstrumentation) -> None:
        self._inner = inner
        self.instrumentation = instrumentation

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        return await self.instrumentation.handle(self._inner, request)

    async def aclose(self) -> None:
        await self._inner.aclose()


def instrument_client(
    client: httpx2.AsyncClient | None = None,
    *,
    policy: ToolPolicy | None = None,
    token_reader: TokenReader | None = None,
    tracer_provider: trace.TracerProvider | None = None,
    resolve_error_frames: bool = True,
    **client_options: Any,
) -> httpx2.AsyncClient:
    """An ``httpx2.AsyncClient`` for ``streamable_http_client(url, http_client=...)``, with the tap.

    Without ``client``, builds one with the MCP SDK's default timeouts (``client_options`` go to
    ``httpx2.AsyncClient``, e.g. ``auth=``). With ``client``, taps its transport in place: that
    touches ``AsyncClient._transport``, which ``tests/integration/test_sdk_contract.py`` pins.
    ``resolve_error_frames`` (part 3 of the resume invariant, docs/span-model.md): a pending call whose
    stream brings an ``event: error`` frame is failed at once with ``wire.REFUSED_ERROR_CODE`` instead of
    reconnecting until its timeout.
    """
    instr = ClientInstrumentation(policy=policy, token_reader=token_reader, tracer_provider=tracer_provider,
                                  resolve_error_frames=resolve_error_frames)
    if client is not None:
        client._transport = ClientTap(client._transport, instr)
        return client
    client_options.setdefault("timeout", httpx2.Timeout(MCP_DEFAULT_TIMEOUT, read=MCP_DEFAULT_SSE_READ_TIMEOUT))
    inner = httpx2.AsyncHTTPTransport()
    return httpx2.AsyncClient(transport=ClientTap(inner, instr), **client_options)
