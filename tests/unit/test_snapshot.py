"""Snapshots: a detector restored from SQLite goes on judging exactly as the one that wrote it would."""

from __future__ import annotations

import json
import os
import sqlite3
from collections.abc import Callable, Iterator
from contextlib import closing
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from mcp_stream_exporter import semconv as sc
from mcp_stream_exporter.detector import Detector, DetectorConfig, RuleConfig, snapshot
from mcp_stream_exporter.detector.app import create_app
from mcp_stream_exporter.detector.snapshot import SnapshotLocked, Snapshots

from spans import FETCH, SEARCH, S, call, cancelled_late, replay, stream

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


def _restarted(before: Detector, clock: Clock, path: Path) -> Detector:
    """``before`` saved to ``path`` (closing lets the next one take the file), and a fresh detector restored from it."""
    Snapshots(before, path).close()
    restarted = Detector(CONFIG, clock=clock)
    assert Snapshots(restarted, path).restore()
    return restarted


def _judged(detector: Detector, clock: Clock) -> set[tuple[str, str | None, tuple[str, ...]]]:
    clock.now += 6 * S
    detector.tick()
    return {(f.rule, f.request_id, tuple(sorted(f.roles))) for f in detector.findings}


def test_a_call_pending_across_a_restart_is_flagged_when_its_grace_period_runs_out(tmp_path):
    clock = Clock()
    before = _fed(clock, _incident_so_far())
    assert "clean_end_pending" not in {f.rule for f in before.findings}
    restarted = _restarted(before, clock, tmp_path / "ledger.db")
    assert restarted.ledger.in_flight == before.ledger.in_flight == 1
    assert {f.id for f in restarted.findings} == {f.id for f in before.findings}
    assert _judged(restarted, clock) == _judged(before, clock)
    assert ("clean_end_pending", "3", (C,)) in _judged(restarted, clock)


def test_a_narrowed_resume_still_open_across_a_restart_is_judged_when_its_grace_runs_out(tmp_path):
    narrowed = {"pending": ("3",), "cursor": "6", "audience": (SEARCH,), "missing": (FETCH,)}
    so_far = stream(C, "resume", "open", events=1, first="7", last="7", **narrowed)
    clock = Clock()
    restarted = _restarted(_fed(clock, [so_far]), clock, tmp_path / "ledger.db")
    assert ("narrowed_resume", "3", (C,)) in _judged(restarted, clock)
    # its end came first, naming no call (its caller gave up): remembered across the restart too
    ended = stream(C, "resume", "clean", events=1, error_frames=1, **{**narrowed, "pending": (), "ids": ()})
    clock = Clock()
    restarted = _restarted(_fed(clock, [ended]), clock, tmp_path / "again.db")
    restarted.consume([so_far])
    assert "narrowed_resume" not in {rule for rule, _, _ in _judged(restarted, clock)}


def test_the_detectors_downtime_counts_against_no_grace_what_its_exporters_held_meanwhile_clears_the_call(tmp_path):
    """Down longer than the grace left, no longer than its senders retry (a Collector's queue): the delivery they held
    through the outage comes after the restart, and the call is judged with it; a call that was lost is still
    flagged, a grace after the restart at the latest."""
    cases = [(down_s, held, expected) for down_s in (60, 2 * 3600)  # a grace of 5 s; sessions idle an hour go
             for held, expected in (([stream(C, "resume", "clean", cursor="41", terminal=("3",), last="44")], set()),
                                    ([], {("clean_end_pending", "3", (C,))}))]
    for down_s, held, expected in cases:
        clock = Clock()
        before = _fed(clock, _incident_so_far())
        path = tmp_path / f"{down_s}-{len(held)}.db"
        Snapshots(before, path).close()
        clock.now += down_s * S
        restarted = Detector(CONFIG, clock=clock)
        assert Snapshots(restarted, path, senders_retry_s=down_s).restore()
        restarted.tick()  # the first tick after the restart, before the held spans come
        clock.now += 2 * S
        restarted.consume(held)
        findings = _judged(restarted, clock)
        assert {f for f in findings if f[0] == "clean_end_pending"} == expected


