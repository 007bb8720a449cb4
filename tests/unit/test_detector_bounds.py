"""The detector's bounds under hostile spans: label values from closed sets, capped strings, no token
kept anywhere; memory bounded in bytes (budget, per-session state, timers, evidence)."""

from __future__ import annotations

import base64
import dataclasses
import gc
import json
import tracemalloc

import pytest
from prometheus_client import generate_latest

from mcp_stream_exporter import semconv as sc
from mcp_stream_exporter.detector import Detector, DetectorConfig, LedgerLimits, RuleConfig, Span
from mcp_stream_exporter.detector.events import _operation
from mcp_stream_exporter.detector.findings import MAX_EVIDENCE_BYTES
from mcp_stream_exporter.detector.metrics import OTHER
from mcp_stream_exporter.detector.settings import load

from spans import FETCH, S, call, sdk_call, stream

C, SV = sc.ROLE_CLIENT, sc.ROLE_SERVER
CONFIG = DetectorConfig(rules=RuleConfig(clean_end_grace_s=5, reissue_grace_s=5, resume_loop_count=3,
                                         resume_loop_window_s=10))
JWT = "eyJhbGciOiJSUzI1NiJ9.eyJzdWIiOiJ1c2VyIn0.c2lnbmF0dXJlLWJ5dGVz"


class Clock:
    def __init__(self) -> None:
        self.now = 100 * S

    def __call__(self) -> int:
        return self.now


def _with(span: Span, **attributes: object) -> Span:
    return dataclasses.replace(span, attributes={**span.attributes, **attributes})


def _label_flood(values: list[str]) -> Detector:
    """Every attribute that reaches a metric label, one new value per span."""
    clock = Clock()
    detector = Detector(CONFIG, clock=clock)
    for i, v in enumerate(values):
        rid = str(i)
        detector.consume([
            stream(C, v, v, tool=v, ids=(rid,), session=f"s{i}"),
            stream(C, "resume", "clean", tool=v, ids=(rid,), pending=(rid,), cursor=f"c{i}", missing=(FETCH,),
                   session=f"s{i}"),
            call(C, sc.OUTCOME_CANCELLED, request_id=rid, tool=v, session=f"s{i}"),
            sdk_call(C, v, request_id=rid, error_type=v),
            sdk_call(SV, v, request_id=rid, error_type=v),
            _with(sdk_call(SV, "fetch", request_id=rid), **{sc.MCP_METHOD_NAME: v, sc.RPC_RESPONSE_STATUS_CODE: v}),
            dataclasses.replace(sdk_call(C, "fetch", request_id=rid, timed_out=True), name=f"MCP send tools/call {v}",
                                exception_types=(v,)),
        ])
    clock.now += 6 * S
    detector.tick()
    return detector


def _series(detector: Detector) -> set[tuple[str, tuple[tuple[str, str], ...]]]:
    return {(s.name, tuple(sorted(s.labels.items()))) for m in detector.registry.collect() for s in m.samples}


def _flood_values(n: int) -> list[str]:
    shapes = ["tool{}", "Bearer {}", "x" * 300 + "{}", "\u00e9\u00e8{}", "a b {}", f"{JWT}{{}}", "{}/../../etc"]
    return [shapes[i % len(shapes)].format(i) for i in range(n)]


