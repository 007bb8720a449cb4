"""The replay guard: a session-scoped ``EventStore`` that enforces the superset-audience invariant.

Legs 1 and 2 of the invariant (docs/incident.md): a resume is replayed only if the resuming token's
``aud`` (and scopes) cover every buffered event after the cursor and the live tail of the stream;
otherwise the client gets an explicit, resumable ``event: error`` frame naming the offending event,
what it requires, what the token holds, and the cursor to resume from, and nothing after it. The
cursor never moves past an event that was not delivered (the error frame has no ``id:``).

It fails closed: an event whose requirement is unknown (never recorded, evicted), a token whose
signature did not verify, an opaque token (by default), a token of another principal than the
event's (who posted its call, or opened the session), and a replay without the request context bound
by ``asgi()`` are all refused with an error frame, never replayed.

Turn it on with one argument: ``instrument_server(mcp, policy=p, event_store=GuardedEventStore(p))``,
or without the hooks, ``GuardedEventStore(p).serve(mcp, ...)``.

What it relies on in the SDK (pinned by tests/integration/test_sdk_contract.py):
- ``EventStore.replay_events_after`` runs inside the resuming GET's task, so the request context
  bound by ``asgi()`` is the resuming request's; ``store_event`` runs in the session's task, a copy
  of the initialize request's context, or in the POST's own for its priming event;
- an ``EventMessage`` with ``event_id=None`` is written as ``event: message`` with no ``id:``
  (``StreamableHTTPServerTransport._create_event_data``), one frame per ASGI body chunk
  (sse-starlette). ``asgi()`` rewrites exactly that chunk, our refusal notice, into ``event: error``;
- a request's stream is keyed by its JSON-RPC id, so a POST reusing an id in flight would take it over
  (``asgi()`` refuses it: ``inflight.InFlight``); a request whose first ``MCP-Protocol-Version`` is not
  a handshake-era version (``HANDSHAKE_PROTOCOL_VERSIONS``) goes to the SDK's sessionless path, whatever
  ``Mcp-Session-Id`` it names (``StreamableHTTPSessionManager._handle_request``);
- a request the server sends for a call (``related_request_id``: an elicitation, a sampling request) is
  stored under that call's stream id, which is how ``asgi()`` knows whose call a client's answer acts on;
  one tied to no call (a tool's ``create_message`` or ``list_roots`` by default) goes on the standalone
  stream, so its events are held to what the calls in flight then require (``InFlight.stored_alone``);
- the SDK authenticates a request after ``asgi()`` reads it: what a POST asks counts once the SDK took it
  (a response below 400, or an event of its stream stored), never for a POST it refuses.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import logging
import math
import operator
import time
from collections.abc import Iterable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Final, Literal

import anyio
from mcp.server.lowlevel import Server
from mcp.server.mcpserver import MCPServer
from mcp.server.streamable_http import EventCallback, EventId, EventMessage, EventStore, StreamId
from mcp_types import (
    JSONRPCError,
    JSONRPCMessage,
    JSONRPCRequest,
    JSONRPCResponse,
)
from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS
from opentelemetry import trace
from sse_starlette import EventSourceResponse
from starlette.applications import Starlette

from mcp_stream_exporter import semconv as sc
from mcp_stream_exporter.asgi import ASGIApp, Message, Receive, Scope, Send, route_path
from mcp_stream_exporter.auth import (
    ABSENT,
    NO_REQUIREMENT,
    AuthView,
    Requirement,
    TokenReader,
    ToolPolicy,
    checked_policy,
)
from mcp_stream_exporter.coding import codings
from mcp_stream_exporter.exchange import (
    AUTHORIZATION,
    CONTENT_ENCODING,
    CONTENT_SSE,
    CONTENT_TYPE,
    LAST_EVENT_ID,
    PROTOCOL_VERSION,
    SESSION_ID,
    STANDALONE_STREAM_ID,
    content_of,
    requirement_of,
)
from mcp_stream_exporter.guard.calls import refused_call
from mcp_stream_exporter.guard.error_frame import (
    AMBIGUOUS_REQUEST,
    AUDIENCE_UNKNOWN,
    DETAILS,
    INSUFFICIENT_AUDIENCE,
    NO_REQUEST_CONTEXT,
    PRINCIPAL_MISMATCH,
    REFUSAL_METHOD,
    REQUIREMENT_UNKNOWN,
    SESSION_ENDED,
    SESSION_OWNER_GONE,
    STORE_UNAVAILABLE,
    STREAM_ENCODED,
    TOKEN_UNVERIFIED,
    UNKNOWN_CURSOR,
    plain,
    refusal_data,
    refusal_notice,
    rewrite_refusal,
    span_attributes,
    sse_bytes,
)
from mcp_stream_exporter.guard.inflight import InFlight
from mcp_stream_exporter.guard.losses import StoreLosses
from mcp_stream_exporter.guard.posts import (
    MAX_REQUESTS,
    NOTHING_ASKED,
    Asked,
    as_the_sdk_reads,
    read_post,
    refuse_request,
    replaying,
)
from mcp_stream_exporter.guard.storage import (
    EventStorage,
    InMemoryEventStorage,
    SharedEventStorage,
    StorageError,
    StoredEvent,
    TailableEventStorage,
)
from mcp_stream_exporter.headers import values
from mcp_stream_exporter.sse import SSEFrame, SSEParser, render
from mcp_stream_exporter.wire import INITIALIZE, MAX_PARSED_BODY, WireMessage

Mode = Literal["enforce", "observe"]
Policy = Literal["all_or_nothing", "prefix"]
ReplayScope = Literal["stream", "session"]
Opaque = Literal["refuse", "allow"]

_MAX_ID: Final = 256  # a longer request id is never recorded nor stored: a hostile POST cannot fill memory with ids
_MAX_UNOPENED: Final = 10_000  # sessions the SDK opened while the storage failed, opened at their next event
_REOPEN_EVERY_S: Final = 10.0
_TAIL_WAIT_S: Final = 1.0  # how long one wait for the owner's next event blocks before checking it is alive
_log = logging.getLogger(__name__)
_Owner = tuple[Requirement, str | None]  # a call in flight's requirement and the principal (hash) that posted it
_SEVERAL_PRINCIPALS: Final = "several"  # a standalone event stored while two principals' calls ran: nobody's


@dataclass(slots=True)
class _Request:
    """The HTTP request guard code runs for: its session (filled in when the initialize response
    names it) and the token it presented, read by the guard's own ``TokenReader``."""

    session_id: str | None
    auth: AuthView
    ambiguous: bool = False  # a repeated Authorization or Mcp-Session-Id header
    pending: list[tuple[str, Requirement]] = field(default_factory=list)  # recorded once the session is known
    # ids it names that the SDK may act on until it ends (``InFlight.hold``): the stream whose live tail a resume
    # was let take, the calls a POST cancels
    holds: list[str] = field(default_factory=list)