def test_a_restore_after_a_crash_or_a_downtime_past_the_senders_retry_judges_none_of_the_calls_it_held_owed(tmp_path):
    """Their spans may be lost for good (taken in after the snapshot and before the crash, or not applied before a
    shutdown's last snapshot; sent in a downtime their senders gave up retrying): a call delivered then would page as
    lost. None is judged, as without a snapshot, and
    they are counted; spans of them that come later are judged as they come."""
    for stop, down_s in (("crash", 1), ("undrained", 1), ("late", 11)):
        clock = Clock()
        before = _fed(clock, _incident_so_far())
        path = tmp_path / f"{stop}.db"
        snapshots = Snapshots(before, path)
        if stop == "crash":
            snapshots.save()
            snapshots._lock_file, lock_file = None, snapshots._lock_file  # a crash: no final snapshot
            assert lock_file is not None
            os.close(lock_file)
        else:  # a shutdown whose ingest did not apply all it had accepted in time loses the rest, as a crash does
            snapshots.close(drained=stop != "undrained")
        clock.now += down_s * S
        restarted = Detector(CONFIG, clock=clock)
        assert Snapshots(restarted, path).restore()
        assert "clean_end_pending" not in {f[0] for f in _judged(restarted, clock)}
        assert restarted.metrics.unjudged_calls._value.get() == 1
        assert restarted.ledger.in_flight == 0
        restarted.consume([stream(C, "resume", "clean", pending=("3",), cursor="41", at=5.0)])
        assert restarted.ledger.in_flight == 1  # owed again
        assert ("clean_end_pending", "3", (C,)) in _judged(restarted, clock)  # a clean end that came after


def test_a_restore_counts_again_the_losses_no_scrape_saw_within_the_alerts_window(tmp_path):
    """Counters start at 0 in a new process: a loss counted after the last scrape would page nowhere. Counted again,
    it pages; one a scrape saw is not (its count was there), nor one older than the alert rules' 10 minutes."""
    for scraped_after, down_s, counted in ((False, 1, 1), (True, 1, 0), (False, 601, 0)):
        clock = Clock()
        before = _fed(clock, _incident_so_far())
        before.scraped_ns = clock.now
        _judged(before, clock)  # the loss is found, a grace later
        assert before.metrics.silent_losses.labels("fetch", "clean_end_pending")._value.get() == 1
        if scraped_after:
            before.scraped_ns = clock.now
        path = tmp_path / f"{scraped_after}-{down_s}.db"
        Snapshots(before, path).close()
        clock.now += down_s * S
        restarted = Detector(CONFIG, clock=clock)
        assert Snapshots(restarted, path, senders_retry_s=down_s).restore()
        assert restarted.metrics.silent_losses.labels("fetch", "clean_end_pending")._value.get() == counted


def test_a_2026_call_re_issued_before_an_unjudged_restore_is_no_loss_when_its_broken_stream_comes_after(tmp_path):
    """Its call span and its re-issue's start came before the crash; the stream that broke, which the SDK ends after
    its caller re-issued, after the restore: the re-issue is still matched against when the stream broke."""
    era = {"session": None, "era": sc.ERA_STATELESS, "fingerprint": "f00d"}
    clock = Clock()
    before = _fed(clock, [call(C, sc.OUTCOME_NO_TERMINAL, at=1.0, **era),
                          call(C, sc.OUTCOME_REISSUED, at=1.5, request_id="4", trace="t2", stream_kind=None, **era)])
    snapshots = Snapshots(before, tmp_path / "ledger.db")
    snapshots.save()
    snapshots._lock_file, lock_file = None, snapshots._lock_file  # a crash: no final snapshot
    assert lock_file is not None
    os.close(lock_file)
    restarted = Detector(CONFIG, clock=clock)
    assert Snapshots(restarted, tmp_path / "ledger.db").restore()
    restarted.consume([stream(C, "post", "dropped", at=2.0, pending=("3",), **era)])
    assert _judged(restarted, clock) == set()


def test_the_restored_ledger_merges_the_other_sides_later_spans_into_the_same_finding(tmp_path):
    clock = Clock()
    before = _fed(clock, _incident_so_far())
    restarted = _restarted(before, clock, tmp_path / "ledger.db")
    restarted.consume([stream(SV, "resume", "clean", pending=("3",), cursor="41")])
    clock.now += 6 * S
    restarted.tick()
    (lost,) = [f for f in restarted.findings if f.rule == "clean_end_pending"]
    assert sorted(lost.roles) == [C, SV]


