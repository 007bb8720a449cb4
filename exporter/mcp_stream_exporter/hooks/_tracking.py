"""Calls and streams as both hooks see them: one tracker per side, spans per the span model.

A ``tools/call`` is tracked from its request until its terminal event (a response or error) is seen
on any stream; a stream is tracked from its response headers until its end. Each side feeds the
tracker what it sees on the wire; the tracker turns that into call, stream and frame spans.

Spans are deferred: a call or a POST stream becomes a span only once it deviates from the healthy
path (a stream ends with the call pending, a resume, an error frame, a refusal, an eviction...). A
healthy call, answered on its own POST, leaves no span of ours: the SDK's own spans already record
it, and the hooks then cost next to nothing (docs/span-model.md, "The healthy path").

A POST's SSE stream is held: its side keeps what it saw (``Holder``) and the tracker reads it only when
the stream ends, or when something else needs what it holds (a resume from one of its events, a cancel
or an eviction of one of its calls, its call's result on another stream). A stream whose held frames
show the healthy path then ends with its calls' terminal events and nothing else: no frame events, no
event-id index, no counts, which only a span would have carried. Any other stream is replayed through
``frame`` with the times its frames were seen, exactly as if it had been followed from its start. A held
POST of one call is not even opened as a stream until something needs it: its side, seeing nothing but
frames that end no call and then the call's result (the server: one whole frame in the SDK's form a
chunk, read once; the client: as the chunks pass, by their frames' heads), ends the call (``answered``)
and lets go of it (``settle``), with no stream, no parser and no frame records.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Protocol

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Link, NonRecordingSpan, Span, SpanContext, SpanKind, StatusCode
from opentelemetry.util.types import AttributeValue

from mcp_stream_exporter import semconv as sc
from mcp_stream_exporter.auth import NO_REQUIREMENT, NOTHING_MISSING, AuthView, Requirement
from mcp_stream_exporter.hooks._sdk_spans import annotate
from mcp_stream_exporter.hooks._spans import (
    MAX_DEFERRED_EVENTS,
    Call,
    CallKey,
    FrameFields,
    Identify,
    Opening,
    SpanStarter,
    Stream,
    Terminal,
    known_missing,
    requirement_attributes,
    sdk_parent,
)
from mcp_stream_exporter.redaction import redact_cut
from mcp_stream_exporter.sse import SSEFrame
from mcp_stream_exporter.wire import WireMessage

_ERROR_FRAME_DATA_CHARS = 1024
_TRANSPORT = "tcp"  # semconv network.transport: Streamable HTTP runs over TCP
_MOVING_EVERY_NS = 60 * 1_000_000_000  # how often a resume moving its calls on says so (``Tracker._moving``)
_MAX_BROKEN = 1024  # arguments fingerprints of stateless calls whose stream broke: what a re-issue matches
_MAX_ALIKE_SPANS = 16  # of the calls alike that broke, whose spans' contexts are kept (their re-issues' traces)
# ids an event sent on several streams stays tied to (``_index``): a session-wide replay hands one stream's events to
# one other; a server sending each event on every stream would otherwise make each entry a tuple of its own, 256 long
_MAX_MERGED = 8
_MAX_DELETED = 1024  # sessions this side saw deleted: a stream of theirs that ends clean ended with them
_MAX_STORE_FAILED = 1024  # (server) sessions whose event store failed: a later call of theirs is lost too
# how long a stream that ended clean during a DELETE of its session waits for the DELETE's answer, and how many do: the
# SDK closes the streams as it accepts the DELETE and answers at once; one it is not running (its body never comes)
# holds nothing back for longer
_DELETE_WAIT_S = 5.0
_MAX_HELD_ENDS = 10_000  # a session: each held a moment, and one session seldom has this many streams open
# how long, once a fingerprint was dropped past ``_MAX_BROKEN``, every stateless call is told as a possible re-issue
_EVICTED_WATCH_S = 600.0


class _Alike:
    """The calls of one fingerprint whose stream broke: how many await their re-issue, and the span contexts of the
    newest ``_MAX_ALIKE_SPANS`` of them, oldest first: where each re-issue's start is told."""

    __slots__ = ("count", "spans")

    def __init__(self) -> None:
        self.count = 0
        self.spans: deque[SpanContext] = deque(maxlen=_MAX_ALIKE_SPANS)


class BrokenCalls(OrderedDict[str, _Alike]):
    """Fingerprints of stateless calls whose stream broke, each with how many such calls await their re-issue (one
    re-issue answers one of them, as the detector matches them), the oldest dropped past ``_MAX_BROKEN``. A dropped
    one's re-issue would look like any call, on the healthy path, with no span: the detector would page its call
    ``not_reissued``. So for ``_EVICTED_WATCH_S`` after a drop, every stateless call is told as a possible re-issue
    (``watching``): more spans in an outage that broke that many calls, never a page for a call sent again."""

    evicted_until = 0.0

    def watching(self) -> bool:
        until = self.evicted_until
        return until > 0 and until > time.monotonic()

    def clear(self) -> None:
        super().clear()
        self.evicted_until = 0.0

    def broke(self, fingerprint: str, span: SpanContext) -> None:
        """A call of ``fingerprint`` broke; ``span``: its call span's."""
        alike = self.get(fingerprint)
        if alike is None:
            alike = self[fingerprint] = _Alike()
        alike.count += 1
        alike.spans.append(span)
        self.move_to_end(fingerprint)
        if len(self) > _MAX_BROKEN:
            self.popitem(last=False)
            self.evicted_until = time.monotonic() + _EVICTED_WATCH_S

    def reissued(self, fingerprint: str) -> SpanContext | None:
        """A call of ``fingerprint`` (one in this table) re-issues the oldest of them: its span's context, if kept."""
        alike = self[fingerprint]
        span = alike.spans.popleft() if len(alike.spans) == alike.count else None  # else the oldest's is gone
        alike.count -= 1
        if not alike.count:
            del self[fingerprint]
        return span


# Those of every client in this process: a caller may re-issue through another client than the one that broke (a
# new one after an error), and the detector matches a re-issue within the client process (``issued``, by origin)
BROKEN_IN_PROCESS = BrokenCalls()


# (server) a terminal event stored on a pending call's stream (``Tracker.keep_stored``): its fields, when, and the
# message (whether it is the call's own result, and its outcome, read only should the call start)
KeptStore = tuple[FrameFields, int, object]


# What a side holds of one stream at most (bytes, and chunks or frames, each with its time): past either, it
# reads what it held and follows the rest frame by frame. A healthy answer is far smaller; a large result, a
# long run of progress notifications or a hostile stream is followed as it goes, never kept whole.
HOLD_BYTES = 64 * 1024
HOLD_PIECES = 64
_TOOL_NAME_CHARS = 128  # MCP's longest tool name (SHOULD): a longer one is kept by no call answered
# A frame a held stream's side read at last (``None`` for a JSON body), its messages, and when it was seen.
HeldFrame = tuple[SSEFrame | None, Sequence[WireMessage], int]


class Holder(Protocol):
    """A side holding what a POST's stream carries (``Tracker.hold``): the stream is opened only when
    something needs it, and never if it shows the healthy path to its end."""

    def read_held(self) -> list[HeldFrame]:
        """The frames held so far, read now; what comes after is followed frame by frame (``Tracker.frame``)."""
        ...

    def held_stream(self) -> Stream | None:
        """Its stream, opened now (``Tracker.open_stream`` with ``holder``) if it was not yet; None for a
        server's POST found to carry no call once its body was read (it then holds nothing)."""
        ...


class Pending(Protocol):
    """A side's call not started (``Tracker.pend``): its answer shows the healthy path so far, on which the call
    never starts."""

    def start_pending(self) -> None:
        """Start it now, as it would have been when its request came: something needs it."""
        ...