_current: ContextVar[_Request | None] = ContextVar("mcp_stream_guard_request", default=None)


_GUARDED = "mcp_stream.guard"  # the store whose ASGI layer a request went through, in its ASGI scope
_CODED_BODY_HEADERS = frozenset({b"content-encoding", b"content-length"})


def _encoded(start: Message) -> bool:
    """Whether a response's body has a content coding (other than ``identity``)."""
    return bool(codings(values(start.get("headers", ()), CONTENT_ENCODING)))


@dataclass(slots=True)
class _GetStream:
    """A GET stream's frames as they go out, for the standalone events among them (``_live_alone``)."""

    parser: SSEParser
    delivered: str | None  # the last event id sent: where a refused client resumes from
    fresh: bool  # no Last-Event-ID: the standalone stream, live
    stopped: bool = False


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
    its own call's requirement either way; ``"session"`` replays other streams' messages, which an SDK
    2.3 client hands the resumed stream's call as its own (docs/guard.md). ``opaque="refuse"`` refuses
    an opaque (non-JWT) token any event that requires something, since its audience cannot be read;
    ``"allow"`` trusts the server's own authentication for them. With a verifying ``token_reader`` only
    verified tokens count. With a ``SharedEventStorage`` (e.g. ``RedisEventStorage``), a resume that reaches a server
    process which does not hold the session is answered from the storage. ``body_timeout_s``: how long its ASGI layer
    waits for a session POST's whole body, which it reads before the SDK (and its authentication) does.
    """

    def __init__(self, policy: ToolPolicy, *, mode: Mode = "enforce", policy_mode: Policy = "all_or_nothing",
                 replay: ReplayScope = "stream", storage: EventStorage | None = None,
                 token_reader: TokenReader | None = None, opaque: Opaque = "refuse",
                 body_timeout_s: float = 30.0) -> None:
        self.policy = checked_policy(policy)
        if isinstance(body_timeout_s, bool) or not (isinstance(body_timeout_s, int | float)
                                                    and 0 < body_timeout_s < math.inf):
            raise ValueError(f"body_timeout_s must be a positive number of seconds, not {body_timeout_s!r}")
        self.body_timeout_s = body_timeout_s  # a POST's body not whole by then is refused (408): nothing waits on it
        self.mode = mode
        self.policy_mode = policy_mode
        self.replay = replay
        self.opaque = opaque
        self.storage: EventStorage = storage if storage is not None else InMemoryEventStorage()
        self.tokens = token_reader or TokenReader()
        self._unstored = itertools.count(1)
        self._in_flight: InFlight[_Owner] = InFlight()
        # what the requests of session POSTs the SDK has not taken yet require: recorded once it takes them
        # (``_flush``), or once it stores an event of their stream, whichever comes first (``store_event``)
        self._unrecorded: dict[tuple[str, str], Requirement] = {}
        # what the storage did not keep, placed among what it did: a resume past it is refused, and a live tail of
        # such a stream ends rather than wait for what will never be stored
        self._losses = StoreLosses()
        # sessions the SDK opened while the storage failed (the newest _MAX_UNOPENED), each with when it was last
        # tried: opened at their next event, at most every _REOPEN_EVERY_S (each try waits out a failing storage)
        self._unopened: dict[str, float] = {}
        self._reopening: dict[str, bool] = {}  # those being opened now, and whether their client deleted them meanwhile

    # --- which call requires what ---

    async def record_call(self, session_id: str, request_id: str, tool: str | None) -> None:
        """A request was received: its stream's events require the tool's policy (``tool`` None: a
        request other than ``tools/call``, which requires nothing). A request id used again in the
        session only ever adds to what its stream requires."""
        if self._unopened:
            await self._reopen(session_id)
        self._losses.reused(session_id, request_id)
        await self.storage.require(session_id, request_id, requirement_of(self.policy, tool))

    async def open_session(self, session_id: str) -> None:
        """A session is born (its initialize response named it): only now may its events be stored."""
        await self.storage.open(session_id)
        await self.storage.require(session_id, STANDALONE_STREAM_ID, NO_REQUIREMENT)  # server-initiated, not a call's

    # --- EventStore ---

    async def store_event(self, stream_id: StreamId, message: JSONRPCMessage | None) -> EventId:
        request = _current.get()
        subject = request.auth.subject_hash if request is not None else None
        # what its call requires, as this process knows it: stored with the event, whatever the storage recorded for
        # its stream (an id used before may still have its earlier call's there, when recording this one's failed)
        requirement: Requirement | None = None
        if request is not None and request.session_id is not None:
            if stream_id != STANDALONE_STREAM_ID:
                # a call's events are the principal's that posted it: the SDK's message router stores them in the
                # context of the request that opened the session, which may be another principal's (a gateway that
                # authenticates for the SDK, or a verifier that names no subject, lets another user post into it)
                in_flight = self._in_flight.owner(request.session_id, stream_id)
                owner = in_flight or self._in_flight.past(request.session_id, stream_id)
                if owner is not None:
                    requirement, subject = owner
                if in_flight is not None:
                    if refused_call(message):  # it never ran: a DELETE ends nothing of it
                        self._in_flight.refused(request.session_id, stream_id)
                    elif message is not None and not _terminal(message):
                        self._in_flight.ran(request.session_id, stream_id)
            if self._unopened:
                await self._reopen(request.session_id)
            unrecorded = self._unrecorded.pop((request.session_id, stream_id), None)
            if unrecorded is not None:  # the SDK runs the request: its answer may come before its response starts
                await self._require(request.session_id, stream_id, unrecorded)
                # the POST's own, with its id's call in flight: another call's, when observe mode let it reuse the id
                requirement = unrecorded if requirement is None else requirement | unrecorded
            if _terminal(message):
                self._in_flight.answered(request.session_id, stream_id)
            elif isinstance(message, JSONRPCRequest):  # the server asks the client something (for this call)
                self._in_flight.asked(request.session_id, str(message.id), stream_id)
        if len(stream_id) > _MAX_ID:  # its requirement was never recorded either: nothing to resume
            return f"unstored-{next(self._unstored)}"
        try:
            event_id = await self.storage.append(request.session_id if request is not None else None, stream_id,
                                                 message, subject, requirement)
        except StorageError:
            _log.exception("guard storage: event of stream %s not stored; a resume from it will be refused",
                           stream_id)
            if request is not None and request.session_id is not None and message is not None:
                self._losses.lost(request.session_id, stream_id)  # sent live: no resume has it
            event_id = None
        if event_id is None:  # failed, or dropped for a session the storage no longer holds (a resume: session_ended)
            event_id = f"unstored-{next(self._unstored)}"
        elif request is not None and request.session_id is not None:
            self._losses.kept(request.session_id, stream_id, event_id)
        if stream_id == STANDALONE_STREAM_ID and request is not None and request.session_id is not None:
            # the SDK sends it live, stored or not: to the session's principal at least (its message router stores
            # in the context of the request that opened the session)
            self._in_flight.stored_alone(request.session_id, event_id, (NO_REQUIREMENT, request.auth.subject_hash))
        return event_id

    async def replay_events_after(self, last_event_id: EventId, send_callback: EventCallback) -> StreamId | None:
        """The checked replay, then a call's stream's live tail sent from the storage (``_tail``) and None to the
        SDK: the SDK takes a stream only after an await of its own, and drops what the call stores meanwhile."""
        return await self._replay(last_event_id, send_callback, None)

    async def _replay(self, last_event_id: str, send_callback: EventCallback,
                      elsewhere: SharedEventStorage | None) -> StreamId | None:
        """A resume: for the SDK (``elsewhere`` None), or for a session another process holds, answered from
        ``elsewhere`` (``_replay_elsewhere``). The stream id when the SDK is to send the live tail."""
        span = trace.get_current_span()  # the hooks' replay span when they are installed
        request = _current.get()
        if request is None or request.ambiguous or request.session_id is None:
            refusal = _request_refusal(request, last_event_id)
            span.set_attributes(span_attributes(self.mode, sc.GUARD_REFUSE, refusal))
            await send_callback(refusal_notice(refusal))  # in every mode: there is nothing to check against
            return None
        session_id = request.session_id
        try:
            cursor = await self.storage.get(session_id, last_event_id)
            stored = await self.storage.after(session_id, cursor) if cursor is not None else None
            buffered = gap = None
            if cursor is not None and stored is not None:
                gap = self._losses.first_after(session_id, None if self.replay == "session" else cursor.stream_id,
                                               cursor.event_id, [e.event_id for e in stored])
                if gap is not None:  # stored events past a loss: sent up to it, then the refusal
                    stored = stored[:gap]
                buffered = [self._alone(session_id, e) for e in stored if self._carries(cursor.stream_id, e)]
            if cursor is None or buffered is None:
                # unknown, evicted (since it was found, too: what followed it may be gone with it), or another
                # session's: never an empty 200
                span.set_attributes(span_attributes(self.mode, sc.GUARD_UNKNOWN_CURSOR,
                                                     plain(UNKNOWN_CURSOR, last_event_id)))
                await send_callback(refusal_notice(plain(UNKNOWN_CURSOR, last_event_id)))
                return None
            live = await self.storage.requirement(session_id, cursor.stream_id)
        except StorageError:
            _log.exception("guard storage: replay refused, the storage is unavailable")
            span.set_attributes(span_attributes(self.mode, sc.GUARD_REFUSE, plain(STORE_UNAVAILABLE, last_event_id)))
            await send_callback(refusal_notice(plain(STORE_UNAVAILABLE, last_event_id)))
            return None
        verdict = self._verdict(request.auth, cursor, buffered, live)
        if verdict.refusal is None or self.mode == "observe":
            for event in buffered:  # what the verdict lets through: all of it, or (observe) what it would refuse
                await send_callback(EventMessage(event.message, event.event_id))  # type: ignore[arg-type]
            delivered = buffered[-1].event_id if buffered else cursor.event_id
            if gap is not None:  # what was not stored never comes: said, in every mode, as a failing storage is
                span.set_attributes(span_attributes(self.mode, sc.GUARD_REFUSE, plain(STORE_UNAVAILABLE, delivered)))
                await send_callback(refusal_notice(plain(STORE_UNAVAILABLE, delivered)))
                return None
            stop = verdict.refusal or self._taken_over(request, cursor.stream_id, delivered)
            if stop is not None and self.mode == "enforce":
                span.set_attributes(span_attributes(self.mode, sc.GUARD_REFUSE, stop))
                await send_callback(refusal_notice(stop))
                return None
            decision = sc.GUARD_ALLOW if stop is None else sc.GUARD_WOULD_REFUSE
            span.set_attributes(span_attributes(self.mode, decision, stop))
            if cursor.stream_id != STANDALONE_STREAM_ID and _answered(cursor, buffered):
                return None  # its answer is replayed: no live tail to wait on, nor an id to hold for one
            # no await from the check to the live tail being taken (by the SDK, or below): the id stays held
            storage = elsewhere if elsewhere is not None else self.storage
            if not isinstance(storage, TailableEventStorage) or (elsewhere is None
                                                                  and cursor.stream_id == STANDALONE_STREAM_ID):
                self._hold(request, cursor.stream_id)
                return cursor.stream_id  # a storage it cannot wait on, or the standalone stream: the SDK's tail
            if elsewhere is None and self._in_flight.posting(session_id, cursor.stream_id):
                return None  # the call's POST is open: the SDK sends its events there, and would send none here
            self._hold(request, cursor.stream_id)
            await self._tail(storage, request.auth, session_id, cursor.stream_id, delivered, send_callback, elsewhere)
            return None
        for event in verdict.deliver:
            await send_callback(EventMessage(event.message, event.event_id))  # type: ignore[arg-type]
        span.set_attributes(span_attributes(self.mode, sc.GUARD_REFUSE, verdict.refusal))
        await send_callback(refusal_notice(verdict.refusal))
        return None  # no live tail: the stream ends after the error frame

    def _hold(self, request: _Request, stream_id: str) -> None:
        """Keep ``stream_id`` from a new call while this resume holds its live tail (released when it ends)."""
        assert request.session_id is not None
        self._in_flight.hold(request.session_id, stream_id)
        request.holds.append(stream_id)

    def _taken_over(self, request: _Request, stream_id: str, delivered: str) -> dict[str, Any] | None:
        """Why a resume let replay may not take the live tail of ``stream_id`` after all: while its events were
        sent (a client that reads slowly holds it there), a new call took the stream's id, one whose events the
        token would be refused. Read from the in-flight table: nothing awaited between this and the SDK."""
        owner = self._in_flight.owner(request.session_id, stream_id) if request.session_id is not None else None
        reason = self._covers(request.auth, *owner) if owner is not None else None
        if owner is None or reason is None:
            return None
        return refusal_data(reason, None, stream_id, owner[0], request.auth, delivered)

    def _alone(self, session_id: str, event: StoredEvent) -> StoredEvent:
        """``event``, requiring what it may carry: on the standalone stream, what the calls in flight when it was
        stored required too, and theirs to see (unknown, so refused, when this process did not see it stored), as
        ``_live_alone`` holds it live: a replay from the storage (the SDK dropped the session, or another replica's)
        passes no GET chunk through that check."""
        if event.stream_id != STANDALONE_STREAM_ID or event.requirement is None:
            return event
        owners = self._in_flight.alone(session_id, event.event_id)
        if owners is None:
            return dataclasses.replace(event, requirement=None)
        requirement = functools.reduce(operator.or_, (owner[0] for owner in owners), event.requirement)
        principals = {owner[1] for owner in owners}
        return dataclasses.replace(event, requirement=requirement,
                                   subject=principals.pop() if len(principals) == 1 else _SEVERAL_PRINCIPALS)

    def _live_alone(self, request: _Request, stream: _GetStream, chunk: bytes) -> dict[str, Any] | None:
        """Why a GET stream may not go on with ``chunk``: one of its standalone events carries what a call its
        token may not see had in flight (``_alone``), the SDK sending it live (a fresh GET stream, or the live
        tail of a resumed one). None when it may: events of a call's stream were checked when it was resumed."""
        assert request.session_id is not None
        alone = stream.fresh or STANDALONE_STREAM_ID in request.holds  # the stream is the standalone one
        for frame in stream.parser.feed(chunk):
            if frame.id is None:
                continue
            owners = self._in_flight.alone(request.session_id, frame.id) if frame.data else ()
            if owners is None and alone:  # not kept (the storage failed), or too old: unknown, so refused
                return refusal_data(REQUIREMENT_UNKNOWN, frame.id, STANDALONE_STREAM_ID, None, request.auth,
                                     stream.delivered or "")
            for requirement, subject in owners or ():
                reason = self._covers(request.auth, requirement, subject)
                if reason is not None:
                    return refusal_data(reason, frame.id, STANDALONE_STREAM_ID, requirement, request.auth,
                                         stream.delivered or "")  # "": none yet, open the stream afresh
            stream.delivered = frame.id
        return None

    def _carries(self, stream_id: str, event: StoredEvent) -> bool:
        """Whether a resume of ``stream_id`` replays ``event`` (priming events are never replayed)."""
        return event.message is not None and (self.replay == "session" or event.stream_id == stream_id)

    def _verdict(self, auth: AuthView, cursor: StoredEvent, buffered: list[StoredEvent],
                 live: Requirement | None) -> _Verdict:
        delivered = cursor.event_id
        for index, event in enumerate(buffered):
            reason = self._covers(auth, event.requirement, event.subject)
            if reason is not None:
                prefix = buffered[:index] if self.policy_mode == "prefix" else []
                resume_from = prefix[-1].event_id if prefix else cursor.event_id
                return _Verdict(prefix, refusal_data(reason, event.event_id, event.stream_id, event.requirement,
                                                      auth, resume_from))
            delivered = event.event_id
        reason = self._covers(auth, live, cursor.subject)
        if reason is not None:  # the live tail would carry events the token may not see
            prefix = buffered if self.policy_mode == "prefix" else []
            return _Verdict(prefix, refusal_data(reason, None, cursor.stream_id, live, auth,
                                                  delivered if prefix else cursor.event_id))
        return _Verdict(buffered, None)

    def _covers(self, auth: AuthView, requirement: Requirement | None, subject: str | None) -> str | None:
        """None when ``auth`` may see an event with this requirement and owner; else why not."""
        if requirement is None:
            return REQUIREMENT_UNKNOWN
        if auth.verification == "failed" or (self.tokens.verifies and auth.verification == "unverified"):
            return TOKEN_UNVERIFIED  # before the principal: an unverified token's claims name nobody
        if subject != auth.subject_hash:  # both None only when neither token names a principal
            return PRINCIPAL_MISMATCH
        if requirement == NO_REQUIREMENT:
            return None
        if auth.verification == "opaque":
            return None if self.opaque == "allow" else AUDIENCE_UNKNOWN
        return None if auth.grants(requirement) else INSUFFICIENT_AUDIENCE

    # --- HTTP side ---

    def asgi(self, app: ASGIApp, path: str = "/mcp") -> ASGIApp:
        """Bind the request context (session, the token as this guard reads it), record each
        request's requirement, turn the refusal notice into an ``event: error`` frame, and answer
        from a shared storage a resume for a session this process does not hold. ``path``: the MCP
        endpoint's (``streamable_http_path``), the only one whose 404 may be the SDK's for such a session."""
        endpoint = path.rstrip("/")

        async def guarded(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != "http" or scope.get(_GUARDED) is self:  # this store's layer is in front already
                await app(scope, receive, send)  # (``serve`` under the instrumentor, whose app applies it too)
                return
            scope[_GUARDED] = self
            raw_headers = scope.get("headers", ())
            request = self._request(raw_headers)
            if request.ambiguous and self.mode == "enforce":  # which session, whose token, would the SDK take?
                await refuse_request(send, 400, "more than one Mcp-Session-Id or Authorization header")
                return
            cursors = values(raw_headers, LAST_EVENT_ID)
            if (scope.get("method") == "GET" and request.session_id is not None and (not cursors or not cursors[0])
                    and self.mode == "enforce" and self._not_the_openers(request.auth, request.session_id)):
                # a fresh GET takes the session's one standalone stream: another principal's would lock its opener
                # out of what the server sends tied to no call (the SDK's 409 for a second one)
                await refuse_request(send, 404, "Session not found")
                return
            # the SDK's 404 for a session it does not hold is also its answer to a credential not the session's;
            # answered from the storage only for a token that names its principal, which the events are bound to,
            # and only on the endpoint: elsewhere the router's 404 comes before the SDK checks the token at all
            elsewhere = (isinstance(self.storage, SharedEventStorage) and scope.get("method") == "GET"
                         and len(cursors) == 1 and request.session_id is not None
                         and request.auth.subject_hash is not None
                         and route_path(scope).rstrip("/") == endpoint)
            held: list[Message] = []  # the SDK's 404 for a session it does not hold, until we know better
            token = _current.set(request)
            app_receive = receive
            asked = NOTHING_ASKED
            # fresh: what the SDK takes for a new standalone stream (no Last-Event-ID, or an empty first one)
            get = (_GetStream(SSEParser(), cursors[0] if len(cursors) == 1 else None, not cursors or not cursors[0])
                   if scope.get("method") == "GET" and request.session_id is not None else None)
            posted: list[str] = []  # the POST's request ids this process holds in flight, in its session
            # whether the exchange answers them itself: no response, an error status, or JSON (else an SSE stream,
            # whose requests stay in flight until their answers are stored)
            answered_here = True
            # a session's POST, wherever it goes, and the endpoint's: its request ids are checked before the SDK sees
            # them (a POST elsewhere without a session carries no call of this server's: it is not read)
            if scope.get("method") == "POST" and (request.session_id is not None
                                                  or route_path(scope).rstrip("/") == endpoint):
                if codings(values(raw_headers, CONTENT_ENCODING)) and self.mode == "enforce":
                    # a body a middleware inside decompresses: its request ids cannot be read, so neither checked
                    # (another call's id taken) nor what they require recorded (fails closed, as a coded GET stream)
                    _current.reset(token)
                    await refuse_request(send, 415, "a compressed request body: the replay guard cannot read its "
                                                    "request ids (decompress outside the guard's ASGI layer)")
                    return
                posted_body = await read_post(receive, self.body_timeout_s)
                if posted_body.late:  # before any check: whoever sent it, nothing held
                    _log.warning("a POST's body was not whole within %g s: %s", self.body_timeout_s,
                                 "refused" if self.mode == "enforce" else "let through (observe mode)")
                    if self.mode == "enforce":
                        _current.reset(token)
                        await refuse_request(send, 408,
                                             f"request body not received whole within {self.body_timeout_s:g} s")
                        return
                body = posted_body.body
                asked = as_the_sdk_reads(body) if body else NOTHING_ASKED
                requests = asked.requests
                refusal = self._admit(request, body, asked)
                if refusal is not None and self.mode == "enforce":
                    _current.reset(token)
                    await refuse_request(send, *refusal)
                    return
                if refusal is None and request.session_id is not None:
                    posted = [msg.id for msg in requests if msg.id is not None]
                    for cancelled in asked.cancelled:  # its id may not be taken by a new call before the SDK acts
                        self._in_flight.hold(request.session_id, cancelled)
                        request.holds.append(cancelled)
                self._record(request, requests)
                app_receive = replaying(posted_body.messages, receive)
            elif scope.get("method") == "DELETE" and request.session_id is not None:
                refusal = self._may_end(request.auth, request.session_id)
                if refusal is not None and self.mode == "enforce":
                    _current.reset(token)
                    await refuse_request(send, *refusal)
                    return

            async def guarded_send(message: Message) -> None:
                nonlocal answered_here
                if held or (elsewhere and message["type"] == "http.response.start" and message["status"] == 404):
                    held.append(message)
                    return
                if (get is not None and message["type"] == "http.response.start" and self.mode == "enforce"
                        and message["status"] < 300 and _encoded(message)):
                    # compressed inside the guard: it can neither read the events it must check nor write its
                    # refusal into them, so the stream is refused (fails closed) rather than sent unread
                    get.stopped = True
                    await send({**message, "headers": [(k, v) for k, v in message.get("headers", ())
                                                       if k.lower() not in _CODED_BODY_HEADERS]})
                    await send({"type": "http.response.body", "more_body": False, "body": render(SSEFrame(
                        json.dumps(refusal_data(STREAM_ENCODED, None, STANDALONE_STREAM_ID, None, request.auth,
                                                get.delivered or "")), event="error"))})
                    return
                if get is not None and message["type"] == "http.response.body":
                    if get.stopped:  # ended with an error frame: what the SDK still writes to it goes nowhere
                        return
                    stop = self._live_alone(request, get, message.get("body", b""))
                    if stop is not None and self.mode == "enforce":
                        get.stopped = True
                        await send({"type": "http.response.body", "more_body": False,
                                    "body": render(SSEFrame(json.dumps(stop), event="error"))})
                        return
                if posted and message["type"] == "http.response.start":
                    content = values(message.get("headers", ()), CONTENT_TYPE)
                    answered_here = message["status"] >= 400 or [content_of(c) for c in content] != [CONTENT_SSE]
                if (message["type"] == "http.response.start" and scope.get("method") == "POST"
                        and request.session_id is not None and message["status"] < 400):
                    await self._flush(request)  # the SDK took it: now what it asks counts
                    self._in_flight.accepted(request.session_id, [(msg.id, self._owner(request, msg))
                                                                  for msg in asked.requests if msg.id is not None],
                                             asked.answers)
                elif (message["type"] == "http.response.start" and request.session_id is None
                      and scope.get("method") == "POST" and message["status"] < 400):
                    # the SDK names a session in its refusals too (the one it made for the request and dropped)
                    session_ids = values(message.get("headers", ()), SESSION_ID)
                    if len(session_ids) == 1:  # a session is born: its initialize response names it
                        request.session_id = session_ids[0]
                        await self._born(request)
                elif (message["type"] == "http.response.start" and scope.get("method") == "DELETE"
                      and message["status"] < 300 and request.session_id is not None):
                    self._in_flight.end(request.session_id)
                    # dropped before the answer goes (a resume the client sends after it is the SDK's 404 everywhere);
                    # the storage's timeout bounds the wait, well within the hooks' hold of the streams it ended
                    await self._ended(request.session_id)  # the SDK ended the session its client deleted
                elif message["type"] == "http.response.body" and REFUSAL_METHOD.encode() in message.get("body", b""):
                    message = {**message, "body": rewrite_refusal(message["body"])}
                await send(message)

            try:
                await app(scope, app_receive, guarded_send)
                if held and not await self._replay_elsewhere(scope, request, cursors[0], receive, send):
                    for message in held:
                        await send(message)
            finally:
                _current.reset(token)
                if request.session_id is not None:
                    for request_id, _ in request.pending:  # never taken by the SDK: nothing of it is recorded
                        self._unrecorded.pop((request.session_id, request_id), None)
                for held_id in request.holds:
                    self._in_flight.release(request.session_id, held_id)  # type: ignore[arg-type]
                if posted:  # the exchange is over, its stream with it (a call may run on, its id held until answered)
                    self._in_flight.ended(request.session_id, posted, answered=answered_here)  # type: ignore[arg-type]

        return guarded

    def _request(self, headers: Iterable[tuple[bytes, bytes]]) -> _Request:
        session_ids, authorizations = values(headers, SESSION_ID), values(headers, AUTHORIZATION)
        ambiguous = len(session_ids) > 1 or len(authorizations) > 1
        auth = ABSENT if ambiguous or not authorizations else self.tokens.from_authorization(authorizations[0])
        versions = values(headers, PROTOCOL_VERSION)
        if versions and versions[0] not in HANDSHAKE_PROTOCOL_VERSIONS:
            # the SDK answers it sessionless (2026-07-28, or a version it will refuse), whatever session it names
            return _Request(None, auth, ambiguous)
        return _Request(session_ids[0] if len(session_ids) == 1 else None, auth, ambiguous)

    def _admit(self, request: _Request, body: bytes | None, asked: Asked) -> tuple[int, str] | None:
        """Whether a POST may reach the SDK: None, or its refusal (status, message). Refused: a request whose id is
        the key the SDK gives the standalone stream; in a session, a token of another principal than its opener's
        (the SDK's own 404), an ``initialize``, a body
        too large to read its request ids from (``body`` None), more requests than one POST may carry, a
        cancel or an answer acting on a call in flight whose events the token may not see, or a request id
        the session has in flight (``InFlight``). Synchronous: no other request runs between the check and
        the claim."""
        if any(msg.id == STANDALONE_STREAM_ID for msg in asked.requests):
            # the SDK keys a request's stream by its id: this one's would be the standalone stream, every message
            # the server sends outside a call going to whoever posted it, checked by nothing
            return 400, f"request id {STANDALONE_STREAM_ID!r} is the session's standalone stream's"
        session_id = request.session_id
        if session_id is None:
            return None  # initialize: its session is born with it
        if self._not_the_openers(request.auth, session_id):
            return 404, "Session not found"
        if any(msg.method == INITIALIZE for msg in asked.requests):
            # the SDK takes it, and every call running in the session then sees its capabilities (a narrower token
            # could turn another call's sampling off, or on for a client that never answers it)
            return 400, "initialize inside a session: open a new session (no Mcp-Session-Id) instead"
        if body is None:
            return 413, f"request body over {MAX_PARSED_BODY} bytes: the replay guard cannot read its request ids"
        if asked.too_many or len(asked.requests) + len(asked.cancelled) + len(asked.answers) > MAX_REQUESTS:
            return 413, f"more than {MAX_REQUESTS} requests, cancels and answers in one POST"
        refusal = self._foreign(request.auth, session_id, asked)
        if refusal is not None:
            _log.warning("a POST acts on a call in flight its token may not see: %s",
                         "refused" if self.mode == "enforce" else "let through (observe mode)")
            return 403, refusal
        refusal = self._in_flight.claim(session_id, [(msg.id, self._owner(request, msg))
                                                     for msg in asked.requests if msg.id is not None])
        if refusal is None:
            for msg in asked.requests:  # a new call on each id: what an earlier call of it lost or answered is not its
                if msg.id is not None:
                    self._losses.reused(session_id, msg.id)
            return None
        _log.warning("a POST reuses a request id in flight in its session: %s",
                     "refused" if self.mode == "enforce" else "let through (observe mode)")
        return 409, refusal

    def _not_the_openers(self, auth: AuthView, session_id: str) -> bool:
        """Whether the request's token names another principal than the one that opened the session (as this process
        knows it): the session is not theirs, whatever the SDK binds it to (behind a gateway nothing; with a verifier
        that names no subject, the client app), and the request is answered as the SDK answers a credential not the
        session's, as if the session did not exist. By the claims, verified or not: the opener's own token that expired,
        or that a key fetch failed to verify, reaches the SDK, whose 401 gets its client a fresh one."""
        opener = self._in_flight.opener(session_id)
        return opener is not None and auth.subject_hash != opener[1]

    def _owner(self, request: _Request, msg: WireMessage) -> _Owner:
        return requirement_of(self.policy, msg.tool), request.auth.subject_hash

    def _foreign(self, auth: AuthView, session_id: str, asked: Asked) -> str | None:
        """Why a POST's ``notifications/cancelled`` or its answer to a request of the server may not reach the
        SDK: it acts on a call whose events the token would be refused (``_covers``), or answers a request the
        server awaits no answer to (the SDK acts on it later, maybe on a request that has that id by then). A
        cancel of a call no longer in flight (``InFlight.past``) acts on nothing (the SDK ignores it), but is how a
        client that never got a result tells it gave up (the server's hooks read it as ``cancelled_late``, a loss):
        it takes a verified token of the call's principal, whatever its audience (a client whose token was narrowed
        as its connection was lost sends its cancel with that token). One of an id not known reaches the SDK too,
        its id held while it is handled as any cancel's."""
        acts: list[tuple[str, tuple[_Owner, ...] | None]] = []
        for request_id in asked.cancelled:
            owner = self._in_flight.owner(session_id, request_id)
            if owner is None and (past := self._in_flight.past(session_id, request_id)) is not None:
                owner = (NO_REQUIREMENT, past[1])  # its principal's, whatever the audience
            if owner is not None:
                acts.append((f"notifications/cancelled of request {request_id[:64]!r}", (owner,)))
        for answer in asked.answers:
            acts.append((f"the answer to the server's request {answer[:64]!r}",
                         self._in_flight.asker(session_id, answer)))
        for act, owners in acts:
            if owners is None:
                return f"{act} answers nothing the server awaits in this session"
            for owner in owners:
                reason = self._covers(auth, *owner)
                if reason is not None:
                    return f"{act} acts on a call this token may not see: {reason}: {DETAILS[reason]}"
        return None

    def _may_end(self, auth: AuthView, session_id: str) -> tuple[int, str] | None:
        """Whether a DELETE may end the session: None, or its refusal (403) when its token is another principal's
        than the session's opener, or it would end calls whose events its token would be refused (``_covers``)."""
        for owner in self._in_flight.owners(session_id):
            reason = self._covers(auth, *owner)
            if reason is not None:
                _log.warning("a DELETE would end calls in flight its token may not see: %s",
                             "refused" if self.mode == "enforce" else "let through (observe mode)")
                return 403, f"the session has calls in flight this token may not see: {reason}: {DETAILS[reason]}"
        return None

    def _record(self, request: _Request, requests: Sequence[WireMessage]) -> None:
        """What each request of a POST requires (its tool's policy; nothing but for ``tools/call``), to record
        once the SDK takes the POST (``_flush``, ``store_event``): a POST it refuses (no token, another user's
        session) records nothing, so it can neither fill a session's table of streams nor widen what an id the
        client uses next requires."""
        for msg in requests[:MAX_REQUESTS]:
            assert msg.id is not None
            if len(msg.id) > _MAX_ID:
                continue  # unknown, so its stream's events are refused, never replayed
            requirement = requirement_of(self.policy, msg.tool)
            request.pending.append((msg.id, requirement))
            if request.session_id is not None:
                self._unrecorded[(request.session_id, msg.id)] = requirement

    async def _born(self, request: _Request) -> None:
        session_id = request.session_id
        assert session_id is not None
        try:
            await self.open_session(session_id)
        except StorageError:
            _log.exception("guard storage: session not opened; it will be at its next event")
            self._unopened[session_id] = time.monotonic()
            if len(self._unopened) > _MAX_UNOPENED:
                del self._unopened[next(iter(self._unopened))]
        for request_id, requirement in request.pending:  # the initialize POST: taken, as its session is born
            self._unrecorded[(session_id, request_id)] = requirement
        # whose the session is: another principal may neither post into it (``_admit``) nor end it (``_may_end``)
        self._in_flight.opened(session_id, (NO_REQUIREMENT, request.auth.subject_hash))
        await self._flush(request)

    async def _reopen(self, session_id: str) -> None:
        """Open a session the SDK opened while the storage failed, if it is one: its events are kept from now on (a
        session not open drops them, so that an ended one is never re-created), and resumes from them answered."""
        tried = self._unopened.get(session_id)
        now = time.monotonic()
        if tried is None or now - tried < _REOPEN_EVERY_S or session_id in self._reopening:
            return
        self._unopened[session_id] = now
        self._reopening[session_id] = False
        try:
            await self.open_session(session_id)
        except StorageError:
            return  # still failing: this event goes unstored, counted
        finally:
            ended = self._reopening.pop(session_id)
        if ended:  # its client deleted it meanwhile (``_ended``): no session is re-created after its end
            await self._ended(session_id)
        else:
            self._unopened.pop(session_id, None)

    async def _ended(self, session_id: str) -> None:
        self._unopened.pop(session_id, None)
        if session_id in self._reopening:
            self._reopening[session_id] = True
        try:
            await self.storage.close(session_id)
        except StorageError:  # its keys expire with the session's TTL; until then a replica answers from them
            _log.exception("guard storage: an ended session's events not dropped")

    async def _flush(self, request: _Request) -> None:
        session_id = request.session_id
        assert session_id is not None
        pending, request.pending = request.pending, []
        for request_id, _ in pending:  # unless an event of its stream was stored first, which recorded it
            requirement = self._unrecorded.pop((session_id, request_id), None)
            if requirement is not None:
                await self._require(session_id, request_id, requirement)

    async def _require(self, session_id: str, stream_id: str, requirement: Requirement) -> None:
        if self._unopened:  # the first thing a call of it records
            await self._reopen(session_id)
        try:
            await self.storage.require(session_id, stream_id, requirement)
        except StorageError:  # each event of its call is stored with it all the same (``store_event``)
            _log.exception("guard storage: a requirement not recorded; its call's events carry it as they are stored")

    async def _replay_elsewhere(self, scope: Scope, request: _Request, cursor: str, receive: Receive,
                                send: Send) -> bool:
        """Answer a resume for a session another server process holds, from the shared storage: the
        same verdict as a local replay, then the live tail as the owner stores it, until the call's
        terminal event, an event the token may not see, or the owner is gone (an error frame, never
        a silent end). False when the storage does not know the session either (the SDK's 404 stands); a storage
        that fails to say is ``store_unavailable``, not a guess that the session is gone."""
        storage = self.storage
        session_id = request.session_id
        if not isinstance(storage, SharedEventStorage) or session_id is None:
            return False
        try:
            known: bool | None = await storage.is_open(session_id)
            found = await storage.get(session_id, cursor) if known else None
        except StorageError:
            _log.exception("guard storage: a resume of a session this process does not hold refused, the storage "
                           "is unavailable")
            known = found = None
        if known is False or (found is not None and found.subject != request.auth.subject_hash):
            return False  # another principal's session is one that does not exist, as the SDK answers it
        frames, read = anyio.create_memory_object_stream[bytes](0)

        async def emit(event: EventMessage) -> None:
            await frames.send(sse_bytes(event))

        async def replay() -> None:
            async with frames:
                if known is None:
                    refusal = plain(STORE_UNAVAILABLE, cursor)
                    trace.get_current_span().set_attributes(span_attributes(self.mode, sc.GUARD_REFUSE, refusal))
                    await emit(refusal_notice(refusal))
                    return
                await self._replay(cursor, emit, storage)

        # as the SDK answers a resume: sse-starlette ends it when the client leaves or the server shuts down
        await EventSourceResponse(read, data_sender_callable=replay,
                                  headers={"cache-control": "no-cache", "mcp-session-id": session_id})(
            scope, receive, send)
        return True

    async def _tail(self, storage: TailableEventStorage, auth: AuthView, session_id: str, stream_id: str,
                    delivered: str, send: EventCallback, elsewhere: SharedEventStorage | None) -> None:
        """Send the live tail of ``stream_id`` from the storage: every event of it stored after ``delivered``, the
        last one replayed (waiting from there, none stored since the replay read is missed), each checked as a
        replayed one is, until the stream's terminal event. An event the token may not see, the session's end,
        its owner gone (``elsewhere``: another process's), events evicted under it or the storage failing end it
        with an error frame whose cursor is the last event sent, never silently; the client leaving cancels it."""
        after = own = delivered  # ``own``: the newest event of ``stream_id`` read (``after`` passes other streams')
        scope = None if self.replay == "session" else stream_id
        while True:
            try:
                events = await storage.wait_after(session_id, after, _TAIL_WAIT_S)
                stop = await self._tail_stop(storage, session_id, after, events, elsewhere)
            except StorageError:
                stop = STORE_UNAVAILABLE
            if stop is not None:
                await send(refusal_notice(plain(stop, delivered)))
                return
            # what the storage failed to keep since ``after``: never coming, so said where it was, not waited on
            gap = self._losses.first_after(session_id, scope, after, [e.event_id for e in events])
            for stored in events if gap is None else events[:gap]:
                after = stored.event_id
                if stored.stream_id == stream_id:
                    own = after
                if not self._carries(stream_id, stored):
                    continue
                event = self._alone(session_id, stored)
                reason = self._covers(auth, event.requirement, event.subject)
                if reason is not None and self.mode == "enforce":
                    await send(refusal_notice(refusal_data(reason, event.event_id, event.stream_id, event.requirement,
                                                      auth, delivered)))
                    return
                await send(EventMessage(event.message, event.event_id))  # type: ignore[arg-type]
                delivered = event.event_id
                if event.stream_id == stream_id and _terminal(event.message):
                    return
            if gap is not None:
                await send(refusal_notice(plain(STORE_UNAVAILABLE, delivered)))
                return
            latest = self._losses.stored_after(session_id, stream_id, own)
            if latest is not None and await self._gone(storage, session_id, latest):
                # stored here after what was sent, and not in the storage any more (restored from an older copy, or
                # evicted): never coming, nor what waits on it (an elicitation's tool waits for its answer forever)
                await send(refusal_notice(plain(UNKNOWN_CURSOR, delivered)))
                return

    @staticmethod
    async def _gone(storage: TailableEventStorage, session_id: str, event_id: str) -> bool:
        """Whether the storage no longer has an event it stored (a storage failing now is no answer: not gone)."""
        try:
            return await storage.get(session_id, event_id) is None
        except StorageError:
            return False

    @staticmethod
    async def _tail_stop(storage: TailableEventStorage, session_id: str, after: str, events: list[StoredEvent],
                         elsewhere: SharedEventStorage | None) -> str | None:
        """Why a live tail that read ``events`` after ``after`` may not go on: the session ended, its owner is gone,
        or ``after`` was evicted meanwhile (a client reading slowly while the session's cap drops its oldest
        events), and events after it may have been too: while it is held, none newer was dropped."""
        if events:
            if await storage.get(session_id, after) is not None:
                return None
            return UNKNOWN_CURSOR if await storage.is_open(session_id) else SESSION_ENDED
        if not await storage.is_open(session_id):
            return SESSION_ENDED
        if elsewhere is not None and not await elsewhere.owner_alive(session_id):
            return SESSION_OWNER_GONE
        return None

    def serve(self, server: MCPServer[Any] | Server[Any], **app_options: Any) -> Starlette:
        """Without the hooks: the server's Streamable HTTP app with this store, guarded around its whole middleware
        stack as ``instrument_server`` observes it (``add_middleware``, ``state``, ``routes`` as without the guard)."""
        app = server.streamable_http_app(event_store=self, **app_options)
        build, path = app.build_middleware_stack, app_options.get("streamable_http_path", "/mcp")
        app.build_middleware_stack = lambda: self.asgi(build(), path)  # type: ignore[method-assign]
        return app


def _request_refusal(request: _Request | None, cursor: str) -> dict[str, Any]:
    if request is None:
        _log.warning("replay refused: GuardedEventStore.asgi() is not in front of the server "
                     "(use instrument_server(..., event_store=guard) or guard.serve(...))")
    return plain(AMBIGUOUS_REQUEST if request is not None and request.ambiguous else NO_REQUEST_CONTEXT, cursor)


def _answered(cursor: StoredEvent, buffered: list[StoredEvent]) -> bool:
    """Whether the cursor's stream's answer is the cursor or among the events replayed after it."""
    return _terminal(cursor.message) or any(e.stream_id == cursor.stream_id and _terminal(e.message)
                                            for e in buffered)


def _terminal(message: JSONRPCMessage | None) -> bool:
    """A response or error: the last event of a request's stream (the SDK closes the stream after it)."""
    return isinstance(message, JSONRPCResponse | JSONRPCError)
