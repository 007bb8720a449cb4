"""Each rule fires on its scenario and stays silent on the healthy twin (spans as the hooks emit them)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import sqlite3
from collections.abc import Sequence
from contextlib import closing
from pathlib import Path

from mcp_stream_exporter import semconv as sc
from mcp_stream_exporter.detector import RULES, Detector, DetectorConfig, LedgerLimits, RuleConfig, RuleId, Span
from mcp_stream_exporter.detector.snapshot import Snapshots

from spans import FETCH, SEARCH, S, call, cancelled_late, replay, sdk_call, stream

ROOT = Path(__file__).resolve().parents[2]

C, SV = sc.ROLE_CLIENT, sc.ROLE_SERVER


class Clock:
    def __init__(self) -> None:
        self.now = 100 * S

    def __call__(self) -> int:
        return self.now


def run(spans: Sequence[Span], *, after_s: float = 0.0) -> Detector:
    clock = Clock()
    detector = Detector(DetectorConfig(rules=RuleConfig(clean_end_grace_s=5, reissue_grace_s=5, resume_loop_count=3,
                                                        resume_loop_window_s=10)), clock=clock)
    for span in spans:
        detector.consume([span])
        clock.now += S // 10
    clock.now += int(after_s * S)
    detector.tick()
    return detector


def rules(detector: Detector) -> list[str]:
    return sorted(f.rule for f in detector.findings)


def test_every_rule_is_named_by_its_id_enum_whose_values_are_the_documented_ids():
    assert list(RULES) == list(RuleId)
    assert all(RULES[rule.value].id is rule for rule in RuleId)  # looked up by the plain id a label carries
    documented = (ROOT / "docs" / "rules.md").read_text()
    assert all(f"| `{rule.value}` |" in documented for rule in RuleId)


def test_clean_end_pending_fires_after_the_grace_period_and_not_before():
    spans = [stream(C, "resume", "clean", pending=("3",), cursor="6")]
    assert rules(run(spans, after_s=1)) == []
    (finding,) = run(spans, after_s=6).findings
    assert (finding.rule, finding.tool, finding.request_id, finding.severity) == ("clean_end_pending", "fetch", "3",
                                                                                  "critical")


def test_clean_end_pending_is_silent_when_the_result_arrives_on_a_later_resume():
    spans = [stream(C, "post", "clean", pending=("3",)),  # the server closed the stream (polling)
             stream(C, "resume", "clean", cursor="6", terminal=("3",), last="9")]
    assert rules(run(spans, after_s=60)) == []


def test_a_clean_end_with_an_error_frame_is_an_explicit_answer_not_a_silent_loss_where_its_client_heeds_it():
    """The server sent it; a client with the resolver fails the call at it and closes the stream. One that read on
    past it to the end (the SDK alone drops the frame) told its caller nothing: that clean end is silent."""
    refusal = {"pending": ("3",), "cursor": "6", "error_frames": 1, "missing": (FETCH,)}
    assert rules(run([stream(SV, "resume", "clean", **refusal)], after_s=60)) == []
    assert rules(run([stream(C, "resume", "closed", **refusal)], after_s=60)) == []
    assert rules(run([stream(C, "resume", "clean", **refusal)], after_s=60)) == ["clean_end_pending"]


def test_client_and_server_views_of_one_loss_make_one_finding_with_both_roles():
    spans = [stream(C, "resume", "clean", pending=("3",), cursor="6"),
             stream(SV, "resume", "clean", pending=("3",), cursor="6")]
    detector = run(spans, after_s=6)
    (finding,) = detector.findings
    assert sorted(finding.roles) == [C, SV]
    sample = detector.registry.get_sample_value("mcp_stream_silent_losses_total",
                                                {"tool": "fetch", "rule": "clean_end_pending"})
    assert sample == 1.0


def test_the_other_sides_view_of_a_loss_joins_its_finding_when_it_comes_after_the_grace():
    detector = run([stream(C, "resume", "clean", pending=("3",), cursor="6")], after_s=6)
    (finding,) = detector.findings
    assert finding.roles == [C]
    detector.consume([stream(SV, "resume", "clean", pending=("3",), cursor="6")])  # a server exporter running late
    detector.tick()
    (finding,) = detector.findings
    assert sorted(finding.roles) == [C, SV]
    assert detector.registry.get_sample_value("mcp_stream_silent_losses_total",
                                              {"tool": "fetch", "rule": "clean_end_pending"}) == 1.0


def test_narrowed_resume_records_the_audience_gap_and_is_silent_with_a_superset_token():
    narrowed = run([stream(C, "resume", "clean", pending=("3",), cursor="6", audience=(SEARCH,), missing=(FETCH,))])
    (finding,) = narrowed.findings
    assert finding.rule == "narrowed_resume"
    assert finding.evidence["audience_held"] == [SEARCH]
    assert finding.evidence["missing_resources"] == [FETCH]
    assert rules(run([stream(C, "resume", "clean", pending=("3",), cursor="6")])) == []


def test_a_narrowed_resume_answered_with_an_http_error_or_a_redirect_is_no_finding():
    """No stream came (a 4xx, a redirect the client follows): its client was told, and nothing was carried."""
    for role in (C, SV):
        for status in (400, 307):
            assert rules(run([stream(role, "resume", "http_error", pending=("3",), cursor="6", audience=(SEARCH,),
                                     missing=(FETCH,), status=status)])) == []


def test_a_narrowed_resume_cut_before_anything_came_is_no_finding_one_that_delivered_events_is():
    """Cut before its first frame, the stream says nothing of the server's answer: the guard's error frame may have
    been that frame (its next resume, refused, tells). One that carried events to the narrower token did get them."""
    narrowed = {"pending": ("3",), "cursor": "6", "audience": (SEARCH,), "missing": (FETCH,)}
    assert rules(run([stream(C, "resume", "dropped", **narrowed)], after_s=1)) == []
    assert rules(run([stream(C, "resume", "dropped", events=2, last="8", **narrowed)], after_s=1)) == [
        "narrowed_resume"]


def test_a_narrowed_resume_still_open_is_judged_at_its_end_where_an_error_frame_after_its_prefix_tells():
    """The guard's prefix policy sends what the token covers, then its error frame: the resume's span of it so far
    (``open``) cannot know of the frame yet, and raised a finding the refusal answered."""
    narrowed = {"pending": ("3",), "cursor": "6", "audience": (SEARCH,), "missing": (FETCH,)}
    for role in (C, SV):
        so_far = stream(role, "resume", "open", events=1, first="7", last="7", **narrowed)
        refused = stream(role, "resume", "clean", at=1.1, events=1, first="7", last="7", error_frames=1, **narrowed)
        assert "narrowed_resume" not in rules(run([so_far, refused], after_s=1))
        assert "narrowed_resume" in rules(run([so_far, stream(role, "resume", "clean", at=1.1, events=2, first="7",
                                                              last="8", **narrowed)], after_s=1))
        # one that never ends (the SDK keeps it open for no caller; a client that crashed): judged a grace later
        assert "narrowed_resume" not in rules(run([so_far], after_s=1))
        (finding,) = run([so_far], after_s=6).findings
        assert (finding.rule, finding.evidence["end_reason"]) == ("narrowed_resume", "open")
        assert "narrowed_resume" not in rules(run([so_far, refused], after_s=60))
        assert "narrowed_resume" not in rules(run([refused, so_far], after_s=60))  # its end came first
        # a later resume still open is judged on its own grace, not on the timer an earlier one left
        later = {**narrowed, "cursor": "7", "first": "8", "last": "8"}
        again = stream(role, "resume", "open", at=4.0, events=1, **later)
        refused_again = stream(role, "resume", "clean", at=4.1, events=1, error_frames=1, **later)
        assert "narrowed_resume" not in rules(run([so_far, refused, again], after_s=2))
        assert "narrowed_resume" not in rules(run([so_far, refused, again, refused_again], after_s=60))
        (finding,) = run([so_far, refused, again], after_s=6).findings
        assert (finding.rule, finding.evidence["cursor"]) == ("narrowed_resume", "7")
        # refused as the other side tells it (the guard's replay span; the other side's error frame), in any order
        other = SV if role == C else C
        told = stream(other, "resume", "clean", at=1.1, events=1, first="7", last="7", error_frames=1, **narrowed)
        for spans in ([so_far, told],
                      [so_far, replay(sc.REPLAY_REFUSED, cursor="6", missing=(FETCH,), guard=sc.GUARD_REFUSE)]):
            assert "narrowed_resume" not in rules(run(spans, after_s=60))
        # its end names no call (its caller gave up as the error frame came): ended all the same, whichever side
        nameless = {**narrowed, "pending": (), "ids": ()}
        refused_late = stream(role, "resume", "clean", events=1, error_frames=1, **nameless)  # the same start
        refused_there = stream(other, "resume", "clean", at=1.1, events=1, error_frames=1, **nameless)
        for spans in ([so_far, refused_late], [refused_late, so_far], [so_far, refused_there]):
            assert "narrowed_resume" not in rules(run(spans, after_s=60))
        # a resume that carried two calls, one delivered (its token covers it), then refused at the other: its end
        # names the delivered one no more among those pending
        both = stream(role, "resume", "open", events=1, ids=("3", "4"), pending=("3", "4"), cursor="6",
                      audience=(SEARCH,), missing=(FETCH,))
        ended = stream(role, "resume", "clean", events=2, ids=("3", "4"), pending=("3",), terminal=("4",),
                       error_frames=1, cursor="6", audience=(SEARCH,), missing=(FETCH,))
        assert "narrowed_resume" not in rules(run([both, ended], after_s=60))


def test_narrowed_resumes_held_open_are_bounded_a_call_and_in_all():
    narrowed = {"pending": ("3",), "cursor": "6", "audience": (SEARCH,), "missing": (FETCH,)}
    detector = run([stream(C, "resume", "open", at=1 + n / 100, events=1, **narrowed) for n in range(20)])
    held = detector.ledger.dump_rest()["open_narrowed"]
    assert [len(entries) for _, _, entries in held] == [8]  # the newest of one call's
    many = Detector(clock=Clock())
    many.consume([stream(C, "resume", "open", session=f"s{n}", events=1, **narrowed) for n in range(1100)])
    assert sum(len(entries) for _, _, entries in many.ledger.dump_rest()["open_narrowed"]) == 1024


def test_narrowed_resume_from_the_server_replay_and_the_client_stream_is_one_finding():
    detector = run([replay(sc.REPLAY_TRUNCATED, missing=(FETCH,)),
                    stream(C, "resume", "clean", pending=("3",), cursor="6", audience=(SEARCH,), missing=(FETCH,))])
    assert rules(detector) == ["narrowed_resume", "replay_truncated"]


def test_a_refused_replay_is_the_guard_working_not_a_narrowed_resume():
    detector = run([replay(sc.REPLAY_REFUSED, missing=(FETCH,), guard=sc.GUARD_REFUSE)])
    assert rules(detector) == []


def test_replay_truncated_fires_on_a_truncated_replay_and_not_on_a_complete_one():
    (finding,) = run([replay(sc.REPLAY_TRUNCATED)]).findings
    assert (finding.rule, finding.evidence["offending_event_id"]) == ("replay_truncated", "8")
    assert rules(run([replay(sc.REPLAY_COMPLETE, sent=4)])) == []


def test_cursor_past_undelivered_fires_when_a_replay_skips_events_then_sends_later_ones():
    detector = run([replay(sc.REPLAY_TRUNCATED, sent=2, skipped=2)])
    assert rules(detector) == ["cursor_past_undelivered"]
    assert rules(run([replay(sc.REPLAY_TRUNCATED, sent=2, skipped=0)])) == ["replay_truncated"]


def test_a_replay_interrupted_by_its_client_leaving_is_no_truncation_but_what_it_skipped_still_pages():
    assert rules(run([replay(sc.REPLAY_INTERRUPTED, sent=2)])) == []
    assert rules(run([replay(sc.REPLAY_INTERRUPTED, sent=2, skipped=1)])) == ["cursor_past_undelivered"]


def test_resume_loop_fires_on_repeated_resumes_without_progress_within_the_window():
    loop = [stream(C, "resume", "clean", pending=("3",), cursor="6", at=t) for t in (1.0, 1.2, 1.4)]
    assert "resume_loop" in rules(run(loop))
    progressing = [stream(C, "resume", "clean", pending=("3",), cursor=c, last=n, events=1, at=t)
                   for t, c, n in ((1.0, "6", "8"), (1.2, "8", "10"), (1.4, "10", "12"))]
    assert "resume_loop" not in rules(run(progressing))
    spread = [stream(C, "resume", "clean", pending=("3",), cursor="6", at=t) for t in (1.0, 20.0, 40.0)]
    assert "resume_loop" not in rules(run(spread))


def test_session_expired_in_flight_fires_on_a_404_while_a_call_is_owed():
    owed = stream(C, "post", "dropped", pending=("3",), last="6")
    expired = stream(C, "resume", "http_error", ids=("3",), cursor="6", status=404)
    assert rules(run([owed, expired], after_s=1)) == []  # judged a grace later
    assert rules(run([owed, expired], after_s=6)) == ["session_expired_in_flight"]
    delivered = stream(C, "resume", "clean", cursor="6", terminal=("3",), last="9")
    assert rules(run([owed, delivered, expired], after_s=6)) == []
    assert rules(run([owed, expired, delivered], after_s=6)) == []  # the delivery's span came after the 404's


def test_a_404_while_a_call_is_owed_is_no_expiry_once_its_caller_is_told_by_a_refused_resume_it_heeded():
    """A replica answering from shared storage for a session whose owner died refuses the call's resume
    (``session_owner_gone``), and the SDK's standalone GET, reconnected to it, gets 404: the caller the resolver told
    at the frame (the client closes the stream) lost nothing silently; one whose client read on past it did."""
    owed = stream(C, "post", "dropped", pending=("3",), last="6")
    standalone_gone = stream(C, "get", "http_error", ids=(), tool=None, status=404, at=1.0)
    heeded = stream(C, "resume", "closed", pending=("3",), cursor="6", error_frames=1, at=1.3)
    for spans in ([owed, standalone_gone, heeded], [owed, heeded, standalone_gone]):
        assert rules(run(spans, after_s=60)) == []
    unheeded = stream(C, "resume", "clean", pending=("3",), cursor="6", error_frames=1, at=1.3)
    for spans in ([owed, standalone_gone, unheeded], [owed, unheeded, standalone_gone]):
        assert rules(run(spans, after_s=60)) == ["session_expired_in_flight"]


def test_a_404_after_the_client_deleted_its_session_is_no_expiry_and_the_clean_end_stays_the_loss():
    # the server's view of the incident's end: the SDK client, resuming on after its caller gave up, sends a
    # resume or a notification after its own DELETE; whichever comes first, the loss is the clean end's
    pending = stream(SV, "resume", "clean", pending=("3",), cursor="6", audience=(SEARCH,), missing=(FETCH,))
    deleted = stream(SV, "delete", "clean", ids=(), tool=None, at=2.0)  # at exit, after the loss
    for stray in (stream(SV, "resume", "http_error", ids=(), cursor="6", status=404, tool=None),
                  stream(SV, "post", "http_error", ids=(), status=404, tool=None)):
        detector = run([pending, deleted, stray], after_s=6)
        assert rules(detector) == ["clean_end_pending", "narrowed_resume"]
        (lost,) = (f for f in detector.findings if f.rule == "clean_end_pending")
        assert lost.severity == "critical" and "also" not in lost.evidence
    refused = stream(SV, "delete", "http_error", ids=(), tool=None, status=404)  # not the client's: it was gone
    expired = stream(SV, "resume", "http_error", ids=(), cursor="6", status=404, tool=None)
    assert rules(run([pending, refused, expired], after_s=6)) == ["narrowed_resume", "session_expired_in_flight"]


def test_unknown_cursor_fires_on_an_empty_answer_and_not_on_the_guards_explicit_error():
    assert rules(run([replay(sc.REPLAY_UNKNOWN_CURSOR, request_id=None, buffered=0)])) == ["unknown_cursor"]
    assert rules(run([replay(sc.REPLAY_UNKNOWN_CURSOR, request_id=None, buffered=0,
                             guard=sc.GUARD_UNKNOWN_CURSOR)])) == []


def test_an_unknown_cursor_is_one_finding_of_its_cursor_whatever_order_the_spans_come_in():
    """The server's hooks tie no call to a cursor unknown to them; the stream that ended there may be told by the
    client's spans before or after the replay's: one finding, keyed by the cursor, in either order."""
    dropped = stream(C, "post", "dropped", pending=("3",), last="6")
    unknown = [replay(sc.REPLAY_UNKNOWN_CURSOR, request_id=None, buffered=0, at=t) for t in (2.0, 2.5)]
    for spans in ([dropped, *unknown], [unknown[0], dropped, unknown[1]], [*unknown, dropped]):
        found = [f for f in run(spans).findings if f.rule == "unknown_cursor"]
        assert [(f.request_id, f.tool) for f in found] == [(None, None)]


def test_cross_stream_replay_fires_on_foreign_events():
    assert "cross_stream_replay" in rules(run([replay(sc.REPLAY_COMPLETE, sent=4, foreign=("7", "9"))]))
    assert rules(run([replay(sc.REPLAY_COMPLETE, sent=4)])) == []


def test_foreign_result_fires_when_a_stream_delivers_another_calls_id():
    (finding,) = run([stream(C, "resume", "clean", cursor="6", terminal=("2",), last="12")]).findings
    assert (finding.rule, finding.request_id, finding.evidence["wire_ids"]) == ("foreign_result", "3", ["2"])
    assert rules(run([stream(C, "resume", "clean", cursor="6", terminal=("3",), last="12")])) == []


def test_another_calls_result_after_a_streams_own_reaches_no_caller():
    """The SDK client takes the first response on a call's stream as its result and reads no further."""
    for role in (C, SV):
        after = stream(role, "resume", "clean", cursor="6", terminal=("3", "2"), last="12")
        assert rules(run([after])) == []
        before = stream(role, "resume", "clean", cursor="6", terminal=("2", "3"), last="12")
        assert rules(run([before])) == ["foreign_result"]
    # a full list has its own id first, whatever came before it: a flood of others' results then pages
    flooded = stream(C, "resume", "clean", cursor="6", terminal=("3", *(str(n) for n in range(100, 355))), last="12")
    assert rules(run([flooded])) == ["foreign_result"]


