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
