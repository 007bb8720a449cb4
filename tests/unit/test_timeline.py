"""Per-call timelines: a finding keeps its call's story, and every bound holds (entries, strings, lists, bytes,
findings)."""

from __future__ import annotations

from mcp_stream_exporter import semconv as sc
from mcp_stream_exporter.detector import Detector, DetectorConfig, Finding, RuleConfig, Span, sizes
from mcp_stream_exporter.detector.events import lifecycle
from mcp_stream_exporter.detector.ingest import IngestLimits, IngestQueue
from mcp_stream_exporter.detector.timeline import TimelineLimits, Timelines

from spans import FETCH, SEARCH, S, call, replay, sdk_call, stream

C, SV = sc.ROLE_CLIENT, sc.ROLE_SERVER


class Clock:
    def __init__(self) -> None:
        self.now = 100 * S

    def __call__(self) -> int:
        return self.now


def _incident(session: str = "s1") -> list[Span]:
    """The incident's spans for request 3 (fetch): POST dropped, a narrowed resume ending clean, the
    truncated replay, the caller's timeout and its call span."""
    sdk = sdk_call(C, "fetch", at=0.5, timed_out=True, span_id="00000000000000aa")
    return [
        stream(C, "post", "dropped", at=1.0, session=session, pending=("3",), first="4", last="6", events=2),
        stream(C, "resume", "clean", at=1.2, session=session, pending=("3",), cursor="6", audience=(SEARCH,),
               missing=(FETCH,)),
        replay(sc.REPLAY_TRUNCATED, at=1.21, session=session, cursor="6", missing=(FETCH,)),
        sdk,
        call(C, sc.OUTCOME_CANCELLED, at=3.0, session=session, parent=sdk.span_id),
    ]


def _run(spans: list[Span], detector: Detector | None = None, after_s: float = 10) -> Detector:
    clock = Clock()
    detector = detector or Detector(DetectorConfig(rules=RuleConfig(clean_end_grace_s=5)), clock=clock)
    detector.clock = clock
    for span in spans:
        detector.consume([span])
        clock.now += S // 10
    clock.now += int(after_s * S)
    detector.tick()
    return detector


def _finding(detector: Detector, rule: str) -> Finding:
    return next(f for f in detector.findings if f.rule == rule)


def test_a_lost_call_s_findings_keep_its_story_from_the_post_to_the_caller_s_timeout():
    detector = _run(_incident())
    lost = _finding(detector, "clean_end_pending")
    timeline = detector.timelines.of(lost)
    assert timeline is not None
    steps = [(e.role, e.step) for e in timeline.entries()]
    assert steps == [(C, "timeout"), (C, "post"), (C, "resume"), (SV, "replay"), (C, "call")]  # by start time
    post, resume, replay_entry = timeline.entries()[1:4]
    assert (post.reason, post.first_event_id, post.last_event_id, post.pending) == ("dropped", "4", "6", ("3",))
    assert (resume.cursor, resume.audience, resume.missing_resources, resume.error_frames) == (
        "6", (SEARCH,), (FETCH,), 0)
    assert (replay_entry.decision, replay_entry.buffered, replay_entry.sent) == (sc.REPLAY_TRUNCATED, 4, 0)
    assert timeline.entries()[0].error_type == "timeout"
    narrowed = _finding(detector, "narrowed_resume")
    assert detector.timelines.of(narrowed) is timeline  # one call, one story, shared by its findings


def test_the_caller_s_timeout_is_placed_whether_its_span_ends_before_or_after_the_call_span():
    spans = _incident()
    sdk, call_span = spans[3], spans[4]
    for order in ([*spans[:3], sdk, call_span], [*spans[:3], call_span, sdk]):
        detector = _run(order)
        timeline = detector.timelines.of(_finding(detector, "clean_end_pending"))
        assert timeline is not None and "timeout" in [e.step for e in timeline.entries()]


def test_a_delivered_call_without_a_finding_leaves_no_timeline_behind():
    detector = _run([stream(C, "post", "clean", terminal=("3",), first="1", last="2", events=2),
                     call(C, sc.OUTCOME_RESULT, at=1.1)])
    assert detector.findings.dump() == [] and len(detector.timelines) == 0 and detector.timelines.bytes == 0


def test_a_long_story_keeps_its_first_and_last_steps_and_counts_the_middle():
    timelines = Timelines(TimelineLimits(max_entries=6))
    for i in range(50):
        timelines.record(_event(stream(C, "resume", "clean", at=1 + i, pending=("3",), cursor=str(i))))
    timelines.attach(_lost())
    timeline = timelines.of(_lost())
    assert timeline is not None
    cursors = [e.cursor for e in timeline.entries()]
    assert cursors == ["0", "1", "2", "47", "48", "49"] and timeline.omitted == 44


