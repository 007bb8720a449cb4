"""Server hooks: what an MCP server on the SDK sends, stores and replays, as spans.

Three seams, all public API of the SDK: an ASGI observer around the app from ``streamable_http_app()``
(every request, status and SSE frame, a client disconnect told apart from a server end, and what the
``ToolPolicy`` requires of each ``tools/call`` against the request's token), a delegating ``EventStore``
(event-id assignment and what a replay sent against what was stored), and a ``ServerMiddleware`` (the
link to the SDK's own request span, and refusal when ``enforce=True``). ``instrument_server`` installs
all three in one call.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Final

from mcp.server.context import CallNext, HandlerResult, ServerRequestContext
from mcp.server.mcpserver import MCPServer
from mcp.server.streamable_http import (
    GET_STREAM_KEY,
    EventCallback,
    EventId,
    EventMessage,
    EventStore,
    StreamId,
)
from mcp.shared.exceptions import MCPError
from mcp_types import JSONRPCError, JSONRPCMessage, JSONRPCResponse
from opentelemetry import trace
from opentelemetry.trace import SpanKind
from opentelemetry.util.types import AttributeValue

from mcp_stream_exporter import scope as request_scope
from mcp_stream_exporter import semconv as sc
from mcp_stream_exporter.asgi import ASGIApp, Message, Receive, Scope, Send
from mcp_stream_exporter.auth import Requirement, TokenReader, ToolPolicy
from mcp_stream_exporter.headers import pick
from mcp_stream_exporter.hooks._tracking import (
    NOTHING_MISSING,
    Call,
    CallKey,
    DeviationTracer,
    Stream,
    Tracker,
    auth_attributes,
    era_of,
    known_missing,
    requirement_attributes,
    stream_kind,
)
from mcp_stream_exporter.sse import SSEParser
from mcp_stream_exporter.wire import (
    CANCELLED,
    INITIALIZE,
    MAX_PARSED_BODY,
    REFUSED_ERROR_CODE,
    TOOLS_CALL,
    WireMessage,
    classify,
    classify_frame,
)

_EXCHANGE = "mcp_stream.exchange"  # where the observer leaves its _Exchange in the ASGI scope
_REQUEST_HEADERS = frozenset({b"mcp-session-id", b"authorization", b"mcp-protocol-version", b"last-event-id"})
_RESPONSE_HEADERS = frozenset({b"mcp-session-id", b"content-type"})
_SDK_REQUEST_LINK: Final = MappingProxyType({sc.LINK_TYPE: sc.LINK_SDK_REQUEST})


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


@dataclass(slots=True)
class _Stored:
    event_id: str
    kind: str
    request_id: str | None


class ServerInstrumentation:
    """The server side of the span model. Build one per app; ``instrument_server`` does it for you."""

    def __init__(
        self,
        *,
        policy: ToolPolicy | None = None,
        enforce: bool = False,
        token_reader: TokenReader | None = None,
        tracer_provider: trace.TracerProvider | None = None,
        path: str = "/mcp",
        max_calls: int = 10_000,
        max_events_per_stream: int = 1_000,
        max_streams: int = 10_000,
    ) -> None:
        self.policy = policy or ToolPolicy()
        self.enforce = enforce
        self.tokens = token_reader or TokenReader()
        self.path = path.rstrip("/")
        self._tracer = DeviationTracer(tracer_provider)
        self.tracker = Tracker(self._tracer, sc.ROLE_SERVER, max_calls=max_calls)
        self._requirements: OrderedDict[CallKey, Requirement] = OrderedDict()
        self._stored: OrderedDict[tuple[str | None, str], deque[_Stored]] = OrderedDict()
        # (session, event id) -> (stream id, store order): whose event it is, and what came before it
        self._stream_of_event: OrderedDict[tuple[str | None, str], tuple[str, int]] = OrderedDict()
        self._store_order = 0
        self._max_calls = max_calls
        self._max_events_per_stream = max_events_per_stream
        self._max_streams = max_streams

    # --- ASGI observer ---

    def asgi(self, app: ASGIApp) -> ASGIApp:
        """Wrap the ASGI app: every exchange on the MCP endpoint becomes a stream span."""
        tracker = self.tracker

        async def observed(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != "http" or scope.get("path", "").rstrip("/") != self.path:
                await app(scope, receive, send)
                return
            headers = pick(scope.get("headers", ()), _REQUEST_HEADERS)
            rs = request_scope.RequestScope(headers.get("mcp-session-id"),
                                            self.tokens.from_authorization(headers.get("authorization")))
            ex = _Exchange(scope.get("method", ""), time.time_ns(), headers.get("last-event-id"), rs,
                           headers.get("mcp-protocol-version"))
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

            async def observed_send(message: Message) -> None:
                kind = message["type"]
                if kind == "http.response.body":
                    self._on_response_body(ex, message)
                elif kind == "http.response.start":
                    self._on_response_start(ex, message)
                await send(message)

            try:
                await app(scope, observed_receive, observed_send)
            finally:
                request_scope.unbind(token)
                if ex.stream is not None:
                    tracker.end_stream(ex.stream, sc.END_DROPPED if ex.disconnected else sc.END_CLEAN, ex.status)

        return observed

    def _on_body(self, ex: _Exchange, message: Message) -> None:
        ex.body += message.get("body", b"")
        if len(ex.body) > MAX_PARSED_BODY:  # too large to parse: observe the exchange without its calls
            ex.oversized = True
            ex.body.clear()
            return
        if message.get("more_body", False):
            return
        body = bytes(ex.body)
        ex.body.clear()
        for msg in classify(body):
            if msg.method == TOOLS_CALL and msg.id is not None:
                ex.calls.append(self._start_call(ex, msg))
            elif msg.method == INITIALIZE and msg.protocol_version is not None:
                ex.protocol_version = msg.protocol_version
            elif msg.method == CANCELLED and msg.cancelled_id is not None:
                self.tracker.cancel((ex.scope.session_id, msg.cancelled_id))

    def _start_call(self, ex: _Exchange, msg: WireMessage) -> Call:
        """A call and what the policy says of it: the token is the request's, so the audience gap at
        call time is known here, before any handler runs."""
        stateless = era_of(ex.protocol_version) == sc.ERA_STATELESS
        auth = ex.scope.auth
        call = self.tracker.start_call(ex.scope.session_id, msg, ex.protocol_version, auth, stateless=stateless,
                                       start_time=ex.start_ns)
        requirement = self.policy.requirement(msg.tool)
        if requirement is None:
            call.require(None, NOTHING_MISSING, "unknown_tool")
            return call
        if not stateless:
            self._remember(call.key, requirement)
        missing = auth.missing(requirement)
        gap = bool(missing[0] or missing[1])
        call.require(requirement, missing, "refused" if gap and self.enforce else "allowed")
        if any(known_missing(auth, requirement)):
            self.tracker.span_of(call)  # an audience gap at call time is worth a span, refused or not
        return call

    def _on_response_start(self, ex: _Exchange, message: Message) -> None:
        ex.status = status = int(message.get("status", 0))
        headers = pick(message.get("headers", ()), _RESPONSE_HEADERS)
        session_id = ex.scope.session_id
        if session_id is None and "mcp-session-id" in headers:
            session_id = ex.scope.session_id = headers["mcp-session-id"]  # initialize: the session's scope
        content_type = headers.get("content-type", "")
        if content_type.startswith("text/event-stream"):
            content = "sse"
            ex.parser = SSEParser()
        elif content_type.startswith("application/json"):
            content = "json"
            ex.json_body = bytearray()
        else:
            content = "none"
        cursor = ex.cursor
        kind = stream_kind(ex.method, cursor)
        calls = ex.calls
        if cursor:
            calls = calls + list(self.tracker.calls_of_cursor(session_id, cursor))
        attrs: dict[str, AttributeValue] = {
            sc.HTTP_REQUEST_METHOD: ex.method,
            sc.STREAM_CONTENT: content,
            sc.ERA: era_of(ex.protocol_version),
        }
        if ex.protocol_version is not None:
            attrs[sc.MCP_PROTOCOL_VERSION] = ex.protocol_version
        if cursor:
            attrs[sc.RESUME_CURSOR] = cursor
        ex.stream = self.tracker.open_stream(kind, session_id, calls, attrs, ex.scope.auth, status,
                                             start_time=ex.start_ns)

    def _on_response_body(self, ex: _Exchange, message: Message) -> None:
        stream = ex.stream
        if stream is None or stream.ended:
            return
        chunk = message.get("body", b"")
        if ex.parser is not None:
            for frame in ex.parser.feed(chunk):
                self.tracker.frame(stream, frame, classify_frame(frame.data) if frame.data else ())
        elif ex.json_body is not None and len(ex.json_body) <= MAX_PARSED_BODY:
            ex.json_body += chunk
        if message.get("more_body", False):
            return
        if ex.json_body:
            self.tracker.frame(stream, None, classify_frame(ex.json_body.decode("utf-8", "replace")))
        self.tracker.end_stream(stream, sc.END_HTTP_ERROR if ex.status >= 400 else sc.END_CLEAN, ex.status)

    # --- ServerMiddleware ---

    async def middleware(self, ctx: ServerRequestContext[Any, Any], call_next: CallNext) -> HandlerResult:
        """Links each ``tools/call`` to the SDK's own span; with ``enforce``, refuses a token that lacks
        what the tool requires, with an error that names it."""
        if ctx.method != TOOLS_CALL or ctx.request_id is None:
            return await call_next(ctx)
        call = self._call_of(ctx.request, str(ctx.request_id))
        if call is not None:
            sdk = trace.get_current_span().get_span_context()  # the SDK's own tools/call span
            if sdk.is_valid:
                call.link(sdk, _SDK_REQUEST_LINK)
            tool, requirement, (missing_resources, missing_scopes) = call.tool, call.requirement, call.missing
        else:  # not seen by the observer (an app served without it): read the request here
            tool = (ctx.params or {}).get("name")
            tool = tool if isinstance(tool, str) else None
            headers = getattr(ctx.request, "headers", None)
            view = self.tokens.from_authorization(headers.get("authorization") if headers is not None else None)
            requirement = self.policy.requirement(tool)
            missing_resources, missing_scopes = view.missing(requirement) if requirement else NOTHING_MISSING
        if self.enforce and (missing_resources or missing_scopes):
            raise MCPError(
                code=REFUSED_ERROR_CODE,
                message=f"token does not grant what tool {tool!r} requires: resource indicators "
                f"{sorted(missing_resources)}, scopes {sorted(missing_scopes)}",
                data={"tool": tool, "required_resources": sorted(requirement.resources if requirement else ()),
                      "missing_resources": sorted(missing_resources), "missing_scopes": sorted(missing_scopes)},
            )
        return await call_next(ctx)

    def _call_of(self, request: Any, request_id: str) -> Call | None:
        """The call, from the exchange the observer left in the request's scope."""
        ex = getattr(request, "scope", {}).get(_EXCHANGE)
        if isinstance(ex, _Exchange):
            for call in ex.calls:
                if call.key[1] == request_id:
                    return call
        return None

    def _remember(self, key: CallKey, requirement: Requirement) -> None:
        self._requirements[key] = requirement
        if len(self._requirements) > self._max_calls:
            self._requirements.popitem(last=False)

    def requirement_of(self, session_id: str | None, stream_id: str) -> Requirement | None:
        return self._requirements.get((session_id, stream_id))

    # --- EventStore wrapper ---

    def event_store(self, inner: EventStore) -> EventStore:
        return _ObservedEventStore(inner, self)

    def _on_stored(self, session_id: str | None, stream_id: str, event_id: str,
                   message: JSONRPCMessage | None) -> None:
        kind, request_id = sc.FRAME_PRIMING, None
        if isinstance(message, JSONRPCResponse | JSONRPCError):
            kind, request_id = (sc.FRAME_ERROR if isinstance(message, JSONRPCError) else sc.FRAME_RESPONSE,
                                None if message.id is None else str(message.id))
        elif message is not None:
            kind = sc.FRAME_NOTIFICATION if getattr(message, "id", None) is None else sc.FRAME_REQUEST
        key = (session_id, stream_id)
        events = self._stored.get(key)
        if events is None:
            events = self._stored[key] = deque(maxlen=self._max_events_per_stream)
            while len(self._stored) > self._max_streams:
                self._stored.popitem(last=False)
        events.append(_Stored(event_id, kind, request_id))
        self._store_order += 1
        self._stream_of_event[(session_id, event_id)] = (stream_id, self._store_order)
        while len(self._stream_of_event) > self._max_streams * 10:
            self._stream_of_event.popitem(last=False)
        if request_id is not None and stream_id != GET_STREAM_KEY:
            call = self.tracker.call((session_id, stream_id))
            if call is not None:
                call.event(sc.EVENT_STORED, {sc.EVENT_ID: event_id, sc.FRAME_KIND: kind})
                if request_id == stream_id:
                    self.tracker.stored(call, event_id, _outcome(message))

    def stream_of(self, session_id: str | None, event_id: str) -> str | None:
        known = self._stream_of_event.get((session_id, event_id))
        return known[0] if known is not None else None

    def skipped(self, session_id: str | None, buffered: Sequence[str], sent: Sequence[str]) -> int:
        """Buffered events not sent that were stored before the last event sent: a client that takes
        that event's id as its cursor has moved past them."""
        def order(event_id: str) -> int:
            known = self._stream_of_event.get((session_id, event_id))
            return known[1] if known is not None else 0

        last = max((order(e) for e in sent), default=0)
        delivered = set(sent)
        return sum(1 for e in buffered if e not in delivered and order(e) < last)

    def _buffered_after(self, session_id: str | None, stream_id: str, cursor: str) -> list[str]:
        """Events stored on ``stream_id`` after ``cursor``: after it in that stream, or, for a cursor
        stored on another stream, after it in store order."""
        events = list(self._stored.get((session_id, stream_id), ()))
        ids = [e.event_id for e in events]
        if cursor in ids:
            after = events[ids.index(cursor) + 1:]
        else:
            known = self._stream_of_event.get((session_id, cursor))
            position = known[1] if known is not None else 0
            after = [e for e in events if self._order(session_id, e.event_id) > position]
        return [e.event_id for e in after if e.kind != sc.FRAME_PRIMING]

    def _order(self, session_id: str | None, event_id: str) -> int:
        known = self._stream_of_event.get((session_id, event_id))
        return known[1] if known is not None else 0

    def resumed_stream(self, session_id: str | None, cursor: str) -> tuple[str | None, Call | None]:
        """The stream a resume from ``cursor`` continues, and its call: the calls the resume really
        carries (the stream this side sent the cursor event on), not the stream the event was stored
        on. They differ when a session-wide replay handed another stream's event to this call's stream:
        the client's next cursor is then that event, and the replay after it is still this call's."""
        stored_on = self.stream_of(session_id, cursor)
        carried = self.tracker.calls_of_cursor(session_id, cursor)
        if len(carried) == 1 and carried[0].key[1] != stored_on and stored_on is not None:
            return carried[0].key[1], carried[0]
        return stored_on, self.tracker.call((session_id, stored_on)) if stored_on else None


