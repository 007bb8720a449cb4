"""The guard's table of request ids in flight (``guard.inflight.InFlight``): what a reusing POST is refused by."""

from __future__ import annotations

from mcp_stream_exporter.guard.inflight import InFlight


def test_an_id_is_held_until_both_its_answer_is_stored_and_its_post_has_ended():
    table = InFlight()
    assert table.claim("s1", ["5"]) is None
    table.ended("s1", ["5"])  # a polling server closed the POST: the call runs on under id 5
    assert table.claim("s1", ["5"]) is not None
    table.answered("s1", "5")
    assert table.claim("s1", ["5"]) is None
    table.ended("s1", ["5"], answered=True)  # refused, or answered as JSON: free at once
    assert table.claim("s1", ["5"]) is None


def test_no_flood_of_other_sessions_frees_a_running_calls_id():
    table = InFlight(max_sessions=3)
    assert table.claim("victim", ["5"]) is None
    for n in range(1000):  # POSTs naming made-up sessions, refused by the SDK: nothing of them stays
        assert table.claim(f"bogus-{n}", ["1"]) is None
        table.ended(f"bogus-{n}", ["1"], answered=True)
    assert table.claim("victim", ["5"]) is not None
    assert table.claim("a", ["1"]) is None and table.claim("b", ["1"]) is None
    assert table.claim("c", ["1"]) is not None  # full of sessions in flight: refused, none dropped


def test_a_long_id_is_held_as_its_digest_and_a_batch_repeating_an_id_is_a_reuse():
    table = InFlight(max_id=8)
    long_id = "9" * 10_000
    assert table.claim("s1", [long_id]) is None
    assert table.claim("s1", [long_id]) is not None
    assert all(len(key) < 80 for held in table._sessions.values() for key in held)
    assert table.claim("s1", ["7", "7"]) is not None and table.claim("s1", ["7"]) is None