def test_a_session_its_client_deleted_stays_deleted_across_a_restart(tmp_path):
    clock = Clock()
    before = _fed(clock, [*_incident_so_far(), stream(C, "delete", "clean", ids=(), tool=None, at=1000.0)])
    restarted = _restarted(before, clock, tmp_path / "ledger.db")
    restarted.consume([stream(C, "resume", "http_error", ids=(), cursor="41", status=404, tool=None)])
    assert ("clean_end_pending", "3", (C,)) in _judged(restarted, clock)
    assert "session_expired_in_flight" not in {f.rule for f in restarted.findings}


def test_a_call_lost_to_a_failed_store_across_a_restart_is_flagged_unless_its_delivery_comes_in_the_grace(tmp_path):
    clock = Clock()
    before = _fed(clock, [call(SV, sc.OUTCOME_STORE_FAILED)])
    assert before.findings.dump() == []
    restarted = _restarted(before, clock, tmp_path / "lost.db")
    assert restarted.ledger.dump() == before.ledger.dump()
    assert _judged(restarted, clock) == _judged(before, clock) == {("store_failed", "3", (SV,))}
    delivered = _fed(clock, [call(SV, sc.OUTCOME_STORE_FAILED)])
    restarted = _restarted(delivered, clock, tmp_path / "delivered.db")
    restarted.consume([stream(C, "post", "clean", terminal=("3",), last="9")])
    assert _judged(restarted, clock) == set()


def test_a_result_sent_on_a_lost_connection_is_judged_across_a_restart_as_before_it(tmp_path):
    """Whether the cancel came late enough to be no race is kept too: with only the server's spans, one that may
    have crossed the result stays quiet after a restart as before it."""
    for cancelled, expected in ((3.0, {("sent_not_received", "3", (SV,))}), (1.5, set())):
        clock = Clock()
        before = _fed(clock, [cancelled_late(sent=1.0, cancelled=cancelled)])
        restarted = _restarted(before, clock, tmp_path / f"{cancelled}.db")
        assert restarted.ledger.dump() == before.ledger.dump()
        assert _judged(restarted, clock) == _judged(before, clock) == expected


def test_a_snapshot_round_trips_the_whole_ledger(tmp_path):
    clock = Clock()
    before = _fed(clock, _incident_so_far() * 2)
    restarted = _restarted(before, clock, tmp_path / "ledger.db")
    assert restarted.ledger.dump() == before.ledger.dump()
    assert restarted.findings.dump() == before.findings.dump()
    assert restarted.registry.get_sample_value("mcp_stream_detector_snapshot_timestamp_seconds") == clock.now / 1e9


def test_a_restored_ledgers_look_ups_and_retry_window_are_charged_what_they_were(tmp_path):
    clock = Clock()
    before = _fed(clock, _incident_so_far() * 2)
    restarted = _restarted(before, clock, tmp_path / "ledger.db")
    before.ledger.account()
    restarted.ledger.account()
    assert restarted.ledger._seen and restarted.ledger._index_bytes == before.ledger._index_bytes  # its look-ups


def test_no_snapshot_means_a_fresh_start(tmp_path):
    fresh = Detector(CONFIG)
    assert not Snapshots(fresh, tmp_path / "ledger.db").restore()
    assert fresh.ledger.sessions == 0


def _errors(detector: Detector) -> float:
    return detector.registry.get_sample_value("mcp_stream_detector_errors_total", {"where": "snapshot"}) or 0


def test_a_newer_format_is_refused_and_never_overwritten(tmp_path, caplog):
    path = tmp_path / "ledger.db"
    with closing(sqlite3.connect(path)) as db:
        db.execute("CREATE TABLE meta (id INTEGER PRIMARY KEY, format INTEGER, taken_ns INTEGER)")
        db.execute("INSERT INTO meta VALUES (1, 99, 0)")
        db.commit()
    written = path.read_bytes()
    clock = Clock()
    detector = Detector(CONFIG, clock=clock)
    snapshots = Snapshots(detector, path)
    assert not snapshots.restore()
    detector.consume(_incident_so_far())
    snapshots.close()
    assert path.read_bytes() == written
    assert _errors(detector) == 1 and "newer format" in caplog.text


def _valid_snapshot(path: Path) -> None:
    clock = Clock()
    Snapshots(_fed(clock, _incident_so_far()), path).close()


