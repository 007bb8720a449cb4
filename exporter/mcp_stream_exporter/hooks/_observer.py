"""The server's wire: an ASGI observer that turns every exchange on the MCP endpoint into tracker input.

Every request, status and SSE frame, a client disconnect told apart from a server end, and what the
``ToolPolicy`` requires of each ``tools/call`` against the request's token. It changes nothing: a
call refused by whatever enforces the policy (``guard.CallGuard``) is seen as its JSON-RPC error.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Any

from mcp_stream_exporter import scope as request_scope
from mcp_stream_exporter import semconv as sc
from mcp_stream_exporter.asgi import ASGIApp, Message, Receive, Scope, Send
from mcp_stream_exporter.auth import TokenReader, ToolPolicy
from mcp_stream_exporter.exchange import (
    AUTHORIZATION,
    CONTENT_JSON,
    CONTENT_SSE,
    CONTENT_TYPE,
    LAST_EVENT_ID,
    PROTOCOL_VERSION,
    REQUEST_HEADERS,
    RESPONSE_HEADERS,
    SESSION_ID,
    can_ask,
    content_of,
    era_of,
    read_body,
    stream_attributes,
    stream_kind,
)
from mcp_stream_exporter.headers import pick
from mcp_stream_exporter.hooks._tracking import (
    NOTHING_MISSING,
    Call,
    Requirements,
    Stream,
    Tracker,
    audience_known,
)
from mcp_stream_exporter.sse import SSEFrame, SSEParser
from mcp_stream_exporter.wire import MAX_PARSED_BODY, REFUSED_ERROR_CODE, WireMessage, classify_frame

_EXCHANGE = "mcp_stream.exchange"  # where the observer leaves its _Exchange in the ASGI scope
DECISION_ALLOWED = "allowed"
DECISION_REFUSED = "refused"
DECISION_UNKNOWN_TOOL = "unknown_tool"


@dataclass(slots=True, eq=False)
class _Exchange:
    """One HTTP request to the MCP endpoint and its response, as the observer sees them."""

    method: str
    start_ns: int
    cursor: str | None  # Last-Event-ID
    scope: request_scope.RequestScope
    protocol_version: str | None
    body: bytearray = field(default_factory=bytearray)
    calls: list[Call] = field(default_factory=list)
    stream: Stream | None = None
    parser: SSEParser | None = None
    json_body: bytearray | None = None
    status: int = 0
    disconnected: bool = False
    oversized: bool = False

    def release(self) -> None:
        """The exchange is over: let go of its calls, stream and parser. The app's objects that hold our
        ``receive`` and ``send`` (and the scope) are often in reference cycles, which only the garbage
        collector frees: what they reach would otherwise wait for it, and make its passes more frequent."""
        self.calls.clear()
        self.stream = self.parser = self.json_body = None


class WireObserver:
    """Observes the ASGI app's exchanges on one MCP endpoint for the server's tracker."""

    def __init__(self, tracker: Tracker, requirements: Requirements, policy: ToolPolicy, tokens: TokenReader,
                 path: str) -> None:
        self.tracker = tracker
        self.requirements = requirements
        self.policy = policy
        self.tokens = tokens
        self.path = path.rstrip("/")

    def asgi(self, app: ASGIApp) -> ASGIApp:
        """Wrap the ASGI app: every exchange on the MCP endpoint becomes a stream span."""
        tracker = self.tracker

        async def observed(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != "http" or scope.get("path", "").rstrip("/") != self.path:
                await app(scope, receive, send)
                return
            headers = pick(scope.get("headers", ()), REQUEST_HEADERS, lowered=True)
            rs = request_scope.RequestScope(headers.get(SESSION_ID),
                                            self.tokens.from_authorization(headers.get(AUTHORIZATION)))
            ex = _Exchange(scope.get("method", ""), time.time_ns(), headers.get(LAST_EVENT_ID), rs,
                           headers.get(PROTOCOL_VERSION))
            token = request_scope.bind(rs)
            scope[_EXCHANGE] = ex  # the SDK hands this scope to middleware as ctx.request.scope

            async def observed_receive() -> Message:
                message = await receive()
                kind = message["type"]
                if kind == "http.request":
                    if ex.method == "POST" and not ex.oversized:
                        self._on_body(ex, message)
                elif kind == "http.disconnect":
                    ex.disconnected = True
                    if ex.stream is not None:
                        tracker.end_stream(ex.stream, sc.END_DROPPED, ex.status)
                return message

            def observed_send(message: Message) -> Awaitable[None]:  # send's own awaitable: no coroutine of ours
                kind = message["type"]
                if kind == "http.response.body":
                    self._on_response_body(ex, message)
                elif kind == "http.response.start":
                    self._on_response_start(ex, message)
                return send(message)

            try:
                await app(scope, observed_receive, observed_send)
            finally:
                request_scope.unbind(token)
                del scope[_EXCHANGE]
                if ex.stream is not None:
                    tracker.end_stream(ex.stream, sc.END_DROPPED if ex.disconnected else sc.END_CLEAN, ex.status)
                ex.release()

        return observed

    @staticmethod
    def call_of(request: Any, request_id: str) -> Call | None:
        """A call of the exchange the observer left in a request's ASGI scope (the SDK's ``ctx.request``)."""
        ex = getattr(request, "scope", {}).get(_EXCHANGE)
        if isinstance(ex, _Exchange):
            for call in ex.calls:
                if call.key[1] == request_id:
                    return call
        return None

    def _on_body(self, ex: _Exchange, message: Message) -> None:
        body: bytes = message.get("body", b"")
        more = message.get("more_body", False)
        if more or ex.body:  # a body in several messages: gathered (one message, the usual, is read as it is)
            ex.body += body
            if len(ex.body) > MAX_PARSED_BODY:  # too large to parse: observe the exchange without its calls
                ex.oversized = True
                ex.body.clear()
                return
            if more:
                return
            body = bytes(ex.body)
            ex.body.clear()
        elif len(body) > MAX_PARSED_BODY:
            ex.oversized = True
            return
        if not can_ask(body):  # no tools/call, cancel or initialize in it: nothing to parse for
            return
        asked = read_body(body)
        if asked.protocol_version is not None:
            ex.protocol_version = asked.protocol_version
        ex.calls.extend(self._start_call(ex, msg) for msg in asked.calls)
        for request_id in asked.cancelled:
            self.tracker.cancel((ex.scope.session_id, request_id))

    def _start_call(self, ex: _Exchange, msg: WireMessage) -> Call:
        """A call and what the policy says of it: the token is the request's, so the audience gap at
        call time is known here, before any handler runs."""
        stateless = era_of(ex.protocol_version) == sc.ERA_STATELESS
        auth = ex.scope.auth
        call = self.tracker.start_call(ex.scope.session_id, msg, ex.protocol_version, auth, stateless=stateless,
                                       start_time=ex.start_ns)
        requirement = self.policy.requirement(msg.tool)
        if requirement is None:
            call.require(None, NOTHING_MISSING, DECISION_UNKNOWN_TOOL)
            return call
        if not stateless:
            self.requirements.remember(call.key, requirement)
        missing = auth.missing(requirement)
        call.require(requirement, missing, DECISION_ALLOWED)
        if audience_known(auth) and (missing[0] or missing[1]):
            self.tracker.span_of(call)  # an audience gap at call time is worth a span, refused or not
        return call

    def _on_response_start(self, ex: _Exchange, message: Message) -> None:
        ex.status = status = int(message.get("status", 0))
        headers = pick(message.get("headers", ()), RESPONSE_HEADERS, lowered=True)
        session_id = ex.scope.session_id
        if session_id is None and SESSION_ID in headers:
            session_id = ex.scope.session_id = headers[SESSION_ID]  # initialize: the session's scope
        content = content_of(headers.get(CONTENT_TYPE, ""))
        if content == CONTENT_SSE:
            ex.parser = SSEParser()
        elif content == CONTENT_JSON:
            ex.json_body = bytearray()
        cursor = ex.cursor
        calls = ex.calls
        if cursor:
            calls = calls + list(self.tracker.calls_of_cursor(session_id, cursor))
        ex.stream = self.tracker.open_stream(stream_kind(ex.method, cursor), session_id, calls,
                                             stream_attributes(ex.method, content, ex.protocol_version, cursor),
                                             ex.scope.auth, status, start_time=ex.start_ns)

    def _on_response_body(self, ex: _Exchange, message: Message) -> None:
        stream = ex.stream
        if stream is None or stream.ended:
            return
        chunk = message.get("body", b"")
        if ex.parser is not None:
            for frame in ex.parser.feed(chunk):
                self._frame(ex, stream, frame, classify_frame(frame.data) if frame.data else ())
        elif ex.json_body is not None and len(ex.json_body) <= MAX_PARSED_BODY:
            ex.json_body += chunk
        if message.get("more_body", False):
            return
        if ex.json_body:
            self._frame(ex, stream, None, classify_frame(ex.json_body.decode("utf-8", "replace")))
        self.tracker.end_stream(stream, sc.END_HTTP_ERROR if ex.status >= 400 else sc.END_CLEAN, ex.status)

    def _frame(self, ex: _Exchange, stream: Stream, frame: SSEFrame | None, messages: Sequence[WireMessage]) -> None:
        for msg in messages:
            if msg.error_code == REFUSED_ERROR_CODE:  # the policy was enforced: before the error ends the call
                for call in ex.calls:
                    if call.key[1] == msg.id and call.decision == DECISION_ALLOWED:
                        call.require(call.requirement, call.missing, DECISION_REFUSED)
        self.tracker.frame(stream, frame, messages)
