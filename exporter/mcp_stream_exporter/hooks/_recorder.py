"""The server's event store, observed: which event ids the author's ``EventStore`` assigned to what, and
what each replay sent against what was stored, as replay spans and call-span events.

A delegating ``EventStore``: every call goes to the author's store unchanged.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import cast

from mcp.server.streamable_http import EventCallback, EventId, EventMessage, EventStore, StreamId
from mcp_types import JSONRPCError, JSONRPCMessage, JSONRPCNotification, JSONRPCRequest, JSONRPCResponse
from opentelemetry import trace
from opentelemetry.trace import SpanKind
from opentelemetry.util.types import AttributeValue

from mcp_stream_exporter import scope as request_scope
from mcp_stream_exporter import semconv as sc
from mcp_stream_exporter.auth import AuthView
from mcp_stream_exporter.exchange import STANDALONE_STREAM_ID, request_id_of, stream_id_of
from mcp_stream_exporter.hooks import _defects
from mcp_stream_exporter.hooks._spans import Call, SpanStarter, auth_attributes, known_missing, requirement_attributes
from mcp_stream_exporter.hooks._tracking import Requirements, Tracker

_TERMINAL = (JSONRPCResponse, JSONRPCError)  # built once: ``A | B`` in isinstance builds a union on every call
_KINDS: dict[type, str] = {type(None): sc.FRAME_PRIMING, JSONRPCResponse: sc.FRAME_RESPONSE,
                           JSONRPCError: sc.FRAME_ERROR, JSONRPCRequest: sc.FRAME_REQUEST,
                           JSONRPCNotification: sc.FRAME_NOTIFICATION}
_TERMINAL_KINDS = frozenset({sc.FRAME_RESPONSE, sc.FRAME_ERROR})
# What the journal holds at most before it is indexed: 64 events of four items (session, stream, event, kind).
_JOURNAL_ITEMS = 4 * 64
_NO_SESSION = "\0"  # a session id is a header value, which never holds a NUL
_ERROR_TYPE_CHARS = 128  # an exception's class name, as ``error.type`` carries it: a module path and a name


def _key(session: str | None, name: str) -> str:
    """A session's stream or event, as one string. Kept for as long as the bounds allow, a string is no
    object for the garbage collector to count, where the tuples kept for each event stored made it pass
    16 to 19 % more often behind a legacy server's hooks than without them (5 to 8 % now). A session id
    is a header value, which never holds a line end: its first line end ends it."""
    return f"{_NO_SESSION if session is None else session}\n{name}"


class StoreRecorder:
    """What the server's event store holds, per session and stream, bounded; and the observed store."""

    def __init__(self, tracker: Tracker, tracer: SpanStarter, requirements: Requirements, *,
                 max_events_per_stream: int = 1_000, max_streams: int = 10_000) -> None:
        if max_events_per_stream < 0 or max_streams < 0:
            raise ValueError("max_events_per_stream and max_streams must not be negative")
        self.tracker = tracker
        self.tracer = tracer
        self._requirements = requirements
        # whether the SDK sends what a session stores on a stream, asked right after the store (``instrument_server``
        # given the server); None: not known, and a stream open for the call is taken to carry it
        self.routes: Callable[[str | None, object], bool | None] | None = None
        # (session, stream) -> its events' ids and frame kinds, alternating: no tuple for each event; as many events
        # in all as the index below keeps (``_held_events``), the oldest streams going first
        self._stored: OrderedDict[str, list[str]] = OrderedDict()
        self._held_events = 0
        # (session, event id) -> whose event it is, and where it came in store order (what came before it)
        self._stream_of_event: OrderedDict[str, str] = OrderedDict()
        self._order_of_event: dict[str, int] = {}
        # events whose id the store gave on more than one stream of their session (MCP wants them unique: a store
        # numbering each stream from 1): no one stream's, and a cursor of one continues no stream it can tell
        self._reused: set[str] = set()
        self._store_order = 0
        self._max_events_per_stream = max_events_per_stream
        self._max_streams = max_streams
        self._max_indexed = max_streams * 10
        # events stored since the indexes were last brought up to date, flat, four items each: only a replay
        # reads the indexes (``_catch_up``), so each stored event costs an append, and they are indexed in
        # a batch, where that code runs hot, or when a replay needs them
        self._journal: list[str] = []

    def event_store(self, inner: EventStore) -> EventStore:
        self.tracker.sees_stores = True
        return _ObservedEventStore(inner, self)

    def on_stored(self, session_id: str | None, stream_id: str, event_id: str, message: JSONRPCMessage | None) -> None:
        kind = _KINDS.get(type(message))  # the SDK's own classes, and None (a priming event), in one look-up
        if kind is None:
            kind = _kind_of(message)
        journal = self._journal
        journal += (_NO_SESSION if session_id is None else session_id, stream_id, event_id, kind)
        if len(journal) >= _JOURNAL_ITEMS:
            self._catch_up()
        if kind not in _TERMINAL_KINDS or stream_id == STANDALONE_STREAM_ID:  # a request's stream: ``request_id_of``
            return
        request_id = cast(JSONRPCResponse | JSONRPCError, message).id
        if request_id is None:
            return
        key = (session_id, stream_id)
        fields = (kind, event_id, None, None, None)
        if self.tracker.keep_stored(key, fields, message):
            return  # its call not started: kept for it, carried by its held answer
        call = self.tracker.call(key)
        if call is not None:
            call.event(sc.EVENT_STORED, fields)  # attributes built if it is a span
            routes = self.routes
            self.tracker.stored(call, event_id, outcome_of(message),
                                routed=None if routes is None else routes(session_id, stream_id))

    def store_failed(self, session_id: str, error: Exception) -> None:
        """The author's store raised storing a message of the session (only the SDK's message router stores one):
        the session's calls owed their result are lost (``Tracker.store_failed``). Only the exception's class is
        kept: its message may hold a secret (a connection string, a password)."""
        self.tracker.store_failed(session_id, _error_type(error),
                                  lambda key: self._terminal_stored(session_id, key[1]))

    def _terminal_stored(self, session_id: str, request_id: str) -> bool:
        """Whether the store holds a response or error on the stream of request ``request_id``."""
        self._catch_up()
        return any(kind in _TERMINAL_KINDS for kind in self._stored.get(_key(session_id, request_id), ())[1::2])

    def _catch_up(self) -> None:
        """Index what the journal holds, in store order, as each event would have been when stored."""
        if not self._journal:
            return
        journal, self._journal = self._journal, []
        stored, stream_of_event, order_of_event, reused = (self._stored, self._stream_of_event, self._order_of_event,
                                                           self._reused)
        max_events, max_streams, max_indexed = 2 * self._max_events_per_stream, self._max_streams, self._max_indexed
        order, held = self._store_order, self._held_events
        items = iter(journal)
        try:
            for session, stream_id, event_id, kind in zip(items, items, items, items, strict=True):
                key = f"{session}\n{stream_id}"  # ``_key``, inlined (the session's None is in the journal already)
                events = stored.get(key)
                if events is None:  # a list, not a deque: a stream stores a few events, and a deque allocates 64
                    events = stored[key] = []
                    if len(stored) > max_streams:  # one added: one out
                        held -= len(stored.popitem(last=False)[1]) // 2
                events += (event_id, kind)
                held += 1
                if len(events) > max_events:
                    del events[:2]
                    held -= 1
                while held > max_indexed:  # many long streams: 10,000 of 1,000 events would hold some 700 MB
                    held -= len(stored.popitem(last=False)[1]) // 2
                order += 1
                event_key = f"{session}\n{event_id}"
                if stream_of_event.setdefault(event_key, stream_id) != stream_id:
                    reused.add(event_key)
                order_of_event[event_key] = order
                if len(stream_of_event) > max_indexed:
                    gone = stream_of_event.popitem(last=False)[0]
                    del order_of_event[gone]
                    reused.discard(gone)
        finally:  # what was indexed keeps its order, whatever stopped the rest
            self._store_order, self._held_events = order, held

    def stream_of(self, session_id: str | None, event_id: str) -> str | None:
        """The stream the event was stored on; None if not known, or if its id was given on several (``reused``)."""
        self._catch_up()
        key = _key(session_id, event_id)
        return None if key in self._reused else self._stream_of_event.get(key)

    def knows(self, session_id: str | None, event_id: str) -> bool:
        """Whether the index holds the event (however many streams it was given on)."""
        self._catch_up()
        return _key(session_id, event_id) in self._stream_of_event

    def reused(self, session_id: str | None, event_id: str) -> bool:
        """Whether the store gave the event's id on more than one stream of the session."""
        self._catch_up()
        return _key(session_id, event_id) in self._reused

    def skipped(self, session_id: str | None, buffered: Sequence[str], sent: Sequence[str]) -> int:
        """Buffered events not sent that were stored before the last event sent: a client that takes
        that event's id as its cursor has moved past them."""
        self._catch_up()
        last = max((self._order(session_id, e) for e in sent), default=0)
        delivered = set(sent)
        return sum(1 for e in buffered if e not in delivered and self._order(session_id, e) < last)

    def buffered_after(self, session_id: str | None, stream_id: str, cursor: str) -> list[str]:
        """Events stored on ``stream_id`` after ``cursor``: after it in that stream, or, for a cursor
        stored on another stream, after it in store order."""
        self._catch_up()
        stored = self._stored.get(_key(session_id, stream_id), [])
        ids = stored[0::2]
        events = list(zip(ids, stored[1::2], strict=True))
        if cursor in ids:
            after = events[ids.index(cursor) + 1:]
        else:
            position = self._order(session_id, cursor)
            after = [e for e in events if self._order(session_id, e[0]) > position]
        return [event_id for event_id, kind in after if kind != sc.FRAME_PRIMING]

    def _order(self, session_id: str | None, event_id: str) -> int:
        """An event's place in store order (0: unknown); its callers bring the indexes up to date first."""
        return self._order_of_event.get(_key(session_id, event_id), 0)

    def resumed_stream(self, session_id: str | None, cursor: str) -> tuple[str | None, Call | None]:
        """The stream a resume from ``cursor`` continues, and its call: the calls the resume really
        carries (the stream this side sent the cursor event on), not the stream the event was stored
        on. They differ when a session-wide replay handed another stream's event to this call's stream:
        the client's next cursor is then that event, and the replay after it is still this call's."""
        stored_on = self.stream_of(session_id, cursor)
        carried = self.tracker.calls_of_cursor(session_id, cursor)
        if len(carried) == 1 and stream_id_of(carried[0].key[1]) != stored_on and (
                stored_on is not None or self.reused(session_id, cursor)):
            return stream_id_of(carried[0].key[1]), carried[0]
        owner = request_id_of(stored_on) if stored_on else None
        return stored_on, self.tracker.call((session_id, owner)) if owner else None

    def replay_attributes(self, session_id: str | None, stream_id: str | None, buffered: list[str], sent: list[str],
                          foreign: list[str], refusals: int, auth: AuthView,
                          interrupted: bool = False) -> dict[str, AttributeValue]:
        """What a replay did against what was stored: the replay span's closing attributes. One ``interrupted``
        before the store was done is no truncation (no one waits for the rest), but what it sent was sent."""
        unsent = [e for e in buffered if e not in sent]
        if stream_id is None:
            decision = sc.REPLAY_UNKNOWN_CURSOR
        elif refusals:
            decision = sc.REPLAY_REFUSED
        elif interrupted:
            decision = sc.REPLAY_INTERRUPTED
        elif unsent:
            decision = sc.REPLAY_TRUNCATED
        else:
            decision = sc.REPLAY_COMPLETE
        out: dict[str, AttributeValue] = {
            sc.REPLAY_DECISION: decision,
            sc.REPLAY_BUFFERED: len(buffered),
            sc.REPLAY_SENT: len(sent),
        }
        owner = request_id_of(stream_id) if stream_id is not None else None
        if stream_id is not None:
            out[sc.REPLAY_STREAM_ID] = stream_id
            if owner is not None:
                out[sc.JSONRPC_REQUEST_ID] = owner
        if sent:
            out[sc.REPLAY_SENT_LAST_ID] = sent[-1]
        if unsent:
            skipped = self.skipped(session_id, buffered, sent)
            if skipped:
                out[sc.REPLAY_SKIPPED] = skipped
            if skipped or decision == sc.REPLAY_TRUNCATED:  # not the tail an interrupted replay never got to
                out[sc.REPLAY_OFFENDING_EVENT_ID] = unsent[0]
        if foreign:
            out[sc.REPLAY_FOREIGN_EVENT_IDS] = foreign[:sc.MAX_ITEMS]
        requirement = self._requirements.get((session_id, owner)) if owner is not None else None
        if requirement is not None:
            out.update(requirement_attributes(requirement, known_missing(auth, requirement)))
        return out