def _corrupt(kind: str, path: Path) -> None:
    if kind == "garbage":
        path.write_bytes(b"not a database at all" * 100)
        return
    _valid_snapshot(path)
    if kind == "truncated":
        path.write_bytes(path.read_bytes()[:1000])
        return
    with closing(sqlite3.connect(path)) as db:
        statement = {"bad json": "UPDATE rows SET data = '{not json' WHERE kind = 'sessions'",
                     "unknown row kind": "UPDATE rows SET kind = 'mystery' WHERE kind = 'findings'",
                     "wrong types": "UPDATE rows SET data = '[\"x\"]' WHERE kind = 'sessions'",
                     "missing fields": "UPDATE rows SET data = '[{}]' WHERE kind = 'findings'",
                     "foreign database": "DROP TABLE meta"}[kind]
        db.execute(statement)
        if kind == "foreign database":
            db.execute("CREATE TABLE users (name TEXT)")
        db.commit()


@pytest.mark.parametrize("kind", ["garbage", "truncated", "bad json", "unknown row kind", "wrong types",
                                  "missing fields", "foreign database"])
def test_a_corrupt_snapshot_is_moved_aside_and_the_detector_starts_empty_saying_so(tmp_path, caplog, kind):
    path = tmp_path / "ledger.db"
    _corrupt(kind, path)
    detector = Detector(CONFIG, clock=Clock())
    snapshots = Snapshots(detector, path)
    assert not snapshots.restore()
    (aside,) = tmp_path.glob("ledger.db.corrupt-*")
    assert aside.stat().st_size > 0 and not path.exists()
    assert (detector.ledger.sessions, detector.ledger.calls, len(detector.findings)) == (0, 0, 0)
    assert _errors(detector) == 1 and "moved aside, starting empty" in caplog.text
    snapshots.close()  # and it writes a fresh one
    assert Snapshots(Detector(CONFIG), path).restore()


def test_a_second_writer_on_the_same_file_is_refused(tmp_path):
    first = Snapshots(Detector(CONFIG), tmp_path / "ledger.db")
    first.restore()
    with pytest.raises(SnapshotLocked, match="in use by another detector"):
        Snapshots(Detector(CONFIG), tmp_path / "ledger.db").restore()
    first.close()
    Snapshots(Detector(CONFIG), tmp_path / "ledger.db").restore()  # free once the first is gone


def test_a_failing_write_is_logged_with_its_cause_and_counted_and_never_raises(tmp_path, caplog):
    path = tmp_path / "ledger.db"
    path.mkdir()  # not a file SQLite can write
    detector = Detector(CONFIG, clock=Clock())
    snapshots = Snapshots(detector, path)
    assert not snapshots.restore()
    detector.consume(_incident_so_far())
    snapshots.close()
    (failed,) = [r for r in caplog.records if r.getMessage() == "snapshot failed"]
    assert _errors(detector) == 2 and "OperationalError" in failed.error


def test_a_version_1_snapshot_is_read_after_an_upgrade(tmp_path):
    clock = Clock()
    before = _fed(clock, _incident_so_far())
    with closing(sqlite3.connect(tmp_path / "ledger.db")) as db:
        db.execute("CREATE TABLE snapshot (id INTEGER PRIMARY KEY, format INTEGER, taken_ns INTEGER, ledger TEXT, "
                   "findings TEXT)")
        db.execute("INSERT INTO snapshot VALUES (1, 1, ?, ?, ?)", (clock.now, json.dumps(before.ledger.dump()),
                                                                   json.dumps(before.findings.dump())))
        db.commit()
    restarted = Detector(CONFIG, clock=clock)
    assert Snapshots(restarted, tmp_path / "ledger.db").restore()
    assert _judged(restarted, clock) == _judged(before, clock)


def test_a_large_ledger_is_written_in_bounded_rows_and_never_serialised_under_the_detectors_lock(tmp_path,
                                                                                                    monkeypatch):
    clock = Clock()
    detector = Detector(CONFIG, clock=clock)
    for i in range(0, 6000, 500):
        detector.consume([stream(C, "post", "dropped", pending=("1",), session=f"{'s' * 200}{j}")
                          for j in range(i, i + 500)])
    real_dumps = snapshot.json.dumps

    def checked_dumps(*args, **kwargs):
        assert not detector.lock.locked(), "serialising under the detector's lock"
        return real_dumps(*args, **kwargs)

    monkeypatch.setattr(snapshot.json, "dumps", checked_dumps)
    Snapshots(detector, tmp_path / "ledger.db").close()
    monkeypatch.undo()
    with closing(sqlite3.connect(tmp_path / "ledger.db")) as db:
        sizes = [n for (n,) in db.execute("SELECT length(data) FROM rows WHERE kind = 'sessions'")]
    assert len(sizes) > 1 and max(sizes) < 2 * snapshot._CHUNK_BYTES
    restarted = Detector(CONFIG, clock=clock)
    assert Snapshots(restarted, tmp_path / "ledger.db").restore()
    assert restarted.ledger.dump() == detector.ledger.dump()


