"""The replay guard: a session-scoped ``EventStore`` that enforces the superset-audience invariant.

Parts 1 and 2 of the invariant in docs/incident.md: a resume is replayed only if the resuming token's
``aud`` (and scopes) cover every buffered event after the cursor and the live tail of the stream;
otherwise the client gets an explicit, resumable ``event: error`` frame naming the offending event,
what it requires, what the token holds, and the cursor to resume from, and nothing after it. The
cursor never moves past an event that was not delivered (the error frame has no ``id:``).

It fails closed: an event whose requirement is unknown (never recorded, evicted), a token whose
signature did not verify, an opaque token (by default), a token of another principal than the
session's, and a replay without the request context bound by ``asgi()`` are all refused with an
error frame, never replayed.

Turn it on with one argument: ``instrument_server(mcp, policy=p, event_store=GuardedEventStore(p))``,
or without the hooks, ``GuardedEventStore(p).serve(mcp, ...)``.

What it relies on in the SDK (pinned by tests/integration/test_sdk_contract.py):
- ``EventStore.replay_events_after`` runs inside the resuming GET's task, so the request context
  bound by ``asgi()`` is the resuming request's; ``store_event`` runs in the session's task, a copy
  of the initialize request's context, or in the POST's own for its priming event;
- an ``EventMessage`` with ``event_id=None`` is written as ``event: message`` with no ``id:``
  (``StreamableHTTPServerTransport._create_event_data``), one frame per ASGI body chunk
  (sse-starlette). ``asgi()`` rewrites exactly that chunk, our refusal notice, into ``event: error``.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from contextvars import ContextVar
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

from mcp_stream_exporter import semconv as sc
from mcp_stream_exporter.asgi import ASGIApp, Message, Receive, Scope, Send
from mcp_stream_exporter.auth import ABSENT, NO_REQUIREMENT, AuthView, Requirement, TokenReader, ToolPolicy
from mcp_stream_exporter.sse import SSEFrame, SSEParser, render
from mcp_stream_exporter.wire import MAX_PARSED_BODY, TOOLS_CALL, classify

Mode = Literal["enforce", "observe"]
Policy = Literal["all_or_nothing", "prefix"]
ReplayScope = Literal["stream", "session"]
Opaque = Literal["refuse", "allow"]

REFUSAL_METHOD: Final = "notifications/mcp_stream/replay_refused"  # the in-process notice asgi() rewrites
# The ``error`` of a refusal frame: why the replay stopped (docs/guard.md, "The error frame").
INSUFFICIENT_AUDIENCE: Final = "insufficient_audience"
UNKNOWN_CURSOR: Final = "unknown_cursor"
REQUIREMENT_UNKNOWN: Final = "requirement_unknown"
TOKEN_UNVERIFIED: Final = "token_unverified"  # noqa: S105 (a refusal reason, not a secret)
AUDIENCE_UNKNOWN: Final = "audience_unknown"
PRINCIPAL_MISMATCH: Final = "principal_mismatch"
NO_REQUEST_CONTEXT: Final = "no_request_context"
AMBIGUOUS_REQUEST: Final = "ambiguous_request"

_DETAILS: Final = {
    INSUFFICIENT_AUDIENCE: "the token's aud or scopes do not cover this event's call: re-authorise for "
                           "required_resources and resume from cursor",
    REQUIREMENT_UNKNOWN: "the guard has no record of what this event's call requires (never recorded or "
                         "evicted): re-issue the call",
    TOKEN_UNVERIFIED: "the token's signature did not verify: only a verified token's audience counts",
    AUDIENCE_UNKNOWN: "an opaque token's audience cannot be read: present a JWT access token covering "
                      "required_resources",
    PRINCIPAL_MISMATCH: "the token's subject is not the one that opened this session",
    NO_REQUEST_CONTEXT: "the guard's ASGI layer is not in front of this server: no session or token to "
                        "check a replay against",
    AMBIGUOUS_REQUEST: "the resume carried more than one Authorization or Mcp-Session-Id header",
    UNKNOWN_CURSOR: "event id unknown or evicted in this session; re-issue the pending calls",
}
_REQUEST_HEADERS: Final = (b"mcp-session-id", b"authorization")
_log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StoredEvent:
    seq: int
    event_id: str
    stream_id: str
    message: JSONRPCMessage | None  # None: a priming event
    requirement: Requirement | None  # None: unknown when stored, so never replayed
    subject: str | None = None  # the subject hash of the token the session was opened with


class EventStorage(Protocol):
    """Where a ``GuardedEventStore`` keeps events and what each stream's call requires: per session,
    in order, bounded per session. A requirement lives with the events it protects, and a session
    exists only from ``open`` (its initialize response) until it is evicted: an evicted session is
    never re-created by a later write, so what its streams required can never be recorded anew,
    lower."""

    evictions: int

    def open(self, session_id: str) -> None: ...

    def append(self, session_id: str | None, event: StoredEvent) -> None:
        """Keep ``event``; dropped (and counted) when the session is not open."""
        ...

    def get(self, session_id: str | None, event_id: str) -> StoredEvent | None: ...

    def after(self, session_id: str | None, event: StoredEvent) -> list[StoredEvent]: ...

    def require(self, session_id: str | None, stream_id: str, requirement: Requirement) -> None:
        """Record that ``stream_id``'s events require ``requirement``, on top of (never instead of)
        what was recorded for it before; dropped (and counted) when the session is not open or holds
        its maximum of streams already, so the stream's events are never replayed."""
        ...

    def requirement(self, session_id: str | None, stream_id: str) -> Requirement | None: ...


