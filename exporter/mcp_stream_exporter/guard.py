"""The replay guard: a session-scoped ``EventStore`` that enforces the superset-audience invariant.

Legs 1 and 2 of the invariant (docs/incident.md): a resume is replayed only if the resuming token's ``aud`` (and scopes)
cover every buffered event after the cursor and the live tail of the stream; otherwise the client
gets an explicit, resumable ``event: error`` frame naming the offending event, what it requires, what
the token holds, and the cursor to resume from, and nothing after it. The cursor never moves past
an event that was not delivered (the error frame has no ``id:``).

Turn it on with one argument: ``instrument_server(mcp, policy=p, event_store=GuardedEventStore(p))``,
or without the hooks, ``GuardedEventStore(p).serve(mcp, ...)``.

What it relies on in the SDK (pinned by tests/integration/test_sdk_contract.py):
- ``EventStore.replay_events_after`` runs inside the resuming GET's task, so the request scope bound
  by ``asgi()`` is the resuming request's;
- an ``EventMessage`` with ``event_id=None`` is written as ``event: message`` with no ``id:``
  (``StreamableHTTPServerTransport._create_event_data``), one frame per ASGI body chunk
  (sse-starlette). ``asgi()`` rewrites exactly that chunk, our refusal notice, into ``event: error``.
"""

from __future__ import annotations

import itertools
import json
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final, Literal, Protocol

from mcp.server.mcpserver import MCPServer
from mcp.server.streamable_http import (
    GET_STREAM_KEY,
    EventCallback,
    EventId,
    EventMessage,
    EventStore,
    StreamId,
)
from mcp_types import JSONRPCMessage, JSONRPCNotification
from opentelemetry import trace

from mcp_stream_exporter import scope as request_scope
from mcp_stream_exporter import semconv as sc
from mcp_stream_exporter.asgi import ASGIApp, Message, Receive, Scope, Send
from mcp_stream_exporter.auth import NO_REQUIREMENT, AuthView, Requirement, TokenReader, ToolPolicy
from mcp_stream_exporter.headers import pick
from mcp_stream_exporter.sse import SSEFrame, SSEParser, render
from mcp_stream_exporter.wire import MAX_PARSED_BODY, TOOLS_CALL, classify

Mode = Literal["enforce", "observe"]
Policy = Literal["all_or_nothing", "prefix"]
ReplayScope = Literal["stream", "session"]

REFUSAL_METHOD: Final = "notifications/mcp_stream/replay_refused"  # the in-process notice asgi() rewrites
INSUFFICIENT_AUDIENCE: Final = "insufficient_audience"
UNKNOWN_CURSOR: Final = "unknown_cursor"
_REQUEST_HEADERS = frozenset({b"mcp-session-id", b"authorization"})


@dataclass(frozen=True, slots=True)
class StoredEvent:
    seq: int
    event_id: str
    stream_id: str
    message: JSONRPCMessage | None  # None: a priming event
    requirement: Requirement


class EventStorage(Protocol):
    """Where a ``GuardedEventStore`` keeps events: per session, in order, bounded."""

    evictions: int

    def append(self, session_id: str | None, event: StoredEvent) -> None: ...

    def get(self, session_id: str | None, event_id: str) -> StoredEvent | None: ...

    def after(self, session_id: str | None, event: StoredEvent) -> list[StoredEvent]: ...


@dataclass(slots=True)
class _Session:
    events: OrderedDict[str, StoredEvent] = field(default_factory=OrderedDict)
    touched: float = 0.0