def test_lists_a_producer_sent_are_cut_and_its_longest_strings_are_charged():
    timelines = Timelines(TimelineLimits(max_items=2))
    huge = [f"{i:x<250}" for i in range(101)]  # the longest a producer's strings get through (events.MAX_CHARS)
    timelines.record(_event(stream(C, "resume", "clean", pending=("3",), cursor=huge[0], audience=tuple(huge[1:51]),
                                   missing=tuple(huge[51:]))))
    timelines.attach(_lost())
    timeline = timelines.of(_lost())
    assert timeline is not None
    (entry,) = timeline.entries()
    assert entry.cursor == huge[0] and entry.audience == tuple(huge[1:3])
    assert entry.missing_resources == tuple(huge[51:53])
    assert 5 * 250 < timelines.bytes < 2_000


def test_the_ingest_queue_keeps_the_same_timelines_as_a_detector_fed_directly():
    spans = [*_incident("s1"), *_incident("s2")]
    consumed, queued = (Detector(DetectorConfig(rules=RuleConfig(clean_end_grace_s=5)), clock=Clock()) for _ in "ab")
    consumed.consume(spans, "otlp_http")
    queue = IngestQueue(queued, IngestLimits())
    try:
        events, _ = queued.read(spans, "otlp_http")  # one batch: every kind of event
        assert queue.offer(events) and queue.wait_idle(10)
    finally:
        queue.close()
    assert queued.timelines.bytes == consumed.timelines.bytes > 0
    assert len(queued.timelines) == len(consumed.timelines) > 2 and len(queued.findings) == len(consumed.findings)


def test_the_byte_budget_holds_and_evicts_unflagged_calls_before_findings_timelines():
    limits = TimelineLimits(max_bytes=64 * 1024)
    timelines = Timelines(limits)
    timelines.record(_event(stream(C, "resume", "clean", session="lost", pending=("3",), cursor="6")))
    timelines.attach(_lost("lost"))
    for i in range(5_000):
        timelines.record(_event(stream(C, "post", "dropped", session=f"s{i}", ids=(str(i),), pending=(str(i),))))
        assert timelines.bytes <= limits.max_bytes
    assert timelines.of(_lost("lost")) is not None  # the finding's story outlived 5,000 newer calls
    assert 0 < len(timelines) < 5_000 and timelines.evicted == 0


def test_a_timeline_leaves_with_its_finding():
    timelines = Timelines(TimelineLimits(max_findings=2))
    findings = [_lost(f"s{i}") for i in range(3)]
    for f in findings:
        timelines.record(_event(stream(C, "resume", "clean", session=f.session_id, pending=("3",), cursor="6")))
        timelines.attach(f)
    held = [timelines.of(f) is not None for f in findings]
    assert held == [False, True, True]


def _event(span: Span):
    event = lifecycle(span)
    assert event is not None
    return event


def _lost(session: str = "s1") -> Finding:
    return Finding(id=f"lost-{session}", rule="clean_end_pending", severity="critical", era="resumable", tool="fetch",
                   session_id=session, request_id="3", detected_ns=200 * S, summary="")


def test_every_kind_of_step_reads_back_as_the_entry_its_event_tells() -> None:
    """A step is kept as its ``Entry`` fields by position (for size): a field out of its place fails here."""
    from mcp_stream_exporter.detector.events import Operation
    from mcp_stream_exporter.detector.timeline import Entry

    post = _event(stream(C, "post", "dropped", at=1.0, ids=("3", "4"), pending=("3",), terminal=("4",), first="7",
                         last="9", events=3, missing=(FETCH,), audience=(SEARCH,)))
    resumed = _event(replay(sc.REPLAY_TRUNCATED, at=1.5, cursor="6", missing=(FETCH,)))
    ended = _event(call(C, sc.OUTCOME_CANCELLED, at=2.0, parent="00000000000000aa"))
    gave_up = _event(sdk_call(C, "fetch", at=0.5, timed_out=True, span_id="00000000000000aa"))
    assert isinstance(gave_up, Operation)
    timelines = Timelines()
    for event in (post, resumed, gave_up, ended):
        timelines.record(event)
    timelines.attach(_lost())
    timeline = timelines.of(_lost())
    assert timeline is not None

    def at(e: object) -> tuple[int, int, str]:
        c = e.at  # type: ignore[attr-defined]
        return c.start_ns, c.end_ns, c.role

    def ids(e: object) -> tuple[str, str, str]:
        c = e.at  # type: ignore[attr-defined]
        return c.trace_id, c.span_id, c.origin

    token = post.token
    assert timeline.entries() == [
        Entry(gave_up.start_ns, gave_up.start_ns + int(gave_up.duration_s * 1e9), C, "timeout", gave_up.trace_id,
              gave_up.span_id, gave_up.origin, error_type=gave_up.error_type, duration_s=gave_up.duration_s),
        Entry(*at(post), "post", *ids(post), reason="dropped", status=post.status, events=3, first_event_id="7",
              last_event_id="9", cursor=None, error_frames=post.error_frames, pending=("3",), terminal=("4",),
              audience=token.audience, required=post.required, missing_resources=(FETCH,),
              missing_scopes=token.missing_scopes),
        Entry(*at(resumed), "replay", *ids(resumed), cursor="6", decision=sc.REPLAY_TRUNCATED,
              guard_decision=resumed.guard_decision, buffered=resumed.buffered, sent=resumed.sent,
              offending_event_id=resumed.offending_event_id, audience=resumed.token.audience,
              required=resumed.required, missing_resources=(FETCH,), missing_scopes=resumed.token.missing_scopes),
        Entry(*at(ended), "call", *ids(ended), outcome=sc.OUTCOME_CANCELLED, audience=ended.token.audience,
              required=ended.required, missing_resources=ended.token.missing_resources,
              missing_scopes=ended.token.missing_scopes),
    ]
    assert post.token.audience == (SEARCH,) and resumed.buffered == 4


