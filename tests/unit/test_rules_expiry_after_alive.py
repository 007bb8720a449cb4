"""A clean end that left a call pending, on a session shown alive after it, is the loss even if a 404 follows.

A session that goes away (its idle timeout, a restart) ends its streams cleanly first, then every request
gets 404: the clean end is no silent loss, the session expired with the call (``session_expired_in_flight``).
But a resume of the session that started after that clean end and was answered 2xx (by the same side's
clock) shows the session still existed: the clean end lost the call while it lived (``clean_end_pending``,
critical), and a later 404 only joins that finding. Spans come in any order: judged when a grace runs out.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import pytest

from mcp_stream_exporter import semconv as sc
from mcp_stream_exporter.detector import Detector, DetectorConfig, RuleConfig, Span
from mcp_stream_exporter.detector.ledger import _PAIR_BYTES, _call_bytes
from mcp_stream_exporter.detector.snapshot import Snapshots

from spans import Clock, S, stream

C, SV = sc.ROLE_CLIENT, sc.ROLE_SERVER
CONFIG = DetectorConfig(rules=RuleConfig(clean_end_grace_s=5, reissue_grace_s=5, resume_loop_count=3,
                                         resume_loop_window_s=10))


def _feed(detector: Detector, clock: Clock, spans: Sequence[Span]) -> None:
    for span in spans:
        detector.consume([span])
        clock.now += S // 10


def run(spans: Sequence[Span], *, after_s: float = 6.0) -> Detector:
    clock = Clock()
    detector = Detector(CONFIG, clock=clock)
    _feed(detector, clock, spans)
    clock.now += int(after_s * S)
    detector.tick()
    return detector


def rules(detector: Detector) -> list[str]:
    return sorted(f.rule for f in detector.findings)


def _clean_end(role: str = C, at: float = 1.0) -> Span:
    """The incident's silent end: a resume answered, ended cleanly, the call still pending."""
    return stream(role, "resume", "clean", pending=("3",), cursor="6", at=at)


def _gone(role: str = C, at: float = 3.0) -> Span:
    """A request on the session got 404 (its POST: no cursor, so no resume loop in these tests)."""
    return stream(role, "post", "http_error", ids=(), status=404, tool=None, at=at)


def _answered(kind: str, role: str = C, at: float = 2.0, status: int | None = 200) -> Span:
    """A stream of the session answered ``status``: the client's next resume (empty, ended clean with the call
    pending again, as the SDK's legacy client resumes on), another call's resume, a standalone GET, another call's
    POST. Only a resume counts (``RuleEngine.stream``)."""
    if kind == "resume":
        return stream(role, "resume", "clean", pending=("3",), cursor="6", at=at, status=status)
    if kind == "other resume":
        return stream(role, "resume", "clean", ids=(), tool=None, cursor="9", at=at, status=status)
    if kind == "get":
        return stream(role, "get", "clean", ids=(), tool=None, at=at, status=status)
    return stream(role, "post", "clean", ids=("4",), terminal=("4",), at=at, status=status)


def _only_loss(detector: Detector) -> dict[str, object]:
    (finding,) = detector.findings
    assert (finding.rule, finding.severity, finding.request_id) == ("clean_end_pending", "critical", "3")
    return finding.evidence


@pytest.mark.parametrize("kind", ["resume", "other resume"])
def test_a_clean_end_its_session_outlived_is_the_loss_when_a_404_follows(kind):
    detector = run([_clean_end(), _answered(kind), _gone()])
    evidence = _only_loss(detector)
    assert evidence["also"] == ["session_expired_in_flight"] and evidence["status"] == 404  # the expiry joins it
    assert detector.registry.get_sample_value("mcp_stream_silent_losses_total",
                                              {"tool": "fetch", "rule": "clean_end_pending"}) == 1.0
    assert detector.registry.get_sample_value("mcp_stream_silent_losses_total",
                                              {"tool": "fetch", "rule": "session_expired_in_flight"}) == 0.0
    assert detector.ledger.in_flight == 0  # its session is gone all the same


@pytest.mark.parametrize("kind", ["resume", "other resume"])
def test_the_spans_may_come_in_any_order(kind):
    spans = (_clean_end(), _answered(kind), _gone())
    for order in itertools.permutations(spans):
        evidence = _only_loss(run(order))
        assert evidence["also"] == ["session_expired_in_flight"], [s.name for s in order]


def test_a_clean_end_learned_after_the_expirys_grace_began_is_still_judged_first():
    """The 404 judged a call in flight (a dropped POST) a grace after it; the clean end and the answered resume
    came later (an exporter behind): the expiry waits for the clean end's grace, which then pages."""
    clock = Clock()
    detector = Detector(CONFIG, clock=clock)
    _feed(detector, clock, [stream(C, "post", "dropped", pending=("3",), last="6", at=0.5), _gone()])
    clock.now += 3 * S
    _feed(detector, clock, [_clean_end(), _answered("resume")])
    clock.now += 2 * S + S // 2  # the expiry's grace is over, not the clean end's
    detector.tick()
    assert rules(detector) == []
    clock.now += 3 * S
    detector.tick()
    assert _only_loss(detector)["also"] == ["session_expired_in_flight"]


@pytest.mark.parametrize("role", [C, SV])
def test_a_restart_ends_streams_cleanly_then_answers_404_and_that_is_the_expiry(role):
    for order in itertools.permutations((_clean_end(role), _gone(role))):
        detector = run(order)
        (finding,) = detector.findings
        assert (finding.rule, finding.severity) == ("session_expired_in_flight", "warning")
        assert "clean_end_pending" not in rules(detector)