def test_a_flood_of_new_values_in_every_attribute_that_reaches_a_label_adds_no_series_past_the_bounded_sets():
    small, large = _label_flood(_flood_values(100)), _label_flood(_flood_values(400))
    assert len(_series(small)) == len(_series(large)), "series grow with the values sent"
    assert len(large.findings) > 0, "the flood went through the rules"
    labels: dict[str, set[str]] = {}
    for _, pairs in _series(large):
        for name, value in pairs:
            labels.setdefault(name, set()).add(value)
    assert labels["kind"] <= {*sc.STREAM_KINDS, OTHER}
    assert labels["reason"] - {*sc.END_REASONS, OTHER} <= {"too_large", "bad_encoding", "malformed", "unauthorized",
                                                         "too_many_spans", "queue_full", "span_model", "ttl",
                                                         "capacity", "memory", "busy", "timeout"}
    assert labels["role"] <= {C, SV}
    assert len(labels["tool"] - {OTHER}) <= CONFIG.max_tool_labels
    assert len(labels["gen_ai_tool_name"] - {OTHER, ""}) <= CONFIG.max_tool_labels
    assert labels["mcp_method_name"] <= {"tools/call", OTHER}
    assert labels["error_type"] <= {"", "timeout", OTHER}
    for value in set().union(*labels.values()):
        assert len(value) <= 64 and "Bearer" not in value and "eyJ" not in value, value
    print(f"\nseries after 400 new values in every attribute that reaches a label: {len(_series(large))}")


def test_token_shaped_values_in_any_attribute_are_redacted_from_ledger_findings_metrics_and_logs():
    clock = Clock()
    detector = Detector(CONFIG, clock=clock)
    bearer = f"Bearer {JWT}"
    spans = [stream(C, "resume", "clean", pending=(bearer,), ids=(bearer,), cursor=bearer, session=bearer,
                    tool=bearer, audience=(JWT,), missing=(f"https://x/{JWT}",), last=bearer, first=JWT),
             call(C, sc.OUTCOME_CANCELLED, request_id=bearer, session=bearer, tool=bearer)]
    spans = [dataclasses.replace(s, origin=f"svc {bearer}") for s in spans]
    outcome = detector.consume([*spans, _with(spans[0], **{sc.SPAN: bearer})])
    clock.now += 6 * S
    detector.tick()
    assert outcome.rejected_count == 1 and JWT not in outcome.message()
    assert {f.rule for f in detector.findings} >= {"clean_end_pending", "narrowed_resume"}
    kept = json.dumps([detector.ledger.dump(), detector.findings.dump()]) + generate_latest(detector.registry).decode()
    assert "[redacted]" in kept
    for secret in (JWT, JWT.split(".")[2], "Bearer"):
        assert secret not in kept


def test_a_token_in_the_exception_type_of_a_callers_failed_request_span_is_redacted_from_its_timeline():
    """The exception an SDK span records says whatever its sender put in it: the timeline row of the caller's
    give-up (on the findings page) showed it raw."""
    bearer = f"Bearer {JWT}"
    failed = dataclasses.replace(sdk_call(C, "fetch", request_id="3"), exception_types=(bearer,), error=True)
    given_up = _operation(failed)
    assert given_up.error_type == "[redacted]"
    assert _operation(dataclasses.replace(failed, exception_types=("ConnectionError",))).error_type == "ConnectionError"
    cut = _operation(dataclasses.replace(failed, exception_types=("x" * 236 + JWT,)))  # cut inside its header
    assert cut.error_type is not None and "[redacted]" in cut.error_type and JWT[:12] not in cut.error_type


@pytest.mark.parametrize("pad", [0, 400], ids=["short", "longer-than-the-bound"])
def test_sessions_whose_ids_are_jwts_stay_apart_once_redacted_so_one_sessions_answer_hides_no_others_loss(pad):
    clock = Clock()
    detector = Detector(CONFIG, clock=clock)
    lost, answered = ("eyJhbGciOiJSUzI1NiJ9." + base64.urlsafe_b64encode(b'{"sid":%d,"p":"%s"}' % (n, b"x" * pad))
                      .decode().rstrip("=") + ".c2ln" for n in (1, 2))
    detector.consume([stream(C, "post", "clean", session=lost, pending=("3",)),
                      stream(C, "post", "clean", session=answered, pending=("3",)),
                      stream(C, "resume", "clean", session=answered, terminal=("3",), cursor="e1")])
    clock.now += 6 * S
    detector.tick()
    assert [f.rule for f in detector.findings if f.rule == "clean_end_pending"] == ["clean_end_pending"]
    kept = json.dumps([detector.ledger.dump(), detector.findings.dump()])
    assert lost not in kept and answered not in kept and len(detector.ledger.dump()["sessions"]) == 2