class Unread(Protocol):
    """(server) A request body left for the SDK's own parse (``Tracker.unread``)."""

    def read_unread(self) -> None:
        """Read it now: its calls start, as they would have had it been read as it came."""
        ...


class Requirements:
    """What each call of a session required, kept after the call ends (a resume may come later), bounded:
    the server's replay span compares the resuming token with it."""

    def __init__(self, max_calls: int) -> None:
        self._max_calls = max_calls
        self._of: OrderedDict[CallKey, Requirement] = OrderedDict()

    def remember(self, key: CallKey, requirement: Requirement) -> None:
        self._of[key] = requirement
        if len(self._of) > self._max_calls:
            self._of.popitem(last=False)

    def get(self, key: CallKey) -> Requirement | None:
        return self._of.get(key)


_HEALTHY_OUTCOMES = frozenset({sc.OUTCOME_RESULT, sc.OUTCOME_TOOL_ERROR, sc.OUTCOME_ERROR})

# a request answered with one was refused, not lost: a client error, but a timeout's or a rate limit's, and but an
# authentication's (401, 407) or authorisation's (403), which an HTTP client's auth flow answers by sending the same
# request again with another token (the SDK's OAuth provider does): that one is the call's, under the same id
_REFUSED = frozenset(range(400, 500)) - {401, 403, 407, 408, 429}
_TERMINAL_KINDS = frozenset({sc.FRAME_RESPONSE, sc.FRAME_ERROR})  # ``WireMessage.is_terminal``
# (client) the streams the SDK opens for one request, in whose SSE it takes the first response of any id as that
# request's
_ONE_REQUEST_STREAMS = frozenset({sc.STREAM_KIND_POST, sc.STREAM_KIND_RESUME})


def _terminal_attributes(terminal: Terminal) -> dict[str, AttributeValue]:
    stream_kind, event_id = terminal
    attrs: dict[str, AttributeValue] = {sc.TERMINAL_STREAM_KIND: stream_kind}
    if event_id is not None:
        attrs[sc.TERMINAL_EVENT_ID] = event_id
    return attrs


def _outcome(msg: WireMessage) -> str:
    """A call's outcome, from the message that ends it (a response or a JSON-RPC error)."""
    if msg.kind == sc.FRAME_ERROR:
        return sc.OUTCOME_ERROR
    return sc.OUTCOME_TOOL_ERROR if msg.is_tool_error else sc.OUTCOME_RESULT


def _indexed(event_id: str) -> str:
    """An event id as the index keeps it: a long one (a server's ids may be anything) by a digest of it,
    so the index's memory is bounded by its entries whatever the server streams."""
    if len(event_id) <= sc.MAX_CHARS:
        return event_id
    return hashlib.sha256(event_id.encode("utf-8", "surrogatepass")).hexdigest()


def _listed(terminal_ids: tuple[str, ...], own: tuple[str, ...]) -> list[str]:
    """A stream's terminal ids as its span lists them: all of them, or past ``MAX_ITEMS`` its own calls'
    first, so a flood of other calls' results never hides which of its own calls were answered."""
    if len(terminal_ids) <= sc.MAX_ITEMS:
        return list(terminal_ids)
    mine = set(own)
    return ([i for i in terminal_ids if i in mine] + [i for i in terminal_ids if i not in mine])[:sc.MAX_ITEMS]


def _owed(stream: Stream, calls: Sequence[Call]) -> dict[str, AttributeValue]:
    """What ``calls`` (those still pending on a stream, the usual) require, and, on a stream that presented its own
    token (a resume or GET), what that token lacks of it: the audience gap, known before any call ends."""
    requirement = NO_REQUIREMENT
    for call in calls:
        if call.requirement is not None:
            requirement = requirement | call.requirement
    if not (requirement.resources or requirement.scopes):
        return {}
    missing = known_missing(stream.auth, requirement) if stream.kind != sc.STREAM_KIND_POST else NOTHING_MISSING
    return requirement_attributes(requirement, missing)