def test_duplicate_terminal_fires_when_one_side_sees_the_terminal_twice():
    twice = [stream(C, "resume", "clean", cursor="6", terminal=("3",), last="12"),
             stream(C, "resume", "clean", cursor="6", terminal=("3",), last="12")]
    assert rules(run(twice)) == ["duplicate_terminal"]
    both_sides = [stream(C, "resume", "clean", cursor="6", terminal=("3",), last="12"),
                  stream(SV, "resume", "clean", cursor="6", terminal=("3",), last="12")]
    assert rules(run(both_sides)) == []
    sent_twice = [stream(SV, "post", "clean", terminal=("3",), last="12"),
                  stream(SV, "post", "clean", terminal=("3",), last="13")]
    assert rules(run(sent_twice)) == ["duplicate_terminal"]


def test_a_server_replaying_a_result_it_sent_before_to_its_resuming_client_is_no_duplicate():
    """Written into a connection its client had lost (a half-open one), the result is replayed to the resume: the
    recovery. The client's spans, where there are any, show one delivery."""
    recovered = [stream(SV, "post", "clean", terminal=("3",), last="12"),
                 stream(SV, "resume", "clean", cursor="6", terminal=("3",), last="12"),
                 stream(C, "resume", "clean", cursor="6", terminal=("3",), last="12")]
    assert rules(run(recovered)) == []


def test_a_page_a_later_delivery_to_its_waiting_caller_contradicts_says_so_and_counts_it_once():
    # a page is final; a wrong one is told: the delivery's span came past the grace (an exporter that held it)
    clock = Clock()
    detector = Detector(DetectorConfig(rules=RuleConfig(clean_end_grace_s=5)), clock=clock)
    detector.consume([stream(C, "resume", "clean", pending=("3",), cursor="6")])
    clock.now += 6 * S
    detector.tick()
    (lost,) = detector.findings
    delivered = stream(C, "resume", "clean", cursor="6", terminal=("3",), last="9", at=1.5)
    detector.consume([delivered, dataclasses.replace(delivered, span_id="f" * 16)])
    assert lost.rule == "clean_end_pending" and lost.evidence["delivered_after"] == clock.now / 1e9
    contradicted = {"rule": "clean_end_pending"}
    assert detector.registry.get_sample_value("mcp_stream_findings_contradicted_total", contradicted) == 1.0
    # its caller gave up first (its timeout): the delivery reached no one, and the page stands as it is
    gave_up = run([stream(C, "resume", "clean", pending=("3",), cursor="6"), call(C, sc.OUTCOME_CANCELLED, at=3.0)],
                  after_s=6)
    gave_up.consume([delivered])
    assert all("delivered_after" not in f.evidence for f in gave_up.findings)
    assert gave_up.registry.get_sample_value("mcp_stream_findings_contradicted_total", contradicted) == 0.0


def test_timeout_attributed_links_a_client_timeout_to_the_finding_that_caused_it():
    lost = [stream(C, "resume", "clean", pending=("3",), cursor="6", audience=(SEARCH,), missing=(FETCH,)),
            call(C, sc.OUTCOME_CANCELLED, at=3.0)]
    detector = run(lost, after_s=6)
    by_rule = {f.rule: f for f in detector.findings}
    assert by_rule["timeout_attributed"].caused_by == by_rule["narrowed_resume"].id
    assert rules(run([call(C, sc.OUTCOME_CANCELLED)])) == []  # a timeout with no finding: a slow tool


def test_timeout_attributed_also_from_the_sdks_own_span_timing_out():
    sdk_id = "00000000000000aa"
    spans = [stream(C, "resume", "clean", pending=("3",), cursor="6", audience=(SEARCH,), missing=(FETCH,)),
             call(C, sc.OUTCOME_RESULT, parent=sdk_id, request_id="3"),
             sdk_call(C, "fetch", timed_out=True, span_id=sdk_id)]
    assert "timeout_attributed" in rules(run(spans))