@pytest.mark.parametrize("kind", ["get", "post"])
def test_only_a_resume_answered_after_the_clean_end_counts(kind):
    """A standalone GET or another call's POST would show it too, but nearly every session has one: the time
    kept of it would cost every tracked call more than its memory budget."""
    for order in itertools.permutations((_clean_end(), _answered(kind), _gone())):
        assert rules(run(order)) == ["session_expired_in_flight"], [s.name for s in order]


def test_an_answer_that_shows_nothing_of_the_session_after_the_clean_end_does_not_count():
    for answered in (_answered("other resume", status=307),  # a redirect: answered before the session was looked up
                     _answered("other resume", status=404),
                     stream(C, "resume", "dropped", pending=("3",), cursor="6", at=2.0, status=None)):  # no answer
        assert rules(run([_clean_end(), answered, _gone()])) == ["session_expired_in_flight"]


def test_a_stream_answered_that_started_before_the_clean_end_does_not_count():
    standalone = _answered("other resume", at=0.5)
    long_lived = dataclasses.replace(standalone, end_ns=int(2.5 * S))  # open across the clean end, ended after it
    for spans in ([standalone, _clean_end(), _gone()], [_clean_end(), long_lived, _gone()],
                  [_gone(), long_lived, _clean_end()]):
        assert rules(run(spans)) == ["session_expired_in_flight"]


def test_a_stream_answered_after_a_clean_end_that_a_later_one_superseded_does_not_count():
    """The answered resume moved the call on (its next event) and then ended clean with it pending: the clean end
    judged is its own, and nothing of the session was seen answered after it."""
    moved = stream(C, "resume", "clean", pending=("3",), cursor="6", last="8", events=1, at=2.0)
    for order in itertools.permutations((_clean_end(), moved, _gone())):
        assert rules(run(order)) == ["session_expired_in_flight"], [s.name for s in order]


def test_a_stream_answered_on_the_other_sides_clock_does_not_count():
    """The client's clean end and the server's answered stream are not compared: their clocks may disagree."""
    for at in (2.0, 50.0):
        for answered in (_answered("resume", role=SV, at=at), _answered("other resume", role=SV, at=at)):
            for order in itertools.permutations((_clean_end(C), answered, _gone(C))):
                assert rules(run(order)) == ["session_expired_in_flight"], (at, [s.name for s in order])


def test_either_sides_clean_end_compares_with_that_sides_answered_streams():
    both = [_clean_end(C), _clean_end(SV, at=1.2), _answered("other resume", role=SV, at=2.0), _gone(C)]
    for order in itertools.permutations(both):
        assert rules(run(order)) == ["clean_end_pending"]


def test_what_the_session_showed_answered_is_kept_across_a_restart(tmp_path):
    clock = Clock()
    before = Detector(CONFIG, clock=clock)
    _feed(before, clock, [_answered("resume"), _clean_end()])  # the answered resume's span first: it ends clean too
    Snapshots(before, tmp_path / "ledger.db").close()  # saves, and lets the next one take the file
    restarted = Detector(CONFIG, clock=clock)
    assert Snapshots(restarted, tmp_path / "ledger.db").restore()
    assert restarted.ledger.dump() == before.ledger.dump()
    before.ledger.account()
    restarted.ledger.account()
    assert restarted.ledger._bytes == before.ledger._bytes  # sessions and calls: charged alike
    restarted.consume([_gone()])
    clock.now += 6 * S
    restarted.tick()
    assert _only_loss(restarted)["also"] == ["session_expired_in_flight"]


def test_a_restart_of_the_detector_keeps_a_call_that_a_restart_of_the_server_took_as_expired(tmp_path):
    clock = Clock()
    before = Detector(CONFIG, clock=clock)
    _feed(before, clock, [_answered("other resume", at=0.5), _clean_end()])
    Snapshots(before, tmp_path / "ledger.db").close()
    restarted = Detector(CONFIG, clock=clock)
    assert Snapshots(restarted, tmp_path / "ledger.db").restore()
    restarted.consume([_gone()])
    clock.now += 6 * S
    restarted.tick()
    assert rules(restarted) == ["session_expired_in_flight"]


def test_what_a_session_and_a_call_keep_of_it_is_charged_and_given_back():
    clock = Clock()
    detector = Detector(CONFIG, clock=clock)
    ledger = detector.ledger
    _feed(detector, clock, [_answered("get", at=0.4)])  # the session (nothing kept of a GET)
    ledger.account()
    bare = ledger.bytes
    session = ledger.session("s1", clock.now)
    ledger.answered(session, C, int(0.5 * S))
    ledger.account()
    assert ledger.bytes == bare + _PAIR_BYTES
    ledger.answered(session, C, int(0.7 * S))
    ledger.answered(session, SV, int(0.6 * S))  # times replaced: as much
    ledger.account()
    assert ledger.bytes == bare + _PAIR_BYTES
    assert ledger.answered_at("s1") == (int(0.7 * S), int(0.6 * S))
    _feed(detector, clock, [_answered("resume", at=2.0)])  # a clean end first: the clock stands for it, nothing kept
    (call,) = ledger.in_session("s1")
    assert call.clean_seen is not None and len(call.clean_seen) == 3
    plain = _call_bytes(call)
    _feed(detector, clock, [_clean_end()])  # an earlier one, its span later: kept beside it, and charged
    assert call.clean_seen is not None and call.clean_seen[3:] == (int(1.0 * S) + 1000, 0)
    assert _call_bytes(call) > plain
    clock.now += 2 * 3600 * S  # the session goes (its TTL), and what was charged for it with it
    detector.tick()
    ledger.account()
    assert (ledger.sessions, ledger._bytes) == (0, 0)
