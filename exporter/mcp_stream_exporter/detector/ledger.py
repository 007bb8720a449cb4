"""The ledger: per session, the calls still owed a terminal event, their streams and resumes.

Built only from lifecycle events (``events.py``); the clock is the caller's. Bounded: sessions are
evicted when idle past their TTL or when the session cap is reached, and calls past the per-session
cap; every eviction is counted by reason, so a full ledger is visible rather than silently lossy.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

_MAX_SPAN_REFS = 4
_MAX_CURSORS = 64  # per session: the cursors whose calls a later resume without request ids is told
_MIN_COMPACTION = 2048  # timers held before the first sweep of evicted calls' timers
_K = TypeVar("_K")
_V = TypeVar("_V")


@dataclass(slots=True)
class CallState:
    """One ``tools/call`` as both sides' spans tell it, merged."""

    scope: str
    request_id: str
    first_ns: int
    tool: str | None = None
    era: str = "resumable"
    required: tuple[str, ...] = ()
    owed_since: int | None = None  # a stream ended with the call pending
    clean_since: int | None = None  # ... and that stream ended cleanly: the silent-loss clock
    broken_since: int | None = None  # 2026-07-28: its only stream ended without the result
    stored_since: int | None = None  # the server stored its terminal event with no stream open to carry it
    stored_event_id: str | None = None
    fingerprint: str | None = None  # client: salted hash of tool and arguments, what a re-issue repeats
    terminal: bool = False
    timed_out: bool = False  # the client gave up on it (timeout or cancel)
    roles: tuple[str, ...] = ()  # sides that saw a stream end with it owed
    client_deliveries: int = 0  # terminal deliveries seen, per side
    server_deliveries: int = 0
    trace_id: str | None = None
    span_ids: tuple[str, ...] = ()  # the first stream and call spans that carried it
    origin: str = ""
    findings: dict[str, str] | None = None  # rule -> finding id; most calls never get one

    def note_span(self, trace_id: str, span_id: str) -> None:
        if self.trace_id is None:
            self.trace_id = trace_id
        if len(self.span_ids) < _MAX_SPAN_REFS and span_id not in self.span_ids:
            self.span_ids += (span_id,)

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
        return self.owed_since is not None and not self.terminal and not self.timed_out


@dataclass(slots=True)
class SessionState:
    scope: str
    last_ns: int
    calls: dict[str, CallState] = field(default_factory=dict)  # insertion order: oldest first
    resumes: dict[tuple[str, str], deque[int]] | None = None  # (role, cursor) -> times, once there is one
    cursors: OrderedDict[str, tuple[str, ...]] | None = None  # event id -> the calls of the stream it ended

    def note_cursor(self, event_id: str, request_ids: tuple[str, ...]) -> None:
        """A stream carrying ``request_ids`` ended at ``event_id``: a resume from it continues them."""
        if self.cursors is None:
            self.cursors = OrderedDict()
        self.cursors[event_id] = request_ids
        self.cursors.move_to_end(event_id)
        if len(self.cursors) > _MAX_CURSORS:
            self.cursors.popitem(last=False)


@dataclass(frozen=True, slots=True)
class LedgerLimits:
    max_sessions: int = 20_000
    max_calls_per_session: int = 1_000
    session_ttl_s: float = 3600.0
    max_index: int = 50_000  # SDK-span and re-issue look-ups