def test_the_sdks_timed_out_span_that_comes_before_the_call_span_naming_it_still_ends_the_call():
    # the natural order: the SDK's span ends at the caller's timeout, ours when the hooks let the call go
    sdk_id = "00000000000000ab"
    pending = stream(C, "post", "clean", pending=("3",), last="6")
    timed_out = sdk_call(C, "fetch", timed_out=True, span_id=sdk_id)
    evicted = call(C, sc.OUTCOME_EVICTED, parent=sdk_id)
    for order in ([pending, evicted, timed_out], [timed_out, pending, evicted], [pending, timed_out, evicted]):
        detector = run(order, after_s=6)
        assert rules(detector) == ["clean_end_pending", "timeout_attributed"]
        assert detector.ledger.in_flight == 0
        (lost,) = [f for f in detector.findings if f.rule == "clean_end_pending"]
        assert lost.evidence["timed_out"] is True
    # a producer's SDK span id of any length (a call span's parent is 8 bytes): no such one is kept waiting
    hostile = run([sdk_call(C, "fetch", timed_out=True, span_id="ab" * 50_000)])
    assert not hostile.ledger._early_timeouts


def _broken_stateless_call(fingerprint: str = "f00d") -> list[Span]:
    return [stream(C, "post", "dropped", pending=("3",), session=None, era=sc.ERA_STATELESS),
            call(C, sc.OUTCOME_NO_TERMINAL, session=None, era=sc.ERA_STATELESS, fingerprint=fingerprint)]


def test_not_reissued_fires_when_a_broken_stateless_call_is_not_sent_again():
    (finding,) = run(_broken_stateless_call(), after_s=6).findings
    assert (finding.rule, finding.era, finding.session_id) == ("not_reissued", sc.ERA_STATELESS, None)
    reissued = call(C, sc.OUTCOME_RESULT, at=2.0, request_id="4", session=None, era=sc.ERA_STATELESS,
                    fingerprint="f00d", trace="t2")
    assert rules(run([*_broken_stateless_call(), reissued], after_s=6)) == []


def test_not_reissued_told_by_the_clients_call_span_alone_names_the_client_as_its_side():
    """A finding lists the sides whose spans raised it: a break known only from the call span (its stream ended
    at an HTTP error, which leaves no call owed) still is the client's."""
    for spans in (_broken_stateless_call(), _broken_stateless_call()[1:]):
        (finding,) = run(spans, after_s=6).findings
        assert (finding.rule, finding.roles) == ("not_reissued", [C])


def test_a_break_whose_call_span_was_lost_is_matched_to_its_reissue_by_its_streams_fingerprint():
    # a batch lost on the way: the broken call's own span never comes, its stream's (and the re-issue's) do
    broken = stream(C, "post", "dropped", pending=("3",), session=None, era=sc.ERA_STATELESS, fingerprint="f00d")
    for fingerprint, expected in (("f00d", []), ("beef", ["not_reissued"])):
        reissued = call(C, sc.OUTCOME_RESULT, at=2.0, request_id="4", session=None, era=sc.ERA_STATELESS,
                        fingerprint=fingerprint, trace="t2")
        assert rules(run([broken, reissued], after_s=6)) == expected
        assert rules(run([reissued, broken], after_s=6)) == expected


def test_a_reissue_still_running_when_the_grace_runs_out_is_known_by_the_span_of_its_start():
    """A long tool: the re-issue's own call span ends only with it, past the grace."""
    started = call(C, sc.OUTCOME_REISSUED, at=2.0, request_id="4", session=None, era=sc.ERA_STATELESS,
                   fingerprint="f00d", trace="t2", stream_kind=None)
    assert rules(run([*_broken_stateless_call(), started], after_s=60)) == []


def test_not_reissued_is_not_hidden_by_another_call_of_the_same_tool_or_by_the_sdks_span():
    other_arguments = call(C, sc.OUTCOME_RESULT, at=2.0, request_id="4", session=None, era=sc.ERA_STATELESS,
                           fingerprint="beef", trace="t2")
    sdk_span_only = sdk_call(C, "fetch", at=2.0, request_id="4")  # a sampler may drop it: never the re-issue
    for later in (other_arguments, sdk_span_only):
        assert rules(run([*_broken_stateless_call(), later], after_s=6)) == ["not_reissued"]


def test_not_reissued_needs_the_reissue_from_the_same_client_process():
    elsewhere = call(C, sc.OUTCOME_RESULT, at=2.0, request_id="4", session=None, era=sc.ERA_STATELESS,
                     fingerprint="f00d", trace="t2", origin="another-client")
    assert rules(run([*_broken_stateless_call(), elsewhere], after_s=6)) == ["not_reissued"]


def _stored_with_no_stream(at: float = 1.0) -> list[Span]:
    """The POST dropped before the result; the server stored it with no stream open to carry it."""
    return [stream(C, "post", "dropped", pending=("3",), last="6"), stream(SV, "post", "dropped", pending=("3",)),
            call(SV, sc.OUTCOME_RESULT, at=at, stream_kind=None, terminal_event_id="15")]


def test_stored_not_delivered_fires_when_a_stored_result_never_reaches_the_client_and_pages_as_a_loss():
    spans = [*_stored_with_no_stream(), call(C, sc.OUTCOME_CANCELLED, at=3.0)]  # no resume before the timeout
    assert rules(run(spans, after_s=1)) == []
    detector = run(spans, after_s=6)
    by_rule = {f.rule: f for f in detector.findings}
    assert set(by_rule) == {"stored_not_delivered", "timeout_attributed"}
    lost = by_rule["stored_not_delivered"]
    assert (lost.request_id, lost.severity, lost.evidence["stored_event_id"]) == ("3", "critical", "15")
    assert detector.registry.get_sample_value("mcp_stream_silent_losses_total",
                                              {"tool": "fetch", "rule": "stored_not_delivered"}) == 1.0


def test_a_stored_result_its_client_cancelled_well_after_pages_stored_not_delivered_whichever_span_comes_first():
    # the cause (stored with no stream open, never resumed) names the runbook, not the order a Collector's queues
    # hand the server's two spans over in
    drop, server_drop, stored = _stored_with_no_stream()
    late = cancelled_late(sent=1.0, cancelled=4.0)
    for spans in ([drop, server_drop, stored, late], [drop, server_drop, late, stored], [late, stored, drop]):
        detector = run(spans, after_s=60)
        (finding,) = [f for f in detector.findings if f.rule != "timeout_attributed"]
        assert (finding.rule, finding.evidence.get("also")) == ("stored_not_delivered", ["sent_not_received"])
        assert detector.registry.get_sample_value("mcp_stream_silent_losses_total",
                                                  {"tool": "fetch", "rule": "stored_not_delivered"}) == 1.0


def test_a_stored_result_whose_caller_the_sdk_failed_after_its_resumes_failed_still_pages():
    """Two drops in a row, or resumes answered 401: the SDK fails the call ("reconnection attempts were exhausted"),
    an error that says nothing of the result: the tool ran, its caller does not know (and may run it again)."""
    drop, server_drop, stored = _stored_with_no_stream()
    for spans in ([drop, server_drop, stored, call(C, sc.OUTCOME_NO_TERMINAL, at=2.0)],
                  [call(C, sc.OUTCOME_NO_TERMINAL, at=2.0), stored, drop, server_drop]):
        assert rules(run(spans, after_s=60)) == ["stored_not_delivered"]


def test_stored_not_delivered_is_silent_when_a_resume_delivers_the_stored_result():
    delivered = stream(C, "resume", "clean", cursor="6", terminal=("3",), last="15")
    assert rules(run([*_stored_with_no_stream(), delivered], after_s=60)) == []
    server_sent = call(SV, sc.OUTCOME_RESULT, stream_kind="post")  # the server sent it on its live stream
    assert rules(run([stream(SV, "post", "dropped", pending=("3",)), server_sent], after_s=60)) == []


def test_a_stored_result_lost_behind_a_clean_empty_resume_is_one_finding_not_two():
    empty_resume = stream(C, "resume", "clean", pending=("3",), cursor="6")
    drop, server_drop, stored = _stored_with_no_stream()
    for spans in ([drop, server_drop, stored, empty_resume], [drop, server_drop, empty_resume, stored]):
        detector = run(spans, after_s=60)
        (finding,) = detector.findings
        assert finding.rule in ("clean_end_pending", "stored_not_delivered")
        assert finding.evidence["also"] == [({"clean_end_pending", "stored_not_delivered"} - {finding.rule}).pop()]
        losses = sum(detector.registry.get_sample_value("mcp_stream_silent_losses_total",
                                                        {"tool": "fetch", "rule": rule}) or 0
                     for rule in ("clean_end_pending", "stored_not_delivered"))
        assert losses == 1.0


def _store_failed(at: float = 1.0) -> Span:
    """The server's EventStore raised: its session's messages are never sent again, this call's result with them."""
    return call(SV, sc.OUTCOME_STORE_FAILED, at=at)


def test_store_failed_fires_after_the_grace_period_and_pages_as_a_loss():
    assert rules(run([_store_failed()], after_s=1)) == []
    detector = run([_store_failed()], after_s=6)
    (lost,) = detector.findings
    assert (lost.rule, lost.tool, lost.request_id, lost.severity, lost.roles) == ("store_failed", "fetch", "3",
                                                                                  "critical", [SV])
    assert lost.evidence == {"grace_s": 5, "timed_out": False}
    assert detector.registry.get_sample_value("mcp_stream_silent_losses_total",
                                              {"tool": "fetch", "rule": "store_failed"}) == 1.0
    assert detector.ledger.in_flight == 0  # nothing will send it: over, not waiting to be counted stuck


def test_store_failed_is_silent_when_a_delivery_of_the_call_is_seen_within_the_grace_whatever_the_order():
    delivered = stream(C, "post", "clean", terminal=("3",), last="9")
    for spans in ([_store_failed(), delivered], [delivered, _store_failed()]):
        assert rules(run(spans, after_s=60)) == []


def test_store_failed_with_the_callers_timeout_is_one_loss_and_the_timeout_is_attributed_to_it():
    for spans in ([_store_failed(), call(C, sc.OUTCOME_CANCELLED, at=3.0)],
                  [call(C, sc.OUTCOME_CANCELLED, at=3.0), _store_failed()]):
        detector = run(spans, after_s=6)
        by_rule = {f.rule: f for f in detector.findings}
        assert set(by_rule) == {"store_failed", "timeout_attributed"}
        assert by_rule["store_failed"].evidence["timed_out"] is True
        assert by_rule["timeout_attributed"].caused_by == by_rule["store_failed"].id


def test_store_failed_and_a_clean_end_that_left_the_call_pending_are_one_finding_in_any_span_order():
    clean_end = stream(C, "post", "clean", pending=("3",), last="6")
    for spans in ([clean_end, _store_failed(at=2.0)], [_store_failed(at=2.0), clean_end]):
        detector = run(spans, after_s=60)
        (finding,) = detector.findings
        assert finding.rule == "store_failed"  # the cause, whichever grace ran out first
        assert finding.evidence["also"] == ["clean_end_pending"]
        assert sorted(finding.roles) == [C, SV]
        losses = sum(detector.registry.get_sample_value("mcp_stream_silent_losses_total",
                                                        {"tool": "fetch", "rule": rule}) or 0
                     for rule in ("clean_end_pending", "store_failed"))
        assert losses == 1.0


