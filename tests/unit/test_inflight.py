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
    table.asked("s1", "1", "_GET_stream")  # on no call's stream: any call in flight may have sent it
    assert (table.asker("s1", "0"), table.asker("s1", "1")) == (("broad",), ("broad", "narrow"))
    assert (table.asker("s1", "2"), table.asker("s2", "0")) == (None, None)  # not asked (yet): nothing to answer
    table.accepted("s1", [], ["0"])  # the SDK took the client's answer
    assert table.asker("s1", "0") is None
    table.asked("s1", "2", "5")
    table.answered("s1", "5")
    table.ended("s1", ["5"])
    assert (table.owner("s1", "5"), table.asker("s1", "2")) == (None, None)  # call 5 is done: nothing awaits it


def test_the_server_requests_awaiting_answers_are_bounded_per_session_so_other_sessions_evict_none():
    table: InFlight[str] = InFlight(max_per_session=2, max_sessions=3)
    assert table.claim("s1", _owned("5")) is None
    table.asked("s1", "0", "5")
    for n in range(50):  # another session's requests, never answered
        table.asked("s2", str(n), "_GET_stream")
    assert table.asker("s1", "0") == ("alice",)
    assert [table.asker("s2", str(n)) for n in (47, 48, 49)] == [None, (), ()]  # its own oldest let go


def test_a_refused_post_changes_nothing_the_table_knows_of_its_session():
    """Owners and answers count once the SDK took the POST (``accepted``): a POST it refuses (no token, another
    user's session) can neither make the session's DELETE look foreign, nor answer for the client, nor evict
    another session's past by naming made-up sessions."""
    table: InFlight[str] = InFlight(max_sessions=3)
    assert table.claim("victim", [("5", "alice")]) is None
    table.accepted("victim", [("5", "alice")], [])
    table.asked("victim", "0", "5")
    table.answered("victim", "5")
    table.ended("victim", ["5"])
    for n in range(10):  # refused by the SDK: claimed, then freed at once, never accepted
        assert table.claim(f"bogus-{n}", [("1", "mallory")]) is None
        table.ended(f"bogus-{n}", ["1"], answered=True)
    assert table.claim("victim", [("6", "mallory")]) is None  # refused too
    table.ended("victim", ["6"], answered=True)
    assert table.owners("victim") == ["alice"]


def test_whose_calls_were_in_flight_is_kept_with_each_event_of_the_standalone_stream():
    table: InFlight[str] = InFlight(max_per_session=2)
    table.stored_alone("s1", "1", "storer")  # nothing in flight (a tool's task that outlived its call): its storer's
    assert table.claim("s1", [("5", "broad")]) is None
    table.stored_alone("s1", "2", "storer")  # a sampling request the tool of call 5 sent on no call's stream
    table.stored_alone("s1", "3", "storer")
    assert [table.alone("s1", event_id) for event_id in "239"] == [("broad", "storer"), ("broad", "storer"), None]
    assert table.alone("s1", "1") is None  # past the newest max_per_session: unknown, so refused


def test_the_owners_of_a_sessions_calls_outlive_them_until_the_session_ends():
    """A call's stored result outlives the call: ending the session ends it too."""
    table: InFlight[str] = InFlight()
    assert table.claim("s1", [("5", "broad")]) is None
    assert table.owners("s1") == ["broad"]  # in flight, the SDK yet to take it
    table.accepted("s1", [("5", "broad")], [])
    table.answered("s1", "5")
    table.ended("s1", ["5"])
    assert table.owner("s1", "5") is None and table.owners("s1") == ["broad"]
    table.end("s1")
    assert table.owners("s1") == []


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


def test_an_id_something_the_sdk_may_still_act_on_names_cannot_be_taken_until_it_is_released():
    table: InFlight[str] = InFlight()
    table.hold("s1", "5")  # a resume holding its stream's live tail
    table.hold("s1", "5")  # a cancel of it being handled
    assert table.claim("s1", _owned("05")) is not None and table.claim("s2", _owned("5")) is None
    table.release("s1", "5")
    assert table.claim("s1", _owned("5")) is not None  # one still holds it
    table.release("s1", "5")
    assert table.claim("s1", _owned("5")) is None


def test_a_call_refused_before_it_ran_is_no_owner_of_its_session_in_flight_or_after_whichever_is_told_first():
    """The call guard's refusal is all a refused call has: a DELETE ends nothing of it, even sent as the refusal is
    read (the call still in flight, its POST not yet over). The SDK's taking of the POST (``accepted``) and the
    refusal's store race: a refusal told first took back another call's count of the same owner, whose result a
    DELETE then ended. A call that stored something before an error shaped as a refusal ran, and still counts."""
    table: InFlight[str] = InFlight()
    table.opened("s1", "opener")
    assert table.claim("s1", [("1", "fetch")]) is None
    table.accepted("s1", [("1", "fetch")], [])
    table.answered("s1", "1")
    table.ended("s1", ["1"])  # a broad token's fetch, its result stored
    assert table.claim("s1", [("2", "fetch"), ("3", "search"), ("4", "relay")]) is None
    table.refused("s1", "2")  # a narrower token's fetch, refused: told before its POST's response started
    assert table.owners("s1") == ["opener", "fetch", "search", "relay"]  # the broad fetch's count kept
    table.accepted("s1", [("2", "fetch"), ("3", "search"), ("4", "relay")], [])
    table.refused("s1", "3")  # told after
    table.ran("s1", "4")  # its progress, then a tool's error shaped as the guard's refusal
    table.refused("s1", "4")
    assert table.owners("s1") == ["opener", "fetch", "relay"]
    table.answered("s1", "2")
    table.answered("s1", "3")
    table.answered("s1", "4")
    table.ended("s1", ["2", "3", "4"])
    assert table.owners("s1") == ["opener", "fetch", "relay"]  # the broad fetch's result and the relay's


def test_a_refused_call_takes_back_only_a_count_it_made_when_the_sessions_owners_are_at_their_bound():
    """At ``max_per_session`` owners a call is not counted; marked counted all the same, its refusal took back the
    count another call of its owner made once room was made, and that call's stored result lost its owner."""
    table: InFlight[str] = InFlight(max_per_session=3)
    assert table.claim("s1", [("1", "a"), ("2", "b"), ("3", "c")]) is None
    table.accepted("s1", [("1", "a"), ("2", "b"), ("3", "c")], [])  # the bound reached
    for request_id in "12":
        table.answered("s1", request_id)
    table.ended("s1", ["1", "2"])
    assert table.claim("s1", [("4", "fetch")]) is None
    table.accepted("s1", [("4", "fetch")], [])  # past the bound: not counted
    table.refused("s1", "3")  # room made
    assert table.claim("s1", [("5", "fetch")]) is None
    table.accepted("s1", [("5", "fetch")], [])
    table.answered("s1", "5")
    table.ended("s1", ["5"])  # a broad fetch's result, stored
    table.refused("s1", "4")
    assert "fetch" in table.owners("s1")
