"""A resume still open that moves a call on (``mcp_stream.end.reason = open``) stops the silent-loss clock of the
clean end it resumes from: a tool that polls, reporting progress, is not lost however long it runs."""

from __future__ import annotations

from mcp_stream_exporter import semconv as sc
from mcp_stream_exporter.detector import Detector, DetectorConfig, RuleConfig

from spans import S, stream

C, SV = sc.ROLE_CLIENT, sc.ROLE_SERVER


def _detector() -> tuple[Detector, list[int]]:
    now = [100 * S]
    return Detector(DetectorConfig(rules=RuleConfig(clean_end_grace_s=5)), clock=lambda: now[0]), now


def test_a_polled_call_moving_on_a_resume_that_stays_open_past_the_grace_is_no_loss():
    for role in (C, SV):  # either side's spans tell it
        detector, now = _detector()
        detector.consume([stream(role, "post", "clean", pending=("3",), last="6", at=1.0)])
        now[0] += S
        detector.consume([stream(role, "resume", sc.END_OPEN, cursor="6", pending=("3",), first="7", last="7",
                                 events=1, at=2.0)])
        now[0] += 60 * S  # the tool runs on, far past the grace, its resume open
        detector.tick()
        assert list(detector.findings) == []
        assert _resumes(detector) == 0  # counted when it ends, once
        detector.consume([stream(role, "resume", "clean", cursor="6", terminal=("3",), last="40", at=62.0)])
        now[0] += 60 * S
        detector.tick()
        assert list(detector.findings) == []
        assert _resumes(detector) == 1


def _resumes(detector: Detector) -> float:
    return sum(sample.value for family in detector.metrics.registry.collect() if family.name == "mcp_stream_resumes"
               for sample in family.samples if sample.name.endswith("_total"))


def test_a_resume_that_moved_the_call_on_then_ended_without_its_result_starts_the_clock_again():
    detector, now = _detector()
    detector.consume([stream(C, "post", "clean", pending=("3",), last="6", at=1.0),
                      stream(C, "resume", sc.END_OPEN, cursor="6", pending=("3",), first="7", last="7", at=2.0)])
    now[0] += 60 * S
    detector.tick()
    assert list(detector.findings) == []
    detector.consume([stream(C, "resume", "clean", cursor="6", pending=("3",), last="9", at=62.0)])
    now[0] += 6 * S
    detector.tick()
    assert [f.rule for f in detector.findings] == ["clean_end_pending"]


def _stuck(detector: Detector) -> float | None:
    return detector.registry.get_sample_value("mcp_stream_calls_stuck")


def test_a_call_is_stuck_once_its_session_shows_no_sign_of_life_for_fifteen_minutes_not_while_it_moves_on():
    detector, now = _detector()
    detector.consume([stream(C, "post", "clean", pending=("3",), last="6", at=1.0),
                      stream(C, "post", "dropped", session="s2", pending=("3",), last="6", at=1.0)])
    for minute in range(1, 20):  # s1's resume says every minute that it moves the call on; s2 is silent
        now[0] += 60 * S
        detector.consume([stream(C, "resume", sc.END_OPEN, cursor="6", pending=("3",), last=str(6 + minute),
                                 at=1.0 + 60 * minute)])
        detector.tick()
        assert detector.ledger.in_flight == 2
        assert _stuck(detector) == (1 if minute > 15 else 0), minute  # s2 only, once 15 minutes have passed
    # a stuck call has no finding: the API names it, for the on-call to find its trace
    calls, total = detector.stuck_calls(10)
    assert total == 1 and [(c["session_id"], c["request_id"], c["roles"]) for c in calls] == [("s2", "3", [C])]
    assert calls[0]["owed_for_s"] > 15 * 60 and calls[0]["trace_id"]
    detector.consume([stream(C, "resume", "clean", cursor="6", session="s2", terminal=("3",), last="9", at=1200.0)])
    now[0] += 11 * S
    detector.tick()
    assert _stuck(detector) == 0


def test_a_404_on_the_session_ends_what_it_owed_once_its_finding_is_raised():
    detector, now = _detector()
    detector.consume([stream(C, "post", "dropped", pending=("3",), last="6", at=1.0),
                      stream(C, "resume", "http_error", cursor="6", pending=("3",), status=404, at=2.0)])
    now[0] += 6 * S
    detector.tick()
    assert [f.rule for f in detector.findings] == ["session_expired_in_flight"]
    assert detector.ledger.in_flight == 0  # the SDK fails the call: its session is gone


def test_a_stuck_call_counts_whatever_else_its_session_does():
    """Another call's spans on the session are no sign of life of this one."""
    detector, now = _detector()
    detector.consume([stream(C, "post", "dropped", pending=("3",), last="6", at=1.0)])
    for minute in range(1, 20):
        now[0] += 60 * S
        detector.consume([stream(C, "post", "dropped", ids=(str(100 + minute),), pending=(str(100 + minute),),
                                 last=str(100 + minute), at=1.0 + 60 * minute)])
        detector.tick()
    assert _stuck(detector) is not None and _stuck(detector) >= 1


def test_resumes_that_drop_without_moving_the_call_on_are_no_sign_of_life():
    """A proxy that cuts every resume of a hung tool: each shows the call owed again, none moves it on."""
    detector, now = _detector()
    detector.consume([stream(C, "post", "dropped", pending=("3",), last="6", at=1.0)])
    for minute in range(1, 20):
        now[0] += 60 * S
        detector.consume([stream(C, "resume", "dropped", cursor="6", pending=("3",), at=1.0 + 60 * minute)])
        detector.tick()
    assert _stuck(detector) == 1