def test_each_call_a_failed_store_lost_in_its_session_is_its_own_finding():
    spans = [call(SV, sc.OUTCOME_STORE_FAILED, request_id=rid, tool=tool) for rid, tool in (("3", "fetch"),
                                                                                            ("4", "search"))]
    detector = run(spans, after_s=6)
    assert sorted((f.rule, f.request_id, f.tool) for f in detector.findings) == [("store_failed", "3", "fetch"),
                                                                                 ("store_failed", "4", "search")]


def test_sent_not_received_fires_on_a_cancel_long_after_the_server_sent_the_result_and_pages_as_a_loss():
    assert rules(run([cancelled_late()], after_s=1)) == []
    detector = run([cancelled_late()], after_s=6)
    (lost,) = detector.findings
    assert (lost.rule, lost.tool, lost.request_id, lost.severity, lost.roles) == ("sent_not_received", "fetch", "3",
                                                                                  "critical", [SV])
    assert lost.evidence == {"sent_at": 1.0, "sent_event_id": "6", "grace_s": 5}
    assert detector.registry.get_sample_value("mcp_stream_silent_losses_total",
                                              {"tool": "fetch", "rule": "sent_not_received"}) == 1.0
    assert detector.ledger.in_flight == 0  # its client gave up on it: over


def test_a_cancel_that_may_have_crossed_the_result_on_the_wire_is_no_loss_whatever_the_clients_spans_show():
    """Within ``cancel_race_s`` of the send, the caller may have given up as the result came: its stream between a
    clean end and the resume (a server that closes streams on purpose), or the result still on a slow link."""
    raced = cancelled_late(sent=1.0, cancelled=1.5)
    assert rules(run([raced], after_s=60)) == []
    between_streams = [stream(C, "post", "clean", pending=("3",), last="4"), call(C, sc.OUTCOME_CANCELLED, at=1.4)]
    for spans in ([*between_streams, raced], [raced, *between_streams]):
        assert "sent_not_received" not in rules(run(spans, after_s=60))


def test_sent_not_received_with_the_clients_view_is_one_loss_in_any_span_order_and_explains_the_timeout():
    """A connection reset on the client's side (its stream dropped), or one that died silently (a NAT that drops
    packets: the client's stream stays open, stalled, and its caller gives up): either way the result went out
    long before the cancel."""
    gave_up = call(C, sc.OUTCOME_CANCELLED, at=3.0)
    for client_view in ([stream(C, "post", "dropped", pending=("3",), last="4"), gave_up], [gave_up]):
        for spans in ([*client_view, cancelled_late()], [cancelled_late(), *client_view[::-1]]):
            detector = run(spans, after_s=6)
            by_rule = {f.rule: f for f in detector.findings}
            assert set(by_rule) == {"sent_not_received", "timeout_attributed"}
            assert by_rule["timeout_attributed"].caused_by == by_rule["sent_not_received"].id


def test_sent_not_received_is_silent_when_the_client_got_the_result():
    delivered = stream(C, "resume", "clean", cursor="4", terminal=("3",), last="6")
    for spans in ([cancelled_late(), delivered], [delivered, cancelled_late()]):
        assert rules(run(spans, after_s=60)) == []


def test_a_result_the_sdk_resumed_for_after_its_caller_gave_up_reached_no_caller_and_is_still_lost():
    """The POST dropped and the client resumed only after its caller's timeout (an SSE retry longer than it): the
    SDK resumes on for no caller, and the result it then gets from the store is dropped. Neither side's hooks tie
    that resume to the call; the server's, once its client cancelled it, no longer track it."""
    dropped = [stream(C, "post", "dropped", pending=("3",), last="6"),
               stream(SV, "post", "dropped", pending=("3",), last="6"),
               call(SV, sc.OUTCOME_RESULT, at=1.0, stream_kind=None, terminal_event_id="15")]
    gave_up = [call(C, sc.OUTCOME_CANCELLED, at=3.0), cancelled_late(sent=1.0, cancelled=3.0)]
    resumed_on = [stream(C, "resume", "closed", ids=(), cursor="6", terminal=("3",), last="15", at=4.0),
                  stream(SV, "resume", "clean", ids=(), cursor="6", terminal=("3",), last="15", at=4.0)]
    both = run([*dropped, *gave_up, *resumed_on], after_s=6)
    assert rules(both) == ["stored_not_delivered", "timeout_attributed"]
    assert {f.rule: f for f in both.findings}["stored_not_delivered"].evidence["also"] == ["sent_not_received"]
    server_only = [dropped[1], dropped[2], gave_up[1], resumed_on[1]]
    assert rules(run(server_only, after_s=6)) == ["stored_not_delivered"]
    server_first = [dropped[2], gave_up[1], dropped[0], gave_up[0], resumed_on[0], dropped[1]]
    assert "stored_not_delivered" in rules(run(server_first, after_s=6))
    no_cancel_seen = [*dropped, gave_up[0], *resumed_on]  # its client sent none (resumption hints): no telling
    assert rules(run(no_cancel_seen, after_s=6)) == []


def test_a_result_the_sdk_resumed_for_after_its_caller_gave_up_is_lost_whichever_sides_spans_come_first():
    """Two exporters, a few seconds apart: the client's resume for no caller came before the server's late cancel,
    was counted as its client's delivery, and the loss went unpaged (the server's first, it paged)."""
    cut = [stream(C, "post", "clean", pending=("3",), last="6"), stream(SV, "post", "clean", pending=("3",), last="6")]
    client_side = [call(C, sc.OUTCOME_CANCELLED, at=3.0),
                   stream(C, "resume", "closed", ids=(), cursor="6", terminal=("3",), last="15", at=4.0)]
    server_side = [call(SV, sc.OUTCOME_RESULT, at=1.0, stream_kind=None, terminal_event_id="15"),
                   cancelled_late(sent=1.0, cancelled=3.0),
                   stream(SV, "resume", "clean", ids=(), cursor="6", terminal=("3",), last="15", at=4.0)]
    for spans in ([*cut, *client_side, *server_side], [*cut, *server_side, *client_side],
                  [*client_side, *cut, *server_side[::-1]]):
        found = rules(run(spans, after_s=6))
        assert "clean_end_pending" in found or "stored_not_delivered" in found, found
    assert rules(run([*cut, *client_side, server_side[0], server_side[2]], after_s=6)) == []  # no cancel: no telling
    # after the page, the resume for no caller, then the cancels that say its caller was gone: the page was right,
    # and nothing said otherwise as the resume came (a client process resuming from a saved cursor looks the same)
    late = run([*cut, server_side[0]], after_s=40)
    for span in (client_side[1], client_side[0], server_side[1]):
        late.consume([span])
    (loss,) = [f for f in late.findings if f.rule in ("clean_end_pending", "stored_not_delivered")]
    assert "delivered_after" not in loss.evidence


def test_the_answer_to_a_cancel_the_sdk_resumes_for_after_its_caller_withdrew_the_call_is_its_end():
    """A server that closes its stream on purpose (polling); its client's caller cancels before resuming, and the
    server, which has no result yet, answers the cancel (a -32800 error): the SDK's resume for no caller gets that."""
    polled = [stream(C, "post", "clean", pending=("3",), last="3"),
              stream(SV, "post", "clean", pending=("3",), last="3")]
    withdrawn = [call(C, sc.OUTCOME_CANCELLED, at=1.1), call(SV, sc.OUTCOME_CANCELLED, at=1.1)]
    resumed_on = [stream(C, "resume", "closed", ids=(), cursor="3", terminal=("3",), last="5", at=1.3),
                  stream(SV, "resume", "dropped", ids=(), cursor="3", terminal=("3",), last="6", at=1.3)]
    assert rules(run([*polled, *withdrawn, *resumed_on], after_s=60)) == []


def test_a_delivery_only_the_server_saw_after_its_client_cancelled_well_after_the_result_reached_no_caller():
    """The server saw the client cancel the call 2 s after its result was stored; a resume it then ties to the call
    (it still tracked it), or another replica's that ties it to none, sends the result: the SDK resuming for no
    caller. Without that cancel (a client with resumption hints sends none), the result may have come after its
    caller gave up (a slow tool): nothing tells, and no page."""
    dropped = [stream(C, "post", "dropped", pending=("3",), last="6"),
               call(SV, sc.OUTCOME_RESULT, at=1.0, stream_kind=None, terminal_event_id="15")]
    gave_up = [call(C, sc.OUTCOME_CANCELLED, at=3.0), cancelled_late(sent=1.0, cancelled=3.0)]
    tied = stream(SV, "resume", "clean", cursor="6", terminal=("3",), last="15", at=4.0)
    untied = stream(SV, "resume", "clean", ids=(), cursor="6", terminal=("3",), last="15", at=4.0)
    for spans in ([*dropped, *gave_up, tied], [tied, *dropped, *gave_up], [*dropped, *gave_up, untied]):
        assert "stored_not_delivered" in rules(run(spans, after_s=6))
    assert rules(run([*dropped, gave_up[0], tied], after_s=6)) == []
    waiting = stream(C, "resume", "clean", cursor="6", terminal=("3",), last="15", at=2.0)  # its caller got it
    assert rules(run([*dropped, waiting, tied, *gave_up], after_s=6)) == []


def test_a_cancel_that_crossed_a_result_stored_with_no_stream_open_is_no_loss():
    """The caller gave up just as the result was stored (its POST had dropped, its resume not yet come)."""
    dropped = [stream(C, "post", "dropped", pending=("3",), last="6"),
               call(SV, sc.OUTCOME_RESULT, at=1.0, stream_kind=None, terminal_event_id="15")]
    raced = [call(C, sc.OUTCOME_CANCELLED, at=1.0), cancelled_late(sent=1.0, cancelled=1.004)]
    assert rules(run([*dropped, *raced], after_s=60)) == []


def test_a_resume_from_a_saved_cursor_by_a_client_that_knew_not_the_call_delivers_it():
    """A client process that resumes, from a cursor its predecessor saved, a stream whose call it never sent: its
    hooks tie the resume to no call, and its caller awaits the result."""
    dropped = [stream(C, "post", "dropped", pending=("3",), last="6"),
               call(SV, sc.OUTCOME_RESULT, at=1.0, stream_kind=None, terminal_event_id="15")]
    resumed = stream(C, "resume", "clean", ids=(), cursor="6", terminal=("3",), last="15", at=4.0)
    assert rules(run([*dropped, resumed], after_s=60)) == []


def test_a_late_cancel_seen_by_a_client_or_with_no_session_is_no_loss():
    client_view = dataclasses.replace(cancelled_late(), attributes={
        **cancelled_late().attributes, sc.ROLE: C})
    sessionless = dataclasses.replace(cancelled_late(), attributes={
        k: v for k, v in cancelled_late().attributes.items() if k != sc.MCP_SESSION_ID})
    assert rules(run([client_view], after_s=60)) == []
    assert rules(run([sessionless], after_s=60)) == []