def _error_type(error: Exception) -> str:
    """An exception's class as semconv's ``error.type`` names one (fully qualified, a builtin by its name alone),
    bounded: never its message."""
    cls = type(error)
    name = cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"
    return name[:_ERROR_TYPE_CHARS]


def _kind_of(message: JSONRPCMessage | None) -> str:
    """What a stored message is, of a class other than the SDK's own (a subclass of one; None is in ``_KINDS``)."""
    if isinstance(message, _TERMINAL):
        return sc.FRAME_ERROR if isinstance(message, JSONRPCError) else sc.FRAME_RESPONSE
    return sc.FRAME_NOTIFICATION if getattr(message, "id", None) is None else sc.FRAME_REQUEST


def outcome_of(message: object) -> str:
    """A stored terminal event's outcome, as the call span records it (the SDK stores a response on the stream its
    id names: it is that call's)."""
    if isinstance(message, JSONRPCError):
        return sc.OUTCOME_ERROR
    result = message.result if isinstance(message, JSONRPCResponse) else None
    return sc.OUTCOME_TOOL_ERROR if isinstance(result, dict) and result.get("isError") is True else sc.OUTCOME_RESULT


class _ObservedEventStore(EventStore):
    """Delegates to the author's store; records what was stored and what each replay sent."""

    def __init__(self, inner: EventStore, recorder: StoreRecorder) -> None:
        self._inner = inner
        self._recorder = recorder

    async def store_event(self, stream_id: StreamId, message: JSONRPCMessage | None) -> EventId:
        try:
            event_id = await self._inner.store_event(stream_id, message)
        except Exception as error:
            if message is not None:  # a priming event's failure fails its POST with a 500: its client is told
                rs = request_scope.current()
                if rs is not None and rs.session_id is not None:
                    self._recorder.store_failed(rs.session_id, error)
            raise
        rs = request_scope.current()
        try:
            self._recorder.on_stored(rs.session_id if rs else None, stream_id, event_id, message)
        except Exception:  # the hooks' reading never fails the application's (a store that raised fails the session)
            _defects.report("a stored event")
        return event_id

    async def replay_events_after(self, last_event_id: EventId, send_callback: EventCallback) -> StreamId | None:
        recorder = self._recorder
        try:
            rs = request_scope.current() or request_scope.RequestScope()
            session_id = rs.session_id
            stream_id, call = recorder.resumed_stream(session_id, last_event_id)
            buffered = recorder.buffered_after(session_id, stream_id, last_event_id) if stream_id else []
            attrs: dict[str, AttributeValue] = {sc.SPAN: sc.SPAN_REPLAY, sc.ROLE: sc.ROLE_SERVER,
                                                sc.ERA: sc.ERA_RESUMABLE, sc.RESUME_CURSOR: last_event_id,
                                                **auth_attributes(rs.auth)}
            if session_id is not None:
                attrs[sc.MCP_SESSION_ID] = session_id
            parent = trace.set_span_in_context(recorder.tracker.span_of(call)) if call is not None else None
        except Exception:  # the hooks' reading never fails the application's: the replay goes unobserved
            _defects.report("a replay")
            return await self._inner.replay_events_after(last_event_id, send_callback)
        sent: list[str] = []
        foreign: list[str] = []
        refusals = 0

        async def observed_send(event: EventMessage) -> None:
            nonlocal refusals
            try:
                if event.event_id is None:
                    refusals += 1  # a frame without an id cannot be a replayed event: a refusal
                else:
                    sent.append(event.event_id)
                    stored_on = recorder.stream_of(session_id, event.event_id)
                    # another stream's only beside the one the replay continues (none known: a cursor unknown here, or
                    # given on several streams); an id not known here is one the store never returned, unless the
                    # store wrote it and then raised, or gave it on several streams, or the index let go of it: it
                    # lets go of the oldest first, so of the cursor before any event after it
                    if stream_id is not None and stored_on != stream_id and (stored_on is not None or not (
                            recorder.tracker.store_failed_in(session_id) or recorder.reused(session_id, event.event_id)
                            or not recorder.knows(session_id, last_event_id))):
                        foreign.append(event.event_id)
            except Exception:
                _defects.report("a replayed event")
            await send_callback(event)

        span = recorder.tracer.start_span(sc.SPAN_NAME_REPLAY, context=parent, kind=SpanKind.INTERNAL,
                                           attributes=attrs)
        if call is not None:
            call.replaying += 1
        interrupted = True  # cancelled as its client left (sse-starlette), or failed: what it sent so far still counts
        try:
            with trace.use_span(span, end_on_exit=True):
                try:
                    result = await self._inner.replay_events_after(last_event_id, observed_send)
                    interrupted = False
                finally:
                    try:
                        span.set_attributes(recorder.replay_attributes(session_id, stream_id, buffered, sent, foreign,
                                                                       refusals, rs.auth, interrupted))
                    except Exception:
                        _defects.report("a replay")
        finally:
            if call is not None:
                try:
                    recorder.tracker.replayed(call, sent)
                except Exception:
                    _defects.report("a replay")
        return result
