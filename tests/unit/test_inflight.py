"""The guard's table of request ids in flight (``guard.inflight.InFlight``): what a reusing POST is refused by."""

from __future__ import annotations

from mcp_stream_exporter.guard.inflight import InFlight


def _owned(*ids: str, owner: str = "alice") -> list[tuple[str, str]]:
    return [(request_id, owner) for request_id in ids]


def test_an_id_is_held_until_both_its_answer_is_stored_and_its_post_has_ended():
    table = InFlight()
    assert table.claim("s1", _owned("5")) is None
    table.ended("s1", ["5"])  # a polling server closed the POST: the call runs on under id 5
    assert table.claim("s1", _owned("5")) is not None
    table.answered("s1", "5")
    assert table.claim("s1", _owned("5")) is None
    table.ended("s1", ["5"], answered=True)  # refused, or answered as JSON: free at once
    assert table.claim("s1", _owned("5")) is None


def test_no_flood_of_other_sessions_frees_a_running_calls_id():
    table = InFlight(max_sessions=3)
    assert table.claim("victim", _owned("5")) is None
    for n in range(1000):  # POSTs naming made-up sessions, refused by the SDK: nothing of them stays
        assert table.claim(f"bogus-{n}", _owned("1")) is None
        table.ended(f"bogus-{n}", ["1"], answered=True)
    assert table.claim("victim", _owned("5")) is not None
    assert table.claim("a", _owned("1")) is None and table.claim("b", _owned("1")) is None
    assert table.claim("c", _owned("1")) is not None  # full of sessions in flight: refused, none dropped


def test_a_long_id_is_held_as_its_digest_and_a_batch_repeating_an_id_is_a_reuse():
    table = InFlight(max_id=8)
    long_id = "9" * 10_000
    assert table.claim("s1", _owned(long_id)) is None
    assert table.claim("s1", _owned(long_id)) is not None
    assert all(len(key) < 80 for held in table._sessions.values() for key in held)
    assert table.claim("s1", _owned("7", "7")) is not None and table.claim("s1", _owned("7")) is None


def test_a_call_in_flight_is_known_by_its_owner_and_so_is_each_request_the_server_awaits_an_answer_to():
    table: InFlight[str] = InFlight()
    assert table.claim("s1", [("5", "broad"), ("6", "narrow")]) is None
    assert (table.owner("s1", "5"), table.owner("s1", "7"), table.owner("s2", "5")) == ("broad", None, None)
    table.asked("s1", "0", "5")  # an elicitation sent on call 5's stream
    table.asked("s1", "1", "_GET_stream")  # on no call's stream: anyone's in the session to answer
    assert (table.asker("s1", "0"), table.asker("s1", "1")) == (("broad",), ())
    assert (table.asker("s1", "2"), table.asker("s2", "0")) == (None, None)  # not asked (yet): nothing to answer
    table.replied("s1", ["0"])
    assert table.asker("s1", "0") is None
    table.asked("s1", "2", "5")
    table.answered("s1", "5")
    table.ended("s1", ["5"])
    assert (table.owner("s1", "5"), table.asker("s1", "2")) == (None, ())  # call 5 is done: acts on nothing


def test_the_server_requests_awaiting_answers_are_bounded_and_one_let_go_is_unknown():
    table: InFlight[str] = InFlight(max_asked=2)
    assert table.claim("s1", _owned("5")) is None
    for n in range(5):
        table.asked("s1", str(n), "5")
    assert [table.asker("s1", str(n)) for n in range(5)] == [None, None, None, ("alice",), ("alice",)]


def test_ids_are_held_as_the_sdk_correlates_them_so_a_spelling_of_the_same_int_is_the_same_id():
    table: InFlight[str] = InFlight()
    assert table.claim("s1", [("7", "broad")]) is None
    # int() of each is 7: the SDK cancels call 7 by any of them
    for spelling in ("07", " 7", "+7", "\uff17", "7 ", "0" * 1000 + "7"):
        assert table.owner("s1", spelling) == "broad"
        assert table.claim("s1", _owned(spelling)) is not None
    table.asked("s1", "0", "07")
    assert table.asker("s1", "00") == ("broad",)
    assert table.owner("s1", "7a") is None and table.claim("s1", _owned("7a")) is None


def test_an_id_whose_stream_a_resume_holds_cannot_be_taken_until_the_resume_ends():
    table: InFlight[str] = InFlight()
    table.resuming("s1", "5")
    table.resuming("s1", "5")
    assert table.claim("s1", _owned("05")) is not None and table.claim("s2", _owned("5")) is None
    table.resume_ended("s1", "5")
    assert table.claim("s1", _owned("5")) is not None  # one resume still holds it
    table.resume_ended("s1", "5")
    assert table.claim("s1", _owned("5")) is None
