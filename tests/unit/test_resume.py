"""The client's decision boundary (docs/incident.md): resume, re-authorise with a superset, or re-issue."""

from __future__ import annotations

from mcp_stream_exporter.auth import AuthView, Requirement
from mcp_stream_exporter.resume import Action, Refusal, decide_resume

SEARCH = "https://mcp.example.com/tools/search"
FETCH = "https://mcp.example.com/tools/fetch"
NARROW = AuthView(audience=frozenset({SEARCH}))
BROAD = AuthView(audience=frozenset({SEARCH, FETCH}))


def test_single_tool_stream_resumes_with_any_token_covering_that_tool():
    decision = decide_resume([Requirement.of([SEARCH])], NARROW, cursor="41", can_widen=False)
    assert decision.action is Action.RESUME
    assert decision.cursor == "41"


def test_multi_tool_stream_with_a_narrowed_token_reauthorises_for_the_union():
    decision = decide_resume([Requirement.of([SEARCH]), Requirement.of([FETCH])], NARROW, cursor="41",
                             can_widen=True)
    assert decision.action is Action.REAUTHORIZE
    assert decision.requirement.resources == {SEARCH, FETCH}
    assert decision.missing_resources == {FETCH}


def test_without_a_superset_token_to_be_had_the_calls_are_reissued():
    decision = decide_resume([Requirement.of([FETCH])], NARROW, cursor="41", can_widen=False)
    assert decision.action is Action.REISSUE


def test_an_unknown_cursor_means_reissue_even_with_a_broad_token():
    assert decide_resume([Requirement.of([FETCH])], BROAD, cursor=None, can_widen=True).action is Action.REISSUE


def test_scopes_narrow_like_audiences():
    held = AuthView(audience=frozenset({FETCH}), scopes=frozenset({"read"}))
    decision = decide_resume([Requirement.of([FETCH], ["write"])], held, cursor="7", can_widen=True)
    assert decision.action is Action.REAUTHORIZE
    assert decision.missing_scopes == {"write"}


def test_refusal_reads_the_guards_error_frame_data():
    refusal = Refusal.from_data({"error": "insufficient_audience", "cursor": "6", "request_id": "3",
                                 "event_id": "8", "required_resources": [FETCH + "/"],
                                 "required_scopes": [], "token_audience": [SEARCH]})
    assert refusal.requirement == Requirement.of([FETCH])
    assert (refusal.cursor, refusal.request_id, refusal.event_id) == ("6", "3", "8")
    assert refusal.token_audience == {SEARCH}
    assert Refusal.from_data({"error": "unknown_cursor", "cursor": "9"}).requirement == Requirement()
