"""The ledger: per session, the calls still owed a terminal event, their streams and resumes.

Built only from lifecycle events (``events.py``); the clock is the caller's. Bounded: sessions are
evicted when idle past their TTL, when the session cap is reached, or when the ledger's estimate of
its own size in bytes passes its budget (least recently active first); calls past the per-session
cap, resume cursors past theirs. Every eviction is counted by reason, so a full ledger is visible
rather than silently lossy.

The size is an accounting estimate, kept as the ledger changes: each session, call, resume window,
timer and look-up is charged what CPython takes for it (``sys.getsizeof`` of its strings and
tuples plus a measured, rounded-up constant per object), so the estimate stays above what
``tracemalloc`` measures for the same content.
"""

from __future__ import annotations

import bisect
import hashlib
import heapq
import itertools
import sys
from array import array
from collections import OrderedDict, deque
from collections.abc import Iterator
from dataclasses import dataclass, fields
from typing import Any, TypeVar

from mcp_stream_exporter.detector import sizes

_MAX_SPAN_REFS = 4
_MAX_CURSORS = 64  # per session: the cursors whose calls a later resume without request ids is told
_MAX_ISSUES = 32  # issues kept per client process and call key (the newest): where a broken call's re-issue is found
_LATEST_NS = (1 << 63) - 1  # an issue's start is kept in 64 signed bits: a later one (past 2262) is no clock's, cut
_MIN_COMPACTION = 2048  # timers held before the first sweep of evicted calls' timers
# bytes charged per object beyond its strings and tuples (measured with tracemalloc, rounded up)
_SESSION_BYTES = 200  # the session, its place in the LRU order, its cursors' tuple
_CALLS_BYTES = 200  # a session's dict of calls, once it has two (most have one)
_CALL_BYTES = 600  # the call and its dict slot, and its two possible timers (deduplicated)
_WINDOW_BYTES = 900  # one resume cursor's window (a deque) and its dict slot
_CURSOR_BYTES = 16  # one cursor's two places in its session's tuple (its event id and request ids counted besides)
_ROOM_SCAN = 16  # a session's oldest calls, and as many newest, looked at for one to forget past its cap
_DONE_BYTES = 100  # one forgotten call's id's place in its session's dict (the id counted besides)
_DONE_PER_CALL = 4  # forgotten calls' ids a session keeps, per call it may hold: a span this late is rare
_INDEX_BYTES = 250  # one look-up entry
# one span taken (``first_sight``): its int (a 16-byte digest) and its place in a deque; the set's table, 27 to 128
# bytes an entry as it fills and grows fourfold, is asked (``bytes``)
_SEEN_BYTES = sys.getsizeof(2**127) + 8
_NEVER: tuple[int, int] = (0, 0)  # one tuple shared by every call a resume never moved
_NEVER_RESUMED: tuple[int, int, int, int] = (0, 0, 0, 0)  # ... and by every call never resumed
# a pair of times set apart from ``_NEVER``: its tuple and two ints past the ones CPython shares (a session's latest
# answered starts)
_PAIR_BYTES = sizes.TUPLE + 2 * sizes.ITEM + 2 * sys.getsizeof(_LATEST_NS)
_SEEN_FLOOR = 4096  # the retry window's newest spans, kept through memory pressure and across a restart
# bits of ``CallState.flags``: ``cancelled``; ``late_cancel``'s values; ``running``; a server call span of it came;
# the clean-end clock stands for its client's POST; a server closed its POST as it accepted its session's DELETE;
# its client read a refused resume of it to the end and did not fail it (``told``)
_CLIENT_GAVE_UP = 1
CANCEL_RACED = 2
CANCEL_LATE = 4
_RUNNING = 8
_SERVER_ENDED = 16
_CLOCK_CLIENT_POST = 32
_POST_TERMINATED = 64
_REFUSAL_UNHEEDED = 128
# narrowed resumes still open held for their judgement (``hold_open_narrowed``), in all and a call; past them the
# oldest are let go of, unjudged: about 1.3 KB each, 1.3 MB at most, outside the memory budget
_MAX_OPEN_NARROWED = 1024
_MAX_OPEN_NARROWED_A_CALL = 8
_MAX_EARLY_TIMEOUTS = 2048  # client SDK spans that timed out before their call span came (``timed_out_early``)
_UNIT = 16  # a call's charge is kept in these: a count under 257 is an int CPython shares, not 32 bytes a call
_K = TypeVar("_K")
_V = TypeVar("_V")


def _firsts(clean_seen: tuple[str, int, str | None] | tuple[str, int, str | None, int, int]) -> tuple[int, int]:
    """The earliest clean ends ``clean_seen`` keeps beside the one the clock stands for (``CallState.clean_seen``)."""
    return (clean_seen[3], clean_seen[4]) if len(clean_seen) == 5 else _NEVER