def _outcome(message: JSONRPCMessage | None) -> str:
    """A stored terminal event's outcome, as the call span records it."""
    if isinstance(message, JSONRPCError):
        return sc.OUTCOME_ERROR
    result = message.result if isinstance(message, JSONRPCResponse) else None
    return sc.OUTCOME_TOOL_ERROR if isinstance(result, dict) and result.get("isError") is True else sc.OUTCOME_RESULT


class _ObservedEventStore(EventStore):
    """Delegates to the author's store; records what was stored and what each replay sent."""

    def __init__(self, inner: EventStore, instrumentation: ServerInstrumentation) -> None:
        self._inner = inner
        self._instr = instrumentation

    async def store_event(self, stream_id: StreamId, message: JSONRPCMessage | None) -> EventId:
        event_id = await self._inner.store_event(stream_id, message)
        rs = request_scope.current()
        self._instr._on_stored(rs.session_id if rs else None, stream_id, event_id, message)
        return event_id

    async def replay_events_after(self, last_event_id: EventId, send_callback: EventCallback) -> StreamId | None:
        instr = self._instr
        rs = request_scope.current() or request_scope.RequestScope()
        session_id = rs.session_id
        stream_id, call = instr.resumed_stream(session_id, last_event_id)
        buffered = instr._buffered_after(session_id, stream_id, last_event_id) if stream_id else []
        sent: list[str] = []
        foreign: list[str] = []
        refusals = 0

        async def observed_send(event: EventMessage) -> None:
            nonlocal refusals
            if event.event_id is None:
                refusals += 1  # a frame without an id cannot be a replayed event: a refusal
            else:
                sent.append(event.event_id)
                if instr.stream_of(session_id, event.event_id) != stream_id:
                    foreign.append(event.event_id)
            await send_callback(event)

        attrs: dict[str, AttributeValue] = {sc.SPAN: sc.SPAN_REPLAY, sc.ROLE: sc.ROLE_SERVER, sc.ERA: sc.ERA_RESUMABLE,
                                            sc.RESUME_CURSOR: last_event_id, **auth_attributes(rs.auth)}
        if session_id is not None:
            attrs[sc.MCP_SESSION_ID] = session_id
        parent = trace.set_span_in_context(instr.tracker.span_of(call)) if call is not None else None
        span = instr._tracer.start_span(sc.SPAN_NAME_REPLAY, context=parent, kind=SpanKind.INTERNAL, attributes=attrs)
        with trace.use_span(span, end_on_exit=True):
            result = await self._inner.replay_events_after(last_event_id, observed_send)
            unsent = [e for e in buffered if e not in sent]
            if stream_id is None:
                decision = sc.REPLAY_UNKNOWN_CURSOR
            elif refusals:
                decision = sc.REPLAY_REFUSED
            elif unsent:
                decision = sc.REPLAY_TRUNCATED
            else:
                decision = sc.REPLAY_COMPLETE
            out: dict[str, AttributeValue] = {
                sc.REPLAY_DECISION: decision,
                sc.REPLAY_BUFFERED: len(buffered),
                sc.REPLAY_SENT: len(sent),
            }
            if stream_id is not None:
                out[sc.REPLAY_STREAM_ID] = stream_id
                if stream_id != GET_STREAM_KEY:
                    out[sc.JSONRPC_REQUEST_ID] = stream_id
            if sent:
                out[sc.REPLAY_SENT_LAST_ID] = sent[-1]
            if unsent:
                out[sc.REPLAY_OFFENDING_EVENT_ID] = unsent[0]
                skipped = instr.skipped(session_id, buffered, sent)
                if skipped:
                    out[sc.REPLAY_SKIPPED] = skipped
            if foreign:
                out[sc.REPLAY_FOREIGN_EVENT_IDS] = foreign
            requirement = instr.requirement_of(session_id, stream_id) if stream_id else None
            if requirement is not None:
                out.update(requirement_attributes(requirement, known_missing(rs.auth, requirement)))
            span.set_attributes(out)
        return result