BUDGET = 1024 * 1024  # the ledger's
FINDINGS_BUDGET = 256 * 1024
TIMELINES_BUDGET = 256 * 1024
LONG = "x" * 240  # ids at the cap: 256 characters with the counter


def _budgeted(clock: Clock) -> Detector:
    return Detector(DetectorConfig(rules=CONFIG.rules, max_findings=10**6, max_findings_bytes=FINDINGS_BUDGET,
                                   max_timelines_bytes=TIMELINES_BUDGET,
                                   ledger=LedgerLimits(max_sessions=10**6, max_calls_per_session=10**6,
                                                       max_bytes=BUDGET)), clock=clock)


FLOODS = {
    "a session per call": lambda i: [stream(C, "post", "clean", session=f"s{i}", ids=(str(i),), pending=(str(i),))],
    "ids at the length cap": lambda i: [stream(C, "resume", "clean", session=f"{LONG}{i:016}",
                                               ids=(f"{LONG}{i:016}",), pending=(f"{LONG}{i:016}",),
                                               cursor=f"{LONG}{i:016}", last=LONG, first=LONG, tool=LONG)],
    "one session, calls past the cap": lambda i: [stream(C, "post", "dropped", session="one", ids=(str(i),),
                                                         pending=(str(i),))],
    "one session, a new resume cursor each time": lambda i: [stream(C, "resume", "clean", session="one",
                                                                    ids=("1",), pending=("1",), cursor=f"c{i}")],
    "re-ending the same calls": lambda i: [stream(C, "post", "clean", session=f"s{i % 50}", ids=(str(i % 7),),
                                                  pending=(str(i % 7),))],
    "findings with the largest evidence": lambda i: [stream(C, "resume", "clean", session=f"f{i}", ids=("3",),
                                                            terminal=tuple(f"{LONG}{j:016}" for j in range(256)))],
    "look-ups (SDK spans, tools issued)": lambda i: [
        dataclasses.replace(call(C, sc.OUTCOME_RESULT, request_id=str(i), session=f"l{i}", tool=f"{LONG}{i:016}",
                                 parent=f"{i:016x}"), origin=f"{LONG}{i:016}")],
}


# Spans each flood sends: enough to fill its budget several times over (1,000 findings of 4 KiB evidence
# are 15 times the findings budget; 5,000 calls about 5 times the ledger's).
FLOOD_SPANS = {"findings with the largest evidence": 1_000}


@pytest.mark.load
@pytest.mark.parametrize("shape", sorted(FLOODS))
def test_a_flood_of_each_shape_stays_under_the_memory_budget_as_tracemalloc_measures_it(shape):
    clock = Clock()
    gc.collect()
    tracemalloc.start()
    try:
        detector = _budgeted(clock)
        before = tracemalloc.get_traced_memory()[0]
        for i in range(0, FLOOD_SPANS.get(shape, 5_000), 500):
            detector.consume([span for j in range(i, i + 500) for span in FLOODS[shape](j)])
            clock.now += S
        gc.collect()
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    state = detector.ledger.bytes + detector.findings.bytes + detector.timelines.bytes
    print(f"\n{shape}: {used / 2**20:.1f} MiB measured, {state / 2**20:.1f} MiB estimated, "
          f"sessions {detector.ledger.sessions}, calls {detector.ledger.calls}, findings {len(detector.findings)}, "
          f"evictions {detector.ledger.evictions}")
    assert detector.ledger.bytes <= BUDGET and detector.findings.bytes <= FINDINGS_BUDGET
    assert detector.timelines.bytes <= TIMELINES_BUDGET
    assert used <= BUDGET + FINDINGS_BUDGET + TIMELINES_BUDGET, "the estimate is below what the state takes"
    assert used <= state * 1.25 + 128 * 1024, "the estimate is far from what the state takes"