@dataclass(slots=True)
class CallState:
    """One ``tools/call`` as both sides' spans tell it, merged."""

    scope: str
    request_id: str
    tool: str | None = None
    era: str = "resumable"
    required: tuple[str, ...] = ()
    # a stream ended with the call pending: when the detector first saw it so, or last saw it moving on (its
    # clock): how long a call in flight has shown no sign of life (``count_stuck``)
    owed_since: int | None = None
    clean_since: int | None = None  # ... and that stream ended cleanly (its side's clock): the silent-loss clock
    # whose clock clean_since is (that side's later progress stops it), when the detector learned of it (the grace
    # runs from then, on its own clock), and the event that stream stopped at (either side's resume from it that
    # moved it stops it too: it came after, whatever the clocks)
    # ... and, once a clean end it does not stand for came (the other side's, or an earlier one whose span came
    # later) with no progress of it seen since on that side, the earliest such by each side's clock, client then
    # server (0: none), what a stream of its session answered after is compared with (``ended_before``): kept in
    # this tuple, not a field of its own, so a call whose spans come in order costs what it did
    clean_seen: tuple[str, int, str | None] | tuple[str, int, str | None, int, int] | None = None
    progress: tuple[int, int] = _NEVER  # the latest end of a resume that moved it without its result: client, server
    # by each side's clock, client then server: the latest start of a resume of it refused explicitly (an error frame,
    # the guard), and the latest end of one that was not
    resumed: tuple[int, int, int, int] = _NEVER_RESUMED
    broken_since: int | None = None  # 2026-07-28: its only stream ended without the result
    # the server stored its terminal event with no stream open to carry it; or sent it, and its client cancelled the
    # call after (a ``cancelled_late`` span): when, and which event
    stored_since: int | None = None
    stored_event_id: str | None = None
    fingerprint: str | None = None  # client: salted hash of tool and arguments, what a re-issue repeats
    terminal: bool = False
    timed_out: bool = False  # over undelivered: its caller gave up or was told it failed, or nothing can deliver it
    # ... for its client gave up (a cancel, the SDK's timeout): what a finding may explain (``cancelled``); whether
    # the server saw that cancel come after its result was out (``late_cancel``); whether the server's latest word
    # is that its tool had not answered (``running``): bits of one field, for a tracked call is held to 1 KiB
    flags: int = 0
    roles: tuple[str, ...] = ()  # sides that saw a stream end with it owed
    client_deliveries: int = 0  # terminal deliveries seen, per side
    server_deliveries: int = 0
    trace_id: str | None = None
    span_ids: tuple[str, ...] = ()  # the first stream and call spans that carried it
    origin: str = ""
    findings: dict[str, str] | None = None  # rule -> finding id; most calls never get one
    # the ledger's own book-keeping, not the call's story (never in a snapshot row): what it is charged, in
    # _UNIT bytes (0 once forgotten), and which timers it has set (a bit each), instead of two maps keyed by call
    charged: int = 0
    timers: int = 0

    def note_span(self, trace_id: str, span_id: str) -> None:
        if self.trace_id is None:
            self.trace_id = trace_id
        if len(self.span_ids) < _MAX_SPAN_REFS and span_id not in self.span_ids:
            self.span_ids += (span_id,)

    def progressed(self, role: str, end_ns: int, cursor: str | None) -> None:
        """A resume ``role`` saw from ``cursor`` moved it without its result: a clean end that side saw before, or
        the one it resumed from (seen by either side), stops counting."""
        client, server = self.progress
        self.progress = (max(client, end_ns), server) if role == "client" else (client, max(server, end_ns))
        clean_since, clean_seen = self.clean_since, self.clean_seen
        if clean_since is not None and clean_seen is not None and (
                (clean_seen[0] == role and end_ns > clean_since) or (cursor is not None and cursor == clean_seen[2])):
            self.clean_since = self.clean_seen = None
        elif clean_seen is not None and len(clean_seen) == 5:  # that side's earlier clean ends: past if it moved after
            client, server = clean_seen[3], clean_seen[4]
            if role == "client" and 0 < client < end_ns:
                self.clean_seen = (*clean_seen[:3], 0, server)
            elif role != "client" and 0 < server < end_ns:
                self.clean_seen = (*clean_seen[:3], client, 0)

    def ended_clean(self, role: str, end_ns: int, now_ns: int, stopped_at: str | None, post: bool) -> bool:
        """A stream ``role`` saw ended cleanly with it pending, at event ``stopped_at``: the silent-loss clock
        starts, unless it runs already or that side saw it move after this end (spans come in any order);
        whether it runs. ``post``: that stream was its POST."""
        side = 0 if role == "client" else 1
        if end_ns < self.progress[side]:
            return self.clean_since is not None  # it moved after this end (a tie: not after)
        clean_since, clean_seen = self.clean_since, self.clean_seen
        if clean_since is None:
            self.clean_since, self.clean_seen = end_ns, (role, now_ns, stopped_at)
            self.flags = (self.flags | _CLOCK_CLIENT_POST if post and side == 0
                          else self.flags & ~_CLOCK_CLIENT_POST)
        elif clean_seen is not None and (clean_seen[0] != role or end_ns < clean_since):
            # an end the running clock does not stand for (the other side's, or an earlier one come later)
            client, server = _firsts(clean_seen)
            first = client if side == 0 else server
            if not first or end_ns < first:
                client, server = (end_ns, server) if side == 0 else (client, end_ns)
                self.clean_seen = (clean_seen[0], clean_seen[1], clean_seen[2], client, server)
        return True

    def ended_before(self, answered: tuple[int, int]) -> bool:
        """Whether a clean end that left it pending came before a resume of its session started that was answered
        (``answered``: the latest such starts, client then server), by the same side's clock: its session was
        alive after that end, which was then no session going away (a restart, an idle expiry)."""
        clean_since, clean_seen = self.clean_since, self.clean_seen
        if clean_since is None or clean_seen is None:
            return False
        if clean_since < answered[0 if clean_seen[0] == "client" else 1]:
            return True
        client, server = _firsts(clean_seen)
        return 0 < client < answered[0] or 0 < server < answered[1]

    def resumed_as(self, role: str, refused: bool, start_ns: int, end_ns: int, unheeded: bool = False) -> None:
        """A resume of it that ``role`` saw, refused explicitly or not (``told``); ``unheeded``: a refusal its client
        read on past, to the stream's end, and did not fail the call at."""
        at = (0 if refused else 1) + (0 if role == "client" else 2)
        resumed = list(self.resumed)
        if unheeded:
            self.flags |= _REFUSAL_UNHEEDED
        resumed[at] = max(resumed[at], start_ns if refused else end_ns)
        self.resumed = (resumed[0], resumed[1], resumed[2], resumed[3])

    @property
    def told(self) -> bool:
        """Its last resume was refused explicitly: its caller was told why, so it is no silent loss. Each side
        compares its own clock's times; a resume not refused that one side saw end after a refusal started (a retry,
        which a gateway may answer before the server sees it; or another client's resume of the stream at the same
        time, such as one with a wider token: its caller was told nothing) makes it judged again, whatever the other
        side saw; and a refusal its client did not heed told its caller nothing (``resumed_as``)."""
        if self.flags & _REFUSAL_UNHEEDED:
            return False
        client_refused, client_retried, server_refused, server_retried = self.resumed
        return ((client_refused > client_retried or server_refused > server_retried)
                and client_retried <= client_refused and server_retried <= server_refused)

    def finding(self, rule: str) -> str | None:
        return self.findings.get(rule) if self.findings is not None else None

    def add_finding(self, rule: str, finding_id: str) -> None:
        if self.findings is None:
            self.findings = {}
        self.findings.setdefault(rule, finding_id)

    def delivered_to(self, role: str) -> int:
        """Count one more terminal delivery seen by ``role``; returns that side's count."""
        if role == "client":
            self.client_deliveries += 1
            return self.client_deliveries
        self.server_deliveries += 1
        return self.server_deliveries

    @property
    def in_flight(self) -> bool:
        """Owed, and neither delivered nor given up; nor is its caller told why it will not come (``told``)."""
        return self.owed_since is not None and not self.terminal and not self.timed_out and not self.told

    @property
    def cancelled(self) -> bool:
        return bool(self.flags & _CLIENT_GAVE_UP)

    def client_gave_up(self) -> None:
        """Its client gave up on it (a cancel, the SDK's timeout): ``cancelled``."""
        self.flags |= _CLIENT_GAVE_UP

    @property
    def late_cancel(self) -> int:
        """The server saw its client's cancel come after its result was out (a ``cancelled_late`` span):
        ``CANCEL_RACED`` sooner than ``cancel_race_s`` after (its caller gave up as the result came), ``CANCEL_LATE``
        later (it gave up without it); 0: not seen."""
        return self.flags & (CANCEL_RACED | CANCEL_LATE)

    def cancel_seen_late(self, raced: bool) -> None:
        """The server saw its client's cancel come after its result was out: ``late_cancel``. A cancel well after
        the send says more than one that raced it, and is kept over it."""
        if not raced:
            self.flags = self.flags & ~CANCEL_RACED | CANCEL_LATE
        elif not self.late_cancel:
            self.flags |= CANCEL_RACED

    def post_terminated(self) -> None:
        """A side saw its POST end ``terminated``: closed as the server accepted its session's DELETE."""
        self.flags |= _POST_TERMINATED

    @property
    def closed_by_delete(self) -> bool:
        """The clean end its clock stands for is its client's of a POST the server closed as it accepted the
        session's DELETE (another client's: this one saw the close as a clean end, and its resume gets 404)."""
        return self.flags & (_CLOCK_CLIENT_POST | _POST_TERMINATED) == _CLOCK_CLIENT_POST | _POST_TERMINATED

    @property
    def running(self) -> bool:
        """The server's latest word on it: a stream of it ended while its tool had not answered yet (no result
        stored or sent), and no span of the server's has told of a result since."""
        return bool(self.flags & _RUNNING)

    def server_running(self) -> None:
        """A server stream ended with it pending and its tool not answered yet: ``running``, unless a server call
        span of it came already (its spans come in any order: its end came after any such stream end)."""
        if not self.flags & _SERVER_ENDED:
            self.flags |= _RUNNING

    def server_answered(self) -> bool:
        """A server call span told of its result, or of its end without one: no longer ``running``, nor ever again;
        whether it was."""
        was = self.running
        self.flags = self.flags & ~_RUNNING | _SERVER_ENDED
        return was

    @property
    def reached_caller(self) -> bool:
        """Whether its result reached its caller, as far as the spans tell: a delivery its client saw; or one only
        the server saw (the client's spans may be missing), unless the server saw the client give up well after
        the result was out (``CANCEL_LATE``): then that was the SDK resuming for no caller, which drops it (a
        client that waits sees it)."""
        return self.client_deliveries > 0 or (self.terminal and self.late_cancel != CANCEL_LATE)


