"""Per-call timelines: what the spans said about one call, kept so a finding can tell its story.

Fed every lifecycle event (``Detector.apply``), before the rules see it, so a finding raised by an
event already has that event on its timeline. A call answered on its first stream is not recorded
(the common case costs a look-up), and a call's timeline is dropped when the client sees it answered
without a finding, so a duplicate delivery's timeline starts at the second delivery. A timeline is
held while its call is recent; when a finding is raised it is pinned to the finding and evicted with
it (same capacity, same order as the finding store). Everything is bounded: entries per call (the
first half and the last half are kept, the middle counted), the items of every list a producer sent
(its strings are bounded by the span model, ``events.MAX_CHARS``, and shared with the events, not
copied), and the bytes of all timelines together (oldest calls go first, then the oldest findings'
timelines).

A timeline keeps each step as one ``bytes``: the findings page's :class:`Entry` fields, its lists cut to the
cap, written by ``marshal`` and read back into an ``Entry`` only when the page asks. That is a third of what
the lifecycle event itself holds (an object, its ``Common``, its ``Token``, their timestamps), and its size is
what CPython holds for it, not an estimate: the budget keeps as many stories as it says.
"""

from __future__ import annotations

import marshal
import sys
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise

from mcp_stream_exporter import semconv as sc
from mcp_stream_exporter.detector.events import CallEnd, Lifecycle, Operation, Replay, StreamEnd
from mcp_stream_exporter.detector.findings import Finding

_TERMINAL_OUTCOMES = frozenset({sc.OUTCOME_RESULT, sc.OUTCOME_TOOL_ERROR, sc.OUTCOME_ERROR})
_MAP_ENTRY = 200  # bytes: a place in an OrderedDict, its key tuple and the key's strings, roughly
SESSION_LEVEL = ""  # the request id of a session's resumes and replays that name no call

Key = tuple[str, str]  # (scope, request id)


@dataclass(frozen=True, slots=True)
class TimelineLimits:
    max_entries: int = 40  # per call
    max_items: int = 8  # per list a producer sent
    max_bytes: int = 16 * 1024 * 1024  # all timelines together
    max_findings: int = 10_000  # as the finding store's capacity: timelines leave with their findings
    max_index: int = 50_000  # SDK span ids -> calls, for the caller's timeout


@dataclass(slots=True)
class Entry:
    """One step of a call's story: a stream, a replay, the call's end, or the caller giving up; built when the
    findings page asks, from a kept step (``_row`` writes its fields in this order)."""

    at_ns: int
    end_ns: int
    role: str
    step: str  # post | get | resume | delete | replay | call | timeout
    trace_id: str
    span_id: str
    origin: str = ""
    reason: str | None = None  # how a stream ended: clean | dropped | closed | http_error
    status: int | None = None
    events: int | None = None
    first_event_id: str | None = None
    last_event_id: str | None = None
    cursor: str | None = None
    error_frames: int | None = None
    pending: tuple[str, ...] = ()
    terminal: tuple[str, ...] = ()
    audience: tuple[str, ...] = ()
    required: tuple[str, ...] = ()
    missing_resources: tuple[str, ...] = ()
    missing_scopes: tuple[str, ...] = ()
    decision: str | None = None  # replay: complete | truncated | refused | unknown_cursor
    guard_decision: str | None = None
    buffered: int | None = None
    sent: int | None = None
    offending_event_id: str | None = None
    outcome: str | None = None  # call: result | tool_error | error | cancelled | no_terminal | evicted
    error_type: str | None = None  # the caller's own span: timeout, ...
    duration_s: float | None = None


_STEP = sys.getsizeof(b"")  # a bytes object, before its bytes