def test_resumes_that_go_on_after_the_caller_gave_up_stay_on_the_calls_one_resume_loop_finding():
    before = [stream(C, "resume", "clean", pending=("3",), cursor="6", at=t) for t in (1.0, 1.2, 1.4)]
    after = [stream(C, "resume", "clean", ids=(), cursor="6", at=t) for t in (1.6, 1.8, 2.0)]  # the hooks dropped it
    detector = run([stream(C, "post", "dropped", pending=("3",), last="6"), *before,
                    call(C, sc.OUTCOME_CANCELLED, at=1.5), *after])
    loops = [f for f in detector.findings if f.rule == "resume_loop"]
    assert [f.request_id for f in loops] == ["3"]
    only_after = run([stream(C, "post", "dropped", pending=("3",), last="6"), call(C, sc.OUTCOME_CANCELLED), *after])
    assert [f.request_id for f in only_after.findings if f.rule == "resume_loop"] == ["3"]


def test_an_opaque_token_has_an_unknown_audience_not_an_empty_one():
    complete = replay(sc.REPLAY_COMPLETE, sent=4, audience=(), verification=sc.VERIFICATION_OPAQUE)
    assert rules(run([complete])) == []
    resume = stream(C, "resume", "clean", pending=("3",), cursor="6", audience=(), missing=(FETCH,))
    unknown = Span(**{**{f: getattr(resume, f) for f in resume.__slots__}, "attributes": {
        **resume.attributes, sc.AUTH_VERIFICATION: sc.VERIFICATION_OPAQUE}})  # type: ignore[arg-type]
    assert "narrowed_resume" not in rules(run([unknown], after_s=1))


def test_the_audience_gap_is_computed_from_audience_and_required_when_a_producer_omits_missing():
    (finding,) = run([replay(sc.REPLAY_COMPLETE, sent=4, audience=(SEARCH,))]).findings
    assert (finding.rule, finding.evidence["missing_resources"]) == ("narrowed_resume", [FETCH])
    assert rules(run([replay(sc.REPLAY_COMPLETE, sent=4, audience=(FETCH + "/",))])) == []  # canonical forms


def test_a_healthy_call_leaves_nothing_in_the_ledger():
    detector = run([sdk_call(C, "fetch"), sdk_call(SV, "fetch")], after_s=120)
    assert rules(detector) == []
    assert detector.ledger.calls == 0
    assert detector.registry.get_sample_value("mcp_stream_calls_total",
                                              {"role": C, "tool": "fetch", "outcome": "result"}) == 1.0


def test_a_span_that_breaks_the_model_is_refused_and_the_rest_of_its_batch_is_kept():
    good = stream(C, "resume", "clean", pending=("3",), cursor="6")
    bad = Span(**{**{f: getattr(good, f) for f in good.__slots__}, "attributes": {
        **good.attributes, sc.PENDING_REQUEST_IDS: {"not": "a list"}}})  # type: ignore[arg-type]
    detector = Detector()
    outcome = detector.consume([bad, good])
    assert outcome.accepted == 1
    assert outcome.rejected == {f"{sc.PENDING_REQUEST_IDS} must be a list of strings": 1}
    assert detector.ledger.calls == 1


def test_a_value_the_model_does_not_name_for_an_enumerated_attribute_is_refused_with_its_reason_not_read_as_none():
    """A producer's "CLEAN" end, "canceled" call or "partial" replay would otherwise miss a loss without a word."""
    cases = [(stream(C, "post", "CLEAN", pending=("3",), last="4"), sc.END_REASON),
             (stream(C, "poll", "clean", pending=("3",), last="4"), sc.STREAM_KIND),
             (call(C, "canceled"), sc.CALL_OUTCOME),
             (replay("partial"), sc.REPLAY_DECISION)]
    for span, key in cases:
        outcome = Detector().consume([span])
        (reason,) = outcome.rejected
        assert outcome.accepted == 0 and reason.startswith(f"{key} must be one of ")


def test_a_negative_count_is_refused_not_read_as_events_skipped():
    outcome = Detector().consume([replay(sc.REPLAY_TRUNCATED, skipped=-3)])
    assert (outcome.accepted, outcome.rejected) == (0, {f"{sc.REPLAY_SKIPPED} must not be negative": 1})


def test_the_ledger_is_bounded_and_counts_what_it_evicts():
    clock = Clock()
    detector = Detector(DetectorConfig(ledger=LedgerLimits(max_sessions=2, max_calls_per_session=2,
                                                           session_ttl_s=60)), clock=clock)
    # in flight (a resume from their last event may deliver them): the cap evicts one, counted
    detector.consume([stream(C, "post", "dropped", pending=(rid,), ids=(rid,), last=rid, session="a") for rid in "123"])
    detector.consume([stream(C, "post", "dropped", pending=("1",), ids=("1",), last="1", session=s) for s in "bc"])
    assert (detector.ledger.sessions, detector.ledger.calls) == (2, 2)
    assert detector.ledger.evictions == {"capacity": 2, "ttl": 0, "memory": 0}
    clock.now += 61 * S
    detector.tick()
    assert (detector.ledger.sessions, detector.ledger.calls, detector.ledger.in_flight) == (0, 0, 0)
    assert detector.registry.get_sample_value("mcp_stream_detector_ledger_evictions_total", {"reason": "ttl"}) == 2


def test_grace_timers_of_evicted_calls_do_not_pile_up():
    """Found by the load test: every clean end's timer outlived its evicted call until due."""
    detector = Detector(DetectorConfig(ledger=LedgerLimits(max_sessions=100)), clock=Clock())
    detector.consume([stream(C, "resume", "clean", pending=("1",), cursor="6", session=f"s{i}") for i in range(20_000)])
    assert detector.ledger.sessions == 100
    assert len(detector.ledger.dump()["timers"]) <= 2048


def test_every_loss_rule_is_exported_at_zero_before_any_span_so_its_first_loss_pages():
    registry = Detector(DetectorConfig(tools=("fetch",))).registry
    for rule in ("stored_not_delivered", "clean_end_pending", "not_reissued", "store_failed"):
        assert registry.get_sample_value("mcp_stream_silent_losses_total", {"tool": "fetch", "rule": rule}) == 0.0
        assert registry.get_sample_value("mcp_stream_findings_total",
                                         {"rule": rule, "severity": "critical", "tool": "fetch"}) == 0.0


def test_a_batch_counts_its_stream_ends_and_findings_as_span_by_span_does_by_the_end_of_its_apply_and_tick():
    """Stream ends and findings are added to their counters once per batch and label set: the same values."""
    spans = [stream(C, "post", "dropped", pending=("3",), last="6"),
             *[stream(C, "resume", "clean", pending=("3",), cursor="6", missing=(FETCH,)) for _ in range(3)],
             stream(C, "resume", "clean", session="s2", pending=("4",), cursor="1", terminal=("4",), last="2"),
             replay(sc.REPLAY_TRUNCATED, missing=(FETCH,)), call(C, sc.OUTCOME_CANCELLED)]
    one_by_one = run(spans, after_s=6)
    clock = Clock()
    batched = Detector(one_by_one.config, clock=clock)
    batched.consume(spans)

    def counted(detector: Detector) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        names = ("mcp_stream_stream_ends_total", "mcp_stream_resumes_total", "mcp_stream_audience_gaps_total",
                 "mcp_stream_findings_total", "mcp_stream_silent_losses_total")
        return {(s.name, tuple(sorted(s.labels.items()))): s.value for m in detector.registry.collect()
                for s in m.samples if s.name in names and s.value}

    assert counted(batched)[("mcp_stream_stream_ends_total", (("kind", "resume"), ("reason", "clean"),
                                                              ("role", C)))] == 4
    clock.now += len(spans) * S // 10 + 6 * S
    batched.tick()  # a finding raised by the grace period is counted by the end of the tick
    assert counted(batched) == counted(one_by_one)
    raised = {("mcp_stream_findings_total", (("rule", f.rule), ("severity", f.severity), ("tool", f.tool or "other")))
              for f in batched.findings}
    assert len(raised) >= 3 and all(counted(batched)[key] == 1 for key in raised)
    assert counted(batched)[("mcp_stream_silent_losses_total", (("rule", "clean_end_pending"), ("tool", "fetch")))] == 1


def test_a_stateless_clean_end_the_client_followed_with_its_reissue_is_no_loss():
    """2026-07-28: the SDK tells its caller a stream that ended without the result; the re-issue answers it."""
    cut = [stream(C, "post", "clean", pending=("3",), session=None, era=sc.ERA_STATELESS),
           stream(SV, "post", "clean", pending=("3",), session=None, era=sc.ERA_STATELESS),
           call(C, sc.OUTCOME_NO_TERMINAL, session=None, era=sc.ERA_STATELESS, fingerprint="f00d")]
    reissued = call(C, sc.OUTCOME_RESULT, at=2.0, request_id="4", session=None, era=sc.ERA_STATELESS,
                    fingerprint="f00d")
    assert rules(run([*cut, reissued], after_s=60)) == []
    (lost,) = run(cut, after_s=60).findings  # not sent again: one loss
    assert lost.rule in ("not_reissued", "clean_end_pending")


def test_the_same_spans_delivered_twice_say_what_they_say_once():
    """An exporter retries a batch the detector took: a resume that delivered once is no duplicate."""
    recovered = [stream(C, "post", "dropped", pending=("3",), last="6"),
                 stream(SV, "post", "dropped", pending=("3",), last="6"),
                 stream(C, "resume", "clean", cursor="6", terminal=("3",), last="9", at=2.0),
                 stream(SV, "resume", "clean", cursor="6", terminal=("3",), last="9", at=2.0),
                 replay(sc.REPLAY_COMPLETE, sent=4, at=2.0)]
    assert rules(run([span for span in recovered for _ in range(2)], after_s=60)) == []
    assert rules(run(recovered + recovered, after_s=60)) == []
    twice = [stream(C, "resume", "clean", cursor="6", terminal=("3",), last="9"),
             stream(C, "resume", "clean", cursor="9", terminal=("3",), last="9", at=2.0)]  # two spans: two deliveries
    assert rules(run(twice, after_s=60)) == ["duplicate_terminal"]


def test_a_resume_the_guard_refused_explicitly_is_no_silent_loss_when_the_caller_then_gives_up():
    refused = [replay(sc.REPLAY_REFUSED, cursor="6", missing=(FETCH,), guard=sc.GUARD_REFUSE, at=2.0),
               stream(SV, "resume", "clean", pending=("3",), cursor="6", error_frames=1, missing=(FETCH,), at=2.0),
               stream(C, "resume", "closed", pending=("3",), cursor="6", error_frames=1, missing=(FETCH,), at=2.0)]
    for spans in ([*_stored_with_no_stream(), *refused], [*refused, *_stored_with_no_stream()]):
        assert rules(run(spans, after_s=60)) == []
        assert rules(run([s for s in spans if s.attributes[sc.ROLE] == SV], after_s=60)) == []
    retried_in_vain = [replay(sc.REPLAY_COMPLETE, cursor="6", sent=0, at=3.0),
                       stream(C, "resume", "clean", pending=("3",), cursor="6", at=3.0)]
    assert rules(run([*_stored_with_no_stream(), *refused, *retried_in_vain], after_s=60)) in (
        ["clean_end_pending"], ["stored_not_delivered"])


