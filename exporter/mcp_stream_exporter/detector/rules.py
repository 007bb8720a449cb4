"""The rules: the detector's vocabulary (docs/rules.md), applied to the ledger.

Each rule has a stable id, a severity, the eras it applies to, and the evidence it records. The
engine updates the ledger from each lifecycle event and emits a :class:`Finding` when a rule holds;
rules that need a grace period run from the ledger's timers on :meth:`RuleEngine.tick`.

One loss is one finding: a call has at most one finding of a loss rule; a second loss rule that holds
for the same call adds its evidence to that finding (``also``) instead of paging again. No rule infers
a loss from the absence of a span a sampler may drop: the SDK's spans only add counts and give-ups.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any

from mcp_stream_exporter import semconv as sc
from mcp_stream_exporter.detector.events import CallEnd, Common, Operation, Replay, StreamEnd, Token
from mcp_stream_exporter.detector.findings import Finding, finding_id
from mcp_stream_exporter.detector.ledger import CANCEL_LATE, CANCEL_RACED, CallState, Ledger, SessionState

CRITICAL = "critical"
WARNING = "warning"
_ALL = frozenset({sc.ERA_RESUMABLE, sc.ERA_STATELESS})
_LEGACY = frozenset({sc.ERA_RESUMABLE})
_MODERN = frozenset({sc.ERA_STATELESS})


class RuleId(StrEnum):
    """Every rule's stable id. The values are the ``rule`` label of the metrics, what alerts and
    docs/rules.md name: never change one."""

    CLEAN_END_PENDING = "clean_end_pending"
    NARROWED_RESUME = "narrowed_resume"
    REPLAY_TRUNCATED = "replay_truncated"
    CURSOR_PAST_UNDELIVERED = "cursor_past_undelivered"
    RESUME_LOOP = "resume_loop"
    SESSION_EXPIRED_IN_FLIGHT = "session_expired_in_flight"
    UNKNOWN_CURSOR = "unknown_cursor"
    CROSS_STREAM_REPLAY = "cross_stream_replay"
    FOREIGN_RESULT = "foreign_result"
    DUPLICATE_TERMINAL = "duplicate_terminal"
    TIMEOUT_ATTRIBUTED = "timeout_attributed"
    NOT_REISSUED = "not_reissued"
    STORED_NOT_DELIVERED = "stored_not_delivered"
    STORE_FAILED = "store_failed"
    SENT_NOT_RECEIVED = "sent_not_received"


@dataclass(frozen=True, slots=True)
class Rule:
    id: RuleId
    severity: str
    eras: frozenset[str]
    loss: bool  # a call's result never reached its caller (or a wrong one did): counted as a silent loss
    summary: str


RULES: dict[str, Rule] = {r.id: r for r in (
    Rule(RuleId.CLEAN_END_PENDING, CRITICAL, _ALL, True,
         "A stream ended cleanly while a call on it had no terminal event, and none arrived in the grace period."),
    Rule(RuleId.NARROWED_RESUME, WARNING, _LEGACY, False,
         "A resume's token lacks a resource (or scope) its pending call requires, and no error frame said so."),
    Rule(RuleId.REPLAY_TRUNCATED, CRITICAL, _LEGACY, False,
         "The server ended a replay cleanly before sending every buffered event, without an error frame."),
    Rule(RuleId.CURSOR_PAST_UNDELIVERED, CRITICAL, _LEGACY, False,
         "A replay skipped buffered events and sent later ones: the client's cursor moved past undelivered events."),
    Rule(RuleId.RESUME_LOOP, WARNING, _LEGACY, False,
         "A stream was resumed again and again from the same cursor without progress."),
    Rule(RuleId.SESSION_EXPIRED_IN_FLIGHT, WARNING, _LEGACY, True,
         "The session was gone (404) while a call on it was still owed its result."),
    Rule(RuleId.UNKNOWN_CURSOR, WARNING, _LEGACY, False,
         "A resume to an unknown or evicted event id was answered with an empty stream, not an error."),
    Rule(RuleId.CROSS_STREAM_REPLAY, CRITICAL, _LEGACY, False,
         "A replay sent events stored on another stream or session."),
    Rule(RuleId.FOREIGN_RESULT, CRITICAL, _LEGACY, True,
         "A stream delivered another call's result; the SDK client hands it to this stream's caller as its own."),
    Rule(RuleId.DUPLICATE_TERMINAL, WARNING, _ALL, False,
         "A call's terminal event was delivered more than once."),
    Rule(RuleId.TIMEOUT_ATTRIBUTED, WARNING, _ALL, False,
         "A client gave up on a call (timeout or cancel) after an earlier finding on it: that finding is the cause."),
    Rule(RuleId.NOT_REISSUED, CRITICAL, _MODERN, True,
         "2026-07-28: a response stream broke before the response and the client did not re-issue the call."),
    Rule(RuleId.STORED_NOT_DELIVERED, CRITICAL, _LEGACY, True,
         "The server stored a call's result with no stream open to carry it, and the client never received "
         "it within the grace period."),
    Rule(RuleId.STORE_FAILED, CRITICAL, _LEGACY, True,
         "The server's event store failed, so the server never sent the call's result: no terminal event "
         "reached the client within the grace period."),
    Rule(RuleId.SENT_NOT_RECEIVED, CRITICAL, _LEGACY, True,
         "The server sent the call's result on a stream its client had lost, and the client, which never got "
         "it, cancelled the call."),
)}


@dataclass(frozen=True, slots=True)
class RuleConfig:
    # keep above the server's close_sse_stream / polling interval and the client's reconnection delay (SSE
    # retry): also how long a result stored with no stream open has to reach the client (stored_not_delivered)
    clean_end_grace_s: float = 30.0
    reissue_grace_s: float = 30.0
    resume_loop_count: int = 5
    resume_loop_window_s: float = 60.0
    stuck_after_s: float = 900.0  # a call in flight that has not moved on this long since it was owed is stuck
    # a cancel that comes this soon after the server sent the call's result may have crossed it on the wire (its
    # caller gave up as it came): no loss (sent_not_received)
    cancel_race_s: float = 1.0


_TERMINAL_OUTCOMES = frozenset({sc.OUTCOME_RESULT, sc.OUTCOME_TOOL_ERROR, sc.OUTCOME_ERROR})
# a call span that ended so shows the call over, though not delivered: the SDK failed it to its caller, or it has
# no stream left to come on (no_terminal); the server accepted its client's cancel (cancelled)
_OVER_OUTCOMES = frozenset({sc.OUTCOME_NO_TERMINAL, sc.OUTCOME_CANCELLED})
# the losses of a result that never reached its caller: a delivery seen later says the page was wrong
_UNDELIVERED = frozenset({RuleId.CLEAN_END_PENDING, RuleId.STORED_NOT_DELIVERED, RuleId.SENT_NOT_RECEIVED,
                          RuleId.STORE_FAILED})
_STUCK_EVERY_NS = 10 * 1_000_000_000  # how often the stuck calls are counted: a walk of every call
_CLEAN_END = "clean_end"
_REISSUE = "reissue"
_STORED = "stored"
_EXPIRED = "expired"
_STORE_FAILED = "store_failed"
_SENT = "sent"  # the result went out and its client cancelled the call after, later than a race could explain
_NARROWED_OPEN = "narrowed_open"  # a narrowed resume still open: judged a grace later unless its end told first


class RuleEngine:
    def __init__(self, ledger: Ledger, config: RuleConfig, emit: Callable[[Finding, CallState | None], None],
                 lookup: Callable[[str], Finding | None], contradicted: Callable[[Finding], None]) -> None:
        self.ledger = ledger
        self.config = config
        self._emit_to = emit
        self._lookup = lookup
        self._contradicted = contradicted
        self._clean_end_grace_ns = _ns(config.clean_end_grace_s)
        self._reissue_grace_ns = _ns(config.reissue_grace_s)
        self._resume_loop_window_ns = _ns(config.resume_loop_window_s)
        self._stuck_after_ns = _ns(config.stuck_after_s)
        self._cancel_race_ns = _ns(config.cancel_race_s)
        self._stuck_counted_ns = 0  # when the stuck calls were last counted (every _STUCK_EVERY_NS)

    # --- events ---

    def stream(self, e: StreamEnd, now_ns: int) -> None:
        at = e.at
        session = self.ledger.session(at.scope, now_ns)
        single_tool = e.tool if len(e.request_ids) == 1 else None
        # what the pending calls require, as a union: a call's own only when the stream carries it alone (kept on
        # each of hundreds of calls, one span's union would be charged hundreds of times for one tuple)
        own_required = e.required if len(e.request_ids) <= 1 else ()
        expired = e.status == 404 and not session.deleted and not e.other_owner
        in_flight_before = [c for c in self.ledger.in_session(at.scope) if c.in_flight] if expired else ()
        session.expired = session.expired or expired
        if e.kind == sc.STREAM_KIND_RESUME and e.status is not None and 200 <= e.status < 300:
            self.ledger.answered(session, at.role, at.start_ns)  # the session still existed as this resume started
        if e.kind == sc.STREAM_KIND_DELETE and e.status is not None and 200 <= e.status < 300:
            # the client ended the session (a 2xx: a redirect, 307 for ``/mcp/``, ended nothing): its resumes and
            # notifications still on the way get 404 (the SDK client resumes on after its caller gave up), a call it
            # was owed keeps its own finding, and nothing it owes can come any more
            session.deleted = True
            for call in self.ledger.in_session(at.scope):
                self.ledger.given_up(call)
        calls: dict[str, CallState] = {}
        for rid in e.request_ids:
            calls[rid] = self._call(session, at, rid, now_ns, single_tool, own_required)
        for rid in e.pending_ids:
            if rid not in calls:  # most streams list their pending calls among their request ids
                calls[rid] = self._call(session, at, rid, now_ns, single_tool, own_required)
        for rid in e.terminal_ids:
            if rid not in calls and not e.request_ids:  # a stream its hooks tie to no call: what it carries may
                if not self._awaited(at.scope, rid):   # reach no caller
                    continue
                # a copy of a result delivered before: of the tool it names, if it names one (it delivers copies alone)
                calls[rid] = self._call(session, at, rid, now_ns, e.tool if rid in e.repeated_ids else None, ())
            if rid in calls:
                if rid in e.repeated_ids:  # its side saw it answered before, on a stream that left no span
                    calls[rid].delivered_to(at.role)
                self._delivered(calls[rid], at.role, e, now_ns, uncalled=(
                    not e.request_ids and e.kind == sc.STREAM_KIND_RESUME and rid not in e.repeated_ids))
        foreign = [t for t in e.terminal_ids if t not in calls] if e.terminal_ids else ()
        # its own result came first (a list short of full is in the order they came; a full one, its own first):
        # the SDK client took that and read no further, and another call's after it reached no caller
        if foreign and len(e.request_ids) == 1 and e.terminal_ids[0] == e.request_ids[0] and (
                len(e.terminal_ids) < sc.MAX_ITEMS):
            foreign = []
        if foreign and e.request_ids and at.era == sc.ERA_RESUMABLE:
            for rid in e.request_ids:
                self._emit(RuleId.FOREIGN_RESULT, calls[rid], at, rid, now_ns, lambda: {
                    "stream_kind": e.kind, "wire_ids": foreign, "stream_request_ids": list(e.request_ids),
                    "event_ids": _event_ids(e)})
        if e.request_ids and at.era == sc.ERA_RESUMABLE:
            for event_id in (e.cursor, e.last_event_id):
                if event_id is not None:
                    self.ledger.note_cursor(session, event_id, e.request_ids)
        progressed = bool(e.terminal_ids) or (e.last_event_id is not None and e.last_event_id != e.cursor)
        if progressed and e.kind == sc.STREAM_KIND_RESUME:  # a POST ends before any other stream of its calls
            for call in calls.values():
                if not call.terminal:  # it moved: the silent-loss clock starts again at its next clean end
                    call.progressed(at.role, at.end_ns, e.cursor)
                    self.ledger.alive(call, now_ns)
        running = e.running_ids if at.role == sc.ROLE_SERVER else ()
        for rid in e.pending_ids:
            self._owed(calls[rid], session, e, now_ns, rid in running)
        if e.kind == sc.STREAM_KIND_RESUME:
            if session.resumes is None:
                session.resumes = {}
            self._resume(e, session, calls, progressed, now_ns)
        for call in in_flight_before:  # judged a grace later: its delivery, or its client's DELETE, may come after
            self.ledger.schedule(now_ns + self._clean_end_grace_ns, _EXPIRED, call)

    def call(self, e: CallEnd, now_ns: int) -> None:
        at = e.at
        if e.outcome == sc.OUTCOME_REISSUED:  # a re-issue's start, told at once: an issue, in whichever trace (the
            if at.role == sc.ROLE_CLIENT and e.tool is not None:  # broken call's, where the hooks put it)
                self.ledger.issued(at.origin, _call_key(e.tool, e.fingerprint), at.start_ns)
            return
        call = self._call(self.ledger.session(at.scope, now_ns), at, e.request_id, now_ns, e.tool, e.required)
        if at.role == sc.ROLE_CLIENT:
            if e.sdk_span_id is not None and self.ledger.link_sdk_span(e.sdk_span_id, call):
                self._timed_out(call, now_ns)  # its caller's timeout, told by the SDK's span that came first
            call.fingerprint = call.fingerprint or e.fingerprint
            if call.tool is not None:
                self.ledger.issued(at.origin, _call_key(call.tool, e.fingerprint), at.start_ns)
        if at.role == sc.ROLE_SERVER and call.server_answered():
            self._answered_after_running(call, e.outcome, now_ns)
        if e.stored_only:
            self._stored(call, at.end_ns, e.terminal_event_id, now_ns)
        elif e.outcome in _TERMINAL_OUTCOMES:
            self.ledger.delivered(call)
            self._delivered_late(call, at.role, now_ns)
        elif e.outcome == sc.OUTCOME_STORE_FAILED and at.role == sc.ROLE_SERVER and at.session_id is not None:
            self._store_failed(call, at.role, now_ns)  # only a server's store fails, and only a session's
        elif e.outcome == sc.OUTCOME_CANCELLED_LATE and at.role == sc.ROLE_SERVER and at.session_id is not None:
            self._cancelled_late(call, at, e.terminal_event_id, now_ns)
        elif e.outcome == sc.OUTCOME_CANCELLED and at.role == sc.ROLE_CLIENT:
            self._timed_out(call, now_ns)
        elif e.outcome in _OVER_OUTCOMES:
            self.ledger.given_up(call)  # over, but no give-up of its client's: nothing for a finding to explain
            if e.outcome == sc.OUTCOME_NO_TERMINAL and at.role == sc.ROLE_CLIENT:
                self._broken(call, at.end_ns, now_ns)

    def replay(self, e: Replay, now_ns: int) -> None:
        at = e.at
        session = self.ledger.session(at.scope, now_ns)
        subject = e.request_id or f"cursor:{e.cursor}"
        call = self._call(session, at, e.request_id, now_ns, None, e.required) if e.request_id else None

        def evidence() -> dict[str, Any]:
            return {"cursor": e.cursor, "buffered": e.buffered, "sent": e.sent, "decision": e.decision}

        if e.skipped and e.decision in (sc.REPLAY_TRUNCATED, sc.REPLAY_INTERRUPTED):  # cut short after it skipped
            self._emit(RuleId.CURSOR_PAST_UNDELIVERED, call, at, subject, now_ns, lambda: {
                **evidence(), "skipped": e.skipped, "first_undelivered_event_id": e.offending_event_id,
                "cursor_after": e.sent_last_id})
        elif e.decision == sc.REPLAY_TRUNCATED:
            self._emit(RuleId.REPLAY_TRUNCATED, call, at, subject, now_ns, lambda: {
                **evidence(), "offending_event_id": e.offending_event_id, **_gap(e.token, e.required)})
        explicit = e.decision == sc.REPLAY_REFUSED or e.guard_decision in (sc.GUARD_REFUSE, sc.GUARD_UNKNOWN_CURSOR)
        if call is not None:
            self.ledger.resumed(call, at.role, explicit, at.start_ns, at.end_ns)
        if e.token.gap and not explicit:
            self._emit(RuleId.NARROWED_RESUME, call, at, subject, now_ns,
                       lambda: {**evidence(), **_gap(e.token, e.required)})
        if e.decision == sc.REPLAY_UNKNOWN_CURSOR and not explicit and e.sent == 0:
            # the cursor's, not a call's: the server's hooks know no call of a cursor unknown to them, and which stream
            # ended there the other side's spans may tell only later (a finding per call would then depend on the order)
            self._emit(RuleId.UNKNOWN_CURSOR, None, at, f"cursor:{e.cursor}", now_ns, evidence)
        if e.foreign_event_ids:
            self._emit(RuleId.CROSS_STREAM_REPLAY, call, at, subject, now_ns, lambda: {
                **evidence(), "foreign_event_ids": list(e.foreign_event_ids)})

    def operation(self, e: Operation, now_ns: int) -> None:
        if e.role != sc.ROLE_CLIENT or e.method != "tools/call":
            return
        if e.timed_out:
            call = self.ledger.call_of_sdk_span(e.span_id)
            if call is not None:
                self._timed_out(call, now_ns)
            else:
                self.ledger.timed_out_early(e.span_id)

    def tick(self, now_ns: int) -> None:
        """Grace periods that have run out: silent losses, calls never re-issued; idle sessions."""
        for what, call in self.ledger.due(now_ns):
            if what == _CLEAN_END:
                self._check_clean_end(call, now_ns)
            elif what == _REISSUE:
                self._check_reissue(call, now_ns)
            elif what == _STORED:
                self._check_stored(call, now_ns)
            elif what == _EXPIRED:
                self._check_expired(call, now_ns)
            elif what == _STORE_FAILED:
                self._check_store_failed(call, now_ns)
            elif what == _SENT:
                self._check_sent(call, now_ns)
            elif what == _NARROWED_OPEN:
                self._check_open_narrowed(call, now_ns)
        self.ledger.expire(now_ns)
        if now_ns - self._stuck_counted_ns >= _STUCK_EVERY_NS:
            self._stuck_counted_ns = now_ns
            self.ledger.count_stuck(now_ns, self._stuck_after_ns)

    # --- the ledger, updated ---

    def _call(self, session: SessionState, at: Common, request_id: str, now_ns: int, tool: str | None,
              required: tuple[str, ...]) -> CallState:
        """``request_id``'s call in ``session`` (the session of ``at``, already touched), told what ``at`` says."""
        call = self.ledger.call(session, request_id, now_ns)
        call.era = at.era
        if call.tool is None and tool is not None:
            call.tool = tool
            for finding_id in (call.findings or {}).values():  # raised off a span that did not name it (a replay)
                finding = self._lookup(finding_id)
                if finding is not None and finding.tool is None:
                    finding.tool = tool
        call.required = call.required or required
        call.origin = call.origin or (at.origin if at.role == sc.ROLE_CLIENT else "")
        call.note_span(at.trace_id, at.span_id)
        return call

    def _awaited(self, scope: str, request_id: str) -> bool:
        """Whether what a stream its hooks tie to no call delivers is the call's end: one that knew not what it
        carried (another replica answered it from shared storage; a client process resuming a stream its
        predecessor opened, from a saved cursor). Not once the server saw the client cancel the call well after its
        result was out (``CANCEL_LATE``): this is the SDK resuming on for no caller, which drops the result (its hooks
        no longer tie the resume to the call). Told by nothing else, which it may be (a result that came after its
        caller gave up, to a client that sends no cancel; a call withdrawn before any result, whose answer to the
        cancel, a -32800 error, comes so), it is the call's end."""
        known = self.ledger.find(scope, request_id)
        return known is None or known.late_cancel != CANCEL_LATE

    def _delivered(self, call: CallState, role: str, e: StreamEnd, now_ns: int, *, uncalled: bool = False) -> None:
        """``uncalled``: the first delivery of the call's end on a resume its hooks tie to no call (``_awaited``),
        which reached a caller unless the server saw its client cancel the call well after the result was out (the
        SDK resuming on for no caller), a span that may come after it: so it is no delivery its client saw
        (``CallState.reached_caller`` weighs it as the server's, once the spans are in), and says no page was wrong
        (the cancels that would say its caller was gone may come after it)."""
        self.ledger.delivered(call)
        if uncalled and role == sc.ROLE_CLIENT:
            return
        self._delivered_late(call, role, now_ns)
        # the server replaying to a resume what it had sent before is the recovery, not a duplicate: that send
        # reached no one (a connection its client lost), or the client would not resume; the client's spans tell one
        if role == sc.ROLE_SERVER and e.kind == sc.STREAM_KIND_RESUME:
            return
        deliveries = call.delivered_to(role)
        if deliveries > 1:
            self._emit(RuleId.DUPLICATE_TERMINAL, call, e.at, call.request_id, now_ns, lambda: {
                "deliveries": deliveries, "stream_kind": e.kind, "event_ids": _event_ids(e)})

    def _delivered_late(self, call: CallState, role: str, now_ns: int) -> None:
        """The client's spans show a call paged lost delivered while its caller still waited, as far as the spans
        come by then tell: the page was wrong, the spans that would have held it back having come past the grace (a
        page is final). Said on the finding (``delivered_after``, the detector's clock) and counted, once."""
        if role != sc.ROLE_CLIENT or call.findings is None or call.timed_out:
            return
        loss = self._loss_finding(call)
        if loss is None or loss.rule not in _UNDELIVERED or "delivered_after" in loss.evidence:
            return
        loss.evidence["delivered_after"] = now_ns / 1e9
        self._contradicted(loss)

    def _owed(self, call: CallState, session: SessionState, e: StreamEnd, now_ns: int, running: bool) -> None:
        if e.reason == sc.END_TERMINATED:  # its client deleted the session: nothing can deliver it any more
            if e.kind == sc.STREAM_KIND_POST:
                call.post_terminated()
            self.ledger.given_up(call)
            return
        if e.reason not in (sc.END_CLEAN, sc.END_DROPPED):
            return  # an HTTP error is loud; a stream the client closed was its own decision
        # an error frame is the explicit answer, but to a client that read on past it to the stream's end (no resolver
        # failed the call at it: the SDK drops the frame), whose caller it told nothing; and nothing was lost at an end
        # the server saw while its tool had not answered yet (``running``: the SDK ends a resume that replayed all there
        # was while the call's POST is still open on the server, as it is when a proxy lost only the client's side)
        silent = (e.reason == sc.END_CLEAN and (not e.error_frames or e.at.role == sc.ROLE_CLIENT)
                  and not running)
        self._seen_owed(call, e.at.role)
        self.ledger.owed(call, now_ns, e.at.role)
        if running:
            call.server_running()
            self.ledger.alive(call, now_ns)
        if session.deleted:  # its client ended the session (spans in any order): nothing can deliver it any more
            self.ledger.given_up(call)
        elif session.expired:  # its 404 came first (spans in any order): judged as gone with it
            self.ledger.schedule(now_ns + self._clean_end_grace_ns, _EXPIRED, call)
        stopped_at = e.last_event_id if e.last_event_id is not None else e.cursor
        if silent and not call.terminal and call.ended_clean(e.at.role, e.at.end_ns, now_ns, stopped_at,
                                                             e.kind == sc.STREAM_KIND_POST):
            self.ledger.schedule(now_ns + self._clean_end_grace_ns, _CLEAN_END, call)
        if e.at.era == sc.ERA_STATELESS or (e.kind == sc.STREAM_KIND_POST and e.last_event_id is None):
            # nothing can resume it: that era has no resumption, and a POST that gave no event id left the client
            # no cursor (the SDK fails the call to its caller at once). Its loss, if any, is still judged
            self.ledger.given_up(call)
        if e.at.era == sc.ERA_STATELESS and e.at.role == sc.ROLE_CLIENT:
            if e.fingerprint is not None and len(e.pending_ids) == 1 and len(e.request_ids) <= 1:
                call.fingerprint = call.fingerprint or e.fingerprint  # its call span's may never come (a lost batch)
            self._broken(call, e.at.end_ns, now_ns)

    def _stored(self, call: CallState, at_ns: int, event_id: str | None, now_ns: int) -> None:
        """The server stored the call's terminal event with no stream open: the client must resume to get it. Also
        after a late cancel's span told when it went out (spans in any order): this is the cause, judged first."""
        if call.stored_since is None:
            call.stored_since = at_ns
        if call.stored_event_id is None:
            call.stored_event_id = event_id
        if not call.finding(RuleId.STORED_NOT_DELIVERED):
            self.ledger.schedule(now_ns + self._clean_end_grace_ns, _STORED, call)

    def _store_failed(self, call: CallState, role: str, now_ns: int) -> None:
        """The server's store failed with the call's result unsent: nothing will send it (the SDK stops sending the
        session's messages), so the call is over; lost unless a delivery of it shows up within the grace."""
        self._seen_owed(call, role)
        self.ledger.given_up(call)
        self.ledger.schedule(now_ns + self._clean_end_grace_ns, _STORE_FAILED, call)

    def _cancelled_late(self, call: CallState, at: Common, event_id: str | None, now_ns: int) -> None:
        """The server sent the call's result (at ``at.start_ns``) and its client cancelled the call after (at
        ``at.end_ns``): the client never got it; or, when sooner than ``cancel_race_s`` after (a setting above the
        round trip between them), its caller gave up as the result came (a tool that ran about as long as its caller
        waits): a cancel that crossed the result on the wire. Over either way; a loss judged a grace later, when a
        delivery the client's spans show, if any, has come."""
        self._seen_owed(call, at.role)
        self.ledger.given_up(call)
        if call.stored_since is None:
            call.stored_since, call.stored_event_id = at.start_ns, event_id
        raced = at.end_ns - at.start_ns < self._cancel_race_ns
        call.cancel_seen_late(raced)
        if not raced:
            self.ledger.schedule(now_ns + self._clean_end_grace_ns, _SENT, call)

    def _seen_owed(self, call: CallState, role: str) -> None:
        """``role``'s spans show the call owed its result (``Ledger.seen_owed``): a side of its loss finding too, when
        that was raised before these spans came (a side's exporter later than the grace)."""
        if role not in call.roles and call.findings is not None:
            loss = self._loss_finding(call)
            if loss is not None and role not in loss.roles:
                loss.roles.append(role)
        self.ledger.seen_owed(call, role)

    def _broken(self, call: CallState, at_ns: int, now_ns: int) -> None:
        """The client's spans show the call's only stream broke, at ``at_ns`` (its clock): the earliest such end of
        its spans, whichever came first, is the break a re-issue comes after (a producer may end the call's span as
        the error reaches its caller, who re-issues at once, and its stream's span after)."""
        if call.terminal:
            return
        self._seen_owed(call, sc.ROLE_CLIENT)  # its finding's side, if the break is told by its call span alone
        if call.broken_since is None:
            call.broken_since = at_ns
            self.ledger.schedule(now_ns + self._reissue_grace_ns, _REISSUE, call)
        elif at_ns < call.broken_since:
            call.broken_since = at_ns

    def _resume(self, e: StreamEnd, session: SessionState, calls: dict[str, CallState],
                progressed: bool, now_ns: int) -> None:
        at = e.at
        resumes = session.resumes
        assert resumes is not None
        explicit = e.error_frames > 0  # the server said why (the guard): not silent
        if e.reason not in (sc.END_OPEN, sc.END_HTTP_ERROR):  # one still open ends later; an HTTP error tells
            # a refusal its client read on past to the stream's end: no resolver failed the call at its error frame
            # (the SDK drops the frame and resumes again until its caller's timeout), and its caller is told nothing
            unheeded = explicit and at.role == sc.ROLE_CLIENT and e.reason == sc.END_CLEAN
            for rid in e.pending_ids or e.request_ids:
                self.ledger.resumed(calls[rid], at.role, explicit, at.start_ns, at.end_ns, unheeded)
        # an HTTP error tells and carries nothing; a stream cut before anything came says nothing of what the server
        # answered (the guard's error frame may have been its first)
        narrowed = (e.token.gap and not explicit and e.reason != sc.END_HTTP_ERROR
                    and (e.events or e.reason != sc.END_DROPPED))
        for rid in e.pending_ids or e.request_ids:
            call = calls[rid]
            if e.reason == sc.END_OPEN:
                # one still open may yet be refused with an error frame (the guard's prefix policy sends what the
                # token covers first): judged at its end, or a grace from now if it has not ended by then (a resume
                # the SDK keeps open for no caller, or whose end is never told); not once that end came (spans in
                # any order): refused, or judged
                if narrowed and not call.finding(RuleId.NARROWED_RESUME) and not _refused(call, at):
                    due = now_ns + self._clean_end_grace_ns
                    self.ledger.hold_open_narrowed(call, at.role, at.start_ns, due, _narrowed_evidence(e, call),
                                                   asdict(at), _other_refused(call, at.role))
                    self.ledger.schedule(due, _NARROWED_OPEN, call)
                continue
            if narrowed:
                self._emit(RuleId.NARROWED_RESUME, call, at, rid, now_ns,
                           lambda: _narrowed_evidence(e, call))  # noqa: B023 (called at once)
        if e.reason != sc.END_OPEN:  # its span so far, held, let go of: every call it named, pending or not by now
            named = {*e.pending_ids, *e.request_ids, *e.terminal_ids}
            for rid in named:
                self.ledger.ended_open_narrowed(at.scope, rid, at.role, at.start_ns)
            if not named:  # its caller gave up meanwhile
                self.ledger.ended_open_narrowed(at.scope, None, at.role, at.start_ns, explicit)
        if e.cursor is None or progressed:
            return
        window = self.ledger.resume_window(session, (at.role, e.cursor), self.config.resume_loop_count)
        window.append(at.end_ns)
        horizon = at.end_ns - self._resume_loop_window_ns
        if len(window) >= self.config.resume_loop_count and window[0] >= horizon:
            # a resume the hooks no longer tie to a call (its caller gave up, the SDK resumes on) is still that
            # call's: the calls of the stream that ended at this cursor
            known = e.request_ids or self.ledger.cursor_calls(session, e.cursor)
            for rid in known or (f"cursor:{e.cursor}",):
                self._emit(RuleId.RESUME_LOOP, calls.get(rid) or self.ledger.find(at.scope, rid), at, rid, now_ns,
                           lambda: {"cursor": e.cursor, "resumes": len(window),
                                    "window_s": (at.end_ns - window[0]) / 1e9})

    def _check_open_narrowed(self, call: CallState, now_ns: int) -> None:
        """A grace after a narrowed resume's span so far: one that has not ended since, nor been refused, is judged
        on what it showed."""
        due, later = self.ledger.due_open_narrowed(call, now_ns)
        for _, _, _, evidence, common, other_before in due:
            at = Common(**common)
            if not call.finding(RuleId.NARROWED_RESUME) and not _refused(call, at, other_before):
                self._emit(RuleId.NARROWED_RESUME, call, at, call.request_id, now_ns,
                           lambda: evidence)  # noqa: B023 (called at once)
        if later is not None:
            self.ledger.schedule(later, _NARROWED_OPEN, call)

    def _timed_out(self, call: CallState, now_ns: int) -> None:
        call.client_gave_up()
        self.ledger.given_up(call)
        self._attribute(call, now_ns)

    def _attribute(self, call: CallState, now_ns: int) -> None:
        """A client that gave up on a call with a finding: link the give-up to its cause."""
        if not call.cancelled or call.findings is None or RuleId.TIMEOUT_ATTRIBUTED in call.findings:
            return
        causes = [fid for rule, fid in call.findings.items() if rule != RuleId.TIMEOUT_ATTRIBUTED]
        if not causes:
            return
        finding = self._finding(RuleId.TIMEOUT_ATTRIBUTED, call, call.era, None, call.request_id, now_ns,
                                {"causes": causes})
        finding.caused_by = causes[0]
        self._record(finding, call)

    def _answered_after_running(self, call: CallState, outcome: str, now_ns: int) -> None:
        """The server, whose latest word was that the call's tool had not answered (``running``), told of its end.
        Cancelled with no result: its caller gave up before there was one, and no clean end lost anything. Else a
        result exists from now: a clean end still unanswered is judged a grace from now, the time the client has
        to resume for it."""
        if outcome == sc.OUTCOME_CANCELLED:
            call.clean_since = call.clean_seen = None
        elif call.clean_seen is not None and not call.terminal:
            call.clean_seen = (call.clean_seen[0], now_ns, *call.clean_seen[2:])
            self.ledger.schedule(now_ns + self._clean_end_grace_ns, _CLEAN_END, call)

    def _check_clean_end(self, call: CallState, now_ns: int) -> None:
        if (call.reached_caller or call.clean_since is None or call.finding(RuleId.CLEAN_END_PENDING) or call.told
                or (call.closed_by_delete and not self._alive_after_clean_end(call))):
            return
        if call.running:  # the server's latest word: its tool had not answered, so nothing was lost yet; judged
            return  # again once the server tells of its result (``_answered_after_running``)
        if self.ledger.waiting(call, _EXPIRED) and not self._alive_after_clean_end(call):
            return  # its session went first: that judges it (``_check_expired``)
        if self.ledger.waiting(call, _STORE_FAILED):
            return  # the store's failure is the cause: that judges it first (``_check_store_failed``)
        if call.era == sc.ERA_STATELESS and call.broken_since is not None:
            return  # the SDK told its caller the stream broke: whether it is lost is not_reissued's to say
        due = self._clean_end_due(call)
        if now_ns < due:
            self.ledger.schedule(due, _CLEAN_END, call)
            return
        clean_since = call.clean_since
        self._emit(RuleId.CLEAN_END_PENDING, call, None, call.request_id, now_ns, lambda: {
            "clean_end_at": clean_since / 1e9, "grace_s": self.config.clean_end_grace_s,
            "required": list(call.required), "timed_out": call.timed_out})

    def _clean_end_due(self, call: CallState) -> int:
        """When a clean end's grace runs out: counted on the detector's clock from when it learned of the end,
        so a producer's clock, ahead or behind, neither delays the page nor lets the session expire first."""
        seen = call.clean_seen[1] if call.clean_seen is not None else call.clean_since  # a snapshot's call
        assert seen is not None
        return seen + self._clean_end_grace_ns

    def _check_stored(self, call: CallState, now_ns: int) -> None:
        if call.reached_caller or call.stored_since is None or call.told or call.late_cancel == CANCEL_RACED:
            return
        if call.clean_since is not None and not call.finding(RuleId.CLEAN_END_PENDING):
            # a clean end left it pending too: that is the finding (this one joins it), whichever clock ran out first
            due = self._clean_end_due(call)
            if now_ns < due:
                self.ledger.schedule(due, _STORED, call)
                return
            self._check_clean_end(call, now_ns)
        stored_since = call.stored_since
        self._emit(RuleId.STORED_NOT_DELIVERED, call, None, call.request_id, now_ns, lambda: {
            "stored_at": stored_since / 1e9, "stored_event_id": call.stored_event_id,
            "grace_s": self.config.clean_end_grace_s, "timed_out": call.timed_out})
        if call.late_cancel == CANCEL_LATE:  # held back for this judgement (it joins it)
            self._check_sent(call, now_ns)

    def _check_store_failed(self, call: CallState, now_ns: int) -> None:
        """The server's store failed with the call's result unsent; not delivered a grace later (another producer
        may still send it), nor its caller told by a refused resume: lost. A clean end that left it pending too
        is judged after (it joins this finding, ``also``)."""
        if not call.reached_caller and not call.told:
            self._emit(RuleId.STORE_FAILED, call, None, call.request_id, now_ns, lambda: {
                "grace_s": self.config.clean_end_grace_s, "timed_out": call.cancelled})
        self._check_clean_end(call, now_ns)  # held back for this judgement

    def _check_sent(self, call: CallState, now_ns: int) -> None:
        """A call the server sent the result of and its client cancelled well after: lost unless the client's spans
        show it got it, or its caller was told (a refused resume)."""
        if call.client_deliveries or call.told:  # not what the server saw delivered: its client gave up on it
            return
        if self.ledger.waiting(call, _STORED):  # stored with no stream open: that is the cause, judged first
            return
        stored_since = call.stored_since or 0
        self._emit(RuleId.SENT_NOT_RECEIVED, call, None, call.request_id, now_ns, lambda: {
            "sent_at": stored_since / 1e9, "sent_event_id": call.stored_event_id,
            "grace_s": self.config.clean_end_grace_s})

    def _check_expired(self, call: CallState, now_ns: int) -> None:
        """A request on its session got 404 while it was owed; not delivered a grace later, with no DELETE of its
        client's seen (spans come in any order): it went with the session, which nothing can deliver it from (a
        caller that gave up since was failed by that); not once its caller was told (a refused resume it heeded: a
        replica answering for a session whose owner died). Unless a clean end lost it while the session lived: a resume
        of it answered after that end (``_alive_after_clean_end``) makes the clean end the finding, judged first
        (this one joins it)."""
        if self.ledger.waiting(call, _STORE_FAILED):
            return  # its session's store failed (spans in any order): the cause, judged by ``_check_store_failed``
        if not call.reached_caller and call.clean_since is not None and self._alive_after_clean_end(call):
            due = self._clean_end_due(call)
            if now_ns < due:  # the expiry's grace ran out first: both are judged once the clean end's does
                self.ledger.schedule(due, _EXPIRED, call)
                return
            self._check_clean_end(call, now_ns)
        if not call.reached_caller and not call.told and not self.ledger.deleted(call.scope):
            self._emit(RuleId.SESSION_EXPIRED_IN_FLIGHT, call, None, call.request_id, now_ns, lambda: {
                "status": 404, "owed_seen_at": (call.owed_since or 0) / 1e9})
            self.ledger.given_up(call)
        self._check_clean_end(call, now_ns)  # held back for this judgement (its caller told: no silent loss then)

    def _alive_after_clean_end(self, call: CallState) -> bool:
        """Whether a resume of its session that started after the clean end that left it pending was answered
        (2xx), by that end's side's clock (spans in any order: judged when a grace runs out): the session still
        existed, so that end was no session going away (a restart, an idle expiry ends its streams cleanly first),
        and a 404 after is no reason its result was lost."""
        return call.ended_before(self.ledger.answered_at(call.scope))

    def _check_reissue(self, call: CallState, now_ns: int) -> None:
        """Only a call span of the same client process with the same tool and arguments fingerprint is
        a re-issue; the hooks always record one (docs/span-model.md), so its absence is meaningful. A re-issue
        answers one broken call: two calls broken alike and sent again once are one loss."""
        if call.terminal or call.broken_since is None or call.tool is None or call.era != sc.ERA_STATELESS:
            return
        if self.ledger.take_reissue(call.origin, _call_key(call.tool, call.fingerprint), call.broken_since):
            return
        broken_since = call.broken_since
        self._emit(RuleId.NOT_REISSUED, call, None, call.request_id, now_ns, lambda: {
            "broken_at": broken_since / 1e9, "grace_s": self.config.reissue_grace_s})

    # --- findings ---

    def _emit(self, rule: RuleId, call: CallState | None, at: Common | None, subject: str, now_ns: int,
              evidence: Callable[[], dict[str, Any]]) -> None:
        """Raise ``rule`` on ``call`` (or join what the call already has); ``evidence`` is built only
        when it is used: most resumes and replays of a call repeat a finding already raised."""
        era = at.era if at is not None else (call.era if call is not None else sc.ERA_RESUMABLE)
        if era not in RULES[rule].eras:
            return
        findings = call.findings if call is not None else None  # call.finding(rule), inlined: a call per event
        known = findings.get(rule) if findings is not None else None
        if known is not None:  # seen already (a resume loop, the other side): at most a role to add
            existing = self._lookup(known)
            if existing is not None and at is not None and at.role not in existing.roles:
                existing.roles.append(at.role)
            return
        loss = self._loss_finding(call) if RULES[rule].loss else None
        if loss is not None:  # one loss, one finding: this rule's view joins the call's loss finding
            also = loss.evidence.setdefault("also", [])
            if rule not in also:
                also.append(rule)
            for key, value in evidence().items():
                loss.evidence.setdefault(key, value)
            if at is not None and at.role not in loss.roles:
                loss.roles.append(at.role)
            return
        self._record(self._finding(rule, call, era, at, subject, now_ns, evidence()), call)

    def _loss_finding(self, call: CallState | None) -> Finding | None:
        """The call's finding of a loss rule, if it has one."""
        if call is None or call.findings is None:
            return None
        for rule, fid in call.findings.items():
            if RULES[rule].loss:
                return self._lookup(fid)
        return None

    def _finding(self, rule: RuleId, call: CallState | None, era: str, at: Common | None, subject: str,
                 now_ns: int, evidence: dict[str, Any]) -> Finding:
        scope = at.scope if at is not None else (call.scope if call is not None else "")
        session_id = scope if not scope.startswith("trace:") else None
        spec = RULES[rule]
        trace_ids = [t for t in (at.trace_id if at else None, call.trace_id if call else None) if t]
        span_ids = ([at.span_id] if at else []) + (list(call.span_ids) if call else [])
        roles = [at.role] if at is not None else sorted(call.roles) if call is not None else []
        return Finding(
            id=finding_id(rule, scope, subject), rule=rule, severity=spec.severity, era=era,
            tool=call.tool if call is not None else None, session_id=session_id,
            request_id=call.request_id if call is not None else None, detected_ns=now_ns, summary=spec.summary,
            roles=roles, evidence=evidence, trace_ids=_unique(trace_ids),
            span_ids=_unique(span_ids))

    def _record(self, finding: Finding, call: CallState | None) -> None:
        if call is not None:
            call.add_finding(finding.rule, finding.id)
        self._emit_to(finding, call)
        if call is not None and finding.rule != RuleId.TIMEOUT_ATTRIBUTED:
            self._attribute(call, finding.detected_ns)