def test_a_timeline_is_charged_what_cpython_holds_for_it() -> None:
    """The budget counts each timeline by arithmetic (for speed): it must be what ``sys.getsizeof`` says of the
    timeline, its list and each kept step (plus an estimate of its place in the map)."""
    import sys

    from mcp_stream_exporter.detector.timeline import _MAP_ENTRY

    timelines = Timelines(TimelineLimits(max_entries=6))
    for i in range(9):  # past the cap: the middle steps go
        timelines.record(_event(stream(C, "resume", "clean", at=1 + i, pending=("3",), cursor="r\u00e9" * i)))
        timelines.attach(_lost())
        timeline = timelines.of(_lost())
        assert timeline is not None
        held = sys.getsizeof(timeline) + sys.getsizeof(timeline.kept) + sum(map(sys.getsizeof, timeline.kept))
        assert timeline.bytes == timelines.bytes == held + _MAP_ENTRY


def _held(value: object) -> int:
    """What CPython says ``value`` and every string, list and timestamp it holds take (None, "" and () shared)."""
    import sys

    from mcp_stream_exporter.detector.events import Common, Token

    if isinstance(value, str):
        return sys.getsizeof(value) if value else 0
    if isinstance(value, tuple):
        return sys.getsizeof(value) + sum(map(sys.getsizeof, value)) if value else 0
    if isinstance(value, (Common, Token)) or type(value).__name__ in ("StreamEnd", "Replay", "CallEnd"):
        held = sys.getsizeof(value) + sum(_held(getattr(value, name)) for name in type(value).__slots__)
        return held + (sys.getsizeof(value.start_ns) + sys.getsizeof(value.end_ns) if isinstance(value, Common) else 0)
    return 0


def test_an_event_in_the_ingest_queue_is_charged_what_it_and_every_string_and_list_it_holds_take() -> None:
    """An event's size is arithmetic (for speed), not sys.getsizeof: a field it leaves out, or a string CPython
    holds in more than a byte a character, fails here."""
    wide = "r\u00e9sum\u00e9-\u20ac"  # 2 and 4 bytes a character in CPython
    now = 1_800_000_000.0  # span times of this century: ints of CPython's 36 bytes
    spans = [stream(C, "resume", "clean", at=now, pending=("3",), ids=("3", "4"), terminal=("4",), cursor="6",
                    first="7", last="9", missing=(FETCH,), tool="fetch"),
             stream(C, "resume", "clean", at=now, pending=(wide,), cursor=wide, audience=(wide,)),
             replay(sc.REPLAY_TRUNCATED, at=now, missing=(FETCH,)),
             call(C, sc.OUTCOME_CANCELLED, at=now, parent="00000000000000aa"),
             call(SV, sc.OUTCOME_RESULT, at=now, session=None, tool=wide)]
    for span in spans:
        event = _event(span)
        assert sizes.event(event) == _held(event), span.attributes


def test_values_of_a_subclass_a_span_processor_is_handed_are_read_as_plain_ones_and_kept():
    """In process a span's attribute may be an ``IntEnum`` (``HTTPStatus``, as an HTTP client gives its status) or
    a ``str`` subclass; read by value (not an enum's ``__str__``), the detector takes it, and a timeline, which
    writes its steps with ``marshal``, keeps it. Before, ``marshal`` raised out of the application's ``span.end()``."""
    import enum
    from http import HTTPStatus

    class Cursor(str, enum.Enum):  # noqa: UP042 (not a StrEnum: its str() is not its value)
        SIX = "6"

    span = stream(C, "resume", sc.END_HTTP_ERROR, pending=(Cursor.SIX,), cursor=Cursor.SIX, status=401)
    span.attributes[sc.HTTP_RESPONSE_STATUS_CODE] = HTTPStatus.UNAUTHORIZED
    event = _event(span)
    assert (event.status, event.cursor, event.pending_ids) == (401, "6", ("6",))
    assert type(event.status) is int and type(event.cursor) is str and type(event.pending_ids[0]) is str
    timelines = Timelines()
    timelines.record(event)
    found = Finding(id="f", rule="clean_end_pending", severity="critical", era="resumable", tool="fetch",
                    session_id="s1", request_id="6", detected_ns=200 * S, summary="")
    timelines.attach(found)
    timeline = timelines.of(found)
    assert timeline is not None
    assert [(e.status, e.cursor) for e in timeline.entries()] == [(401, "6")]