def test_a_refusal_the_client_read_on_past_told_its_caller_nothing_and_its_stored_result_is_lost():
    """Without ``resolve_refusals`` the SDK drops the guard's error frame, reads its resume to the end the server
    gives it (``clean``) and resumes again with the same cursor until its caller's timeout: its caller is told
    nothing, as in the incident, from the first such refusal (its timeout may come before a second). With the
    resolver the SDK gets the call's error at the frame and closes the stream (``closed``): told. The server's spans
    alone cannot tell the two apart."""
    def refused(at: float, client_end: str) -> list[Span]:
        return [replay(sc.REPLAY_REFUSED, cursor="6", missing=(FETCH,), guard=sc.GUARD_REFUSE, at=at),
                stream(SV, "resume", "clean", pending=("3",), cursor="6", error_frames=1, missing=(FETCH,), at=at),
                stream(C, "resume", client_end, pending=("3",), cursor="6", error_frames=1, missing=(FETCH,), at=at)]

    for unheeded in (refused(2.0, "clean"), [*refused(2.0, "clean"), *refused(3.0, "clean")]):
        for spans in ([*_stored_with_no_stream(), *unheeded], [*unheeded[::-1], *_stored_with_no_stream()]):
            (lost,) = run(spans, after_s=60).findings  # one loss: its clean end, the stored result joining it
            assert (lost.rule, lost.evidence["also"]) == ("clean_end_pending", ["stored_not_delivered"])
            assert rules(run([s for s in spans if s.attributes[sc.ROLE] == SV], after_s=60)) == []
    heeded = [*refused(2.0, "closed"), *refused(3.0, "closed")]  # the resolver's, and a re-authorised resume's
    assert rules(run([*_stored_with_no_stream(), *heeded], after_s=60)) == []


def test_a_stream_that_ended_before_the_clean_end_does_not_stop_its_clock_whatever_order_spans_come_in():
    dropped = stream(C, "post", "dropped", pending=("3",), last="6", events=2)
    empty_resume = stream(C, "resume", "clean", pending=("3",), cursor="6", at=2.0)
    for spans in ([dropped, empty_resume], [empty_resume, dropped]):
        assert rules(run(spans, after_s=60)) == ["clean_end_pending"]
    moved_on = stream(C, "resume", "clean", pending=("3",), cursor="6", last="8", at=3.0)  # it moved after
    for spans in ([dropped, empty_resume, moved_on], [moved_on, empty_resume, dropped]):
        assert "clean_end_pending" not in rules(run(spans, after_s=4))


def test_the_grace_period_runs_on_the_detectors_clock_whatever_the_producers_clock_says():
    clock = Clock()
    detector = Detector(DetectorConfig(rules=RuleConfig(clean_end_grace_s=5)), clock=clock)
    ahead = clock.now / S + 600  # the server's clock ten minutes ahead of the detector's
    detector.consume([stream(SV, "resume", "clean", pending=("3",), cursor="6", at=ahead)])
    clock.now += 4 * S
    detector.tick()
    assert rules(detector) == []
    clock.now += 2 * S
    detector.tick()
    assert rules(detector) == ["clean_end_pending"]


def test_a_retry_one_side_saw_after_a_refusal_is_judged_again_whatever_the_other_sides_clock():
    """The guard refused (the server's clock a minute ahead); the caller re-authorised and resumed, and a gateway
    answered that resume with an empty stream the server never saw: the stored result is lost."""
    ahead = 60.0
    refused = [replay(sc.REPLAY_REFUSED, cursor="6", missing=(FETCH,), guard=sc.GUARD_REFUSE, at=2.0 + ahead),
               stream(SV, "resume", "clean", pending=("3",), cursor="6", error_frames=1, missing=(FETCH,),
                      at=2.0 + ahead),
               stream(C, "resume", "closed", pending=("3",), cursor="6", error_frames=1, missing=(FETCH,), at=2.0)]
    retried = stream(C, "resume", "clean", pending=("3",), cursor="6", at=2.1)
    for spans in ([*_stored_with_no_stream(), *refused, retried], [retried, *refused, *_stored_with_no_stream()]):
        assert rules(run(spans, after_s=60)) in (["clean_end_pending"], ["stored_not_delivered"])


def test_a_copy_of_a_result_its_side_saw_delivered_on_the_healthy_path_is_a_duplicate_delivery():
    """The first delivery left no span (the healthy path): the copy's stream says its side saw it before; the
    standalone stream's too once its client reconnected it (a resume, from its last event)."""
    for kind, cursor in (("get", None), ("resume", "4")):
        copied = stream(C, kind, "closed", ids=(), terminal=("3",), repeated=("3",), tool=None, at=2.0, cursor=cursor)
        (finding,) = run([copied], after_s=60).findings
        assert (finding.rule, finding.request_id, finding.evidence["deliveries"]) == ("duplicate_terminal", "3", 2)
    assert rules(run([stream(C, "get", "closed", ids=(), terminal=("3",), tool=None)], after_s=60)) == []
    (named,) = run([stream(C, "get", "closed", ids=(), terminal=("3",), repeated=("3",), tool="search")]).findings
    assert (named.rule, named.tool) == ("duplicate_terminal", "search")  # the copy's span names the call's tool


def test_a_refusal_hides_no_loss_of_a_resume_not_refused_that_ran_beside_it_in_either_order():
    """Two resumes of the dropped stream at once: the guard refused the one with a narrower token (another holder of
    the session's id, or an attacker); the one with the wider token came while the POST was still open on the server
    and ended empty. Its caller was told nothing: the stored result is lost, whichever started first."""
    refused = [replay(sc.REPLAY_REFUSED, cursor="6", missing=(FETCH,), guard=sc.GUARD_REFUSE, at=2.0),
               stream(SV, "resume", "clean", pending=("3",), cursor="6", error_frames=1, missing=(FETCH,), at=2.0)]
    for started in (1.9, 2.0):  # before the refusal started, or as it did; it ends after the refusal started
        beside = stream(SV, "resume", "clean", pending=("3",), cursor="6", at=started)
        beside.end_ns = int(2.05 * S)
        for spans in ([*_stored_with_no_stream(), *refused, beside], [beside, *refused, *_stored_with_no_stream()]):
            assert rules(run(spans, after_s=60)) in (["clean_end_pending"], ["stored_not_delivered"])
    before = stream(SV, "resume", "clean", pending=("3",), cursor="6", at=1.5)  # over before the refusal: told
    assert rules(run([*_stored_with_no_stream(), before, *refused], after_s=60)) == []


def test_a_refused_resume_that_sent_events_first_and_said_so_while_open_still_tells_its_caller():
    """The guard's prefix mode, or a live tail cut by an error frame: the resume's span while open (its first
    events) is no resume of its own. The resolver fails the call at the frame, and the SDK closes the stream."""
    moving = stream(C, "resume", sc.END_OPEN, pending=("3",), cursor="6", last="7", at=2.0)
    moving.end_ns = int(2.01 * S)
    refused = stream(C, "resume", "closed", pending=("3",), cursor="6", last="7", error_frames=1, missing=(FETCH,),
                     at=2.0)
    refused.end_ns = int(2.05 * S)
    for spans in ([*_stored_with_no_stream(), moving, refused], [moving, refused, *_stored_with_no_stream()]):
        assert rules(run(spans, after_s=60)) == []
        assert _in_flight([*spans]) == (0, [])


def test_a_call_whose_resume_was_refused_explicitly_is_not_in_flight_nor_stuck_until_a_resume_not_refused():
    """Its caller was told why (the guard's error frame; ``resolve_refusals`` fails the call at once, and the SDK
    closes the stream); not when its client read on past the frame (no resolver: its caller still waits)."""
    dropped = [stream(role, "post", "dropped", pending=("3",), last="6") for role in (C, SV)]
    refused = stream(C, "resume", "closed", pending=("3",), cursor="6", error_frames=1, missing=(FETCH,), at=2.0)
    assert _in_flight([*dropped]) == (1, [])
    assert _in_flight([*dropped, refused]) == (0, [])
    unheeded = stream(C, "resume", "clean", pending=("3",), cursor="6", error_frames=1, missing=(FETCH,), at=2.0)
    assert _in_flight([*dropped, unheeded]) == (1, ["clean_end_pending"])
    detector = run([*dropped, refused], after_s=3600)
    detector.tick()
    assert detector.ledger.stuck == 0
    retried = stream(C, "resume", "clean", pending=("3",), cursor="6", at=3.0)
    assert _in_flight([*dropped, refused, retried]) == (1, ["clean_end_pending"])


def test_the_retry_window_outlasts_memory_pressure_and_a_restart(tmp_path):
    clock = Clock()
    tight = Detector(DetectorConfig(ledger=LedgerLimits(max_bytes=2 * 1024 * 1024)), clock=clock)
    for i in range(4000):  # a busy ledger, evicting for memory
        tight.consume([stream(C, "post", "dropped", session=f"bg{i}", pending=("3",), last="6")])
    delivered = stream(C, "resume", "clean", cursor="6", terminal=("3",), last="9", at=2.0)
    tight.consume([stream(C, "post", "dropped", pending=("3",), last="6"), delivered])
    tight.consume([stream(C, "post", "dropped", session=f"new{i}", pending=("3",), last="6") for i in range(3)])
    assert tight.ledger.evictions["memory"] > 0
    tight.consume([delivered])  # the exporter's retry
    Snapshots(tight, tmp_path / "ledger.db").close()
    restarted = Detector(DetectorConfig(ledger=LedgerLimits(max_bytes=2 * 1024 * 1024)), clock=clock)
    Snapshots(restarted, tmp_path / "ledger.db").restore()
    restarted.consume([delivered])  # retried again, its answer lost in the shutdown
    for detector in (tight, restarted):
        assert "duplicate_terminal" not in rules(detector)


def test_spans_numbered_by_counters_are_never_taken_for_one_another():
    """A producer's ids may be counters (a seeded generator): trace 1 span 3 and trace 2 span 5 are two spans."""
    def numbered(span: Span, trace: int, span_id: int) -> Span:
        return dataclasses.replace(span, trace_id=format(trace, "032x"), span_id=format(span_id, "016x"))

    polled = [numbered(stream(C, "post", "clean", ids=("3",), pending=("3",), last="1"), 1, 2),
              numbered(stream(C, "resume", "clean", ids=("3",), cursor="1", terminal=("3",), last="3", at=2.0), 1, 3),
              numbered(stream(C, "post", "clean", ids=("5",), pending=("5",), last="4", at=3.0), 2, 4),
              numbered(stream(C, "resume", "clean", ids=("5",), cursor="4", terminal=("5",), last="6", at=4.0), 2, 5)]
    assert rules(run(polled, after_s=60)) == []