@dataclass(slots=True)
class SessionState:
    scope: str
    last_ns: int
    # its calls, oldest first: the only one itself (a session usually has one), else a dict by request id
    calls: CallState | dict[str, CallState] | None = None
    resumes: dict[tuple[str, str], deque[int]] | None = None  # (role, cursor) -> times, once there is one
    # event id, then the calls of the stream it ended, and so on, oldest first: one flat tuple, for a session
    # holds one or two (a dict of one entry takes three times the bytes)
    cursors: tuple[str | tuple[str, ...], ...] = ()
    own_bytes: int = 0  # what its calls dict, resume windows and cursors are charged
    deleted: bool = False  # its client ended it (a DELETE the server accepted): a 404 after is no expiry
    expired: bool = False  # a request on it got 404 while it was not deleted: what it owes goes with it
    # by each side's clock, client then server: the latest start of a resume of it that was answered (2xx; 0: none):
    # it still existed then (``CallState.ended_before``)
    answered: tuple[int, int] = _NEVER
    # the ids of calls it forgot delivered (``Ledger._make_room``), oldest first: a late span of one is no new call
    # to judge (its late clean end would page a loss it is not)
    done: dict[str, None] | None = None

    def get(self, request_id: str) -> CallState | None:
        calls = self.calls
        if isinstance(calls, dict):
            return calls.get(request_id)
        return calls if calls is not None and calls.request_id == request_id else None

    def all(self) -> list[CallState]:
        """Its calls, oldest first."""
        calls = self.calls
        if isinstance(calls, dict):
            return list(calls.values())
        return [calls] if calls is not None else []


@dataclass(frozen=True, slots=True)
class LedgerLimits:
    max_sessions: int = 20_000
    max_calls_per_session: int = 1_000
    session_ttl_s: float = 3600.0
    max_index: int = 50_000  # SDK-span and re-issue look-ups
    max_bytes: int = 192 * 1024 * 1024  # the ledger's estimated size; past it, oldest sessions go first
    max_resumes_per_session: int = 64  # resume cursors watched for loops; the oldest is dropped first