class Tracker:
    """Per-side bookkeeping of calls and streams, bounded: the oldest pending call is evicted first."""

    def __init__(self, tracer: SpanStarter, role: str, *, max_calls: int = 10_000,
                 max_event_index: int = 50_000, broken: BrokenCalls | None = None) -> None:
        self._tracer = tracer
        self._role = role
        self._stream_kind = SpanKind.SERVER if role == sc.ROLE_SERVER else SpanKind.CLIENT
        self._max_calls = max_calls
        self._max_event_index = max_event_index
        self._calls: OrderedDict[CallKey, Call] = OrderedDict()
        self._event_index: OrderedDict[tuple[str | None, str], tuple[str, ...]] = OrderedDict()
        # fingerprints of stateless calls whose stream broke (a client's: ``BROKEN_IN_PROCESS``)
        self._broken = BrokenCalls() if broken is None else broken
        # who holds the server's held streams, by session: what a resume reads first (``hold``)
        self._held: dict[str | None, dict[Holder, None]] = {}
        self._unread: dict[str | None, dict[Unread, None]] = {}  # the server's bodies left unread, by session
        self._pending: dict[CallKey, Pending] = {}  # calls not started (``pend``)
        self._client_closed = False  # (client) its HTTP client closed (``client_closed``)
        self._kept: dict[CallKey, list[KeptStore]] = {}  # their stream's terminal events stored
        self._deletions: dict[str, _Deletions] = {}  # DELETEs of a session in progress (``deleting``)
        self._delete_seq = 0
        self._deleted: OrderedDict[str, None] = OrderedDict()  # sessions whose DELETE was accepted
        # (server) sessions whose event store failed (``store_failed``), each with the exception's class
        self._store_failed: OrderedDict[str | None, str] = OrderedDict()
        # (server) the newest ``max_calls`` calls of a session whose terminal event is out of the server's hands (sent,
        # or stored with no stream open): when, the tool, the event's id, the request's traceparent (``result_out``);
        # what a cancel that comes after tells the client never got
        self._results_out: OrderedDict[CallKey, tuple[int, str | None, str, str | None]] | None = (
            OrderedDict() if role == sc.ROLE_SERVER else None)
        # the newest ``max_calls`` calls of a session answered on the healthy path (``answered_healthy``): a later
        # result of one is a repeat (a copy of it on another stream), which nothing else would tell
        self._answered: OrderedDict[CallKey, str | None] = OrderedDict()  # (``answered_healthy``) -> its tool
        # (server) whether the server's event store tells it what is stored (``StoreRecorder``): only then does a call
        # with no result stored say its tool has not answered yet (``RUNNING_REQUEST_IDS``)
        self.sees_stores = False

    # --- calls ---

    def start_call(self, session_id: str | None, msg: WireMessage, protocol_version: str | None,
                   auth: AuthView, stateless: bool, start_time: int | None = None,
                   identify: Identify | None = None, reissue: bool = True) -> Call:
        """A ``tools/call`` request was seen; its span, if it gets one, is a child of the SDK's.

        A stateless call with the fingerprint of one whose stream broke is its re-issue: a deviation,
        so it gets a span however it ends, and the detector sees the loss answered (not_reissued).
        ``identify`` computes the fingerprint of its tool and arguments: only when a call has broken, or this
        one gets a span. ``reissue``: whether it may be a re-issue (False for a call started after its
        request went out, when none had broken: ``reissues_possible``). The hooks pass every argument by
        position: a keyword takes CPython 3.11's unspecialised call path, on every call a side sees."""
        assert msg.id is not None
        if self._pending and (session_id, msg.id) in self._pending:  # an id reused: the first call keeps it
            self._pending[session_id, msg.id].start_pending()
        call = Call((session_id, msg.id), msg.tool, msg.method or "", self._role, auth, protocol_version, stateless,
                    start_time or time.time_ns(), msg.traceparent, identify,
                    None if identify is None else msg.arguments)
        fingerprint = call.fingerprint if reissue and (self._broken or self._broken.watching()) else None
        if fingerprint is not None and fingerprint in self._broken:
            self._reissued(call, self._broken.reissued(fingerprint))
        elif fingerprint is not None and stateless and self._broken.watching():  # perhaps one whose print was dropped
            self._reissued(call, None)
        # a stateless call lives and dies with its one stream: nothing to look up. An id its session reuses while
        # its call is pending (MCP forbids it, the guard refuses it) is observed on its own stream, untracked:
        # the pending call stays the one its id finds
        if not stateless and call.key not in self._calls:
            self._calls[call.key] = call
            while len(self._calls) > self._max_calls:
                self._evict(self._calls.popitem(last=False)[1])
        return call

    def _reissued(self, call: Call, broken: SpanContext | None) -> None:
        """The call re-issues one whose stream broke: a deviation, so it gets its span; and the detector is told
        now, by a span of the call's start ended at once (``OUTCOME_REISSUED``), not when the call ends. That span
        goes in the trace of the broken call (``broken``, its span's context, when known), linked to the call's
        own: a Collector sampling by trace keeps the break and the word of its re-issue together, or neither."""
        span = self.span_of(call)
        name, attributes = call.describe()
        attributes[sc.CALL_OUTCOME] = sc.OUTCOME_REISSUED
        if broken is None:
            self._tracer.start_span(name, context=trace.set_span_in_context(span), kind=SpanKind.INTERNAL,
                                    attributes=attributes, start_time=call.start_time).end()
            return
        self._tracer.start_span(name, context=trace.set_span_in_context(NonRecordingSpan(broken)),
                                kind=SpanKind.INTERNAL, attributes=attributes,
                                links=[Link(span.get_span_context(), {sc.LINK_TYPE: sc.LINK_REISSUE})],
                                start_time=call.start_time).end()

    def reissues_possible(self) -> bool:
        """Whether a call starting now may be the re-issue of one whose stream broke (``start_call``)."""
        return bool(self._broken) or self._broken.watching()

    def _evict(self, call: Call) -> None:
        self._unhold(call)  # its result may be held: then it ends with it, as it would have
        self._finish(call, sc.OUTCOME_EVICTED)

    def call(self, key: CallKey) -> Call | None:
        """The call of ``key``. One not found may be left pending (``pend``) or in a body of its session not read
        yet (``unread``): it is started, or those are read, first, so a look-up finds what it would have had every
        call been started as it came."""
        call = self._calls.get(key)
        if call is None:
            pending = self._pending.get(key)
            if pending is not None:
                pending.start_pending()
            elif key[0] in self._unread:
                for body in list(self._unread[key[0]]):
                    body.read_unread()
            else:
                return None
            call = self._calls.get(key)
        return call

    def runs(self, key: CallKey, call: Call | None = None) -> None:
        """(server) The SDK runs the request of ``key`` now (``call``, if started already): a call of another
        request that holds its id but that the SDK never ran (one answered before the SDK saw it, such as the
        guard's 409 for an id in flight, read first) lets go of it (``evicted``), so the call the SDK runs is the
        one its id finds."""
        held = self._calls.get(key)
        if held is not None and held is not call and not held.ran:
            self._evict(held)
            if call is not None and not call.done:
                self._calls[key] = call

    def pend(self, key: CallKey, pending: Pending) -> bool:
        """A resumable session's call that ``pending`` leaves unstarted while its answer shows the healthy path,
        on which it never starts; a look-up of it (``call``) starts it. False when a call of its id is tracked
        already (an id reused): it is then started as any other. Not counted against ``max_calls``: one a request
        in progress, each a dictionary entry; one started late is tracked from then on, the newest."""
        if key in self._calls or key in self._pending or (self._store_failed and key[0] in self._store_failed):
            return False  # (server) a call of a session whose store failed is started, and ends so (``doomed``)
        self._pending[key] = pending
        return True

    def unpend(self, key: CallKey) -> Sequence[KeptStore]:
        """The call left pending (``pend``) starts, or ended on the healthy path: (server) the stores of terminal
        events on its stream that came meanwhile (``keep_stored``), for its span."""
        del self._pending[key]
        return self._kept.pop(key, ()) if self._kept else ()

    def keep_stored(self, key: CallKey, fields: FrameFields, message: object) -> bool:
        """(server) Whether the call of ``key`` is pending (``pend``): the store of a terminal event on its stream
        is then kept, with its time and its message, for the call should it start (its span's events, its
        ``stored_result``), and the call is not started for it."""
        if key not in self._pending:
            return False
        kept = self._kept.get(key)
        if kept is None:
            self._kept[key] = [(fields, time.time_ns(), message)]
        else:  # more than its own result (a response to a request reusing its id): bounded as a span's events are
            if len(kept) >= MAX_DEFERRED_EVENTS:
                del kept[0]
            kept.append((fields, time.time_ns(), message))
        return True

    def unread(self, body: Unread, session_id: str | None) -> None:
        """(server) A resumable session's request body left for the SDK's own parse: its call starts when the
        SDK hands it over, or when a look-up of a call of its session needs it first (``call``)."""
        bodies = self._unread.get(session_id)
        if bodies is None:
            self._unread[session_id] = {body: None}
        else:
            bodies[body] = None

    def read(self, body: Unread, session_id: str | None) -> None:
        """(server) The body left unread (``unread``) is read, or its call handed over: no look-up needs it."""
        bodies = self._unread.get(session_id)
        if bodies is not None and body in bodies:
            del bodies[body]
            if not bodies:
                del self._unread[session_id]

    def span_of(self, call: Call, context: Context | None = None) -> Span:
        """The call's span, created now if it was still deferred: the call has become worth one. ``context``:
        where it is created, for a call the SDK's ``traceparent`` gives no parent (else the current one)."""
        return call.create(self._tracer, context)

    def cancel(self, key: CallKey) -> None:
        call = self.call(key)
        late = call is None or call.closed  # not in flight: over, or its span ended as its result was stored
        if call is not None:
            self._unhold(call)
            self._finish(call, sc.OUTCOME_CANCELLED)
        self._told_late(key, late)

    def cancelled_in_gone(self, key: CallKey) -> None:
        """(server) The client cancelled the call of ``key`` after its session was gone (the SDK's 404 to its opener):
        nothing is cancelled, but a result that went out before reached no caller (``cancel``)."""
        call = self._calls.get(key)
        self._told_late(key, call is None or call.closed)

    def _told_late(self, key: CallKey, late: bool) -> None:
        """(server) A cancel of ``key``'s call came: after its result went out (``result_out``), and ``late`` (its
        call not in flight), its client never got that result."""
        out = self._results_out.pop(key, None) if self._results_out else None
        if out is not None and late:  # (not an answered call's whose id a call in flight reuses)
            self._cancelled_late(key, *out)

    def result_out(self, key: CallKey, tool: str | None, event_id: str | None, at_ns: int,
                   traceparent: str | None) -> None:
        """(server) The terminal event of ``key``'s call, event ``event_id``, left the server's hands at ``at_ns``:
        sent on a stream, or stored with none open to carry it. A cancel of the call that comes after tells its
        client never got it (``cancel``). Only a resumable session's (an event id, a session): a client that loses
        any other answer's connection is failed at once."""
        out = self._results_out
        if out is None or event_id is None or key[0] is None or len(key[1]) > sc.MAX_CHARS:
            return  # not an id past the span model's bound (a hostile one): 10,000 of them could hold gigabytes
        out[key] = (at_ns, tool if tool is None or len(tool) <= sc.MAX_CHARS else None, event_id,
                    traceparent if traceparent is None or len(traceparent) <= sc.MAX_CHARS else None)
        if len(out) > self._max_calls:
            out.popitem(last=False)

    def _cancelled_late(self, key: CallKey, out_ns: int, tool: str | None, event_id: str,
                        traceparent: str | None) -> None:
        """(server) The client cancelled a call whose terminal event left our hands at ``out_ns``: it never got it (a
        connection its side lost while ours stayed open; a POST that dropped, and no resume before its caller gave
        up), or its caller gave up as it came. A span of its own from then to now (``OUTCOME_CANCELLED_LATE``), in
        the call's trace (the SDK's request span its parent): the detector tells them apart."""
        session_id, request_id = key
        attrs: dict[str, AttributeValue] = {
            sc.SPAN: sc.SPAN_CALL, sc.ROLE: sc.ROLE_SERVER, sc.MCP_METHOD_NAME: "tools/call",
            sc.JSONRPC_REQUEST_ID: request_id, sc.ERA: sc.ERA_RESUMABLE, sc.CALL_OUTCOME: sc.OUTCOME_CANCELLED_LATE,
            sc.TERMINAL_EVENT_ID: event_id}
        if session_id is not None:
            attrs[sc.MCP_SESSION_ID] = session_id
        if tool is not None:
            attrs[sc.GEN_AI_TOOL_NAME] = tool
        name = f"{sc.SPAN_NAME_CALL} tools/call" + (f" {tool}" if tool else "")
        self._tracer.start_span(name, context=sdk_parent(traceparent), kind=SpanKind.INTERNAL, attributes=attrs,
                                start_time=out_ns).end()

    def unanswered(self, call: Call, timed_out: bool, failed: bool) -> None:
        """(client) The SDK's span of ``call`` ended with no terminal event of it seen (``SdkSpans.bind``): its caller
        was answered by the SDK itself, and nothing will deliver the call to anyone. ``timed_out``: its caller's
        timeout ran out; the call ends so, as at a cancel, whether the SDK sent one or not (a request with
        resumption hints sends none, and the SDK resumes on for no caller). ``failed``: the SDK failed it (its
        resumes ran out): ``no_terminal``, as when its POST gave no cursor. Neither: its caller was cancelled, or
        its client's transport closed: cancelled, as a client's close of its stream is. A stateless call is left
        to its stream's end, which always ends it, and tells a break (to be re-issued) from the client's close."""
        if call.done or call.stateless or self._calls.get(call.key) is not call:
            return
        if failed:
            self._unhold(call)
            self._finish(call, sc.OUTCOME_NO_TERMINAL)
        else:
            self.cancel(call.key)

    def abandoned_pending(self, request_id: str, sdk_span_id: int) -> None:
        """(client) The SDK's span ``sdk_span_id`` of a call ended in its caller's timeout: a call left pending
        (``pend``) for it ends as at a cancel (``unanswered``). Found by its request id and the span its request
        names as its parent (``traceparent``): a walk of the calls left pending, once a timeout."""
        span_hex = format(sdk_span_id, "016x")
        for key in [key for key in self._pending if key[1] == request_id]:
            call = self.call(key)
            if call is not None and not call.done and call.traceparent and call.traceparent[36:52] == span_hex:
                self.cancel(key)

    def store_failed(self, session_id: str, error_type: str, stored: Callable[[CallKey], bool]) -> None:
        """(server) Storing an event of the session failed: the SDK's message router, which stores each message the
        session's server writes before sending it, stops there and sends none of the session's messages again
        (that one and every later one: results, progress, server requests). Every call of the session still owed
        its result ends now (``OUTCOME_STORE_FAILED``, ``error_type`` the exception's class): none will get it.
        Not one whose result the store holds (``stored``): routed before the failure, it is sent, or replayed to a
        resume. A call the session starts later is lost too: it ends so as it starts (``doomed``)."""
        for key in [key for key in self._pending if key[0] == session_id]:  # not started: started as they came
            pending = self._pending.get(key)
            if pending is not None:
                pending.start_pending()
        for body in list(self._unread.get(session_id, ())):
            body.read_unread()
        for call in [call for call in self._calls.values() if call.key[0] == session_id]:
            self._unhold(call)  # what its held stream carries comes first: its result, if sent already
            if not call.closed and not stored(call.key):
                self._end_store_failed(call, error_type)
        # known failed only now: the calls above started as they came, some of them stored before the failure
        self._store_failed[session_id] = error_type
        self._store_failed.move_to_end(session_id)
        if len(self._store_failed) > _MAX_STORE_FAILED:
            self._store_failed.popitem(last=False)

    def store_failed_in(self, session_id: str | None) -> bool:
        """(server) Whether the session's store failed (``store_failed``): the SDK sends none of its messages again."""
        return session_id in self._store_failed

    def doomed(self, call: Call) -> None:
        """(server) A call started in a session whose store failed (``store_failed``): with the SDK's message router
        gone, nothing will send its result, so it ends so now, not at whatever its client does next (a cancel at
        its timeout, its user's cancel, or none: a client that only drops its stream)."""
        error_type = self._store_failed.get(call.key[0]) if self._store_failed else None
        if error_type is not None:
            self._unhold(call)
            self._end_store_failed(call, error_type)

    def _end_store_failed(self, call: Call, error_type: str) -> None:
        """End ``call`` lost to its session's failed store: ``error.type`` names the exception's class."""
        if call.done:
            return
        span = self.span_of(call)
        span.set_attribute(sc.ERROR_TYPE, error_type)
        span.set_status(StatusCode.ERROR)
        self._finish(call, sc.OUTCOME_STORE_FAILED)

    def _finish(self, call: Call, outcome: str, terminal: Terminal | None = None) -> None:
        """End a call. One answered on its only stream, never deviating, leaves no span. ``terminal``:
        where its terminal event came, when it came."""
        if call.done:
            return
        if call.span is None and outcome in _HEALTHY_OUTCOMES and call.streams <= 1:
            self._end_healthy(call, terminal)
            return
        call.done = True
        call.ended_by = terminal
        if self._calls.get(call.key) is call:
            del self._calls[call.key]
        fingerprint = call.fingerprint if outcome == sc.OUTCOME_NO_TERMINAL else None
        if fingerprint is not None:
            self._broken.broke(fingerprint, self.span_of(call).get_span_context())
        if terminal is not None and self._results_out is not None:
            self.result_out(call.key, call.tool, terminal[1], time.time_ns(), call.traceparent)
        if call.closed:  # its span ended when its result was stored and nothing carried it (``unsent``)
            return
        self.span_of(call)
        attrs = _terminal_attributes(terminal) if terminal is not None else {}
        attrs[sc.CALL_OUTCOME] = outcome
        attrs[sc.CALL_STREAMS] = call.streams
        call.close(attrs)

    def _end_healthy(self, call: Call, terminal: Terminal | None) -> None:
        """End a call that has no span and was carried by one stream, which its terminal event ended: no
        span, no outcome recorded (the SDK's own span has it); where the event came goes on the SDK's span."""
        call.done = True
        call.ended_by = terminal
        if self._calls.get(call.key) is call:
            del self._calls[call.key]
        if terminal is not None:
            if call.sdk_span is not None:
                annotate(call.sdk_span, terminal)
            if self._results_out is not None:
                self.result_out(call.key, call.tool, terminal[1], time.time_ns(), call.traceparent)
            # its own POST, which leaves no span (another stream has one); a session's (a stateless id is no key)
            if terminal[0] == sc.STREAM_KIND_POST and call.key[0] is not None:
                self.answered_healthy(call.key, call.tool)

    def answered_healthy(self, key: CallKey, tool: str | None) -> None:
        """The call of ``key``, a session's, got its result on its POST on the healthy path, which leaves no span: a
        later result of it on another stream is a repeat (``deliver``), whose span names its tool."""
        answered = self._answered
        # a name as MCP's tool names are (at most 128 ASCII characters) or none: a client's own, kept 10,000 times
        answered[key] = tool if tool is not None and len(tool) <= _TOOL_NAME_CHARS and tool.isascii() else None
        if len(answered) > self._max_calls:
            answered.popitem(last=False)

    def stored(self, call: Call, event_id: str, outcome: str, at_ns: int | None = None,
               routed: bool | None = None) -> None:
        """(server) The call's terminal event was stored (at ``at_ns``, else now; the first such store is the one
        kept). Its exchange (its answer's response yet to start: a JSON answer is stored before it is sent), a
        stream open for it, or a resume still replaying (``replayed``) may still carry it; with none, nothing
        delivers it unless the client resumes (``unsent``). ``routed``: whether the SDK sends it on a stream, where
        the hooks know (``StoreRecorder.routes``): a resume whose replay returned takes the stream only once it sent
        its priming event, and a result stored in between is dropped, as with no stream open."""
        if call.done or call.stateless:
            return
        if call.stored_result is None:
            call.stored_result = (event_id, outcome, time.time_ns() if at_ns is None else at_ns)
        if call.replaying:
            return  # ``replayed`` tells
        if routed is False or (routed is None and not call.on_exchange and not call.open_streams):
            self.unsent(call, call.stored_result[2])

    def replayed(self, call: Call, sent: Collection[str]) -> None:
        """(server) A resume's replay of the call's stream returned, having sent the events ``sent``. The SDK takes
        the resume for the stream only now, and dropped what the call stored during the replay, unless the store
        sent it (the guard sends the live tail itself): a result stored and not among them, with no POST open for
        it, nothing will carry."""
        call.replaying -= 1
        stored = call.stored_result
        if not call.replaying and not call.on_exchange and stored is not None and stored[0] not in sent:
            self.unsent(call, stored[2])

    def unsent(self, call: Call, out_ns: int | None = None) -> None:
        """(server) The call's terminal event was stored (``stored_result``) and nothing carries it: no stream was
        open for it, or a resume's replay ran over its store, or the last stream open for it ended without it (at
        ``out_ns``, else now: from then on only a resume delivers it). The call span ends as of the store, without a
        terminal stream, so the detector knows a result exists (and can tell whether the client ever gets it) even
        when no stream ever carries it. The call stays tracked: a resume may still deliver it."""
        if call.done or call.closed or call.stored_result is None:
            return
        event_id, outcome, at_ns = call.stored_result
        self.span_of(call)
        call.close({sc.CALL_OUTCOME: outcome, sc.TERMINAL_EVENT_ID: event_id, sc.CALL_STREAMS: call.streams}, at_ns)
        self.result_out(call.key, call.tool, event_id, time.time_ns() if out_ns is None else out_ns,
                        call.traceparent)

    # --- streams ---

    def open_stream(self, kind: str, session_id: str | None, calls: Sequence[Call],
                    attributes: Mapping[str, AttributeValue] | Opening, auth: AuthView,
                    status: int | None, start_time: int | None = None, holder: Holder | None = None) -> Stream | None:
        """A stream, or None for a POST that carries no ``tools/call`` and did not fail: those
        (initialize, notifications, other requests) tell nothing about a call's fate. ``attributes``:
        its opening attributes, or the ``Opening`` they are built from if it becomes a span. ``holder``:
        the side holding it (``hold``), whose calls count it already."""
        if kind == sc.STREAM_KIND_POST and not calls and (status is None or status < 400):
            return None
        stream = Stream(session_id, kind, self._role, auth, attributes, status, list(calls),
                        span_kind=self._stream_kind, start_time=start_time)
        if holder is not None:
            stream.holder = holder
        else:
            for call in calls:
                call.streams += 1
                call.open_streams += 1
        if kind != sc.STREAM_KIND_POST:  # a resume or a GET is a deviation already: a span now
            self._create(stream)
        return stream

    def _create(self, stream: Stream) -> Span:
        """The stream's span: a child of its call when it carries one, linked from its pending calls."""
        if stream.span is not None:
            return stream.span
        if len(stream.calls) == 1:
            stream.parent = trace.set_span_in_context(self.span_of(stream.calls[0]))
        span = stream.create(self._tracer)
        for call in stream.pending():
            self.span_of(call)
            call.link(span.get_span_context(), {sc.LINK_TYPE: sc.LINK_STREAM})
        return span

    def calls_of_cursor(self, session_id: str | None, event_id: str) -> tuple[Call, ...]:
        """The calls whose stream carried event ``event_id``: what a resume from it continues."""
        held = self._held.get(session_id)
        if held:  # the event may be on a stream of the session still held: read them first
            for holder in list(held):
                self.follow(holder)
        ids = self._event_index.get((session_id, _indexed(event_id)), ())
        calls = tuple(c for c in (self._calls.get((session_id, i)) for i in ids) if c is not None)
        if len(calls) > 1:  # sent on several streams (a session-wide replay): a client resumes from where one ended
            calls = tuple(c for c in calls if c.last_event == event_id) or calls
        return calls

    # --- held streams ---

    def hold(self, holder: Holder, calls: Sequence[Call], session_id: str | None, resumable: bool) -> None:
        """``holder`` keeps what a POST of session ``session_id`` carrying ``calls`` sends, unread, until it
        ends or something needs it read (``follow``): the calls count it as a stream carrying them from
        now on. Its stream is opened with ``holder`` (``open_stream``) only when it is needed, and never
        when the POST ends on the healthy path (``settle``). ``resumable``: a resume from one of its
        events may come before it ends (the server's side: a client resumes before the server sees its
        POST drop), so a resume in its session reads it first. Only then does the tracker keep it (the
        client's stream ends before the SDK resumes from it, and the tracker must not keep one its side
        abandons)."""
        for call in calls:
            call.held_on = holder
            call.streams += 1
            call.open_streams += 1
        if not resumable or session_id is None:  # no resume can need it first: nothing here keeps it
            return
        held = self._held.get(session_id)
        if held is None:
            self._held[session_id] = {holder: None}
        else:
            held[holder] = None

    def follow(self, holder: Holder) -> None:
        """Read what ``holder`` held as it would have been read had its stream been followed from its start;
        from now on it is followed frame by frame."""
        stream = holder.held_stream()
        if stream is None:
            return
        for frame, messages, seen in self._release(stream):
            self.frame(stream, frame, messages, seen)

    def _release(self, stream: Stream) -> list[HeldFrame]:
        holder = stream.holder
        if holder is None:
            return []
        self._unhold_stream(stream)
        return holder.read_held()

    def _unhold_stream(self, stream: Stream) -> None:
        holder, stream.holder = stream.holder, None
        if holder is not None:
            self._unhold_holder(holder, stream.calls, stream.session_id)

    def _unhold_holder(self, holder: Holder, calls: Sequence[Call], session_id: str | None) -> None:
        for call in calls:
            if call.held_on is holder:
                call.held_on = None
        held = self._held.get(session_id)
        if held is not None and holder in held:
            del held[holder]
            if not held:
                del self._held[session_id]

    def abandon(self, holder: Holder, calls: Sequence[Call], session_id: str | None) -> None:
        """(server) The hooks could not read an exchange (``_defects``): let go of it and of its calls as if never
        seen, judging nothing; a call whose span is open ends ``evicted`` (the hooks lost track of it; it goes on)."""
        self._unhold_holder(holder, calls, session_id)
        for call in calls:
            if call.done:
                continue
            if call.span is None:
                call.done = True
                if self._calls.get(call.key) is call:
                    del self._calls[call.key]
            else:
                self._finish(call, sc.OUTCOME_EVICTED)

    def settle(self, holder: Holder, calls: Sequence[Call], session_id: str | None) -> None:
        """End a POST ``holder`` still holds, never opened as a stream, whose side has seen it carry nothing
        but its calls' results (each ended as it passed, ``answered``) after frames that end no call: the
        healthy path, which leaves nothing, spared the stream, the parse and the frame records."""
        self._unhold_holder(holder, calls, session_id)
        for call in calls:
            call.open_streams -= 1

    def _unhold(self, call: Call) -> None:
        """A held stream carrying ``call`` is read before anything else judges the call."""
        if call.held_on is not None:
            self.follow(call.held_on)

    def _settled(self, stream: Stream, frames: list[HeldFrame], status: int | None) -> bool:
        """End a held stream whose frames show the healthy path: every call it carries answered on it (or
        done before), no other call's result, no error frame, no HTTP error. Its terminal events end their
        calls as ``frame`` would have; nothing only a span would carry is built. Otherwise False, and
        nothing changed."""
        if stream.span is not None or (status or 0) >= 400:
            return False
        session_id, calls = stream.session_id, stream.calls
        delivered: list[tuple[Call, WireMessage, str | None]] = []
        for frame, messages, _ in frames:
            event = frame.event if frame is not None else None
            if event and event != "message":
                if event == "error":
                    return False
                continue  # another event type: a frame event, nothing more (``frame``)
            for msg in messages:
                if msg.id is None or msg.kind not in _TERMINAL_KINDS:
                    continue
                key = (session_id, msg.id)
                for call in calls:
                    if call.key == key:
                        break
                else:
                    return False  # another call's result on this stream
                delivered.append((call, msg, frame.id if frame is not None else None))
        if len(calls) == 1:
            if not (calls[0].done or delivered):
                return False
        else:
            answered = {call.key for call, _, _ in delivered}
            if any(not call.done and call.key not in answered for call in calls):
                return False
        for call, msg, event_id in delivered:
            if not call.done:
                self._finish(call, _outcome(msg), (stream.kind, event_id))
        stream.ended = True
        for call in calls:
            call.open_streams -= 1
        return True

    def frame(self, stream: Stream, frame: SSEFrame | None, messages: Sequence[WireMessage],
              timestamp: int | None = None) -> None:
        """One SSE frame (or, with ``frame=None``, a JSON body) sent on ``stream``, now or when ``timestamp`` says."""
        event_id = event_type = None
        if frame is not None:
            event_id, event_type = frame.id, frame.event or "message"
            if event_id is not None:
                if stream.first_event_id is None:
                    stream.first_event_id = event_id
                stream.last_event_id = event_id
                if stream.request_ids:
                    self._index(stream.session_id, event_id, stream.request_ids)
            if event_type == "error":
                self._error_frame(stream, frame, timestamp)
                return
            if event_type != "message":
                stream.event(sc.EVENT_FRAME, (sc.FRAME_OTHER, event_id, event_type, None, None), timestamp)
                return
            if not frame.data:
                stream.events += 1
                stream.event(sc.EVENT_FRAME, (sc.FRAME_PRIMING, event_id, event_type, None, None), timestamp)
                return
        for msg in messages:
            stream.events += 1
            stream.event(sc.EVENT_FRAME, (msg.kind, event_id, event_type, msg.id, msg.method), timestamp)
            if msg.id is not None and msg.is_terminal:
                self._terminal(stream, msg, event_id, frame is not None)
        if stream.kind == sc.STREAM_KIND_RESUME and event_id is not None and messages:
            seen = timestamp or time.time_ns()
            if seen - stream.moved >= _MOVING_EVERY_NS:
                stream.moved = seen
                self._moving(stream, event_id, timestamp)

    def _moving(self, stream: Stream, event_id: str, timestamp: int | None) -> None:
        """A resume moved its pending calls on: the detector is told now, by a span of the resume so far ended at
        once (``END_OPEN``), and again at most every minute while it goes on, not only when the resume ends,
        which for a tool that polls may be long after any grace its clean end started, and after the detector
        would count its call stuck."""
        pending = stream.pending()
        if not pending or stream.span is None:
            return
        name, attributes = stream.describe()
        attributes.update({sc.END_REASON: sc.END_OPEN, sc.EVENTS_COUNT: stream.events,
                           sc.EVENT_FIRST_ID: stream.first_event_id or event_id, sc.EVENT_LAST_ID: event_id,
                           sc.PENDING_REQUEST_IDS: [c.key[1] for c in pending[:sc.MAX_ITEMS]],
                           **_owed(stream, pending)})
        self._tracer.start_span(name, context=trace.set_span_in_context(stream.span), kind=stream.span_kind,
                                attributes=attributes, start_time=stream.start_time).end(timestamp)

    def _error_frame(self, stream: Stream, frame: SSEFrame, timestamp: int | None) -> None:
        stream.error_frames += 1
        attrs: dict[str, AttributeValue] = {sc.FRAME_KIND: sc.FRAME_ERROR_FRAME, sc.EVENT_TYPE: frame.type,
                                            sc.ERROR_FRAME_DATA: redact_cut(frame.data, _ERROR_FRAME_DATA_CHARS)}
        if frame.id is not None:
            attrs[sc.EVENT_ID] = frame.id
        stream.event(sc.EVENT_ERROR_FRAME, attrs, timestamp)

    def _terminal(self, stream: Stream, msg: WireMessage, event_id: str | None, framed: bool) -> None:
        assert msg.id is not None
        # every delivery while the list is short (a second one of a call is duplicate_terminal), then only
        # the first of each of the stream's own calls: a server that answers a stream with results without
        # end costs a bounded tuple, and the span still says which of its own calls were answered
        ids = stream.terminal_ids
        if len(ids) < sc.MAX_ITEMS or (msg.id not in ids and msg.id in stream.request_ids):
            stream.terminal_ids = (*ids, msg.id)
        self.deliver(stream, msg, event_id, framed)

    def deliver(self, stream: Stream, msg: WireMessage, event_id: str | None, framed: bool = True) -> None:
        """A terminal event for ``msg.id`` came on ``stream`` (in an SSE frame, or ``framed`` False, as a JSON
        body): its call ends, if it was still pending. The client delivers those of a held stream as they pass: its
        call ends when its result came, while the SDK's own span is open, and the rest of the stream stays held."""
        assert msg.id is not None
        key = (stream.session_id, msg.id)
        call: Call | None = None
        for own in stream.calls:
            if own.key == key:
                call = own
                break
        else:
            if (framed and self._role == sc.ROLE_CLIENT and len(stream.calls) == 1
                    and stream.kind in _ONE_REQUEST_STREAMS):
                # the SDK client gives the first response in an SSE stream it opened for one request to that request's
                # caller, as its result (``foreign_result``), and reads no further: that call is answered, wrongly, and
                # the one the id names is not (a JSON answer goes by its id, to the call it names)
                call = stream.calls[0]
                if call.done:
                    return
            else:
                call = self.call(key)
                if call is not None:
                    self._unhold(call)  # another stream's call: what its own stream holds comes first
        if call is None or call.done:  # delivered before: a duplicate, unless
            if (call is not None and call.ended_by == (stream.kind, event_id) and call in stream.calls) or (
                    self._role == sc.ROLE_SERVER and stream.kind == sc.STREAM_KIND_RESUME):
                # the frame that ended it, read again (a held stream followed from its start); the server's replay
                # to a resume, the recovery of a send that reached no one
                return
            if key in self._answered:  # on its POST, which left no span: this stream's span names it
                stream.again = True
                if msg.id not in stream.repeated_ids:
                    stream.repeated_ids = (*stream.repeated_ids[:sc.MAX_ITEMS - 1], msg.id)
            elif call is not None:
                stream.again = True  # on a stream with a span, or on this one: its span tells too
            return
        if stream.span is not None:  # a POST delivering its own call's terminal has no span (yet)
            call.link(stream.span.get_span_context(), {sc.LINK_TYPE: sc.LINK_TERMINAL_STREAM})
        self._finish(call, _outcome(msg), (stream.kind, event_id))

    def answered(self, calls: Sequence[Call], messages: Sequence[WireMessage], event_id: str | None = None) -> bool:
        """Whether a POST's JSON body (or an SSE frame of it, event ``event_id``) is its one call's result
        and nothing else: the call then ends on the healthy path here, and the POST, whose stream would
        leave no span, is not opened as a stream. False for anything else: the caller opens the stream
        and follows it in full, exactly as if it had from the response's start."""
        if len(calls) != 1 or len(messages) != 1:
            return False
        call, msg = calls[0], messages[0]
        if msg.kind != sc.FRAME_RESPONSE or msg.id != call.key[1] or call.done or call.span is not None:
            return False
        self._finish(call, _outcome(msg), (sc.STREAM_KIND_POST, event_id))
        return True

    def answered_by(self, calls: Sequence[Call], request_id: str | None, event_id: str | None = None) -> bool:
        """``answered`` for a POST's JSON body, or an SSE frame of it (event ``event_id``), read by its head
        alone: ``request_id`` is the result's id there (``wire.result_id``), None if it is no result. A call
        that ends on the healthy path records no outcome, so the rest of the body (whether it is a tool
        error: a search of all of it) is not needed. False where it would be (the call has a span, or
        another stream carried it) or the head is no result of it: the caller reads the body in full."""
        if len(calls) != 1:
            return False
        call = calls[0]
        if call.done or call.span is not None or call.streams > 1 or request_id != call.key[1]:
            return False
        self._end_healthy(call, (sc.STREAM_KIND_POST, event_id))
        return True

    def end_stream(self, stream: Stream, reason: str, status: int | None = None) -> None:
        """End a stream. A POST that delivered the terminal event of every call it carried, and
        nothing else, is the healthy path and leaves no span."""
        if stream.ended:
            return
        if self._client_closed and reason == sc.END_DROPPED:  # its client closed it (``client_closed``)
            reason = sc.END_CLOSED
        if self._deletions:
            self._release_due()
        if stream.holder is not None:
            frames = self._release(stream)
            if self._settled(stream, frames, status):
                return
            for frame, messages, seen in frames:
                self.frame(stream, frame, messages, seen)
        stream.ended = True
        answered = True
        for call in stream.calls:
            call.open_streams -= 1
            call.last_event = stream.last_event_id
            answered = answered and call.done
            if call.stored_result is not None and not call.open_streams and not call.on_exchange and not call.replaying:
                self.unsent(call)  # the last stream open for its stored result ended without it
        terminal_ids = stream.terminal_ids
        if (answered and stream.span is None and not stream.error_frames and (status or 0) < 400 and not stream.again
                and (terminal_ids == stream.request_ids or set(terminal_ids).issubset(stream.request_ids))):
            return
        if reason == sc.END_CLEAN and stream.kind != sc.STREAM_KIND_DELETE and stream.session_id is not None:
            # the SDK closes a session's streams as it accepts its DELETE, before it answers: a stream ending then
            # ended with the session, not with its calls' answers (its client's own decision, no loss)
            if stream.session_id in self._deleted:
                reason = sc.END_TERMINATED
            elif (deletions := self._deletions.get(stream.session_id)) is not None:
                held = deletions.hold(stream, status)
                if held is not None:  # ended once one of the DELETEs it waits on is answered, or as it ended
                    self._release_later(stream.session_id, held)
                    return
        self._close(stream, reason, status)

    def _release_due(self) -> None:
        """Close the streams held past ``_DELETE_WAIT_S``, as they ended: what a timer does where there is an
        asyncio loop (``_release_later``), done at the next stream's end where there is none (trio)."""
        due = time.time_ns() - int(_DELETE_WAIT_S * 1e9)
        for session_id, deletions in list(self._deletions.items()):
            for held in [held for held in deletions.held if held.end_time <= due]:
                self._let_go(session_id, held)

    def _release_later(self, session_id: str, held: _Held) -> None:
        """Close a stream held back for DELETEs not answered within ``_DELETE_WAIT_S``: as it ended."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no asyncio loop: an answer, the next stream's end (``_release_due``) or shutdown
            return
        loop.call_later(_DELETE_WAIT_S, self._let_go, session_id, held)

    def _let_go(self, session_id: str, held: _Held) -> None:
        """Let a held stream go as it ended, unless an answer closed it already."""
        deletions = self._deletions.get(session_id)
        if deletions is None or deletions.held.pop(held, False) is False:
            return
        self._close_held(held, sc.END_CLEAN)
        if not deletions.requests and not deletions.held:
            del self._deletions[session_id]

    def _close_held(self, held: _Held, reason: str) -> None:
        self._close(held.stream, reason, held.status, held.end_time, held.pending)

    def _close(self, stream: Stream, reason: str, status: int | None, end_time: int | None = None,
               pending: list[Call] | None = None) -> None:
        """The span of an ended stream that is not the healthy path, and what its end means for its calls.
        ``end_time`` and ``pending``: when it ended and what it left pending then, for a stream closed later."""
        if pending is None:
            pending = stream.pending()
        terminal_ids = stream.terminal_ids
        span = self._create(stream)
        attrs: dict[str, AttributeValue] = {sc.END_REASON: reason, sc.EVENTS_COUNT: stream.events,
                                            sc.NETWORK_TRANSPORT: _TRANSPORT}
        if status:
            attrs[sc.HTTP_RESPONSE_STATUS_CODE] = status
        error_type = _error_type(reason, status, stream.error_frames)
        if error_type is not None:  # the stream failed: semconv's error.type and an ERROR status
            attrs[sc.ERROR_TYPE] = error_type
            span.set_status(StatusCode.ERROR)
        if stream.error_frames:
            attrs[sc.ERROR_FRAMES_COUNT] = stream.error_frames
        if stream.first_event_id is not None:
            attrs[sc.EVENT_FIRST_ID] = stream.first_event_id
            attrs[sc.EVENT_LAST_ID] = stream.last_event_id or stream.first_event_id
        if terminal_ids:
            attrs[sc.TERMINAL_REQUEST_IDS] = _listed(terminal_ids, stream.request_ids)
        if stream.repeated_ids:
            attrs[sc.REPEATED_REQUEST_IDS] = list(stream.repeated_ids)
            if not stream.calls:  # copies alone, all of one tool's calls: that tool, as a stream of one call names it
                tools = {self._answered.get((stream.session_id, request_id)) for request_id in terminal_ids}
                if len(tools) == 1 and (tool := tools.pop()) is not None:
                    attrs[sc.GEN_AI_TOOL_NAME] = tool
        # what its calls require, and what its token lacks of it: the pending calls'; on a resume, also those it
        # delivered (a server that handed them to a token lacking what they require: narrowed_resume)
        carried = stream.calls if stream.kind == sc.STREAM_KIND_RESUME else pending
        if carried:
            attrs.update(_owed(stream, carried))
        if pending:
            attrs[sc.PENDING_REQUEST_IDS] = [c.key[1] for c in pending[:sc.MAX_ITEMS]]
            if self.sees_stores:  # no result stored yet: its tool had not answered, so this end loses nothing yet
                # (a stateless call's is never stored: its stream's end without it is its end)
                running = [c.key[1] for c in pending[:sc.MAX_ITEMS]
                           if c.stored_result is None and not c.closed and not c.stateless]
                if running:
                    attrs[sc.RUNNING_REQUEST_IDS] = running
        span.set_attributes(attrs)
        span.end(end_time)
        # no resumption in this era, nor, on the client, after a POST that brought no event id (no cursor to resume
        # from: the SDK fails the call to its caller): nothing else can deliver it. A client that closed the stream
        # itself cancelled the call (the 2026-07-28 era's cancel: no notifications/cancelled is sent), as at a timeout.
        # One refused with a client error (``_REFUSED``) was answered: the SDK fails the call with it, the tool never
        # ran, and sending it again gets the same; a server's or a gateway's error (5xx), which may come after the
        # tool ran, leaves it owed, as a break does
        if reason == sc.END_CLOSED:
            outcome = sc.OUTCOME_CANCELLED
        elif reason == sc.END_HTTP_ERROR and status in _REFUSED:
            outcome = sc.OUTCOME_ERROR
        else:
            outcome = sc.OUTCOME_NO_TERMINAL
        no_cursor = (self._role == sc.ROLE_CLIENT and stream.kind == sc.STREAM_KIND_POST
                     and stream.last_event_id is None)
        for call in pending:
            if call.stateless or no_cursor:
                self._finish(call, outcome)
        if self._results_out is not None and stream.session_id in self._deleted:  # (server) a session gone
            self._let_go_gone(pending)

    def deleting(self, session_id: str) -> int:
        """A DELETE of the session is sent (client) or received (server); ``deleted`` with what this returns once
        its answer is known."""
        deletions = self._deletions.get(session_id)
        if deletions is None:
            deletions = self._deletions[session_id] = _Deletions()
        self._delete_seq += 1
        deletions.requests[self._delete_seq] = time.monotonic()
        return self._delete_seq

    def deleted(self, session_id: str, request: int, status: int | None) -> None:
        """The answer to a DELETE of the session (``request``, from ``deleting``): its status, None if there was
        none. Accepted (2xx: a redirect, ``/mcp/``'s 307, ends nothing), the streams that ended clean while it
        was in progress ended with the session; refused, they wait on the other DELETEs they ended during, if any.
        A stream that ended before this DELETE began is not its doing, whoever sent the DELETEs around it."""
        deletions = self._deletions.get(session_id)
        if deletions is None:
            return
        deletions.requests.pop(request, None)
        accepted = status is not None and 200 <= status < 300
        if accepted:
            self._deleted[session_id] = None
            self._deleted.move_to_end(session_id)
            if len(self._deleted) > _MAX_DELETED:
                self._deleted.popitem(last=False)
        for held in deletions.answered(request, accepted):
            self._close_held(held, sc.END_TERMINATED if accepted else sc.END_CLEAN)
        if not deletions.requests and not deletions.held:
            del self._deletions[session_id]
        if accepted and self._results_out is not None:  # (server)
            self._let_go_gone([c for key, c in self._calls.items() if key[0] == session_id])

    def _let_go_gone(self, calls: Sequence[Call]) -> None:
        """(server) Calls of a session whose DELETE was accepted (not of one the SDK answered 404 for: it answers so
        another principal's request naming a live session too): nothing can deliver them any more. Let go of (their
        spans end ``evicted``: forgotten, no more) once no stream or exchange of theirs is open (the SDK closes them
        as it accepts the DELETE, and their spans tell it, with the calls they leave pending), not when ``max_calls``
        newer ones push them out: a server whose clients leave without resuming holds none of theirs. A walk of the
        calls tracked, which are only those that deviated."""
        for call in calls:
            if not (call.done or call.open_streams or call.on_exchange or call.replaying):
                self._evict(call)

    def _index(self, session_id: str | None, event_id: str, request_ids: tuple[str, ...]) -> None:
        """Event ``event_id`` went out on a stream of ``request_ids``: a resume from it continues them. One sent on
        several streams (a session-wide replay hands one stream's events to another) continues any of them."""
        key = (session_id, _indexed(event_id))
        known = self._event_index.get(key)
        if known is not None and known != request_ids and len(known) + len(request_ids) <= _MAX_MERGED:
            request_ids = (*known, *[i for i in request_ids if i not in known])
        self._event_index[key] = request_ids  # else the newest sender's own tuple: no new one a frame
        if len(self._event_index) > self._max_event_index:
            self._event_index.popitem(last=False)

    def client_closed(self) -> None:
        """(client) Its HTTP client closed: nothing can send, resume or deliver any of its calls any more, so no caller
        waits for one (the SDK fails them all as its transport goes: ``Connection closed``). Each call in flight, or
        left pending, ends cancelled, as a client's close of its stream is; told even when the application's sampler
        drops the SDK's spans, which ``unanswered`` needs. A stream that ends broken from then on was closed by its
        client (``end_stream``): its stateless call is no break to re-issue."""
        self._client_closed = True
        for key in [*self._pending, *self._calls]:
            call = self.call(key)
            if call is not None and not call.done:
                self.cancel(key)

    def shutdown(self) -> None:
        """End every pending call span (as evicted) so nothing is left open at exit: those in bodies left
        unread (``unread``) and those not started (``pend``) too."""
        for pending in list(self._pending.values()):
            pending.start_pending()
        for bodies in list(self._unread.values()):
            for body in list(bodies):
                body.read_unread()
        for deletions in self._deletions.values():  # DELETEs never answered: their streams ended their own way
            for held in deletions.held:
                self._close_held(held, sc.END_CLEAN)
        self._deletions.clear()
        for call in list(self._calls.values()):
            self._evict(call)


class _Held:
    """A stream that ended clean during DELETEs of its session, held until one of them is answered."""

    __slots__ = ("end_time", "pending", "status", "stream", "waiting")

    def __init__(self, stream: Stream, status: int | None, waiting: set[int]) -> None:
        self.stream = stream
        self.status = status
        self.end_time = time.time_ns()
        self.pending = stream.pending()  # as it ended: a caller that gives up meanwhile changes nothing of it
        self.waiting = waiting  # the DELETEs in progress when it ended


class _Deletions:
    """A session's DELETEs in progress, each by when it began, and the streams of it held for their answers."""

    __slots__ = ("held", "requests")

    def __init__(self) -> None:
        self.requests: dict[int, float] = {}
        self.held: dict[_Held, None] = {}  # in the order they ended

    def hold(self, stream: Stream, status: int | None) -> _Held | None:
        """Hold a stream that ends now, on the DELETEs begun in the last ``_DELETE_WAIT_S``; None if none were (one
        the SDK is not running, its body never sent, holds nothing), or too many streams are held already."""
        now = time.monotonic()
        waiting = {request for request, began in self.requests.items() if now - began < _DELETE_WAIT_S}
        if not waiting or len(self.held) >= _MAX_HELD_ENDS:
            return None
        held = _Held(stream, status, waiting)
        self.held[held] = None
        return held

    def answered(self, request: int, accepted: bool) -> list[_Held]:
        """The held streams ``request``'s answer closes, no longer held: all it was waited on by when accepted;
        refused, those that wait on nothing else."""
        done = []
        for held in self.held:
            if request in held.waiting:
                held.waiting.discard(request)
                if accepted or not held.waiting:
                    done.append(held)
        for held in done:
            del self.held[held]
        return done


def _error_type(reason: str, status: int | None, error_frames: int) -> str | None:
    """Why a stream failed, as semconv's ``error.type`` (its HTTP status, a drop, an error frame), or None."""
    if status is not None and status >= 400:
        return str(status)
    if reason == sc.END_DROPPED:
        return sc.END_DROPPED
    return sc.FRAME_ERROR_FRAME if error_frames else None