class InMemoryEventStorage:
    """Bounded in-memory storage: at most ``max_events_per_session`` events a session (oldest go
    first), ``max_sessions`` sessions, and a session untouched for ``ttl`` seconds is dropped.
    Every event dropped is counted in ``evictions``; its id then reads as an unknown cursor."""

    def __init__(self, *, max_events_per_session: int = 1000, max_sessions: int = 10_000, ttl: float = 3600.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._sessions: OrderedDict[str | None, _Session] = OrderedDict()
        self._max_events = max_events_per_session
        self._max_sessions = max_sessions
        self._ttl = ttl
        self._clock = clock
        self.evictions = 0

    def _expire(self, now: float) -> None:
        while self._sessions:
            key, oldest = next(iter(self._sessions.items()))
            if now - oldest.touched <= self._ttl and len(self._sessions) <= self._max_sessions:
                return
            self.evictions += len(oldest.events)
            del self._sessions[key]

    def append(self, session_id: str | None, event: StoredEvent) -> None:
        now = self._clock()
        session = self._sessions.pop(session_id, None) or _Session()
        session.touched = now
        self._sessions[session_id] = session  # most recently touched last
        session.events[event.event_id] = event
        while len(session.events) > self._max_events:
            session.events.popitem(last=False)
            self.evictions += 1
        self._expire(now)

    def get(self, session_id: str | None, event_id: str) -> StoredEvent | None:
        self._expire(self._clock())
        session = self._sessions.get(session_id)
        return session.events.get(event_id) if session is not None else None

    def after(self, session_id: str | None, event: StoredEvent) -> list[StoredEvent]:
        session = self._sessions.get(session_id)
        if session is None:
            return []
        return [e for e in session.events.values() if e.seq > event.seq]


@dataclass(frozen=True, slots=True)
class _Verdict:
    deliver: list[StoredEvent]
    refusal: dict[str, Any] | None  # the error frame's data, when a requirement is not covered


class GuardedEventStore(EventStore):
    """An ``EventStore`` that scopes every event by session and checks every replay against the
    resuming token.

    ``mode="enforce"`` refuses with an error frame; ``mode="observe"`` replays as before and records
    what it would have refused on the current span (for a rollout). ``policy="all_or_nothing"``
    refuses before sending anything; ``policy="prefix"`` delivers the authorised prefix first.
    ``replay="stream"`` replays the cursor's stream (the SDK's shape); ``replay="session"`` every
    event of the session after the cursor (servers that replay session-wide): each event is checked
    against its own call's requirement either way.
    """

    def __init__(self, policy: ToolPolicy, *, mode: Mode = "enforce", policy_mode: Policy = "all_or_nothing",
                 replay: ReplayScope = "stream", storage: EventStorage | None = None,
                 token_reader: TokenReader | None = None, max_calls: int = 100_000) -> None:
        self.policy = policy
        self.mode = mode
        self.policy_mode = policy_mode
        self.replay = replay
        self.storage: EventStorage = storage if storage is not None else InMemoryEventStorage()
        self.tokens = token_reader or TokenReader()
        self._seq = itertools.count(1)
        self._requirements: OrderedDict[tuple[str | None, str], Requirement] = OrderedDict()
        self._max_calls = max_calls

    # --- which call requires what ---

    def record_call(self, session_id: str | None, request_id: str, tool: str | None) -> None:
        """A ``tools/call`` of ``tool`` was received: its stream's events require the tool's policy."""
        self._requirements[(session_id, request_id)] = self.policy.requirement(tool) or NO_REQUIREMENT
        if len(self._requirements) > self._max_calls:
            self._requirements.popitem(last=False)

    def _requirement(self, session_id: str | None, stream_id: str) -> Requirement:
        return self._requirements.get((session_id, stream_id), NO_REQUIREMENT)

    # --- EventStore ---

    async def store_event(self, stream_id: StreamId, message: JSONRPCMessage | None) -> EventId:
        rs = request_scope.current()
        session_id = rs.session_id if rs is not None else None
        seq = next(self._seq)
        event = StoredEvent(seq, str(seq), stream_id, message, self._requirement(session_id, stream_id))
        self.storage.append(session_id, event)
        return event.event_id

    async def replay_events_after(self, last_event_id: EventId, send_callback: EventCallback) -> StreamId | None:
        rs = request_scope.current() or request_scope.RequestScope()
        span = trace.get_current_span()  # the hooks' replay span when they are installed
        cursor = self.storage.get(rs.session_id, last_event_id)
        if cursor is None:  # unknown, evicted, or another session's: never an empty 200
            span.set_attributes({sc.GUARD_MODE: self.mode, sc.GUARD_DECISION: sc.GUARD_UNKNOWN_CURSOR})
            await send_callback(_refusal({"error": UNKNOWN_CURSOR, "cursor": last_event_id,
                                          "detail": "event id unknown or evicted in this session; "
                                                    "re-issue the pending calls"}))
            return None
        verdict = self._verdict(rs.session_id, rs.auth, cursor)
        if verdict.refusal is None or self.mode == "observe":
            for event in verdict.deliver if verdict.refusal is None else self._buffered(rs.session_id, cursor):
                await send_callback(EventMessage(event.message, event.event_id))  # type: ignore[arg-type]
            decision = sc.GUARD_ALLOW if verdict.refusal is None else sc.GUARD_WOULD_REFUSE
            span.set_attributes(_span_attributes(self.mode, decision, verdict.refusal))
            return cursor.stream_id
        for event in verdict.deliver:
            await send_callback(EventMessage(event.message, event.event_id))  # type: ignore[arg-type]
        span.set_attributes(_span_attributes(self.mode, sc.GUARD_REFUSE, verdict.refusal))
        await send_callback(_refusal(verdict.refusal))
        return None  # no live tail: the stream ends after the error frame

    def _buffered(self, session_id: str | None, cursor: StoredEvent) -> list[StoredEvent]:
        return [e for e in self.storage.after(session_id, cursor)
                if e.message is not None and (self.replay == "session" or e.stream_id == cursor.stream_id)]

    def _verdict(self, session_id: str | None, auth: AuthView, cursor: StoredEvent) -> _Verdict:
        buffered = self._buffered(session_id, cursor)
        delivered = cursor.event_id
        for index, event in enumerate(buffered):
            gap = _gap(auth, event.requirement)
            if gap is not None:
                prefix = buffered[:index] if self.policy_mode == "prefix" else []
                resume_from = prefix[-1].event_id if prefix else cursor.event_id
                return _Verdict(prefix, _refusal_data(event.event_id, event.stream_id, event.requirement, gap,
                                                      auth, resume_from))
            delivered = event.event_id
        live = self._requirement(session_id, cursor.stream_id) if cursor.stream_id != GET_STREAM_KEY else NO_REQUIREMENT
        gap = _gap(auth, live)
        if gap is not None:  # the live tail would carry events the token may not see
            prefix = buffered if self.policy_mode == "prefix" else []
            return _Verdict(prefix, _refusal_data(None, cursor.stream_id, live, gap, auth,
                                                  delivered if prefix else cursor.event_id))
        return _Verdict(buffered, None)

    # --- HTTP side ---

    def asgi(self, app: ASGIApp) -> ASGIApp:
        """Bind the request scope (session, token), record each ``tools/call``, and turn the refusal
        notice into an ``event: error`` frame on the wire."""

        async def guarded(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != "http":
                await app(scope, receive, send)
                return
            rs = request_scope.current()  # bound already when the hooks' observer is in front
            token = None
            if rs is None:
                headers = pick(scope.get("headers", ()), _REQUEST_HEADERS)
                rs = request_scope.RequestScope(headers.get("mcp-session-id"),
                                                self.tokens.from_authorization(headers.get("authorization")))
                token = request_scope.bind(rs)
            body = bytearray()

            async def guarded_receive() -> Message:
                message = await receive()
                if message["type"] == "http.request" and scope.get("method") == "POST" and len(body) <= MAX_PARSED_BODY:
                    body.extend(message.get("body", b""))
                    if not message.get("more_body", False):
                        for msg in classify(bytes(body)):
                            if msg.method == TOOLS_CALL and msg.id is not None:
                                self.record_call(rs.session_id, msg.id, msg.tool)
                return message

            async def guarded_send(message: Message) -> None:
                if message["type"] == "http.response.start" and rs.session_id is None:
                    for k, v in message.get("headers", []):
                        if k.lower() == b"mcp-session-id":
                            rs.session_id = v.decode("latin-1")
                elif message["type"] == "http.response.body" and REFUSAL_METHOD.encode() in message.get("body", b""):
                    message = {**message, "body": _rewrite_refusal(message["body"])}
                await send(message)

            try:
                await app(scope, guarded_receive, guarded_send)
            finally:
                if token is not None:
                    request_scope.unbind(token)

        return guarded

    def serve(self, server: MCPServer, **app_options: Any) -> ASGIApp:
        """Without the hooks: the server's Streamable HTTP app with this store, guarded."""
        return self.asgi(server.streamable_http_app(event_store=self, **app_options))


def _gap(auth: AuthView, requirement: Requirement) -> tuple[frozenset[str], frozenset[str]] | None:
    missing = auth.missing(requirement)
    return missing if missing[0] or missing[1] else None


def _refusal_data(event_id: str | None, stream_id: str, requirement: Requirement,
                  gap: tuple[frozenset[str], frozenset[str]], auth: AuthView, cursor: str) -> dict[str, Any]:
    return {
        "error": INSUFFICIENT_AUDIENCE,
        "event_id": event_id,  # None: the live tail of the stream, not a buffered event
        "request_id": None if stream_id == GET_STREAM_KEY else stream_id,
        "required_resources": sorted(requirement.resources),
        "required_scopes": sorted(requirement.scopes),
        "missing_resources": sorted(gap[0]),
        "missing_scopes": sorted(gap[1]),
        "token_audience": sorted(auth.audience),
        "cursor": cursor,  # resume from here with a token that covers the requirement
    }


def _refusal(data: dict[str, Any]) -> EventMessage:
    """The notice sent through the SDK's replay callback; ``asgi()`` renders it as ``event: error``."""
    return EventMessage(JSONRPCNotification(jsonrpc="2.0", method=REFUSAL_METHOD, params=data), None)


def _span_attributes(mode: str, decision: str, refusal: dict[str, Any] | None) -> dict[str, Any]:
    attrs: dict[str, Any] = {sc.GUARD_MODE: mode, sc.GUARD_DECISION: decision}
    if refusal is not None:
        if refusal["event_id"] is not None:
            attrs[sc.GUARD_OFFENDING_EVENT_ID] = refusal["event_id"]
        attrs[sc.GUARD_MISSING_RESOURCES] = refusal["missing_resources"]
        attrs[sc.GUARD_MISSING_SCOPES] = refusal["missing_scopes"]
        attrs[sc.GUARD_CURSOR] = refusal["cursor"]
    return attrs


def _rewrite_refusal(chunk: bytes) -> bytes:
    """Render our refusal notices in a body chunk as ``event: error`` frames; leave the rest as is."""
    parser = SSEParser()
    frames = [*parser.feed(chunk), *parser.close()]
    out: list[bytes] = []
    for frame in frames:
        notice = _notice(frame)
        out.append(render(SSEFrame(json.dumps(notice), event="error")) if notice is not None else render(frame))
    return b"".join(out) if frames else chunk


def _notice(frame: SSEFrame) -> dict[str, Any] | None:
    if frame.id is not None or REFUSAL_METHOD not in frame.data:
        return None
    try:
        obj = json.loads(frame.data)
    except ValueError:
        return None
    params = obj.get("params") if isinstance(obj, dict) and obj.get("method") == REFUSAL_METHOD else None
    return params if isinstance(params, dict) else None