def instrument_server(
    target: MCPServer | ASGIApp,
    *,
    policy: ToolPolicy | None = None,
    enforce: bool = False,
    event_store: EventStore | None = None,
    token_reader: TokenReader | None = None,
    tracer_provider: trace.TracerProvider | None = None,
    streamable_http_path: str = "/mcp",
    **app_options: Any,
) -> ASGIApp:
    """The one call a server author adds: returns the instrumented ASGI app to serve.

    Given an ``MCPServer``, builds its Streamable HTTP app (``app_options`` go to
    ``streamable_http_app``) with the event store wrapped and the policy middleware installed. Given
    an ASGI app already built, only the wire is observed: pass the server to get the rest.
    """
    instr = ServerInstrumentation(policy=policy, enforce=enforce, token_reader=token_reader,
                                  tracer_provider=tracer_provider, path=streamable_http_path)
    if not isinstance(target, MCPServer):
        return instr.asgi(target)
    target.middleware.append(instr.middleware)
    store = instr.event_store(event_store) if event_store is not None else None
    app = target.streamable_http_app(event_store=store, streamable_http_path=streamable_http_path, **app_options)
    if isinstance(event_store, request_scope.ExchangeAware):
        app = event_store.asgi(app)  # e.g. the guard: inside the observer, so the wire we see is theirs
    return instr.asgi(app)