class Ledger:
    def __init__(self, limits: LedgerLimits | None = None) -> None:
        self.limits = limits or LedgerLimits()
        self._sessions: OrderedDict[str, SessionState] = OrderedDict()  # least recently active first
        self._calls = 0
        self._in_flight = 0
        self.evictions: dict[str, int] = {"ttl": 0, "capacity": 0}
        self._sdk_spans: OrderedDict[str, tuple[str, str]] = OrderedDict()  # SDK span id -> call
        self._issued: OrderedDict[tuple[str, str], int] = OrderedDict()  # (origin, call key) -> last start
        self._timers: list[tuple[int, int, str, str, str]] = []  # (due, seq, what, scope, request id)
        self._seq = 0
        self._compact_at = _MIN_COMPACTION

    # --- sessions and calls ---

    def session(self, scope: str, now_ns: int) -> SessionState:
        session = self._sessions.get(scope)
        if session is None:
            session = self._sessions[scope] = SessionState(scope, now_ns)
            while len(self._sessions) > self.limits.max_sessions:
                self._drop(self._sessions.popitem(last=False)[1], "capacity")
        else:
            session.last_ns = now_ns
            self._sessions.move_to_end(scope)
        return session

    def call(self, session: SessionState, request_id: str, now_ns: int) -> CallState:
        call = session.calls.get(request_id)
        if call is None:
            call = session.calls[request_id] = CallState(session.scope, request_id, now_ns)
            self._calls += 1
            if len(session.calls) > self.limits.max_calls_per_session:
                self._forget(session.calls.pop(next(iter(session.calls))))
                self.evictions["capacity"] += 1
        return call

    def find(self, scope: str, request_id: str) -> CallState | None:
        session = self._sessions.get(scope)
        return session.calls.get(request_id) if session is not None else None

    def owed(self, call: CallState, since_ns: int, role: str) -> None:
        """A stream ended with the call pending: it is in flight until delivered or given up."""
        if role not in call.roles:
            call.roles += (role,)
        if call.owed_since is None:
            was = call.in_flight
            call.owed_since = since_ns
            self._in_flight += call.in_flight - was

    def delivered(self, call: CallState) -> None:
        was = call.in_flight
        call.terminal = True
        self._in_flight -= was

    def given_up(self, call: CallState) -> None:
        was = call.in_flight
        call.timed_out = True
        self._in_flight -= was

    def in_session(self, scope: str) -> list[CallState]:
        session = self._sessions.get(scope)
        return list(session.calls.values()) if session is not None else []

    # --- look-ups that outlive a span: the SDK's request span, and tools (re-)issued ---

    def link_sdk_span(self, span_id: str, call: CallState) -> None:
        _bounded_put(self._sdk_spans, span_id, (call.scope, call.request_id), self.limits.max_index)

    def call_of_sdk_span(self, span_id: str) -> CallState | None:
        key = self._sdk_spans.get(span_id)
        return self.find(*key) if key is not None else None

    def issued(self, origin: str, call_key: str, start_ns: int) -> None:
        """A client process (``origin``) issued a call: ``call_key`` is its tool and arguments fingerprint."""
        key = (origin, call_key)
        _bounded_put(self._issued, key, max(start_ns, self._issued.get(key, 0)), self.limits.max_index)

    def last_issued(self, origin: str, call_key: str) -> int:
        return self._issued.get((origin, call_key), 0)

    # --- timers: grace periods, evaluated by the caller's clock ---

    def schedule(self, due_ns: int, what: str, call: CallState) -> None:
        self._seq += 1
        heapq.heappush(self._timers, (due_ns, self._seq, what, call.scope, call.request_id))
        if len(self._timers) > self._compact_at:
            # timers of evicted calls would otherwise stay until due: drop them; the heap at least
            # doubles between two compactions, so each push pays O(1) for them
            self._timers = [t for t in self._timers if self.find(t[3], t[4]) is not None]
            heapq.heapify(self._timers)
            self._compact_at = max(2 * len(self._timers), _MIN_COMPACTION)

    def due(self, now_ns: int) -> Iterator[tuple[str, CallState]]:
        while self._timers and self._timers[0][0] <= now_ns:
            _, _, what, scope, request_id = heapq.heappop(self._timers)
            call = self.find(scope, request_id)
            if call is not None:
                yield what, call

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

    # --- snapshots (snapshot.py): JSON-able data, never pickles ---

    def dump(self) -> dict[str, Any]:
        """Everything a restarted detector needs to go on judging the calls this one holds."""
        return {
            "sessions": [{"scope": s.scope, "last_ns": s.last_ns,
                          "calls": [_row(c) for c in s.calls.values()],
                          "resumes": [[role, cursor, list(times), times.maxlen]
                                      for (role, cursor), times in (s.resumes or {}).items()],
                          "cursors": [[cursor, list(ids)] for cursor, ids in (s.cursors or {}).items()]}
                         for s in self._sessions.values()],
            "evictions": dict(self.evictions),
            "sdk_spans": [[span_id, *call] for span_id, call in self._sdk_spans.items()],
            "issued": [[origin, tool, start] for (origin, tool), start in self._issued.items()],
            "timers": [list(timer) for timer in self._timers],
            "seq": self._seq,
        }

    def load(self, data: dict[str, Any]) -> None:
        """Take a dump's content in place of this ledger's (at start, before any span)."""
        self._sessions.clear()
        self._calls = self._in_flight = 0
        for s in data["sessions"]:
            session = self._sessions[s["scope"]] = SessionState(s["scope"], s["last_ns"])
            for row in s["calls"]:
                values: dict[str, Any] = {k: tuple(v) if k in _TUPLES else v for k, v in row.items()}
                call = session.calls[row["request_id"]] = CallState(**values)
                self._calls += 1
                self._in_flight += call.in_flight
            if s["resumes"]:
                session.resumes = {(role, cursor): deque(times, maxlen=maxlen)
                                   for role, cursor, times, maxlen in s["resumes"]}
            if s.get("cursors"):
                session.cursors = OrderedDict((cursor, tuple(ids)) for cursor, ids in s["cursors"])
        self.evictions.update(data["evictions"])
        self._sdk_spans = OrderedDict((span_id, (scope, rid)) for span_id, scope, rid in data["sdk_spans"])
        self._issued = OrderedDict(((origin, tool), start) for origin, tool, start in data["issued"])
        self._timers = [(due, seq, what, scope, rid) for due, seq, what, scope, rid in data["timers"]]
        heapq.heapify(self._timers)
        self._compact_at = max(2 * len(self._timers), _MIN_COMPACTION)
        self._seq = data["seq"]

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
        for call in session.calls.values():
            self._forget(call)
        self.evictions[reason] += 1

    def _forget(self, call: CallState) -> None:
        self._calls -= 1
        if call.in_flight:
            self._in_flight -= 1


_TUPLES = frozenset(f.name for f in fields(CallState) if str(f.type).startswith("tuple"))


def _row(call: CallState) -> dict[str, Any]:
    return {f.name: getattr(call, f.name) for f in fields(CallState)}


def _bounded_put(index: OrderedDict[_K, _V], key: _K, value: _V, cap: int) -> None:
    index[key] = value
    index.move_to_end(key)
    if len(index) > cap:
        index.popitem(last=False)