def _call_key(tool: str, fingerprint: str | None) -> str:
    """What a re-issue must repeat: the tool and, when the producer records it, the arguments fingerprint."""
    return f"{tool}#{fingerprint or ''}"


def _narrowed_evidence(e: StreamEnd, call: CallState) -> dict[str, Any]:
    return {"cursor": e.cursor, **_gap(e.token, e.required or call.required), "events": e.events,
            "end_reason": e.reason}


def _refused(call: CallState, at: Common, other_before: int | None = None) -> bool:
    """Whether the resume ``at`` is a span of was refused explicitly, as far as can be told: a resume of ``call``
    that ``at``'s side saw start no earlier was; or, told after ``other_before`` (the other side's latest refusal as
    ``at`` was held), one the other side saw (its clock is not compared with ``at``'s)."""
    refused_client, _, refused_server, _ = call.resumed
    own, other = (refused_client, refused_server) if at.role == sc.ROLE_CLIENT else (refused_server, refused_client)
    return own >= at.start_ns or (other_before is not None and other > other_before)


def _other_refused(call: CallState, role: str) -> int:
    """The start of the latest resume of ``call`` the side other than ``role`` saw refused (by its clock)."""
    return call.resumed[2] if role == sc.ROLE_CLIENT else call.resumed[0]


def _gap(token: Token, required: Iterable[str]) -> dict[str, Any]:
    return {"audience_held": list(token.audience), "required": list(required),
            "missing_resources": list(token.missing_resources), "missing_scopes": list(token.missing_scopes),
            "token_fingerprint": token.fingerprint}


def _event_ids(e: StreamEnd) -> dict[str, str | None]:
    return {"first": e.first_event_id, "last": e.last_event_id, "cursor": e.cursor}


def _unique(values: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(values))


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)