class Ledger:
    def __init__(self, limits: LedgerLimits | None = None) -> None:
        self.limits = limits or LedgerLimits()
        self._sessions: OrderedDict[str, SessionState] = OrderedDict()  # least recently active first
        self._calls = 0
        self._in_flight = 0
        self.stuck = 0  # calls in flight with no sign of life for a while (``count_stuck``)
        self.evictions: dict[str, int] = {"ttl": 0, "capacity": 0, "memory": 0}
        self._sdk_spans: OrderedDict[str, tuple[str, str]] = OrderedDict()  # SDK span id -> call
        self._early_timeouts: OrderedDict[str, None] = OrderedDict()  # SDK span ids that timed out, no call named
        # (origin, call key) -> the starts of its issues, oldest first, each negated once a broken call took it; an
        # array: 8 bytes an issue and sized in one step, for every client call span adds one
        self._issued: OrderedDict[tuple[str, str], array[int]] = OrderedDict()
        # the latest stream spans taken (``first_sight``), as ints: a set to look up, a ring for their order
        self._seen: set[int] = set()
        self._seen_order: deque[int] = deque()
        self._timers: list[tuple[int, int, str, str, str]] = []  # (due, seq, what, scope, request id)
        # (scope, request id) -> the spans so far of its narrowed resumes still open, each as its judgement needs it:
        # [side, resume start, due, evidence, the span's common part, the other side's latest refusal then]
        self._open_narrowed: OrderedDict[tuple[str, str], list[list[Any]]] = OrderedDict()
        self._open_narrowed_count = 0
        # resumes that ended naming no call, by (scope, side, start): a span of one so far that comes after is not held
        self._ended_nameless: OrderedDict[tuple[str, str, int], None] = OrderedDict()
        self._seq = 0
        self._timer_bits: dict[str, int] = {}
        self._compact_at = _MIN_COMPACTION
        self._bytes = 0  # sessions, calls and resume windows
        self._index_bytes = 0
        self._touched: dict[int, CallState] = {}  # calls that may have grown since the last account()

    # --- sessions and calls ---

    def session(self, scope: str, now_ns: int) -> SessionState:
        session = self._sessions.get(scope)
        if session is None:
            session = self._sessions[scope] = SessionState(scope, now_ns)
            self._bytes += _SESSION_BYTES + _size(scope)
            while len(self._sessions) > self.limits.max_sessions:
                self._drop(self._sessions.popitem(last=False)[1], "capacity")
        else:
            session.last_ns = now_ns
            self._sessions.move_to_end(scope)
        return session

    def call(self, session: SessionState, request_id: str, now_ns: int) -> CallState:
        calls = session.calls  # SessionState.get, inlined: a call per event
        if isinstance(calls, dict):
            call = calls.get(request_id)
        else:
            call = calls if calls is not None and calls.request_id == request_id else None
        if call is None:
            call = CallState(session.scope, request_id)
            if session.done is not None and request_id in session.done:
                call.terminal = True  # forgotten once delivered: nothing to judge of it again
            calls = self._add_call(session, call)
            if calls is not None and len(calls) > self.limits.max_calls_per_session:
                self._make_room(session, calls)
        self._touched[id(call)] = call  # the caller fills it in
        return call

    def _make_room(self, session: SessionState, calls: dict[str, CallState]) -> None:
        """A session past its cap of calls (the newest just added) forgets its oldest call that is delivered,
        else the oldest that is over and judged (no timer set): nothing is left to find of either, so neither
        counts as an eviction (a long session of healthy resumed calls would page ``LedgerEvicting``). Only
        when every call may still be a loss does the oldest go, counted: not the one whose grace is running
        because a hundred others came after it. Looked for among its ``_ROOM_SCAN`` oldest and ``_ROOM_SCAN``
        newest calls only (where a session's calls still owed are seldom both): a session whose calls are all still
        owed (a hostile producer's, pending by the thousand) would otherwise cost a walk of all of them for every
        call it adds."""
        gone: CallState | None = None
        over: CallState | None = None
        held = len(calls) - 1  # the newest, just added, stays
        oldest = min(held, _ROOM_SCAN)
        newest = itertools.islice(reversed(calls.values()), 1, 1 + min(held - oldest, _ROOM_SCAN))
        for call in itertools.chain(itertools.islice(calls.values(), oldest), newest):
            if call.reached_caller:
                gone = call
                break
            if over is None and call.timed_out and not call.timers:
                over = call
        if gone is not None:  # delivered: its id kept, so that a late span of it makes no new call to judge
            self._done(session, gone.request_id)
        else:  # over and judged: a late span of it (its result stored, never delivered) is judged anew
            gone = over
        if gone is None:
            gone = next(iter(calls.values()))
            self.evictions["capacity"] += 1
        del calls[gone.request_id]
        self._forget(gone)

    def _done(self, session: SessionState, request_id: str) -> None:
        if session.done is None:
            session.done = {}
        elif request_id in session.done:
            return
        session.done[request_id] = None
        charge = _DONE_BYTES + _size(request_id)
        while len(session.done) > _DONE_PER_CALL * self.limits.max_calls_per_session:
            oldest = next(iter(session.done))
            del session.done[oldest]
            charge -= _DONE_BYTES + _size(oldest)
        self._charge_session(session, charge)

    def _add_call(self, session: SessionState, call: CallState) -> dict[str, CallState] | None:
        """Hold ``call`` in ``session`` and charge it; returns the session's dict of calls, once it has one."""
        self._calls += 1
        self._in_flight += call.in_flight
        self._charge(call)
        calls = session.calls
        if calls is None:
            session.calls = call
            return None
        if not isinstance(calls, dict):
            calls = session.calls = {calls.request_id: calls}
            self._charge_session(session, _CALLS_BYTES)
        calls[call.request_id] = call
        return calls

    def find(self, scope: str, request_id: str) -> CallState | None:
        session = self._sessions.get(scope)
        return session.get(request_id) if session is not None else None

    def owed(self, call: CallState, now_ns: int, role: str) -> None:
        """A stream ended with the call pending: it is in flight until delivered or given up."""
        self.seen_owed(call, role)
        if call.owed_since is None:  # owed again, not moving (a resume that drops at once): no sign of life
            was = call.in_flight
            call.owed_since = now_ns
            self._in_flight += call.in_flight - was

    def seen_owed(self, call: CallState, role: str) -> None:
        """``role``'s spans show the call owed its result (a finding's sides)."""
        if role not in call.roles:
            call.roles = _with_role(call.roles, role)

    def alive(self, call: CallState, now_ns: int) -> None:
        """A span showed the call moving on: not stuck, for a while."""
        if call.owed_since is not None:
            call.owed_since = now_ns

    def resumed(self, call: CallState, role: str, refused: bool, start_ns: int, end_ns: int,
                unheeded: bool = False) -> None:
        """A resume of the call, refused explicitly or not (``CallState.told``, which ends its being in flight)."""
        was = call.in_flight
        call.resumed_as(role, refused, start_ns, end_ns, unheeded)
        self._in_flight += call.in_flight - was

    def delivered(self, call: CallState) -> None:
        was = call.in_flight
        call.terminal = True
        self._in_flight -= was

    def given_up(self, call: CallState) -> None:
        """Its caller no longer waits for it (or nothing can deliver it any more): no longer in flight."""
        was = call.in_flight
        call.timed_out = True
        self._in_flight -= was

    def unjudge(self) -> int:
        """Let go of the judging of every call owed a result (``Snapshots``: their spans may be lost): its grace
        timers dropped, and what they would have judged from (its clean end, its result stored; not when its stream
        broke, which a re-issue is matched against), no longer in flight (not counted stuck). Spans of it that come
        later are judged as they come: a stream that ends without its result makes it owed again. Returns how many
        there were."""
        owed = 0
        for session in self._sessions.values():
            for call in session.all():
                if call.timers or call.in_flight:
                    owed += 1
                    self._in_flight -= call.in_flight
                    call.timers = 0
                    call.owed_since = call.clean_since = call.clean_seen = call.stored_since = None
        self._timers = []
        self._open_narrowed.clear()  # their ends may be among the spans lost
        self._open_narrowed_count = 0
        return owed

    def hold_open_narrowed(self, call: CallState, role: str, start_ns: int, due_ns: int, evidence: dict[str, Any],
                           common: dict[str, Any], other_refused: int) -> None:
        """A narrowed resume of ``call`` still open (its span so far): judged at ``due_ns`` unless it ends first;
        ``other_refused``: the other side's latest refusal of it then."""
        if (call.scope, role, start_ns) in self._ended_nameless:  # its end came first, naming no call
            return
        key = (call.scope, call.request_id)
        held = self._open_narrowed.get(key)
        if held is None:
            held = self._open_narrowed[key] = []
        if any(h[0] == role and h[1] == start_ns for h in held):  # a span of it so far told again
            return
        held.append([role, start_ns, due_ns, evidence, common, other_refused])
        self._open_narrowed_count += 1
        self._open_narrowed.move_to_end(key)
        if len(held) > _MAX_OPEN_NARROWED_A_CALL:
            del held[0]
            self._open_narrowed_count -= 1
        while self._open_narrowed_count > _MAX_OPEN_NARROWED:
            _, oldest = self._open_narrowed.popitem(last=False)
            self._open_narrowed_count -= len(oldest)

    def ended_open_narrowed(self, scope: str, request_id: str | None, role: str, start_ns: int,
                            refused: bool = False) -> None:
        """The resume ``role`` saw start at ``start_ns`` ended: its end is judged, not its span so far. One that
        names no call (its caller gave up) is looked for among the session's, and, ``refused`` explicitly, lets go
        of the other side's too (whose clock is not compared)."""
        if request_id is None:
            self._ended_nameless[(scope, role, start_ns)] = None
            if len(self._ended_nameless) > _MAX_OPEN_NARROWED:
                self._ended_nameless.popitem(last=False)
        keys = [(scope, request_id)] if request_id is not None else [k for k in self._open_narrowed if k[0] == scope]
        for key in keys:
            held = self._open_narrowed.get(key)
            if held is not None:
                kept = [h for h in held if (h[0] != role or h[1] != start_ns)
                        and not (refused and request_id is None and h[0] != role)]
                self._open_narrowed_count -= len(held) - len(kept)
                if kept:
                    self._open_narrowed[key] = kept
                else:
                    del self._open_narrowed[key]

    def due_open_narrowed(self, call: CallState, now_ns: int) -> tuple[list[list[Any]], int | None]:
        """The narrowed resumes of ``call`` still open whose judgement is due, taken; and when the next one is."""
        key = (call.scope, call.request_id)
        held = self._open_narrowed.pop(key, [])
        due = [h for h in held if h[2] <= now_ns]
        later = [h for h in held if h[2] > now_ns]
        self._open_narrowed_count -= len(due)
        if later:
            self._open_narrowed[key] = later
        return due, min((h[2] for h in later), default=None)

    def answered(self, session: SessionState, role: str, start_ns: int) -> None:
        """A resume of ``session`` that ``role`` saw start at ``start_ns`` (its clock) was answered (2xx)."""
        answered = session.answered
        if role == "client":
            if start_ns > answered[0]:
                self._answered(session, (start_ns, answered[1]))
        elif start_ns > answered[1]:
            self._answered(session, (answered[0], start_ns))

    def _answered(self, session: SessionState, answered: tuple[int, int]) -> None:
        if session.answered == _NEVER:
            self._charge_session(session, _PAIR_BYTES)
        session.answered = answered

    def answered_at(self, scope: str) -> tuple[int, int]:
        """The latest starts of resumes of the session that were answered (2xx), client then server (0: none)."""
        session = self._sessions.get(scope)
        return session.answered if session is not None else _NEVER

    def deleted(self, scope: str) -> bool:
        """Whether the session's client deleted it (a DELETE the server accepted)."""
        session = self._sessions.get(scope)
        return session is not None and session.deleted

    def in_session(self, scope: str) -> list[CallState]:
        session = self._sessions.get(scope)
        return session.all() if session is not None else []

    def resume_window(self, session: SessionState, key: tuple[str, str], maxlen: int) -> deque[int]:
        """The times ``key`` (role, cursor) was resumed from in ``session``, at most ``maxlen`` of them;
        at most ``max_resumes_per_session`` cursors are watched, the least recently new dropped first."""
        if session.resumes is None:
            session.resumes = {}
        resumes = session.resumes
        window = resumes.get(key)
        if window is None:
            window = resumes[key] = deque(maxlen=maxlen)
            charge = _window_bytes(key, maxlen)
            self._charge_session(session, charge)
            if len(resumes) > self.limits.max_resumes_per_session:
                oldest = next(iter(resumes))
                dropped = _window_bytes(oldest, resumes.pop(oldest).maxlen or 0)
                self._charge_session(session, -dropped)
        return window

    def note_cursor(self, session: SessionState, event_id: str, request_ids: tuple[str, ...]) -> None:
        """A stream carrying ``request_ids`` ended at ``event_id``: a resume from it continues them. At
        most ``_MAX_CURSORS`` a session, charged to it like its resume windows."""
        cursors = session.cursors
        if cursors and cursors[-2] == event_id and cursors[-1] == request_ids:
            return  # the newest already (a resume loop's every end): nothing changes
        charge = _cursor_bytes(event_id, request_ids)
        for i in range(0, len(cursors), 2):
            if cursors[i] == event_id:
                charge -= _cursor_bytes(event_id, _ids(cursors[i + 1]))
                cursors = cursors[:i] + cursors[i + 2:]
                break
        if len(cursors) == 2 * _MAX_CURSORS:
            i = _spent_cursor(session, cursors)
            charge -= _cursor_bytes(_id(cursors[i]), _ids(cursors[i + 1]))
            cursors = cursors[:i] + cursors[i + 2:]
        session.cursors = (*cursors, event_id, request_ids)
        self._charge_session(session, charge)

    @staticmethod
    def cursor_calls(session: SessionState, event_id: str) -> tuple[str, ...]:
        """The calls of the stream that ended at ``event_id`` in ``session`` (none when not noted)."""
        cursors = session.cursors
        for i in range(len(cursors) - 2, -1, -2):
            if cursors[i] == event_id:
                return _ids(cursors[i + 1])
        return ()

    def _charge_session(self, session: SessionState, charge: int) -> None:
        session.own_bytes += charge
        self._bytes += charge

    # --- look-ups that outlive a span: spans taken, the SDK's request span, and tools (re-)issued ---

    def first_sight(self, trace_id: str, span_id: str, scope: str) -> bool:
        """Whether a stream span is new: an exporter that retries a batch the detector took (its answer lost or
        late) delivers the same spans again, which must not count twice. Only the stream spans that would
        (``Detector.apply``) come here: few, and a retry follows its batch closely, so a bounded window does.
        A span without a valid id (8 bytes) cannot be told from another: always new. Its session (``scope``)
        is part of what it is: a producer that numbers its spans alike in every session (a load generator, a
        seeded id generator) loses nothing to it."""
        if len(span_id) != 16:
            return True
        # one int, not a tuple; a digest of all three, not a mix of the ids (a producer's ids may be counters,
        # whose mixes collide), and bounded whatever a hostile span's ids and session are
        key = int.from_bytes(hashlib.blake2b(f"{trace_id}/{span_id}/{scope}".encode("utf-8", "surrogatepass"),
                                             digest_size=16).digest())
        if key in self._seen:
            return False
        self._sight(key)
        return True

    def _sight(self, key: int) -> None:
        self._seen.add(key)
        self._seen_order.append(key)
        self._index_bytes += _SEEN_BYTES
        if len(self._seen) > self.limits.max_index:
            self._forget_seen()

    def _forget_seen(self) -> None:
        self._seen.discard(self._seen_order.popleft())
        self._index_bytes -= _SEEN_BYTES

    def link_sdk_span(self, span_id: str, call: CallState) -> bool:
        """``call``'s client SDK request span is ``span_id``; True if that span came first and timed out."""
        self._index_bytes += _bounded_put(self._sdk_spans, span_id, (call.scope, call.request_id),
                                          self.limits.max_index)
        return self._early_timeouts.pop(span_id, False) is None

    def timed_out_early(self, span_id: str) -> None:
        """A client SDK request span timed out before any span of ours named it (spans in any order): the call that
        names it later is told then (the newest ``_MAX_EARLY_TIMEOUTS``, a fixed few hundred KB at most). Only a
        span id of 8 bytes is kept: a call span's parent is one (a producer's SDK span id may be of any length)."""
        if len(span_id) != 16:
            return
        self._early_timeouts[span_id] = None
        if len(self._early_timeouts) > _MAX_EARLY_TIMEOUTS:
            self._early_timeouts.popitem(last=False)

    def sdk_span_call(self, span_id: str) -> tuple[str, str] | None:
        """(scope, request id) of the call whose client SDK request span is ``span_id`` (the timelines' look-up)."""
        return self._sdk_spans.get(span_id)

    def call_of_sdk_span(self, span_id: str) -> CallState | None:
        key = self._sdk_spans.get(span_id)
        return self.find(*key) if key is not None else None

    def issued(self, origin: str, call_key: str, start_ns: int) -> None:
        """A client process (``origin``) issued a call: ``call_key`` is its tool and arguments fingerprint. An
        issue is known by its start: a re-issue's two spans (its start's and its own) and a span delivered
        again are one issue, and one a broken call took stays taken."""
        key = (origin, call_key)
        start_ns = min(start_ns, _LATEST_NS)
        issues = self._issued.get(key)
        if issues is None:
            self._index_bytes += _bounded_put(self._issued, key, array("q", (start_ns,)), self.limits.max_index)
            return
        if start_ns in issues or -start_ns in issues:
            return
        before = sys.getsizeof(issues)
        bisect.insort(issues, start_ns, key=abs)
        if len(issues) > _MAX_ISSUES:
            del issues[0]
        self._issued.move_to_end(key)
        self._index_bytes += sys.getsizeof(issues) - before

    def take_reissue(self, origin: str, call_key: str, broken_ns: int) -> bool:
        """Take, for a call of ``call_key`` whose stream broke at ``broken_ns``, the earliest issue after it that
        no broken call took: one re-issue answers one broken call. The earliest, for a call that broke later
        can take only later issues: whatever order broken calls come in, as many get one as could."""
        issues = self._issued.get((origin, call_key))
        if issues is None:
            return False
        for i, start in enumerate(issues):
            if start > broken_ns:  # not taken (a taken one is negative) and after the break
                issues[i] = -start
                return True
        return False

    # --- timers: grace periods, evaluated by the caller's clock ---

    def schedule(self, due_ns: int, what: str, call: CallState) -> None:
        """A timer for ``what`` on ``call``; one at a time: while one is set, another is not added (the
        checks it runs re-arm it when it fires early), so re-ending the same calls adds no timers."""
        bit = self._timer_bit(what)
        if call.timers & bit:
            return
        call.timers |= bit
        self._seq += 1
        heapq.heappush(self._timers, (due_ns, self._seq, what, call.scope, call.request_id))
        if len(self._timers) > self._compact_at:
            # timers of evicted calls would otherwise stay until due: drop them; the heap at least
            # doubles between two compactions, so each push pays O(1) for them
            self._compact_timers()

    def waiting(self, call: CallState, what: str) -> bool:
        """Whether ``call`` has a timer for ``what`` set."""
        return bool(call.timers & self._timer_bit(what))

    def _timer_bit(self, what: str) -> int:
        """A bit of ``CallState.timers`` for each kind of timer the rules set (a handful)."""
        bit = self._timer_bits.get(what)
        if bit is None:
            bit = self._timer_bits[what] = 1 << len(self._timer_bits)
        return bit

    def _compact_timers(self) -> None:
        self._timers = [t for t in self._timers if self.find(t[3], t[4]) is not None]
        heapq.heapify(self._timers)
        self._compact_at = max(2 * len(self._timers), _MIN_COMPACTION)

    def postpone(self, by_ns: int) -> None:
        """Every timer, and every session's idle clock, ``by_ns`` later: the time the detector was down (restored
        from a snapshot) counts against no grace, as the spans that would have come in it come after the restart
        (their exporters retry them), nor against a session's TTL (its calls' graces would find it gone)."""
        if by_ns <= 0:
            return
        self._timers = [(due + by_ns, seq, what, scope, rid) for due, seq, what, scope, rid in self._timers]
        for session in self._sessions.values():  # a uniform shift keeps the heap a heap, and the sessions in order
            session.last_ns += by_ns

    def due(self, now_ns: int) -> Iterator[tuple[str, CallState]]:
        while self._timers and self._timers[0][0] <= now_ns:
            _, _, what, scope, request_id = heapq.heappop(self._timers)
            call = self.find(scope, request_id)
            if call is not None:
                call.timers &= ~self._timer_bit(what)
                self._touched[id(call)] = call  # a finding may be added to it
                yield what, call

    def count_stuck(self, now_ns: int, after_ns: int) -> None:
        """``stuck``: the calls in flight that no span has shown moving on for ``after_ns`` since they were owed
        (a resume moving a call on says so at least every minute: docs/span-model.md). By the detector's clock: no
        producer's clock is compared. A walk of every call, every few seconds (``RuleEngine.tick``)."""
        self.stuck = sum(1 for _ in self.stuck_calls(now_ns, after_ns))

    def stuck_calls(self, now_ns: int, after_ns: int) -> Iterator[CallState]:
        """The calls ``count_stuck`` counts, oldest session first: what the on-call looks up in the traces."""
        horizon = now_ns - after_ns
        for session in self._sessions.values():
            calls = session.calls
            for call in calls.values() if isinstance(calls, dict) else (calls,) if calls is not None else ():
                if call.in_flight and (call.owed_since or 0) < horizon:
                    yield call

    def expire(self, now_ns: int) -> int:
        """Evict sessions idle longer than their TTL; returns how many."""
        horizon = now_ns - int(self.limits.session_ttl_s * 1e9)
        expired = 0
        while self._sessions:
            session = next(iter(self._sessions.values()))
            if session.last_ns >= horizon:
                break
            self._drop(self._sessions.popitem(last=False)[1], "ttl")
            expired += 1
        return expired

    # --- size in bytes: an accounting estimate, kept under the budget ---

    @property
    def bytes(self) -> int:
        return self._bytes + self._index_bytes + sys.getsizeof(self._seen)

    def account(self) -> int:
        """Re-charge the calls touched since the last call, then shorten the retry window (``first_sight``) and the
        SDK-span look-ups (a timeout they no longer find is a warning missed), each to its newest entries, evict
        the least recently active sessions (counted as ``memory``: their losses would go unseen), then the oldest
        look-ups (a re-issue no longer found pages ``not_reissued``), until under the budget; returns how many
        sessions were evicted."""
        for call in self._touched.values():
            if call.charged:  # still held
                self._bytes -= call.charged * _UNIT
                self._charge(call)
        self._touched.clear()
        evicted = 0
        while self.bytes > self.limits.max_bytes and len(self._seen) > _SEEN_FLOOR:  # a shorter retry window first
            self._forget_seen()
        while self.bytes > self.limits.max_bytes and len(self._sdk_spans) > _SEEN_FLOOR:
            self._index_bytes -= _entry_bytes(*self._sdk_spans.popitem(last=False))
        while self.bytes > self.limits.max_bytes and self._sessions:
            self._drop(self._sessions.popitem(last=False)[1], "memory")
            evicted += 1
        while self.bytes > self.limits.max_bytes and (self._sdk_spans or self._issued):
            larger = len(self._sdk_spans) >= len(self._issued)
            index: OrderedDict[Any, Any] = self._sdk_spans if larger else self._issued
            self._index_bytes -= _entry_bytes(*index.popitem(last=False))
        if evicted:
            self._compact_timers()
        return evicted

    def _charge(self, call: CallState) -> None:
        call.charged = -(-_call_bytes(call) // _UNIT)  # rounded up
        self._bytes += call.charged * _UNIT

    # --- snapshots (snapshot.py): JSON-able data, never pickles ---

    def dump(self) -> dict[str, Any]:
        """Everything a restarted detector needs to go on judging the calls this one holds."""
        return {"sessions": [self.dump_session(scope) for scope in self._sessions], **self.dump_rest()}

    def load(self, data: dict[str, Any]) -> None:
        """Take a dump's content in place of this ledger's (at start, before any span)."""
        self._sessions.clear()
        self._calls = self._in_flight = self._bytes = 0
        for s in data["sessions"]:
            self.load_session(s)
        self.load_rest(data)

    def load_rest(self, data: dict[str, Any]) -> None:
        """Take a dump's look-ups, timers and counts (after its sessions)."""
        self.evictions.update(data["evictions"])
        self._sdk_spans = OrderedDict((span_id, (scope, rid)) for span_id, scope, rid in data["sdk_spans"])
        self._issued = OrderedDict(((origin, key), _issues(issues)) for origin, key, issues in data["issued"])
        while self._seen:
            self._forget_seen()
        self._index_bytes = sum(_entry_bytes(k, v) for k, v in self._sdk_spans.items()) + sum(
            _entry_bytes(k, v) for k, v in self._issued.items())
        for key in data.get("seen", ()):  # a batch whose answer the shutdown lost comes again after the restart
            self._sight(key)  # charged: after the look-ups' sum, not overwritten by it
        self._timers = [(due, seq, what, scope, rid) for due, seq, what, scope, rid in data["timers"]]
        self._compact_timers()
        for _, _, what, scope, rid in self._timers:
            call = self.find(scope, rid)
            if call is not None:
                call.timers |= self._timer_bit(what)
        self._seq = data["seq"]
        self._open_narrowed = OrderedDict(((scope, rid), held) for scope, rid, held in data.get("open_narrowed", ()))
        self._open_narrowed_count = sum(len(held) for held in self._open_narrowed.values())
        self._ended_nameless = OrderedDict(((scope, role, start), None) for scope, role, start
                                           in data.get("ended_nameless", ()))

    def dump_session(self, scope: str) -> dict[str, Any] | None:
        """One session as JSON-able data (a snapshot row); None if it is gone."""
        s = self._sessions.get(scope)
        if s is None:
            return None
        return {"scope": s.scope, "last_ns": s.last_ns, "calls": [_row(c) for c in s.all()],
                "resumes": [[role, cursor, list(times), times.maxlen]
                            for (role, cursor), times in (s.resumes or {}).items()],
                "cursors": [[s.cursors[i], list(s.cursors[i + 1])] for i in range(0, len(s.cursors), 2)],
                "deleted": s.deleted, "expired": s.expired, "answered": list(s.answered), "done": list(s.done or ())}

    def load_session(self, s: dict[str, Any]) -> None:
        """Take one dumped session (at start, before any span), as the most recently active."""
        session = self._sessions[s["scope"]] = SessionState(s["scope"], s["last_ns"], deleted=s.get("deleted", False),
                                                            expired=s.get("expired", False))
        self._bytes += _SESSION_BYTES + _size(session.scope)
        for row in s["calls"]:
            values: dict[str, Any] = {k: tuple(v) if k in _TUPLES and v is not None else v
                                      for k, v in row.items() if k in _FIELDS}
            if "flags" not in row:  # a row of before: its give-ups under their own name; its client's give-up kept
                # alone; or, before that, every one
                values["flags"] = row.get("gave_up", _CLIENT_GAVE_UP if row.get("cancelled", row.get("timed_out",
                                                                                                      False)) else 0)
            self._add_call(session, CallState(**values))
        if s["resumes"]:
            session.resumes = {(role, cursor): deque(times, maxlen=maxlen)
                               for role, cursor, times, maxlen in s["resumes"]}
            self._charge_session(session, sum(_window_bytes(k, w.maxlen or 0) for k, w in session.resumes.items()))
        for cursor, ids in s.get("cursors", ()):
            self.note_cursor(session, cursor, tuple(ids))
        for request_id in s.get("done", ()):
            self._done(session, request_id)
        client, server = s.get("answered", _NEVER)  # a row of before: none seen
        if client or server:
            self._answered(session, (int(client), int(server)))

    def dump_rest(self) -> dict[str, Any]:
        """Everything but the sessions (a snapshot row)."""
        return {"evictions": dict(self.evictions),
                "sdk_spans": [[span_id, *call] for span_id, call in self._sdk_spans.items()],
                "issued": [[origin, key, list(issues)] for (origin, key), issues in self._issued.items()],
                "timers": list(self._timers), "seq": self._seq, "seen": self.dump_seen(),
                "open_narrowed": [[scope, rid, held] for (scope, rid), held in self._open_narrowed.items()],
                "ended_nameless": [list(key) for key in self._ended_nameless]}

    def dump_seen(self) -> list[int]:
        """The newest of the retry window (``first_sight``): what a batch that comes again after a restart skips."""
        return list(itertools.islice(reversed(self._seen_order), _SEEN_FLOOR))[::-1]

    def session_scopes(self) -> list[str]:
        """Every session's scope, least recently active first."""
        return list(self._sessions)

    # --- size ---

    @property
    def sessions(self) -> int:
        return len(self._sessions)

    @property
    def calls(self) -> int:
        return self._calls

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def _drop(self, session: SessionState, reason: str) -> None:
        for call in session.all():
            self._forget(call)
        self._bytes -= _SESSION_BYTES + _size(session.scope) + session.own_bytes
        self.evictions[reason] += 1

    def _forget(self, call: CallState) -> None:
        self._calls -= 1
        self._bytes -= call.charged * _UNIT
        call.charged = 0
        if call.in_flight:
            self._in_flight -= 1
        if self._open_narrowed:
            held = self._open_narrowed.pop((call.scope, call.request_id), None)
            self._open_narrowed_count -= len(held) if held is not None else 0


def _spent_cursor(session: SessionState, cursors: tuple[str | tuple[str, ...], ...]) -> int:
    """Where in ``cursors`` the one to forget is: the oldest whose calls were all delivered (or are forgotten),
    so no resume from it continues a call still owed; else the oldest. A session's healthy resumed calls note
    two cursors each: the cursor of a call whose caller gave up, the SDK resuming on from it, must outlast them."""
    for i in range(0, len(cursors), 2):
        if all((call := session.get(rid)) is None or call.terminal for rid in _ids(cursors[i + 1])):
            return i
    return 0


_FIELDS = frozenset(f.name for f in fields(CallState))  # a row of an older snapshot may hold others: left out
_TUPLES = frozenset(f.name for f in fields(CallState) if str(f.type).startswith("tuple"))
_ROLES: dict[tuple[tuple[str, ...], str], tuple[str, ...]] = {}  # (roles, role) -> roles with it: shared tuples


def _with_role(roles: tuple[str, ...], role: str) -> tuple[str, ...]:
    """``roles`` and ``role``, as one tuple shared by every call with them (roles come from a closed set of two)."""
    key = (roles, role)
    shared = _ROLES.get(key)
    if shared is None:
        shared = (*roles, role)
        if len(_ROLES) < 16:  # a snapshot's rows could name others: never an unbounded map
            _ROLES[key] = shared
    return shared


def _id(item: str | tuple[str, ...]) -> str:
    assert isinstance(item, str)
    return item


def _ids(item: str | tuple[str, ...]) -> tuple[str, ...]:
    assert isinstance(item, tuple)
    return item


_BOOK_KEEPING = frozenset({"charged", "timers"})


def _row(call: CallState) -> dict[str, Any]:
    return {f.name: getattr(call, f.name) for f in fields(CallState) if f.name not in _BOOK_KEEPING}


def _issues(row: int | list[int]) -> array[int]:
    """A key's issues in a snapshot row; a snapshot of before kept only the latest start: one issue, not taken."""
    return array("q", (row,) if isinstance(row, int) else row)


def _bounded_put(index: OrderedDict[_K, _V], key: _K, value: _V, cap: int) -> int:
    """Put, dropping the oldest entry past ``cap``; returns the change in the entries' bytes."""
    old = index.get(key)
    change = _entry_bytes(key, value) - (_entry_bytes(key, old) if old is not None else 0)
    index[key] = value
    index.move_to_end(key)
    if len(index) > cap:
        change -= _entry_bytes(*index.popitem(last=False))
    return change


def _size(value: object) -> int:
    """Bytes of a string, a number or a tuple of them (shared strings are counted each time: an upper bound);
    strings by arithmetic (``sizes``), for every look-up entry is sized when put, and again when replaced."""
    if type(value) is str:
        return sizes.STR + len(value) if value.isascii() else sys.getsizeof(value)
    if type(value) is tuple:
        return sizes.TUPLE + sizes.ITEM * len(value) + sum(map(_size, value))
    return sys.getsizeof(value)


def _entry_bytes(key: object, value: object) -> int:
    return _INDEX_BYTES + _size(key) + _size(value)


def _cursor_bytes(event_id: str, request_ids: tuple[str, ...]) -> int:
    return _CURSOR_BYTES + sizes.strings((event_id, *request_ids)) + sizes.TUPLE + sizes.ITEM * len(request_ids)


def _window_bytes(key: tuple[str, str], maxlen: int) -> int:
    return _WINDOW_BYTES + _size(key) + 32 * maxlen


def _call_bytes(call: CallState) -> int:
    """What ``call`` holds: its strings, lists and findings (a string held twice is counted twice)."""
    findings = call.findings
    held = [call.request_id, call.origin, *call.required, *call.roles, *call.span_ids]
    if call.tool:
        held.append(call.tool)
    if call.trace_id:
        held.append(call.trace_id)
    if findings:
        held += findings
        held += findings.values()
    items = len(call.required) + len(call.roles) + len(call.span_ids)
    return (_CALL_BYTES + sizes.strings(held) + 3 * sizes.TUPLE + sizes.ITEM * items
            + (sys.getsizeof(findings) if findings else 0)
            + (2 * sizes.ITEM + 2 * sys.getsizeof(_LATEST_NS) if call.clean_seen and len(call.clean_seen) == 5 else 0))