def test_memory_evictions_take_the_least_recently_active_sessions_first_and_are_counted():
    clock = Clock()
    detector = _budgeted(clock)
    for i in range(0, 10_000, 500):
        detector.consume([stream(C, "post", "dropped", session=f"s{j}", ids=("1",), pending=("1",))
                          for j in range(i, i + 500)])
    evicted = detector.ledger.evictions["memory"]
    assert evicted > 0 and detector.ledger.sessions == 10_000 - evicted
    assert detector.ledger.find("s9999", "1") is not None and detector.ledger.find("s0", "1") is None
    assert detector.registry.get_sample_value("mcp_stream_detector_ledger_evictions_total",
                                              {"reason": "memory"}) == evicted
    assert detector.registry.get_sample_value("mcp_stream_detector_state_bytes", {"part": "ledger"}) <= BUDGET


def test_under_memory_pressure_sdk_span_look_ups_shrink_to_their_newest_before_any_session_goes():
    """A session evicted hides its losses; an SDK span no longer found hides a timeout's warning at most."""
    from mcp_stream_exporter.detector import ledger as ledger_module

    ledger = ledger_module.Ledger(LedgerLimits(max_index=10**6, max_bytes=1 << 40))
    call_ = ledger.call(ledger.session("one", 0), "1", 0)
    ledger.account()
    base = ledger.bytes
    for n in range(20_000):
        ledger.link_sdk_span(f"{n:016x}", call_)
    entry = (ledger.bytes - base) / 20_000
    ledger.limits = dataclasses.replace(ledger.limits, max_bytes=int(base + (ledger_module._SEEN_FLOOR + 100) * entry))
    assert ledger.account() == 0 and ledger.sessions == 1
    assert ledger.sdk_span_call(f"{19_999:016x}") == ("one", "1") and ledger.sdk_span_call(f"{0:016x}") is None


def test_a_sessions_stream_ends_are_bounded_kept_newest_last_and_charged_the_same_after_a_snapshot():
    from mcp_stream_exporter.detector.ledger import Ledger

    ledger = Ledger()
    session = ledger.session("one", 0)
    for i in range(70):
        ledger.note_cursor(session, f"e{i}", (str(i),))
    ledger.note_cursor(session, "e10", ("3", "4"))  # the same event id again: the newest word on it
    restored = Ledger()
    restored.load(ledger.dump())
    again = restored.session("one", 0)
    assert [restored.cursor_calls(again, e) for e in ("e5", "e6", "e10", "e69")] == [(), ("6",), ("3", "4"), ("69",)]
    assert ledger.dump()["sessions"] == restored.dump()["sessions"] and restored.bytes == ledger.bytes


def test_one_session_watches_a_bounded_number_of_resume_cursors():
    detector = Detector(CONFIG, clock=Clock())
    detector.consume([stream(C, "resume", "clean", session="one", pending=("1",), cursor=f"c{i}") for i in range(5000)])
    (session,) = detector.ledger.dump()["sessions"]
    assert len(session["resumes"]) == LedgerLimits().max_resumes_per_session


def _polled(rid: str, at: float) -> list[Span]:
    """A healthy call of a tool that polls: its POST closed clean with it pending, a resume delivered it."""
    return [stream(C, "post", "clean", session="s", ids=(rid,), pending=(rid,), last=f"p{rid}", at=at),
            stream(C, "resume", "clean", session="s", ids=(rid,), cursor=f"p{rid}", terminal=(rid,), last=f"r{rid}",
                   at=at + 0.1)]


def test_a_session_past_its_cap_of_calls_forgets_delivered_ones_first_and_still_pages_its_loss():
    """The oldest call went, whatever it was: the one loss among a hundred healthy resumed calls after it was
    forgotten before its grace ran out (no finding), and each healthy call past the cap counted an eviction."""
    clock = Clock()
    config = dataclasses.replace(CONFIG, ledger=LedgerLimits(max_calls_per_session=10))
    detector = Detector(config, clock=clock)
    detector.consume([stream(C, "resume", "clean", session="s", ids=("0",), pending=("0",), cursor="c0")])
    for i in range(1, 100):
        detector.consume(_polled(str(i), 1 + i / 100))
    clock.now += 6 * S
    detector.tick()
    assert [(f.rule, f.request_id) for f in detector.findings] == [("clean_end_pending", "0")]
    assert detector.ledger.evictions["capacity"] == 0