class Timeline:
    """One call's steps: the first ``max_entries // 2`` and the latest ones, and how many fell between.

    One list, grown as steps come (most calls have two or three): no ring buffer allocated up front."""

    __slots__ = ("bytes", "kept", "max_entries", "omitted", "refs")

    def __init__(self, max_entries: int) -> None:
        self.kept: list[bytes] = []  # the head, then the latest steps in order (``_row``, written)
        self.max_entries = max(2, max_entries)
        self.omitted = 0
        self.bytes = _NEW_TIMELINE
        self.refs = 0  # the calls map and each finding holding it

    def add(self, step: bytes) -> int:
        """Append ``step``; returns the change in bytes."""
        kept = self.kept
        n = len(kept)
        if n < self.max_entries and n < _TABLED:  # most timelines: the list's growth from the table
            grown = _STEP + len(step) + _LIST_GROWTH[n]
            kept.append(step)
        else:
            grown = _STEP + len(step) - sys.getsizeof(kept)
            if n == self.max_entries:
                grown -= _STEP + len(kept.pop(n // 2))  # the oldest of the latest
                self.omitted += 1
            kept.append(step)
            grown += sys.getsizeof(kept)
        self.bytes += grown
        return grown

    def entries(self) -> list[Entry]:
        """The findings page's rows, built now, in the order the steps started."""
        rows = (marshal.loads(step) for step in self.kept)  # noqa: S302 (only what ``Timelines._kept`` wrote)
        return sorted((Entry(*row) for row in rows), key=lambda e: (e.at_ns, e.end_ns))


def _appended_sizes(n: int) -> list[int]:
    """``sys.getsizeof`` of a list grown from empty by appends, at each length up to ``n``: CPython
    over-allocates in steps, and a timeline's list only grows by appends until it is full."""
    grown: list[None] = []
    held = [sys.getsizeof(grown)]
    for _ in range(n):
        grown.append(None)
        held.append(sys.getsizeof(grown))
    return held


_APPENDED = _appended_sizes(4 * TimelineLimits().max_entries)
_LIST_GROWTH = [after - before for before, after in pairwise(_APPENDED)]  # by length before the append
_TABLED = len(_LIST_GROWTH)
_NEW_TIMELINE = sys.getsizeof(object.__new__(Timeline)) + _APPENDED[0] + _MAP_ENTRY

_Row = tuple[int | float | str | tuple[str, ...] | None, ...]  # an ``Entry``'s fields, in its order
# ``Entry``'s fields a kind of step leaves as they are, in ``Entry``'s order
_NOT_A_STREAM = (None,) * 7  # reason, status, events, first and last event id, cursor, error frames
_NO_CALLS: tuple[tuple[str, ...], ...] = ((), ())  # pending, terminal
_NOT_A_REPLAY = (None,) * 5  # decision, guard decision, buffered, sent, offending event id


def _row(e: StreamEnd | Replay | CallEnd, cap: int) -> _Row:
    """``e`` as the ``Entry`` fields it fills, in their order (the rest left to their defaults), each list cut to
    ``cap`` items."""
    at, token = e.at, e.token
    common = (at.start_ns, at.end_ns, at.role)
    ids = (at.trace_id, at.span_id, at.origin)
    lists = (token.audience[:cap], e.required[:cap], token.missing_resources[:cap], token.missing_scopes[:cap])
    if isinstance(e, StreamEnd):
        return (*common, e.kind, *ids, e.reason, e.status, e.events, e.first_event_id, e.last_event_id, e.cursor,
                e.error_frames, e.pending_ids[:cap], e.terminal_ids[:cap], *lists)
    if isinstance(e, Replay):
        return (*common, "replay", *ids, None, None, None, None, None, e.cursor, None, *_NO_CALLS, *lists, e.decision,
                e.guard_decision, e.buffered, e.sent, e.offending_event_id)
    return (*common, "call", *ids, *_NOT_A_STREAM, *_NO_CALLS, *lists, *_NOT_A_REPLAY, e.outcome)


def _give_up(e: Operation) -> _Row:
    """The caller's own request span that gave up or failed, as ``Entry`` fields in their order."""
    return (e.start_ns, e.start_ns + int(e.duration_s * 1e9), e.role, "timeout" if e.timed_out else "error",
            e.trace_id[:32], e.span_id[:16], e.origin, *_NOT_A_STREAM, *_NO_CALLS, (), (), (), (), *_NOT_A_REPLAY,
            None, e.error_type, e.duration_s)


class Timelines:
    """Every call's timeline, bounded. ``sdk_span_call`` tells which call a client SDK request span was (the
    ledger's look-up, ``Ledger.sdk_span_call``): a caller's give-up joins that call's timeline."""

    def __init__(self, limits: TimelineLimits | None = None,
                 sdk_span_call: Callable[[str], Key | None] | None = None) -> None:
        self.limits = limits or TimelineLimits()
        self._calls: OrderedDict[Key, Timeline] = OrderedDict()  # least recently touched first
        self._findings: OrderedDict[str, Timeline] = OrderedDict()  # finding id -> its call's timeline
        self._sdk_span_call = sdk_span_call or (lambda span_id: None)
        self._early: OrderedDict[str, bytes] = OrderedDict()  # a give-up seen before its call span
        self.bytes = 0
        self.evicted = 0  # timelines dropped for the byte budget while a finding still held them

    # --- in: every lifecycle event ---

    def record(self, event: Lifecycle) -> None:
        """Keep ``event`` on its calls' timelines."""
        if isinstance(event, StreamEnd):
            self._stream(event)
        elif isinstance(event, Replay):
            self._add((event.at.scope, event.request_id or SESSION_LEVEL), self._kept(event))
        elif isinstance(event, CallEnd):
            self._call(event)
        else:
            self._operation(event)
        if self.bytes > self.limits.max_bytes:
            self._shrink()

    def attach(self, finding: Finding, scope: str | None = None) -> None:
        """A new finding: pin its call's timeline to it (call once per finding, when first raised). ``scope``:
        where its call is kept (``Common.scope``), when it has one; else read off the finding."""
        key = (scope, finding.request_id or SESSION_LEVEL) if scope is not None else self._key(finding)
        timeline = self._calls.get(key)
        if timeline is None:
            return
        if finding.id in self._findings:
            return
        self._findings[finding.id] = timeline
        timeline.refs += 1
        while len(self._findings) > self.limits.max_findings:
            self._release(self._findings.popitem(last=False)[1])

    # --- out ---

    def of(self, finding: Finding) -> Timeline | None:
        """The finding's timeline; None once evicted, or for a finding restored from a snapshot."""
        return self._findings.get(finding.id)

    def __len__(self) -> int:
        return len(self._calls) + len(self._findings)

    # --- entries ---

    def _stream(self, e: StreamEnd) -> None:
        scope = e.at.scope
        request_ids, pending = e.request_ids, e.pending_ids
        if e.terminal_ids and not pending and all((scope, rid) not in self._calls for rid in request_ids):
            return  # a call answered on its first stream, the common case: no story to keep
        ids: tuple[str, ...] = request_ids  # one call, the usual stream
        if len(request_ids) != 1 or (pending and pending != request_ids):
            ids = tuple(dict.fromkeys((*request_ids, *pending)))
        if not ids and e.kind != sc.STREAM_KIND_RESUME:
            return  # a standalone GET or a DELETE: no call's story
        step = self._kept(e)
        for rid in ids[:self.limits.max_items] or (SESSION_LEVEL,):
            self._add((scope, rid), step)

    def _call(self, e: CallEnd) -> None:
        key = (e.at.scope, e.request_id)
        if e.outcome in _TERMINAL_OUTCOMES and key not in self._calls:
            return  # answered, and nothing was kept about it
        self._add(key, self._kept(e))
        if e.at.role != sc.ROLE_CLIENT:
            return
        if e.sdk_span_id is not None:
            early = self._early.pop(e.sdk_span_id, None)
            if early is not None:
                self._add(key, early)
        timeline = self._calls.get(key)
        if e.outcome in _TERMINAL_OUTCOMES and timeline is not None and timeline.refs == 1:
            self._release(self._calls.pop(key))  # delivered, no finding: nothing left to tell

    def _operation(self, e: Operation) -> None:
        """The caller's own request span: kept when it gave up or failed, the end the caller saw."""
        if e.role != sc.ROLE_CLIENT or e.method != "tools/call" or (e.error_type is None and not e.timed_out):
            return
        step = marshal.dumps(_give_up(e))
        key = self._sdk_span_call(e.span_id)
        if key is not None:
            if key in self._calls:  # else its story is over (answered) or was dropped for the budget
                self._add(key, step)
            return
        self._early[e.span_id] = step
        while len(self._early) > self.limits.max_index // 10:
            self._early.popitem(last=False)

    def _kept(self, e: StreamEnd | Replay | CallEnd) -> bytes:
        """What a timeline keeps of ``e``: its row (``_row``), written."""
        return marshal.dumps(_row(e, self.limits.max_items))

    # --- the maps, bounded ---

    def _add(self, key: Key, step: bytes) -> None:
        timeline = self._calls.get(key)
        if timeline is None:
            timeline = self._calls[key] = Timeline(self.limits.max_entries)
            timeline.refs = 1
            self.bytes += timeline.bytes
        else:
            self._calls.move_to_end(key)
        self.bytes += timeline.add(step)

    def _release(self, timeline: Timeline) -> None:
        timeline.refs -= 1
        if timeline.refs == 0:
            self.bytes -= timeline.bytes

    def _shrink(self) -> None:
        while self.bytes > self.limits.max_bytes and self._calls:
            self._release(self._calls.popitem(last=False)[1])
        while self.bytes > self.limits.max_bytes and self._findings:
            self._release(self._findings.popitem(last=False)[1])
            self.evicted += 1

    @staticmethod
    def _key(finding: Finding) -> Key:
        scope = finding.session_id or (f"trace:{finding.trace_ids[0]}" if finding.trace_ids else "")
        return scope, finding.request_id or SESSION_LEVEL
