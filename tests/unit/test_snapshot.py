"""Snapshots: a detector restored from SQLite goes on judging exactly as the one that wrote it would."""

from __future__ import annotations

import sqlite3

from mcp_stream_exporter import semconv as sc
from mcp_stream_exporter.detector import Detector, DetectorConfig, RuleConfig
from mcp_stream_exporter.detector.snapshot import Snapshots

from spans import FETCH, SEARCH, S, replay, stream

C, SV = sc.ROLE_CLIENT, sc.ROLE_SERVER
CONFIG = DetectorConfig(rules=RuleConfig(clean_end_grace_s=5, reissue_grace_s=5, resume_loop_count=3,
                                         resume_loop_window_s=10))


class Clock:
    def __init__(self) -> None:
        self.now = 100 * S

    def __call__(self) -> int:
        return self.now


def _incident_so_far() -> list:
    """The incident up to the silent end: the loss is not a finding yet, its grace period runs."""
    return [stream(C, "post", "dropped", pending=("3",), last="41"),
            stream(C, "resume", "clean", pending=("3",), cursor="41", audience=(SEARCH,), missing=(FETCH,)),
            replay(sc.REPLAY_TRUNCATED, cursor="41", buffered=3, sent=1, missing=(FETCH,)),
            stream(C, "resume", "clean", pending=("3",), cursor="41", audience=(SEARCH,), missing=(FETCH,))]


def _fed(clock: Clock, spans: list) -> Detector:
    detector = Detector(CONFIG, clock=clock)
    for span in spans:
        detector.consume([span])
        clock.now += S // 10
    return detector


def _judged(detector: Detector, clock: Clock) -> set[tuple[str, str | None, tuple[str, ...]]]:
    clock.now += 6 * S
    detector.tick()
    return {(f.rule, f.request_id, tuple(sorted(f.roles))) for f in detector.findings}


def test_a_call_pending_across_a_restart_is_flagged_when_its_grace_period_runs_out(tmp_path):
    clock = Clock()
    before = _fed(clock, _incident_so_far())
    assert "clean_end_pending" not in {f.rule for f in before.findings}
    Snapshots(before, tmp_path / "ledger.db").save()

    restarted = Detector(CONFIG, clock=clock)
    assert Snapshots(restarted, tmp_path / "ledger.db").restore()
    assert restarted.ledger.in_flight == before.ledger.in_flight == 1
    assert {f.id for f in restarted.findings} == {f.id for f in before.findings}
    assert _judged(restarted, clock) == _judged(before, clock)
    assert ("clean_end_pending", "3", (C,)) in _judged(restarted, clock)


def test_the_restored_ledger_merges_the_other_sides_later_spans_into_the_same_finding(tmp_path):
    clock = Clock()
    before = _fed(clock, _incident_so_far())
    Snapshots(before, tmp_path / "ledger.db").save()
    restarted = Detector(CONFIG, clock=clock)
    Snapshots(restarted, tmp_path / "ledger.db").restore()
    restarted.consume([stream(SV, "resume", "clean", pending=("3",), cursor="41")])
    clock.now += 6 * S
    restarted.tick()
    (lost,) = [f for f in restarted.findings if f.rule == "clean_end_pending"]
    assert sorted(lost.roles) == [C, SV]


def test_a_snapshot_round_trips_the_whole_ledger(tmp_path):
    clock = Clock()
    before = _fed(clock, _incident_so_far() * 2)
    Snapshots(before, tmp_path / "ledger.db").save()
    restarted = Detector(CONFIG, clock=clock)
    Snapshots(restarted, tmp_path / "ledger.db").restore()
    assert restarted.ledger.dump() == before.ledger.dump()
    assert restarted.findings.dump() == before.findings.dump()
    assert restarted.registry.get_sample_value("mcp_stream_detector_snapshot_timestamp_seconds") == clock.now / 1e9


def test_no_snapshot_means_a_fresh_start_and_an_unknown_format_is_ignored(tmp_path):
    fresh = Detector(CONFIG)
    assert not Snapshots(fresh, tmp_path / "ledger.db").restore()
    with sqlite3.connect(tmp_path / "ledger.db") as db:
        db.execute("INSERT INTO snapshot VALUES (1, 99, 0, '{}', '[]')")
    assert not Snapshots(fresh, tmp_path / "ledger.db").restore()
    assert fresh.ledger.sessions == 0