def test_a_session_past_its_cap_looks_for_a_call_to_forget_among_its_oldest_and_newest_only():
    """A session of calls still owed by the thousand (a hostile producer's) cost a walk of all of them for each
    call it added: only its ``_ROOM_SCAN`` oldest and newest are looked at. A delivered call among them is
    forgotten, not counted; one amid that many calls still owed at both ends is not found, and the oldest goes,
    counted."""
    from mcp_stream_exporter.detector.ledger import _ROOM_SCAN

    def owed(rid: str) -> Span:
        return stream(C, "post", "dropped", session="s", ids=(rid,), pending=(rid,), last=f"e{rid}")

    cap = 4 * _ROOM_SCAN
    for delivered_at, found in ((_ROOM_SCAN - 1, True), (cap - _ROOM_SCAN, True), (2 * _ROOM_SCAN, False)):
        detector = Detector(dataclasses.replace(CONFIG, ledger=LedgerLimits(max_calls_per_session=cap)),
                            clock=Clock())
        for i in range(cap):
            detector.consume(_polled(str(i), 1.0) if i == delivered_at else [owed(str(i))])
        detector.consume([owed("new")])
        forgotten = str(delivered_at) if found else "0"
        assert detector.ledger.find("s", forgotten) is None and detector.ledger.calls == cap
        assert detector.ledger.evictions["capacity"] == (not found)


def test_a_late_span_of_a_delivered_call_the_session_forgot_pages_nothing_before_or_after_a_restart():
    """Forgotten to make room, a delivered call came back fresh with the late span of its clean end (the client's
    exporter batching behind the server's), and paged a silent loss with no eviction counted to explain it."""
    clock = Clock()
    config = dataclasses.replace(CONFIG, ledger=LedgerLimits(max_calls_per_session=10))
    detector = Detector(config, clock=clock)
    detector.consume(_polled("1", 1.0)[1:])  # the server's view: its resume delivered call 1
    for i in range(2, 30):
        detector.consume(_polled(str(i), 1 + i / 100))
    again = Detector(config, clock=clock)
    again.ledger.load(detector.ledger.dump())  # as a snapshot carries it across a restart
    for judged in (detector, again):
        judged.consume(_polled("1", 1.0)[:1])  # the client's POST span, late: clean, call 1 pending
        clock.now += 6 * S
        judged.tick()
        assert [(f.rule, f.request_id) for f in judged.findings] == [] and judged.ledger.evictions["capacity"] == 0


def test_a_late_span_showing_a_forgotten_given_up_calls_result_stored_and_never_delivered_still_pages():
    """Only a delivered call is remembered as done: one its caller gave up on may yet show its loss."""
    clock = Clock()
    detector = Detector(dataclasses.replace(CONFIG, ledger=LedgerLimits(max_calls_per_session=10)), clock=clock)
    for rid in map(str, range(1, 30)):  # an outage: each call's POST drops, its caller gives up
        detector.consume([stream(C, "post", "dropped", session="s", ids=(rid,), pending=(rid,), last=f"e{rid}"),
                          call(C, sc.OUTCOME_CANCELLED, session="s", request_id=rid)])
    clock.now += 6 * S
    detector.tick()
    detector.consume([call(SV, sc.OUTCOME_RESULT, session="s", request_id="1", stream_kind=None,
                           terminal_event_id="e9")])  # the server's exporter was behind: call 1's result was stored
    clock.now += 6 * S
    detector.tick()
    assert ("stored_not_delivered", "1") in [(f.rule, f.request_id) for f in detector.findings]