def test_spans_applied_while_a_snapshot_copies_its_sessions_are_never_restored_without_their_timers(tmp_path,
                                                                                                      monkeypatch):
    """Ingest goes on between the snapshot's chunks of sessions. Spans it applies then may be in a session copied
    after them; the timers, look-ups and findings restored with it are never older, so the clean end they bring is
    restored with it (after a crash, no final snapshot, the call it leaves owed is not judged, but counted), and
    the findings they raised are still there."""
    clock = Clock()
    spans = _incident_so_far()
    detector = _fed(clock, spans[:1])  # the session exists; the rest of the incident comes during the snapshot
    snapshots = Snapshots(detector, tmp_path / "ledger.db")
    chunks = snapshots._chunks

    def chunks_after_ingest(keys: list[str], per_lock: int, read: Callable[[list[str]], list]) -> Iterator[list]:
        for span in spans[1:]:  # as the ingest thread would, between two holds of the lock
            detector.consume([span])
        monkeypatch.setattr(snapshots, "_chunks", chunks)
        return chunks(keys, per_lock, read)

    monkeypatch.setattr(snapshots, "_chunks", chunks_after_ingest)
    snapshots.save()
    assert {f.rule for f in detector.findings} >= {"narrowed_resume", "replay_truncated"}
    snapshots._lock_file, lock_file = None, snapshots._lock_file  # a crash: no final snapshot, the lock let go
    os.close(lock_file)
    restarted = Detector(CONFIG, clock=clock)
    assert Snapshots(restarted, tmp_path / "ledger.db").restore()
    assert {f.id for f in restarted.findings} == {f.id for f in detector.findings}
    assert restarted.metrics.unjudged_calls._value.get() == 1  # its clean end came with its session: owed


def test_a_delivery_applied_while_the_sessions_are_copied_is_applied_again_when_its_batch_comes_again(tmp_path,
                                                                                                      monkeypatch):
    """A span the ingest thread applies once its session was copied is not in the snapshot: after a crash, the
    exporter sends its batch again (the answer was lost with the process), and it must not be taken as seen."""
    clock = Clock()
    detector = _fed(clock, [stream(C, "post", "clean", pending=("3",), last="41")])  # its grace timer runs
    delivery = [stream(C, "resume", "clean", ids=("3",), terminal=("3",), cursor="41", last="42")]
    snapshots = Snapshots(detector, tmp_path / "ledger.db")
    chunks = snapshots._chunks

    def sessions_then_ingest(keys: list[str], per_lock: int, read: Callable[[list[str]], list]) -> Iterator[list]:
        yield from chunks(keys, per_lock, read)
        detector.consume(delivery)
        monkeypatch.setattr(snapshots, "_chunks", chunks)

    monkeypatch.setattr(snapshots, "_chunks", sessions_then_ingest)
    snapshots.save()
    assert _judged(detector, clock) == set()
    snapshots._lock_file, lock_file = None, snapshots._lock_file  # a crash: no final snapshot, the lock let go
    os.close(lock_file)
    restarted = Detector(CONFIG, clock=clock)
    assert Snapshots(restarted, tmp_path / "ledger.db").restore()
    restarted.consume(delivery)
    assert _judged(restarted, clock) == set()


def test_a_scrape_reads_its_time_between_batches():
    """A batch holds the detector's lock from the time its findings are stamped with to their count: a scrape that
    read its time within one would say it saw a finding whose count it did not, which a restore would then skip."""
    held: list[bool] = []
    detector = Detector(CONFIG, clock=lambda: held.append(detector.lock.locked()) or 100 * S)
    held.clear()
    assert TestClient(create_app(detector)).get("/metrics").status_code == 200
    assert held == [True] and detector.scraped_ns == 100 * S