@dataclass(slots=True)
class _Session:
    events: OrderedDict[str, StoredEvent] = field(default_factory=OrderedDict)
    requirements: dict[str, Requirement] = field(default_factory=dict)
    touched: float = 0.0


class InMemoryEventStorage:
    """Bounded in-memory storage: at most ``max_events_per_session`` events a session (oldest go
    first), ``max_calls_per_session`` stream requirements a session (later ones are not recorded),
    ``max_sessions`` sessions (least recently used go first), and a session untouched for ``ttl``
    seconds is dropped. Everything dropped is counted in ``evictions``: an evicted event's id reads
    as an unknown cursor, and an event without a recorded requirement is never replayed."""

    def __init__(self, *, max_events_per_session: int = 1000, max_calls_per_session: int = 1000,
                 max_sessions: int = 10_000, ttl: float = 3600.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._sessions: OrderedDict[str | None, _Session] = OrderedDict()
        self._max_events = max_events_per_session
        self._max_calls = max_calls_per_session
        self._max_sessions = max_sessions
        self._ttl = ttl
        self._clock = clock
        self.evictions = 0

    def _expire(self, now: float) -> None:
        while self._sessions:
            key, oldest = next(iter(self._sessions.items()))
            if now - oldest.touched <= self._ttl and len(self._sessions) <= self._max_sessions:
                return
            self.evictions += len(oldest.events) + len(oldest.requirements)
            del self._sessions[key]

    def _touch(self, session_id: str | None) -> _Session | None:
        now = self._clock()
        self._expire(now)
        session = self._sessions.get(session_id)
        if session is not None:
            session.touched = now
            self._sessions.move_to_end(session_id)  # most recently touched last
        return session

    def open(self, session_id: str) -> None:
        if session_id not in self._sessions:
            self._sessions[session_id] = _Session(touched=self._clock())
            self._expire(self._clock())

    def append(self, session_id: str | None, event: StoredEvent) -> None:
        session = self._touch(session_id)
        if session is None:
            self.evictions += 1
            return
        session.events[event.event_id] = event
        while len(session.events) > self._max_events:
            session.events.popitem(last=False)
            self.evictions += 1

    def get(self, session_id: str | None, event_id: str) -> StoredEvent | None:
        self._expire(self._clock())
        session = self._sessions.get(session_id)
        return session.events.get(event_id) if session is not None else None

    def after(self, session_id: str | None, event: StoredEvent) -> list[StoredEvent]:
        session = self._sessions.get(session_id)
        if session is None:
            return []
        return [e for e in session.events.values() if e.seq > event.seq]

    def require(self, session_id: str | None, stream_id: str, requirement: Requirement) -> None:
        session = self._touch(session_id)
        before = session.requirements.get(stream_id) if session is not None else None
        if session is None or (before is None and len(session.requirements) >= self._max_calls):
            self.evictions += 1
            return
        session.requirements[stream_id] = requirement if before is None else before | requirement

    def requirement(self, session_id: str | None, stream_id: str) -> Requirement | None:
        session = self._sessions.get(session_id)
        return session.requirements.get(stream_id) if session is not None else None


@dataclass(slots=True)
class _Request:
    """The HTTP request guard code runs for: its session (filled in when the initialize response
    names it) and the token it presented, read by the guard's own ``TokenReader``."""

    session_id: str | None
    auth: AuthView
    ambiguous: bool = False  # a repeated Authorization or Mcp-Session-Id header
    pending: list[tuple[str, Requirement]] = field(default_factory=list)  # recorded once the session is known


_current: ContextVar[_Request | None] = ContextVar("mcp_stream_guard_request", default=None)


@dataclass(frozen=True, slots=True)
class _Verdict:
    deliver: list[StoredEvent]
    refusal: dict[str, Any] | None  # the error frame's data, when the replay may not go on


class GuardedEventStore(EventStore):
    """An ``EventStore`` that scopes every event by session and checks every replay against the
    resuming token.

    ``mode="enforce"`` refuses with an error frame; ``mode="observe"`` replays as before and records
    what it would have refused on the current span (for a rollout). ``policy_mode="all_or_nothing"``
    refuses before sending anything; ``"prefix"`` delivers the authorised prefix first.
    ``replay="stream"`` replays the cursor's stream (the SDK's shape); ``"session"`` every event of
    the session after the cursor (servers that replay session-wide): each event is checked against
    its own call's requirement either way. ``opaque="refuse"`` refuses an opaque (non-JWT) token any
    event that requires something, since its audience cannot be read; ``"allow"`` trusts the server's
    own authentication for them. With a verifying ``token_reader`` only verified tokens count.
    """

    def __init__(self, policy: ToolPolicy, *, mode: Mode = "enforce", policy_mode: Policy = "all_or_nothing",
                 replay: ReplayScope = "stream", storage: EventStorage | None = None,
                 token_reader: TokenReader | None = None, opaque: Opaque = "refuse") -> None:
        self.policy = policy
        self.mode = mode
        self.policy_mode = policy_mode
        self.replay = replay
        self.opaque = opaque
        self.storage: EventStorage = storage if storage is not None else InMemoryEventStorage()
        self.tokens = token_reader or TokenReader()
        self._seq = itertools.count(1)

    # --- which call requires what ---

    def record_call(self, session_id: str | None, request_id: str, tool: str | None) -> None:
        """A request was received: its stream's events require the tool's policy (``tool`` None: a
        request other than ``tools/call``, which requires nothing). A request id used again in the
        session only ever adds to what its stream requires."""
        self.storage.require(session_id, request_id, self._requirement_of(tool))

    def _requirement_of(self, tool: str | None) -> Requirement:
        return self.policy.requirement(tool) or NO_REQUIREMENT

    def _stream_requirement(self, session_id: str | None, stream_id: str) -> Requirement | None:
        if stream_id == GET_STREAM_KEY:
            return NO_REQUIREMENT  # server-initiated messages, not a call's
        return self.storage.requirement(session_id, stream_id)

    # --- EventStore ---

    async def store_event(self, stream_id: StreamId, message: JSONRPCMessage | None) -> EventId:
        request = _current.get()
        session_id = request.session_id if request is not None else None
        seq = next(self._seq)
        event = StoredEvent(seq, str(seq), stream_id, message, self._stream_requirement(session_id, stream_id),
                            request.auth.subject_hash if request is not None else None)
        self.storage.append(session_id, event)
        return event.event_id

    async def replay_events_after(self, last_event_id: EventId, send_callback: EventCallback) -> StreamId | None:
        span = trace.get_current_span()  # the hooks' replay span when they are installed
        request = _current.get()
        if request is None or request.ambiguous or request.session_id is None:
            refusal = _request_refusal(request, last_event_id)
            span.set_attributes(_span_attributes(self.mode, sc.GUARD_REFUSE, refusal))
            await send_callback(_refusal(refusal))  # in every mode: there is nothing to check against
            return None
        cursor = self.storage.get(request.session_id, last_event_id)
        if cursor is None:  # unknown, evicted, or another session's: never an empty 200
            span.set_attributes({sc.GUARD_MODE: self.mode, sc.GUARD_DECISION: sc.GUARD_UNKNOWN_CURSOR,
                                 sc.GUARD_REASON: UNKNOWN_CURSOR})
            await send_callback(_refusal(_plain(UNKNOWN_CURSOR, last_event_id)))
            return None
        verdict = self._verdict(request, cursor)
        if verdict.refusal is None or self.mode == "observe":
            for event in verdict.deliver if verdict.refusal is None else self._buffered(request.session_id, cursor):
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

    def _verdict(self, request: _Request, cursor: StoredEvent) -> _Verdict:
        auth = request.auth
        buffered = self._buffered(request.session_id, cursor)
        delivered = cursor.event_id
        for index, event in enumerate(buffered):
            reason = self._covers(auth, event.requirement, event.subject)
            if reason is not None:
                prefix = buffered[:index] if self.policy_mode == "prefix" else []
                resume_from = prefix[-1].event_id if prefix else cursor.event_id
                return _Verdict(prefix, _refusal_data(reason, event.event_id, event.stream_id, event.requirement,
                                                      auth, resume_from))
            delivered = event.event_id
        live = self._stream_requirement(request.session_id, cursor.stream_id)
        reason = self._covers(auth, live, cursor.subject)
        if reason is not None:  # the live tail would carry events the token may not see
            prefix = buffered if self.policy_mode == "prefix" else []
            return _Verdict(prefix, _refusal_data(reason, None, cursor.stream_id, live, auth,
                                                  delivered if prefix else cursor.event_id))
        return _Verdict(buffered, None)

    def _covers(self, auth: AuthView, requirement: Requirement | None, subject: str | None) -> str | None:
        """None when ``auth`` may see an event with this requirement and owner; else why not."""
        if requirement is None:
            return REQUIREMENT_UNKNOWN
        if subject is not None and subject != auth.subject_hash:
            return PRINCIPAL_MISMATCH
        if requirement == NO_REQUIREMENT:
            return None
        if auth.verification == "failed" or (self.tokens.verifies and auth.verification == "unverified"):
            return TOKEN_UNVERIFIED
        if auth.verification == "opaque":
            return None if self.opaque == "allow" else AUDIENCE_UNKNOWN
        return None if auth.grants(requirement) else INSUFFICIENT_AUDIENCE

    # --- HTTP side ---

    def asgi(self, app: ASGIApp) -> ASGIApp:
        """Bind the request context (session, the token as this guard reads it), record each
        request's requirement, and turn the refusal notice into an ``event: error`` frame."""

        async def guarded(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != "http":
                await app(scope, receive, send)
                return
            request = self._request(scope.get("headers", ()))
            token = _current.set(request)
            body = bytearray()

            async def guarded_receive() -> Message:
                message = await receive()
                if message["type"] == "http.request" and scope.get("method") == "POST" and len(body) <= MAX_PARSED_BODY:
                    body.extend(message.get("body", b""))
                    if not message.get("more_body", False) and len(body) <= MAX_PARSED_BODY:
                        self._record(request, bytes(body))  # too large to read: unknown, never replayed
                return message

            async def guarded_send(message: Message) -> None:
                if message["type"] == "http.response.start" and request.session_id is None:
                    session_ids = _values(message.get("headers", ()), b"mcp-session-id")
                    if len(session_ids) == 1:  # a session is born: its initialize response names it
                        request.session_id = session_ids[0]
                        self.storage.open(request.session_id)
                        self._flush(request)
                elif message["type"] == "http.response.body" and REFUSAL_METHOD.encode() in message.get("body", b""):
                    message = {**message, "body": _rewrite_refusal(message["body"])}
                await send(message)

            try:
                await app(scope, guarded_receive, guarded_send)
            finally:
                _current.reset(token)

        return guarded

    def _request(self, headers: Iterable[tuple[bytes, bytes]]) -> _Request:
        session_ids, authorizations = (_values(headers, name) for name in _REQUEST_HEADERS)
        ambiguous = len(session_ids) > 1 or len(authorizations) > 1
        auth = ABSENT if ambiguous or not authorizations else self.tokens.from_authorization(authorizations[0])
        return _Request(session_ids[0] if len(session_ids) == 1 else None, auth, ambiguous)

    def _record(self, request: _Request, body: bytes) -> None:
        for msg in classify(body):
            if msg.method is not None and msg.id is not None:
                request.pending.append((msg.id, self._requirement_of(msg.tool if msg.method == TOOLS_CALL else None)))
        if request.session_id is not None:
            self._flush(request)

    def _flush(self, request: _Request) -> None:
        for request_id, requirement in request.pending:
            self.storage.require(request.session_id, request_id, requirement)
        request.pending.clear()

    def serve(self, server: MCPServer, **app_options: Any) -> ASGIApp:
        """Without the hooks: the server's Streamable HTTP app with this store, guarded."""
        return self.asgi(server.streamable_http_app(event_store=self, **app_options))


def _values(headers: Iterable[tuple[bytes, bytes]], name: bytes) -> list[str]:
    """Every value of one header (latin-1): a repeat is kept, so it can be refused, not guessed at."""
    return [v.decode("latin-1") for k, v in headers if k.lower() == name]


def _request_refusal(request: _Request | None, cursor: str) -> dict[str, Any]:
    if request is None:
        _log.warning("replay refused: GuardedEventStore.asgi() is not in front of the server "
                     "(use instrument_server(..., event_store=guard) or guard.serve(...))")
    return _plain(AMBIGUOUS_REQUEST if request is not None and request.ambiguous else NO_REQUEST_CONTEXT, cursor)


def _plain(error: str, cursor: str) -> dict[str, Any]:
    return {"error": error, "cursor": cursor, "detail": _DETAILS[error]}


def _refusal_data(error: str, event_id: str | None, stream_id: str, requirement: Requirement | None,
                  auth: AuthView, cursor: str) -> dict[str, Any]:
    known = requirement or NO_REQUIREMENT
    missing = auth.missing(known) if error == INSUFFICIENT_AUDIENCE else (known.resources, known.scopes)
    return {
        "error": error,
        "event_id": event_id,  # None: the live tail of the stream, not a buffered event
        "request_id": None if stream_id == GET_STREAM_KEY else stream_id,
        "required_resources": sorted(known.resources),
        "required_scopes": sorted(known.scopes),
        "missing_resources": sorted(missing[0]),
        "missing_scopes": sorted(missing[1]),
        "token_audience": sorted(auth.audience),
        "cursor": cursor,  # resume from here with a token that covers the requirement
        "detail": _DETAILS[error],
    }


def _refusal(data: dict[str, Any]) -> EventMessage:
    """The notice sent through the SDK's replay callback; ``asgi()`` renders it as ``event: error``."""
    return EventMessage(JSONRPCNotification(jsonrpc="2.0", method=REFUSAL_METHOD, params=data), None)


def _span_attributes(mode: str, decision: str, refusal: dict[str, Any] | None) -> dict[str, Any]:
    attrs: dict[str, Any] = {sc.GUARD_MODE: mode, sc.GUARD_DECISION: decision}
    if refusal is None:
        return attrs
    attrs[sc.GUARD_REASON] = refusal["error"]
    attrs[sc.GUARD_CURSOR] = refusal["cursor"]
    if refusal.get("event_id") is not None:
        attrs[sc.GUARD_OFFENDING_EVENT_ID] = refusal["event_id"]
    if "missing_resources" in refusal:
        attrs[sc.GUARD_MISSING_RESOURCES] = refusal["missing_resources"]
        attrs[sc.GUARD_MISSING_SCOPES] = refusal["missing_scopes"]
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