def test_a_resume_from_where_a_clean_end_stopped_restarts_the_clock_whichever_side_saw_that_end():
    """A server that polls (closes each stream) whose own exporter went down after its POST's span: the client's
    resumes, on its own clock (here far behind), show the call moving on from where the POST stopped."""
    clock = Clock()
    detector = Detector(DetectorConfig(rules=RuleConfig(clean_end_grace_s=5)), clock=clock)
    polled = [stream(SV, "post", "clean", pending=("3",), last="6", at=1000.0),
              stream(C, "resume", "clean", cursor="6", pending=("3",), last="9", at=1.0),
              stream(C, "resume", "clean", cursor="9", pending=("3",), last="12", at=3.0),
              stream(C, "resume", "clean", cursor="12", terminal=("3",), last="15", at=5.0)]
    for span in polled:
        detector.consume([span])
        clock.now += 4 * S  # each within the grace of the one before, not of the first
        detector.tick()
        assert rules(detector) == []
    stuck = [stream(SV, "post", "clean", pending=("3",), last="6", at=1000.0),
             stream(C, "resume", "clean", cursor="5", pending=("3",), last="8", at=1.0)]  # from before that end
    assert rules(run(stuck, after_s=6)) == ["clean_end_pending"]


def test_findings_raised_off_a_replay_that_came_first_name_the_tool_once_a_span_does():
    """A replay span names no tool: whichever span of the call names it later names it on its findings."""
    detector = run([replay(sc.REPLAY_TRUNCATED, missing=(FETCH,)),
                    stream(C, "resume", "clean", cursor="6", pending=("3",), missing=(FETCH,), at=1.1)])
    assert {(f.rule, f.tool) for f in detector.findings} == {("narrowed_resume", "fetch"),
                                                             ("replay_truncated", "fetch")}


def test_a_resume_another_replica_answered_from_shared_storage_delivers_what_it_lists_as_terminal():
    """That replica never saw the call: its resume span lists no request ids, only the result it delivered."""
    server_only = [stream(SV, "post", "dropped", pending=("3",), last="6"),
                   call(SV, sc.OUTCOME_RESULT, at=1.0, stream_kind=None, terminal_event_id="15"),
                   stream(SV, "resume", "clean", ids=(), cursor="6", terminal=("3",), last="15", at=2.0)]
    assert rules(run(server_only, after_s=60)) == []
    assert rules(run(server_only[:2], after_s=60)) == ["stored_not_delivered"]


def _stateless(role: str, outcome: str, request_id: str, at: float, trace: str, **kw: object) -> Span:
    return call(role, outcome, at=at, request_id=request_id, session=None, era=sc.ERA_STATELESS, trace=trace,
                fingerprint="f00d", **kw)  # type: ignore[arg-type]


def _broken(request_id: str, at: float) -> list[Span]:
    """A fetch whose only stream broke before its response (its caller told), in a trace of its own."""
    trace = f"b{request_id}"
    return [stream(C, "post", "dropped", ids=(request_id,), pending=(request_id,), session=None, at=at,
                   era=sc.ERA_STATELESS, trace=trace),
            _stateless(C, sc.OUTCOME_NO_TERMINAL, request_id, at, trace)]


def _reissue(request_id: str, at: float) -> list[Span]:
    """A re-issue as the client hook records it: the span of its start, ended at once, and its own call span."""
    trace = f"e{request_id}"
    return [_stateless(C, sc.OUTCOME_REISSUED, request_id, at, trace, stream_kind=None),
            _stateless(C, sc.OUTCOME_RESULT, request_id, at, trace)]


def _not_reissued(detector: Detector) -> list[str | None]:
    return sorted(f.request_id for f in detector.findings if f.rule == "not_reissued")