def test_the_cursor_of_a_call_still_owed_outlasts_those_of_a_hundred_delivered_calls():
    """A resume that no longer names its call (its caller gave up, the SDK resumes on) is told its call by the
    cursor: one loop of them makes one finding, on its call, however many healthy calls the session makes."""
    detector = Detector(CONFIG, clock=Clock())
    detector.consume([stream(C, "post", "clean", session="s", ids=("0",), pending=("0",), last="c0")])
    for i in range(1, 100):
        detector.consume(_polled(str(i), 1 + i / 100))
    detector.consume([stream(C, "resume", "clean", session="s", ids=(), cursor="c0", tool=None, at=3 + i / 10)
                      for i in range(5)])
    loops = [f for f in detector.findings if f.rule == "resume_loop"]
    assert [(f.request_id, f.tool) for f in loops] == [("0", "fetch")]


def test_re_ending_the_same_calls_adds_no_timers():
    detector = Detector(CONFIG, clock=Clock())
    for _ in range(50):
        detector.consume([stream(C, "post", "clean", session="s", ids=(str(i),), pending=(str(i),)) for i in range(20)])
    assert len(detector.ledger.dump()["timers"]) == 20


def test_a_findings_evidence_is_cut_to_its_bound_and_says_so():
    detector = Detector(CONFIG, clock=Clock())
    detector.consume([stream(C, "resume", "clean", ids=("3",), terminal=tuple(f"{LONG}{j:016}" for j in range(256)))])
    (finding,) = detector.findings
    assert finding.rule == "foreign_result" and finding.evidence["truncated"] is True
    assert len(json.dumps(finding.to_json()["evidence"])) <= MAX_EVIDENCE_BYTES


def test_max_memory_mb_splits_into_the_ledger_findings_timelines_and_queue_budgets():
    config = load(["--max-memory-mb", "64"]).config
    mib = 1024 * 1024
    assert config.detector_config().ledger.max_bytes == 40 * mib
    assert config.detector_config().max_findings_bytes == 8 * mib
    assert config.detector_config().max_timelines_bytes == 8 * mib
    assert config.ingest_limits().max_queued_bytes == 8 * mib


def test_a_streams_requirement_is_charged_to_the_call_it_carries_alone_not_to_each_of_hundreds():
    """A stream span lists what its pending calls require, as a union: kept on each of the 256 calls it may carry,
    one tuple would be charged 256 times, and a few small requests would evict the sessions being judged."""
    long_resources = tuple(f"https://mcp.example.com/{n:03d}/" + "r" * 230 for n in range(256))
    ids = tuple(str(n) for n in range(256))
    charged = []
    for required in ((), long_resources):
        detector = Detector(CONFIG, clock=Clock())
        detector.consume([_with(stream(C, "post", "clean", ids=ids, pending=ids, tool=None),
                                **{sc.REQUIRED_RESOURCES: required} if required else {})])
        charged.append(detector.ledger.bytes)
    assert charged[1] - charged[0] < 128 * 1024  # one span's list, not 256 copies of it (16 MB)


def test_without_a_policy_a_tools_finding_series_are_exported_at_0_from_its_first_span():
    """A counter born at its first count has no ``increase()``: the alert rules would hold its page by its instant
    value alone, which one missed scrape or a restart drops (the page resolved, then paged again), and the
    dashboards' panels would read it as 0. From the tool's first span (an SDK span of a healthy call) on, they are
    there at 0; ``other`` from the start."""
    detector = Detector(CONFIG, clock=Clock())
    loss = {"tool": "fetch", "rule": "clean_end_pending"}
    assert detector.registry.get_sample_value("mcp_stream_silent_losses_total", loss) is None
    assert detector.registry.get_sample_value("mcp_stream_silent_losses_total",
                                              {"tool": OTHER, "rule": "clean_end_pending"}) == 0.0
    detector.consume([sdk_call(C, "fetch", request_id="1")])
    assert detector.registry.get_sample_value("mcp_stream_silent_losses_total", loss) == 0.0
    narrowed = {"tool": "fetch", "rule": "narrowed_resume", "severity": "warning"}
    assert detector.registry.get_sample_value("mcp_stream_findings_total", narrowed) == 0.0