def test_a_reissue_after_the_calls_span_ended_is_one_even_when_its_streams_span_ended_later_and_came_first():
    """A producer may end the call's span as the error reaches its caller, who re-issues at once, and the stream's
    span after: the break is the earliest end of the two, whichever span comes first."""
    broken_stream, broken_call = _broken("3", 1.0)
    late_stream = dataclasses.replace(broken_stream, end_ns=broken_call.end_ns + S // 100)  # 10 ms after the call's
    reissue = [dataclasses.replace(span, start_ns=broken_call.end_ns + 1, end_ns=broken_call.end_ns + S // 5)
               for span in _reissue("4", 1.0)]
    assert _not_reissued(run([late_stream, broken_call, *reissue], after_s=6)) == []
    assert _not_reissued(run([late_stream, *reissue, broken_call], after_s=6)) == []
    assert _not_reissued(run([late_stream, broken_call], after_s=6)) == ["3"]


def test_one_reissue_answers_one_broken_call_of_the_same_tool_and_arguments():
    two_broken = [*_broken("3", 1.0), *_broken("5", 1.0)]
    assert len(_not_reissued(run([*two_broken, *_reissue("7", 2.0)], after_s=6))) == 1
    assert _not_reissued(run([*two_broken, *_reissue("7", 2.0), *_reissue("9", 2.5)], after_s=6)) == []
    # the re-issue broke too, and was not sent again: the first call's re-issue was sent, the second's was not
    assert _not_reissued(run([*_broken("3", 1.0), *_broken("7", 2.0)], after_s=6)) == ["7"]


def test_a_reissues_start_told_in_the_broken_calls_trace_answers_it_alone_and_keeps_no_call_of_its_own():
    # a Collector sampling by trace kept the break's trace, where the client hook tells the re-issue's start, and
    # dropped the re-issue's own
    told = _stateless(C, sc.OUTCOME_REISSUED, "7", 2.0, "b3", stream_kind=None)
    detector = run([*_broken("3", 1.0), told], after_s=6)
    assert _not_reissued(detector) == []
    assert detector.ledger.calls == 1  # the broken call's: the span of a start is an issue, no call of its own


def test_a_reissue_counts_once_whichever_of_its_spans_come_twice_and_in_whatever_order():
    reissue = _reissue("7", 2.0)
    two_broken = [*_broken("3", 1.0), *_broken("5", 1.0)]
    for spans in ([*two_broken, *reissue, *reissue],  # an exporter's retry delivers them again
                  [*reissue, *two_broken],  # the re-issue's exporter flushed first
                  [*reissue[::-1], *two_broken[::-1], *reissue]):
        assert len(_not_reissued(run(spans, after_s=6))) == 1


def test_a_reissue_a_broken_call_claimed_stays_claimed_across_a_restart_and_an_older_snapshot_still_loads(
        tmp_path):
    clock = Clock()
    config = DetectorConfig(rules=RuleConfig(reissue_grace_s=5))
    before = Detector(config, clock=clock)
    before.consume([*_broken("3", 1.0), *_reissue("7", 2.0)])
    clock.now += 6 * S
    before.tick()  # "3" takes "7" as its re-issue
    Snapshots(before, tmp_path / "ledger.db").close()
    restarted = Detector(config, clock=clock)
    Snapshots(restarted, tmp_path / "ledger.db").restore()
    restarted.consume(_broken("5", 1.5))  # broken before "7" started, but told late: "7" is taken
    clock.now += 6 * S
    restarted.tick()
    assert _not_reissued(restarted) == ["5"]

    issued = Detector(config, clock=clock)
    issued.consume(_reissue("7", 2.0))
    Snapshots(issued, tmp_path / "older.db").close()
    with closing(sqlite3.connect(tmp_path / "older.db")) as db:  # as before: format 2, each key's latest issue
        ((rows,),) = db.execute("SELECT data FROM rows WHERE kind = 'issued'")
        latest = [[origin, key, issues[-1]] for origin, key, issues in json.loads(rows)]
        db.execute("UPDATE rows SET data = ? WHERE kind = 'issued'", (json.dumps(latest),))
        db.execute("UPDATE meta SET format = 2")
        db.commit()
    older = Detector(config, clock=clock)
    assert Snapshots(older, tmp_path / "older.db").restore()
    older.consume(_broken("3", 1.0))
    clock.now += 6 * S
    older.tick()
    assert _not_reissued(older) == []


def _in_flight(spans: Sequence[Span]) -> tuple[int, list[str]]:
    detector = run(spans, after_s=6)
    return detector.ledger.in_flight, rules(detector)


def test_a_call_whose_caller_the_sdk_told_it_failed_is_over_not_in_flight_and_its_give_up_explains_nothing():
    dropped = [stream(role, "post", "dropped", pending=("3",), last="6") for role in (C, SV)]
    assert _in_flight([*dropped, call(C, sc.OUTCOME_EVICTED)]) == (1, [])  # the client's tracker forgot it: owed
    assert _in_flight([*dropped, call(C, sc.OUTCOME_NO_TERMINAL)]) == (0, [])
    # no event id to resume from (a server with no event store): the SDK fails the call to its caller at once
    for role in (C, SV):
        assert _in_flight([stream(role, "post", "dropped", pending=("3",), session=None)]) == (0, [])
    emptied = stream(C, "resume", "clean", pending=("3",), cursor="6", at=2.0)
    assert _in_flight([*dropped, emptied, call(C, sc.OUTCOME_NO_TERMINAL, at=3.0)]) == (0, ["clean_end_pending"])
    assert _in_flight(_broken("3", 1.0)) == (0, ["not_reissued"])  # 2026-07-28: the loss is the call not sent again


def test_a_404_the_sdk_gave_another_principal_is_no_expiry_the_loss_stays_critical_and_the_call_in_flight():
    # anyone who knows a session id gets the SDK's 404 naming it: read as expiry, it would turn the session's silent
    # loss into a warning and take its calls out of the in-flight count
    lost = stream(SV, "resume", "clean", pending=("3",), cursor="6")
    for owner, expected in ((None, ["session_expired_in_flight"]), (sc.SESSION_OWNER_OTHER, ["clean_end_pending"])):
        refused = stream(SV, "resume", "http_error", ids=(), cursor="6", status=404, tool=None, at=2.0, owner=owner)
        for order in ([lost, refused], [refused, lost]):
            detector = run(order, after_s=6)
            assert rules(detector) == expected
        dropped = stream(SV, "post", "dropped", pending=("3",), last="6")
        assert _in_flight([dropped, refused]) == ((0, expected) if owner is None else (1, []))
    (page,) = run([lost, refused], after_s=6).findings
    assert page.severity == "critical"


def test_a_call_whose_server_accepted_its_cancel_is_over_not_in_flight_nor_expired_with_its_session():
    dropped = stream(SV, "post", "dropped", pending=("3",), last="6")
    cancelled = call(SV, sc.OUTCOME_CANCELLED, at=2.0)
    expired = stream(SV, "resume", "http_error", ids=(), cursor="6", status=404, tool=None, at=3.0)
    assert _in_flight([dropped, expired]) == (0, ["session_expired_in_flight"])  # gone with its session
    assert _in_flight([dropped, cancelled, expired]) == (0, [])
    emptied = stream(SV, "resume", "clean", pending=("3",), cursor="6", at=1.5)
    assert _in_flight([dropped, emptied, cancelled]) == (0, ["clean_end_pending"])  # its caller gave up: no cause


def test_a_stateless_call_whose_server_stream_ended_without_its_response_is_over_not_in_flight():
    """2026-07-28 has no resumption: nothing can deliver it any more (server spans only: its caller's timeout)."""
    dropped = stream(SV, "post", "dropped", pending=("3",), session=None, era=sc.ERA_STATELESS)
    no_terminal = call(SV, sc.OUTCOME_NO_TERMINAL, session=None, era=sc.ERA_STATELESS)
    assert _in_flight([dropped]) == (0, [])
    assert _in_flight([no_terminal, dropped]) == (0, [])


def test_a_give_up_in_a_snapshot_of_before_still_explains_the_finding_its_call_gets_after_the_restart():
    # its give-ups under their own name; its client's give-up kept alone; before that, every give-up was one
    for older in ({"gave_up": 1}, {"cancelled": True}, {}):
        clock = Clock()
        config = DetectorConfig(rules=RuleConfig(clean_end_grace_s=5))
        before = Detector(config, clock=clock)
        before.consume([stream(C, "resume", "clean", pending=("3",), cursor="6"), call(C, sc.OUTCOME_CANCELLED)])
        rows = before.ledger.dump()
        for session in rows["sessions"]:
            for row in session["calls"]:
                del row["flags"]
                row.update(older)
        restarted = Detector(config, clock=clock)
        restarted.ledger.load(rows)
        clock.now += 6 * S
        restarted.tick()
        assert rules(restarted) == ["clean_end_pending", "timeout_attributed"]


def test_a_reissue_dated_past_what_64_signed_bits_hold_is_still_taken_for_one():
    far = dataclasses.replace(_reissue("7", 2.0)[1], start_ns=2**64 - 1, end_ns=2**64 - 1)  # OTLP's times: uint64
    assert _not_reissued(run([*_broken("3", 1.0), far], after_s=6)) == []


def test_a_snapshot_whose_reissue_look_up_no_64_bit_time_holds_is_set_aside_not_raised(tmp_path):
    issued = Detector(clock=Clock())
    issued.consume(_reissue("7", 2.0))
    Snapshots(issued, tmp_path / "ledger.db").close()
    with closing(sqlite3.connect(tmp_path / "ledger.db")) as db:
        db.execute("UPDATE rows SET data = ? WHERE kind = 'issued'",
                   (json.dumps([["client-app", "fetch#f00d", [2**63]]]),))
        db.commit()
    assert not Snapshots(Detector(), tmp_path / "ledger.db").restore()
    assert list(tmp_path.glob("ledger.db.corrupt-*"))


def test_a_404_whose_span_comes_before_the_one_showing_its_call_owed_still_judges_that_call():
    owed = stream(SV, "post", "dropped", pending=("3",), last="6", at=1.0)
    expired = stream(SV, "resume", "http_error", ids=(), cursor="6", status=404, tool=None, at=2.0)
    assert rules(run([expired, owed], after_s=6)) == ["session_expired_in_flight"]


def test_what_a_session_owed_is_over_once_its_client_deleted_it_and_a_clean_end_before_still_pages():
    """Nothing can deliver a call of a deleted session: it leaves the in-flight gauge, in whichever order the
    spans come; a clean end that lost it is still judged (a DELETE at the client's exit absolves nothing)."""
    resumed = stream(SV, "resume", "clean", pending=("3",), cursor="6", at=1.0)
    deleted = stream(SV, "delete", "clean", ids=(), tool=None, at=2.5)
    for spans in ([deleted, resumed], [resumed, deleted]):
        detector = run(spans, after_s=6)
        assert (rules(detector), detector.ledger.in_flight) == (["clean_end_pending"], 0)


def test_a_stream_ended_with_its_session_leaves_its_calls_over_and_pages_nothing_in_any_order():
    """``terminated``: the hooks saw the session's DELETE accepted while the stream was open (the SDK closes a
    session's streams as it accepts its DELETE): a call its client left as it exited is no loss."""
    deleted = stream(SV, "delete", "clean", ids=(), tool=None, at=2.5)
    running = stream(SV, "post", sc.END_TERMINATED, pending=("3",), last="6", at=2.5)  # a long call, its POST open
    polled = stream(SV, "post", "clean", pending=("3",), last="6", at=1.0)  # a tool that polls: its resume moved on
    moving = stream(SV, "resume", sc.END_TERMINATED, pending=("3",), cursor="6", last="8", at=2.5)
    for spans in ([running], [running, deleted], [deleted, running], [polled, moving], [moving, deleted, polled]):
        detector = run(spans, after_s=6)
        assert (rules(detector), detector.ledger.in_flight) == ([], 0)


def test_a_post_the_server_closed_as_it_accepted_another_clients_delete_is_no_silent_loss_in_any_order():
    """Another client of the session (the same principal) deleted it: the server closed the POST (``terminated``),
    which this client saw as a clean end; its resume got 404, and the SDK failed the call to its caller."""
    closed = stream(SV, "post", sc.END_TERMINATED, pending=("3",), last="6", at=2.5)
    seen_clean = stream(C, "post", "clean", pending=("3",), last="6", at=2.5)
    gone = stream(C, "resume", "http_error", ids=(), cursor="6", status=404, tool=None, at=2.6)
    deleted = stream(SV, "delete", "clean", ids=(), tool=None, at=2.4)
    for spans in itertools.permutations([closed, seen_clean, gone, deleted]):
        assert rules(run(list(spans), after_s=60)) == []
    # a POST the server ended cleanly lost it, whoever deleted the session after
    lost = stream(SV, "post", "clean", pending=("3",), last="6", at=1.0)
    assert rules(run([lost, seen_clean, gone, deleted], after_s=60)) == ["clean_end_pending"]
    # a clean end its session outlived (a resume answered after it) was no such close, whatever came later
    answered = stream(C, "resume", "dropped", pending=("3",), cursor="6", at=2.6)
    assert rules(run([closed, seen_clean, answered, gone, deleted], after_s=60)) == ["clean_end_pending"]
    # the client's clean end of a resume the server closed so is judged as before (the POST was no such close)
    dropped = stream(C, "post", "dropped", pending=("3",), last="6", at=1.0)
    emptied = stream(C, "resume", "clean", pending=("3",), cursor="6", at=1.5)
    assert rules(run([dropped, emptied, closed, deleted], after_s=60)) == ["clean_end_pending"]


def test_store_failed_pages_whichever_comes_first_its_spans_or_a_404_on_its_session():
    """The store's failure is the cause, the session going after it the effect: one critical finding either way,
    the expiry under ``also`` when its grace ran out first."""
    dropped = stream(C, "post", "dropped", pending=("3",), last="6")
    gone = stream(C, "resume", "http_error", ids=(), cursor="6", status=404, tool=None, at=2.0)
    for spans in ([dropped, _store_failed(at=1.5), gone], [dropped, gone, _store_failed(at=1.5)]):
        detector = run(spans, after_s=60)
        (finding,) = detector.findings
        assert (finding.rule, finding.severity) == ("store_failed", "critical")
        assert detector.registry.get_sample_value("mcp_stream_silent_losses_total",
                                                  {"tool": "fetch", "rule": "store_failed"}) == 1.0


def test_store_failed_is_read_only_off_a_servers_call_span_of_a_session():
    """Only a server's store fails, and only the calls of a session end so: any other span saying it is no loss."""
    for span in (call(C, sc.OUTCOME_STORE_FAILED), call(SV, sc.OUTCOME_STORE_FAILED, session=None)):
        assert rules(run([span], after_s=60)) == []


def _half_open_resumes(times: Sequence[float]) -> list[Span]:
    """Resumes from event 4 of a call whose POST the server still holds open (its client lost it): each replays
    nothing new and ends clean, on both sides, the server's saying its tool had not answered yet."""
    out: list[Span] = []
    for at in times:
        out.append(stream(C, "resume", "clean", at=at, pending=("3",), cursor="4", last="4"))
        out.append(stream(SV, "resume", "clean", at=at, pending=("3",), cursor="4", last="4", running=("3",)))
    return out


def test_clean_ends_while_the_servers_tool_had_not_answered_page_nothing_however_long_it_runs():
    dropped = stream(C, "post", "dropped", pending=("3",), last="4")
    assert rules(run([dropped, *_half_open_resumes([2.0, 3.0])], after_s=60)) == []
    client_first = [dropped, stream(C, "resume", "clean", at=2.0, pending=("3",), cursor="4", last="4")]
    server_after = [stream(SV, "resume", "clean", at=2.0, pending=("3",), cursor="4", last="4", running=("3",))]
    assert rules(run([*client_first, *server_after], after_s=60)) == []  # the server's word comes after the client's


def test_a_running_word_that_comes_after_the_servers_call_span_is_not_taken_whatever_that_span_says():
    """The server's call span ends after every stream end of it: a running word that comes later is older."""
    client = [stream(C, "post", "dropped", pending=("3",), last="4"),
              stream(C, "resume", "clean", at=2.0, pending=("3",), cursor="4", last="4")]
    running = stream(SV, "resume", "clean", at=2.0, pending=("3",), cursor="4", last="4", running=("3",))
    evicted = call(SV, sc.OUTCOME_EVICTED, at=2.5)
    assert "clean_end_pending" in rules(run([*client, evicted, running], after_s=60))
    assert "clean_end_pending" in rules(run([*client, running, evicted], after_s=60))


def test_a_result_the_server_tells_of_after_it_said_its_tool_was_running_is_judged_a_grace_from_then():
    clock = Clock()
    detector = Detector(DetectorConfig(rules=RuleConfig(clean_end_grace_s=5)), clock=clock)
    detector.consume([stream(C, "post", "dropped", pending=("3",), last="4"), *_half_open_resumes([2.0, 3.0])])
    clock.now += 60 * S
    detector.tick()
    detector.consume([call(SV, sc.OUTCOME_RESULT, at=70.0, stream_kind=None, terminal_event_id="9")])  # stored
    clock.now += 4 * S
    detector.tick()
    assert rules(detector) == []  # within the grace since the result came to be
    clock.now += 2 * S
    detector.tick()
    (lost,) = detector.findings  # one loss, one finding
    assert (lost.rule, lost.evidence["also"]) == ("clean_end_pending", ["stored_not_delivered"])


def test_a_running_call_its_client_cancelled_before_any_result_was_no_loss():
    spans = [stream(C, "post", "dropped", pending=("3",), last="4"), *_half_open_resumes([2.0]),
             call(C, sc.OUTCOME_CANCELLED, at=3.0), call(SV, sc.OUTCOME_CANCELLED, at=3.0)]
    assert rules(run(spans, after_s=60)) == []


def test_a_running_word_that_comes_after_the_servers_result_is_not_taken():
    spans = [stream(C, "post", "dropped", pending=("3",), last="4"),
             stream(C, "resume", "clean", at=2.0, pending=("3",), cursor="4", last="4"),
             call(SV, sc.OUTCOME_RESULT, at=2.5, stream_kind=None, terminal_event_id="9"),
             stream(SV, "resume", "clean", at=2.0, pending=("3",), cursor="4", last="4", running=("3",))]
    assert "clean_end_pending" in rules(run(spans, after_s=60))


def test_a_resume_answered_401_or_403_tells_no_caller_and_a_stored_result_never_delivered_still_pages():
    """The SDK retries a resume that got an HTTP error (a token refreshed meanwhile may get through) and fails the call
    only once its attempts ran out, with an error that says nothing of the result: the result stored and never
    delivered is lost all the same, and a retry that got through and then lost it must not go unseen."""
    for status in (401, 403):
        refused = stream(C, "resume", sc.END_HTTP_ERROR, pending=("3",), cursor="6", status=status, at=2.0)
        stalled = stream(C, "resume", sc.END_DROPPED, pending=("3",), cursor="6", at=2.5)
        for spans in ([*_stored_with_no_stream(), refused], [refused, *_stored_with_no_stream(), stalled]):
            assert rules(run(spans, after_s=60)) == ["stored_not_delivered"]
