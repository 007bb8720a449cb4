"""The replay guard's verdicts, driven directly (no HTTP): modes, policies, cursors, bounds."""

from __future__ import annotations

import asyncio
import gc
import json
import tracemalloc
from typing import Any

import jwt
import pytest
from mcp_types import JSONRPCNotification, JSONRPCRequest, JSONRPCResponse

from mcp_stream_exporter.asgi import route_path
from mcp_stream_exporter.auth import NO_REQUIREMENT, AuthView, Requirement, TokenReader, ToolPolicy
from mcp_stream_exporter.exchange import read_body
from mcp_stream_exporter.guard import (
    REFUSAL_METHOD,
    GuardedEventStore,
    InMemoryEventStorage,
)
from mcp_stream_exporter.guard.error_frame import rewrite_refusal
from mcp_stream_exporter.guard.storage import StorageError
from mcp_stream_exporter.guard.store import _current as guard_request
from mcp_stream_exporter.guard.store import _Request as GuardRequest
from mcp_stream_exporter.sse import SSEParser

SEARCH = "https://mcp.example.com/tools/search"
FETCH = "https://mcp.example.com/tools/fetch"
POLICY = ToolPolicy({"search": Requirement.of([SEARCH]), "fetch": Requirement.of([FETCH])})
BROAD = AuthView(audience=frozenset({SEARCH, FETCH}), fingerprint="b", verification="unverified")
NARROW = AuthView(audience=frozenset({SEARCH}), fingerprint="n", verification="unverified")
OPENER = AuthView()  # the initialize request's token: no subject here, so no principal binding


def run(coro):
    return asyncio.new_event_loop().run_until_complete(coro)


def progress(n):
    return JSONRPCNotification(jsonrpc="2.0", method="notifications/progress", params={"progress": n})


def result(rid):
    return JSONRPCResponse(jsonrpc="2.0", id=rid, result={"content": []})


class ClientLeft(Exception):
    """A resume's client goes away while its live tail waits."""


class Session:
    """One MCP session's view of the store, as the SDK would drive it."""

    def __init__(self, store, session_id="s1"):
        self.store = store
        self.session_id = session_id
        run(store.open_session(session_id))  # its initialize response named it

    def store_event(self, stream_id, message, auth=OPENER):
        token = guard_request.set(GuardRequest(self.session_id, auth))
        try:
            return run(self.store.store_event(stream_id, message))
        finally:
            guard_request.reset(token)

    def call(self, request_id, tool, n_progress=2, with_result=True):
        run(self.store.record_call(self.session_id, str(request_id), tool))
        ids = [self.store_event(str(request_id), None)]
        ids += [self.store_event(str(request_id), progress(i)) for i in range(n_progress)]
        if with_result:
            ids.append(self.store_event(str(request_id), result(request_id)))
        return ids

    def resume(self, cursor, auth):
        """Resume from ``cursor``; the client leaves where the live tail would wait for the call's next event.
        ``stream``: the stream whose live tail the resume held (the guard's tail, or the SDK's), else None."""
        sent = []
        storage = self.store.storage

        async def send(event):
            sent.append(event)

        async def wait_after(session_id, event_id, timeout_s):
            last = await storage.get(session_id, event_id)
            events = (await storage.after(session_id, last) or []) if last is not None else []
            if not events:
                raise ClientLeft
            return events

        storage.wait_after = wait_after
        token = guard_request.set(GuardRequest(self.session_id, auth))
        try:
            stream = run(self.store.replay_events_after(cursor, send))
        except ClientLeft:
            stream = run(storage.get(self.session_id, cursor)).stream_id
        finally:
            guard_request.reset(token)
            del storage.wait_after
        delivered = [e.event_id for e in sent if e.event_id is not None]
        notices = [e.message.params for e in sent if e.event_id is None]
        assert all(e.message.method == REFUSAL_METHOD for e in sent if e.event_id is None)
        return stream, delivered, notices


def test_authorised_resume_replays_everything_after_the_cursor_and_keeps_the_live_tail_until_the_answer():
    s = Session(GuardedEventStore(POLICY))
    ids = s.call(2, "fetch", with_result=False)
    stream, delivered, notices = s.resume(ids[1], BROAD)
    assert (stream, delivered, notices) == ("2", ids[2:], [])
    answered = s.call(3, "fetch")
    assert s.resume(answered[1], BROAD) == (None, answered[2:], [])  # its answer replayed: nothing live to come


def test_narrowed_resume_is_refused_with_an_error_naming_event_requirement_audience_and_cursor():
    s = Session(GuardedEventStore(POLICY))
    ids = s.call(2, "fetch")
    stream, delivered, notices = s.resume(ids[1], NARROW)
    assert stream is None  # no live tail: the stream ends after the error frame
    assert delivered == []
    (notice,) = notices
    assert notice["error"] == "insufficient_audience"
    assert notice["event_id"] == ids[2]
    assert notice["request_id"] == "2"
    assert notice["required_resources"] == [FETCH]
    assert notice["missing_resources"] == [FETCH]
    assert notice["token_audience"] == [SEARCH]
    assert notice["cursor"] == ids[1]  # unchanged: nothing was delivered


def test_prefix_policy_delivers_the_authorised_prefix_then_refuses_with_the_cursor_there():
    s = Session(GuardedEventStore(POLICY, policy_mode="prefix", replay="session"))
    search = s.call(2, "search", with_result=False)
    fetch = s.call(3, "fetch")
    tail = [s.store_event("2", progress(9)), s.store_event("2", result(2))]
    _, delivered, (notice,) = s.resume(search[1], NARROW)
    assert delivered == search[2:]  # search's events before fetch's first
    assert notice["event_id"] == fetch[1]
    assert notice["cursor"] == search[-1]
    assert tail[0] not in delivered  # nothing after an undelivered event


def test_all_or_nothing_refuses_a_session_wide_replay_before_sending_anything():
    s = Session(GuardedEventStore(POLICY, replay="session"))
    search = s.call(2, "search", with_result=False)
    s.call(3, "fetch")
    _, delivered, (notice,) = s.resume(search[0], NARROW)
    assert delivered == []
    assert notice["cursor"] == search[0]


def test_live_tail_requirement_is_checked_even_with_nothing_buffered():
    s = Session(GuardedEventStore(POLICY))
    ids = s.call(2, "fetch", n_progress=1, with_result=False)
    stream, delivered, (notice,) = s.resume(ids[-1], NARROW)
    assert stream is None
    assert delivered == []
    assert notice["event_id"] is None
    assert notice["missing_resources"] == [FETCH]


def test_observe_mode_replays_as_before():
    s = Session(GuardedEventStore(POLICY, mode="observe"))
    ids = s.call(2, "fetch", with_result=False)
    stream, delivered, notices = s.resume(ids[1], NARROW)
    assert (stream, delivered, notices) == ("2", ids[2:], [])


@pytest.mark.parametrize("cursor", ["999", "not-an-id"])
def test_unknown_cursor_gets_an_explicit_error_not_an_empty_stream(cursor):
    s = Session(GuardedEventStore(POLICY))
    s.call(2, "fetch")
    stream, delivered, (notice,) = s.resume(cursor, BROAD)
    assert stream is None
    assert delivered == []
    assert set(notice) == {"error", "cursor", "detail"}
    assert (notice["error"], notice["cursor"]) == ("unknown_cursor", cursor)
    assert "re-issue" in notice["detail"]


def test_a_cursor_from_another_session_is_refused_and_nothing_of_it_leaks():
    store = GuardedEventStore(POLICY)
    alice, bob = Session(store, "alice"), Session(store, "bob")
    alice_ids = alice.call(2, "fetch", with_result=False)
    bob.call(2, "fetch")  # the same request id in another session
    _, delivered, (notice,) = bob.resume(alice_ids[0], BROAD)
    assert delivered == []
    assert notice["error"] == "unknown_cursor"
    _, delivered, _ = alice.resume(alice_ids[0], BROAD)
    assert delivered == alice_ids[1:]  # alice's own events only, none of bob's


def test_storage_bounds_count_evictions_and_expire_idle_sessions():
    now = [0.0]
    storage = InMemoryEventStorage(max_events_per_session=3, max_sessions=3, ttl=10, clock=lambda: now[0])
    s = Session(GuardedEventStore(POLICY, storage=storage))
    ids = s.call(2, "fetch", n_progress=3)  # 5 events, cap 3
    assert storage.evictions == 2
    assert s.resume(ids[0], BROAD)[2][0]["error"] == "unknown_cursor"
    Session(s.store, "other").call(3, "search", n_progress=0, with_result=False)
    now[0] = 11.0
    assert run(storage.get("s1", ids[-1])) is None  # idle past its ttl
    assert storage.evictions == 2 + (3 + 2) + (1 + 2)  # s1: 3 events, 2 requirements (its call, GET); other


def _big(rid, chars):
    return JSONRPCResponse(jsonrpc="2.0", id=rid, result={"text": "x" * chars})


def test_storage_bounds_the_bytes_a_session_and_all_sessions_keep_oldest_first():
    """A count of events bounds nothing when each is a megabyte a client made the tool echo."""
    storage = InMemoryEventStorage(max_bytes_per_session=3000, max_bytes=5000)
    run(storage.open("a"))
    kept = [run(storage.append("a", str(i), _big(i, 1000), None)) for i in range(5)]
    assert [run(storage.get("a", e)) is not None for e in kept] == [False, False, False, True, True]  # ~1 KB each
    assert storage.evictions == 3
    run(storage.open("b"))
    run(storage.append("b", "9", _big(9, 3500), None))  # the total past its bound: the heavier session goes
    assert [run(storage.is_open(s)) for s in ("a", "b")] == [True, False]
    roomy = InMemoryEventStorage(max_bytes_per_session=3000)
    run(roomy.open("c"))
    first = run(roomy.append("c", "9", _big(9, 1000), None))
    alone = run(roomy.append("c", "10", _big(10, 4500), None))  # past the session's bound, kept alone
    assert [run(roomy.get("c", e)) is not None for e in (first, alone)] == [False, True]


@pytest.mark.parametrize("message", [None, JSONRPCNotification(jsonrpc="2.0", method="notifications/progress", params={
    "progressToken": 3, "progress": 1, "message": "fetch step 1"}), _big(3, 20)], ids=["priming", "progress", "result"])
def test_what_the_storage_charges_an_event_is_what_holding_it_costs(message):
    """``max_bytes`` is what pods are sized from: a parsed message held ten times its JSON, a priming event held
    some 300 bytes charged none, and a storage at its bound held ten times the bound."""
    storage = InMemoryEventStorage(max_events_per_session=10**6, max_bytes=1 << 40, max_bytes_per_session=1 << 40)
    sessions = [f"{n:032x}" for n in range(50)]

    async def store() -> int:
        for session in sessions:
            await storage.open(session)
        gc.collect()
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        for n in range(4000):
            await storage.append(sessions[n % 50], str(n % 7), message, "subject")
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        return held

    held = asyncio.run(store())
    assert 0.85 * held <= storage._bytes <= 1.2 * held


def test_past_the_storages_byte_bound_the_principal_holding_the_most_loses_its_oldest_session_not_others():
    """One user making a tool echo megabytes across sessions of their own pushed out whoever's session was used
    longest ago; a bound counted in characters let four-byte characters hold four times what it said."""
    storage = InMemoryEventStorage(max_bytes_per_session=10_000, max_bytes=12_000)
    run(storage.open("victim"))
    kept = run(storage.append("victim", "1", _big(1, 1000), "alice"))
    for i in range(4):  # mallory's, newer than alice's
        run(storage.open(f"m{i}"))
        run(storage.append(f"m{i}", "1", _big(1, 3000), "mallory"))
    assert run(storage.get("victim", kept)) is not None
    assert [run(storage.is_open(f"m{i}")) for i in range(4)] == [False, True, True, True]
    run(storage.open("wide"))
    wide = JSONRPCResponse(jsonrpc="2.0", id=1, result={"text": "\U0001f600" * 2500})  # 10 KB in UTF-8
    run(storage.append("wide", "1", wide, "mallory"))
    assert [run(storage.is_open(s)) for s in ("victim", "m1", "m2", "m3", "wide")] == [True, False, False, False, True]
    run(storage.open("opaque"))  # naming no principal, a session is its own: not charged with other such ones
    run(storage.append("opaque", "1", _big(1, 500), None))
    for i in range(3):
        run(storage.open(f"o{i}"))
        run(storage.append(f"o{i}", "1", _big(1, 4000), None))
    assert run(storage.is_open("opaque")) and run(storage.is_open("victim"))


def test_refusal_notice_is_rewritten_into_an_error_frame_without_an_id():
    notice = JSONRPCNotification(jsonrpc="2.0", method=REFUSAL_METHOD, params={"error": "x", "cursor": "7"})
    chunk = f"event: message\r\ndata: {notice.model_dump_json(by_alias=True, exclude_unset=True)}\r\n\r\n".encode()
    (frame,) = SSEParser().feed(rewrite_refusal(chunk))
    assert frame.event == "error"
    assert frame.id is None
    assert json.loads(frame.data) == {"error": "x", "cursor": "7"}
    other = b"id: 3\r\nevent: message\r\ndata: {}\r\n\r\n"
    assert rewrite_refusal(other) == other



# --- failing closed (a narrower or unproven token never gets another call's event) ---

def test_a_reused_request_id_never_lowers_what_the_pending_calls_events_require():
    s = Session(GuardedEventStore(POLICY))
    fetch = s.call(2, "fetch", with_result=False)
    run(s.store.record_call("s1", "2", "search"))  # a narrow token POSTs search with fetch's id
    fetch.append(s.store_event("2", result(2)))
    stream, delivered, (notice,) = s.resume(fetch[0], NARROW)
    assert (stream, delivered) == (None, [])
    assert notice["error"] == "insufficient_audience"
    assert notice["missing_resources"] == [FETCH]
    assert run(s.store.storage.requirement("s1", "2")) == Requirement.of([SEARCH, FETCH])  # only ever more
    assert s.resume(fetch[0], BROAD)[1] == fetch[1:]


@pytest.mark.parametrize("concurrent", [False, True])
def test_a_reused_request_ids_events_carry_the_new_calls_requirement_when_the_storage_failed_to_record_it(concurrent):
    """The storage (Redis) fails to record what a call reusing a finished call's id requires as the SDK takes its POST
    (``concurrent``: the record still under way, and failing, as its first event is stored): none of its events may
    be kept with what the earlier call's stream required, or a narrower token is replayed them. Each is stored with
    its call's requirement, widening the stream's, whatever the storage recorded before."""
    store = GuardedEventStore(POLICY)
    s = Session(store)
    search = s.call(5, "search")  # answered: id 5 is free again
    storage = store.storage
    fetch: list[str] = []

    async def failing(*args: Any) -> None:
        if concurrent:  # an event of the call is stored while the record waits on the storage
            fetch.append(await store.store_event("5", progress(0)))
        raise StorageError("down")

    storage.require = failing  # type: ignore[method-assign]
    assert _guarded_post(store, _tools_call(5, "fetch"))[0] == 200
    fetch += [s.store_event("5", progress(1), auth=BROAD), s.store_event("5", result(5), BROAD)]
    assert not any(event.startswith("unstored-") for event in fetch)
    _, delivered, notices = s.resume(search[-1], NARROW)
    assert delivered == [] and [notice["error"] for notice in notices] == ["insufficient_audience"]
    _, delivered, notices = s.resume(search[-1], BROAD)
    assert (delivered, notices) == (fetch, [])
    assert run(storage.requirement("s1", "5")) == Requirement.of([SEARCH, FETCH])


def test_an_event_whose_requirement_was_never_recorded_is_refused_not_replayed():
    s = Session(GuardedEventStore(POLICY))
    ids = [s.store_event("7", None), s.store_event("7", result(7))]  # no record_call for stream 7
    stream, delivered, (notice,) = s.resume(ids[0], BROAD)
    assert (stream, delivered) == (None, [])
    assert notice["error"] == "requirement_unknown"
    assert notice["event_id"] == ids[1]
    assert notice["cursor"] == ids[0]


def test_other_sessions_filling_their_tables_never_evict_a_sessions_requirements():
    storage = InMemoryEventStorage(max_calls_per_session=4)
    store = GuardedEventStore(POLICY, storage=storage)
    victim = Session(store, "victim")
    fetch = victim.call(2, "fetch", with_result=False)
    for n in range(200):  # the attacker's own session, far past its cap
        run(store.record_call("attacker", str(n), "search"))
    fetch.append(victim.store_event("2", result(2)))
    _, delivered, (notice,) = victim.resume(fetch[0], NARROW)
    assert delivered == []
    assert notice["error"] == "insufficient_audience"
    assert run(storage.requirement("victim", "2")) == Requirement.of([FETCH])


def test_a_session_past_its_stream_cap_records_no_more_and_those_streams_are_refused():
    storage = InMemoryEventStorage(max_calls_per_session=2)
    s = Session(GuardedEventStore(POLICY, storage=storage))
    s.call(2, "fetch", with_result=False)
    run(s.store.record_call("s1", "3", "search"))
    run(s.store.record_call("s1", "4", "fetch"))  # over the cap: not recorded, never replayed
    later = [s.store_event("4", None), s.store_event("4", result(4))]
    _, delivered, (notice,) = s.resume(later[0], BROAD)
    assert delivered == []
    assert notice["error"] == "requirement_unknown"
    assert run(storage.requirement("s1", "2")) == Requirement.of([FETCH])  # what was recorded stays


@pytest.mark.parametrize(("auth", "verifies", "error"), [
    (AuthView(audience=frozenset({SEARCH, FETCH}), verification="failed"), False, "token_unverified"),
    (AuthView(audience=frozenset({SEARCH, FETCH}), verification="unverified"), True, "token_unverified"),
    (AuthView(fingerprint="o", verification="opaque"), False, "audience_unknown"),
    (AuthView(), False, "insufficient_audience"),  # absent
])
def test_a_token_whose_audience_cannot_be_trusted_is_refused_every_event_that_requires_one(auth, verifies, error):
    reader = TokenReader(key="k" * 32) if verifies else TokenReader()
    s = Session(GuardedEventStore(POLICY, token_reader=reader))
    ids = s.call(2, "fetch")
    _, delivered, (notice,) = s.resume(ids[0], auth)
    assert delivered == []
    assert notice["error"] == error
    assert notice["missing_resources"] == [FETCH]


def test_a_token_that_failed_verification_gets_nothing_not_even_events_that_require_nothing():
    """Its claims, the principal among them, are whatever its forger wrote: nothing of the session is its."""
    s = Session(GuardedEventStore(POLICY))
    ids = s.call(2, "unlisted-tool")
    _, delivered, (notice,) = s.resume(ids[0], AuthView(verification="failed"))
    assert (delivered, notice["error"]) == ([], "token_unverified")


def test_opaque_tokens_are_replayed_only_when_the_setting_allows_them():
    s = Session(GuardedEventStore(POLICY, opaque="allow"))
    ids = s.call(2, "fetch", with_result=False)
    stream, delivered, notices = s.resume(ids[0], AuthView(fingerprint="o", verification="opaque"))
    assert (stream, delivered, notices) == ("2", ids[1:], [])


def test_a_replay_without_the_guards_request_context_is_refused_whatever_the_mode():
    for mode in ("enforce", "observe"):
        store = GuardedEventStore(POLICY, mode=mode)
        ids = Session(store).call(2, "search")
        sent = []

        async def send(event, sent=sent):
            sent.append(event)

        assert run(store.replay_events_after(ids[0], send)) is None  # nothing bound: no asgi() in front
        (event,) = sent
        assert event.event_id is None
        assert event.message.params["error"] == "no_request_context"


def test_a_token_of_another_principal_than_the_sessions_opener_is_refused():
    s = Session(GuardedEventStore(POLICY))
    alice = AuthView(audience=frozenset({SEARCH, FETCH}), subject_hash="alice", verification="unverified")
    mallory = AuthView(audience=frozenset({SEARCH, FETCH}), subject_hash="mallory", verification="unverified")
    run(s.store.record_call("s1", "2", "search"))
    ids = [s.store_event("2", None, alice), s.store_event("2", result(2), alice)]
    _, delivered, (notice,) = s.resume(ids[0], mallory)
    assert delivered == []
    assert notice["error"] == "principal_mismatch"
    assert s.resume(ids[0], alice)[1] == ids[1:]


@pytest.mark.parametrize("headers", [
    [(b"mcp-session-id", b"a"), (b"mcp-session-id", b"b")],
    [(b"authorization", b"Bearer x.y.z"), (b"Authorization", b"Bearer p.q.r")],
])
def test_a_request_with_a_repeated_session_or_authorization_header_is_ambiguous_and_refused(headers):
    store = GuardedEventStore(POLICY)
    ids = Session(store, "a").call(2, "search")
    sent = []

    async def send(event):
        sent.append(event)

    token = guard_request.set(store._request(headers))
    try:
        assert run(store.replay_events_after(ids[0], send)) is None
    finally:
        guard_request.reset(token)
    (event,) = sent
    assert event.message.params["error"] == "ambiguous_request"


def test_an_evicted_session_is_never_recreated_by_a_later_write():
    storage = InMemoryEventStorage(max_sessions=1)
    store = GuardedEventStore(POLICY, storage=storage)
    victim = Session(store, "victim")
    fetch = victim.call(2, "fetch", with_result=False)
    Session(store, "attacker")  # a new session evicts the victim's
    run(store.record_call("victim", "2", None))  # then, in the victim's session, a harmless request with fetch's id
    victim.store_event("2", result(2))
    assert run(storage.requirement("victim", "2")) is None
    _, delivered, (notice,) = victim.resume(fetch[0], NARROW)
    assert delivered == []
    assert notice["error"] == "unknown_cursor"


def test_the_call_guard_never_trusts_a_token_whose_signature_failed():
    from types import SimpleNamespace

    import jwt
    from cryptography.hazmat.primitives.asymmetric import rsa
    from mcp.shared.exceptions import MCPError

    from mcp_stream_exporter.guard import CallGuard

    issuer, forger = (rsa.generate_private_key(public_exponent=65537, key_size=2048) for _ in range(2))
    claims = {"sub": "alice", "aud": [SEARCH, FETCH]}
    guard = CallGuard(POLICY, token_reader=TokenReader(key=issuer.public_key()))

    def call(token):
        ctx = SimpleNamespace(method="tools/call", params={"name": "fetch"},
                              request=SimpleNamespace(headers={"authorization": f"Bearer {token}"}))

        async def handler(ctx):
            return "ran"

        return run(guard(ctx, handler))

    assert call(jwt.encode(claims, issuer, algorithm="RS256")) == "ran"
    with pytest.raises(MCPError) as refused:
        call(jwt.encode(claims, forger, algorithm="RS256"))
    assert refused.value.error.data["missing_resources"] == [FETCH]


def test_a_request_id_longer_than_the_cap_is_neither_recorded_nor_stored():
    from mcp_stream_exporter.guard.store import _MAX_ID

    s = Session(GuardedEventStore(POLICY))
    huge = "9" * (_MAX_ID + 1)
    request = GuardRequest("s1", BROAD)
    body = json.dumps([{"jsonrpc": "2.0", "id": huge, "method": "tools/call", "params": {"name": "fetch"}},
                       {"jsonrpc": "2.0", "id": "2", "method": "tools/call", "params": {"name": "fetch"}}])
    s.store._record(request, read_body(body.encode()).requests)
    run(s.store._flush(request))  # the SDK took the POST
    assert run(s.store.storage.requirement("s1", huge)) is None
    assert run(s.store.storage.requirement("s1", "2")) == Requirement.of([FETCH])
    cursor = s.store_event(huge, None)
    assert cursor.startswith("unstored-")
    assert s.resume(cursor, BROAD)[2][0]["error"] == "unknown_cursor"


def _guarded_post(store: GuardedEventStore, body: bytes, *, session: str | None = "s1", chunks: int = 1,
                  headers: list[tuple[bytes, bytes]] | None = None,
                  status: int = 200, method: str = "POST") -> tuple[int, bytes, bytes | None]:
    """One POST through the guard's ASGI layer to an app that reads its whole body and answers with an SSE
    stream it leaves without the answer (the call runs on, as after a dropped connection), or with ``status``
    (the SDK refusing it: 401, 404): (status, what the client got, the body the app read; None when the app
    never ran)."""
    size = -(-len(body) // chunks)
    messages = [{"type": "http.request", "body": body[i * size:(i + 1) * size], "more_body": i < chunks - 1}
                for i in range(chunks)]
    sent: list[dict] = []
    seen: list[bytes] = []

    async def receive() -> dict:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    async def app(scope: dict, receive: object, send: object) -> None:
        read = b""
        while True:
            message = await receive()  # type: ignore[operator]
            read += message.get("body", b"")
            if not message.get("more_body", False):
                break
        seen.append(read)
        await send({"type": "http.response.start", "status": status,  # type: ignore[operator]
                    "headers": [(b"content-type", b"text/event-stream" if status == 200 else b"application/json")]})
        await send({"type": "http.response.body", "body": b""})  # type: ignore[operator]

    sent_headers = [(b"mcp-session-id", session.encode())] if session else []
    asyncio.run(store.asgi(app)({"type": "http", "path": "/mcp", "method": method,
                                 "headers": sent_headers + (headers or [])}, receive, send))
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:]), seen[0] if seen else None


def _tools_call(request_id: int, tool: str = "search") -> bytes:
    return json.dumps({"jsonrpc": "2.0", "id": request_id, "method": "tools/call",
                       "params": {"name": tool, "arguments": {}}}).encode()


def test_a_post_reusing_the_request_id_of_a_call_in_flight_never_reaches_the_server():
    """MCP forbids it, and the SDK would hand that id's stream (the pending call's events) to whoever sent it."""
    store = GuardedEventStore(POLICY)
    run(store.open_session("s1"))
    assert _guarded_post(store, _tools_call(5, "fetch"), chunks=3) == (200, b"", _tools_call(5, "fetch"))
    for reuse in (_tools_call(5, "search"), b"[" + _tools_call(6) + b"," + _tools_call(5) + b"]",
                  b"[" + _tools_call(7) + b"," + _tools_call(7) + b"]"):
        status, answer, reached = _guarded_post(store, reuse)
        assert (status, reached) == (409, None)
        assert json.loads(answer)["error"]["code"] == -32600
    assert run(store.storage.requirement("s1", "5")) == Requirement.of([FETCH])  # never widened by the reuse
    assert _guarded_post(store, _tools_call(5), session="s2")[0] == 200  # ids are per session
    token = guard_request.set(GuardRequest("s1", BROAD))
    try:
        run(store.store_event("5", result(5)))  # fetch answered: its id is free again
    finally:
        guard_request.reset(token)
    assert _guarded_post(store, _tools_call(5))[0] == 200


def test_a_post_the_sdk_answers_sessionless_holds_no_id_in_the_session_it_names():
    """The SDK routes a protocol version past the handshake's (2026-07-28) sessionless, whatever Mcp-Session-Id says."""
    store = GuardedEventStore(POLICY)
    run(store.open_session("s1"))
    modern = [(b"mcp-protocol-version", b"2026-07-28")]
    assert _guarded_post(store, _tools_call(5), headers=modern)[0] == 200
    assert _guarded_post(store, _tools_call(5))[0] == 200  # the session's own id 5 is not taken


def test_a_compressed_post_body_is_refused_in_enforce_mode_as_its_request_ids_cannot_be_read():
    """A middleware inside the guard that decompresses request bodies would hand the SDK calls the guard never read:
    an id in flight taken by another call (its result on the newcomer's stream), requirements never recorded."""
    for mode, expected in (("enforce", (415, None)), ("observe", (200, _tools_call(5, "fetch")))):
        store = GuardedEventStore(POLICY, mode=mode)
        run(store.open_session("s1"))
        assert _guarded_post(store, _tools_call(5, "fetch"), headers=[(b"content-encoding", b"gzip")])[::2] == expected
        assert _guarded_post(store, _tools_call(6), headers=[(b"content-encoding", b"identity")])[0] == 200


def test_a_post_with_its_session_or_token_header_twice_is_refused():
    store = GuardedEventStore(POLICY)
    run(store.open_session("s1"))
    twice = [(b"mcp-session-id", b"s1")]
    assert _guarded_post(store, _tools_call(5), headers=twice)[::2] == (400, None)


def test_a_session_post_too_large_to_read_its_ids_is_refused_and_observe_mode_lets_everything_through():
    store = GuardedEventStore(POLICY)
    run(store.open_session("s1"))
    padded = json.dumps({"jsonrpc": "2.0", "id": 7, "method": "tools/call",
                         "params": {"name": "search", "arguments": {"pad": "x" * (4 * 1024 * 1024)}}}).encode()
    assert _guarded_post(store, padded, chunks=4)[0] == 413
    batch = b"[" + b",".join(_tools_call(n) for n in range(101)) + b"]"
    assert _guarded_post(store, batch)[0] == 413  # more requests than one POST may carry: bounded work
    observing = GuardedEventStore(POLICY, mode="observe")
    run(observing.open_session("s1"))
    assert _guarded_post(observing, padded, chunks=4) == (200, b"", padded)
    assert _guarded_post(observing, _tools_call(8))[0] == 200
    assert _guarded_post(observing, _tools_call(8))[0] == 200  # reused while in flight, let through


def _posted(store: GuardedEventStore, pieces: list[bytes], *, path: str = "/mcp", session: bool = True,
            stalls: bool = False) -> tuple[int, list[dict]]:
    """A POST whose body comes in ``pieces`` (and then never ends, when it ``stalls``) through the guard's ASGI layer:
    (the status the client got, the body messages the app was handed)."""
    messages = [{"type": "http.request", "body": piece, "more_body": stalls or i < len(pieces) - 1}
                for i, piece in enumerate(pieces)]
    sent: list[dict] = []
    handed: list[dict] = []

    async def receive() -> dict:
        if messages:
            return messages.pop(0)
        await asyncio.Event().wait()  # a client that stopped sending, its connection open
        raise AssertionError

    async def send(message: dict) -> None:
        sent.append(message)

    async def app(scope: dict, receive: Any, send: Any) -> None:
        if not stalls:
            while not handed or handed[-1].get("more_body", False):
                handed.append(await receive())
        await send({"type": "http.response.start", "status": 202, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    headers = [(b"mcp-session-id", b"s1")] if session else []
    asyncio.run(store.asgi(app)({"type": "http", "path": path, "method": "POST", "headers": headers}, receive, send))
    return sent[0]["status"], handed


def test_a_session_post_whose_body_stops_coming_is_refused_once_the_guard_stops_waiting_for_it():
    """The guard reads a session POST's body before the SDK, and its authentication, run: a client that never finished
    its body held what it sent (some 8 MiB a connection), unanswered, for as long as it liked."""
    store = GuardedEventStore(POLICY, body_timeout_s=0.05)
    run(store.open_session("s1"))
    assert _posted(store, [_tools_call(5)[:10]], stalls=True)[0] == 408
    assert _posted(store, [_tools_call(5)])[0] == 202  # the call's id was never claimed
    observing = GuardedEventStore(POLICY, mode="observe", body_timeout_s=0.05)
    run(observing.open_session("s1"))
    assert _posted(observing, [_tools_call(5)[:10]], stalls=True)[0] == 202  # handed on: the SDK's to wait for
    # a 500, or a 408, on every POST; no bound at all; a flag for a number
    for timeout in (0, -1, float("nan"), float("inf"), None, True):
        with pytest.raises(ValueError, match="body_timeout_s"):
            GuardedEventStore(POLICY, body_timeout_s=timeout)  # type: ignore[arg-type]


def test_a_body_in_many_pieces_is_handed_to_the_app_as_one_message_and_a_sessionless_post_elsewhere_is_not_read():
    """A body sent a byte at a time cost the guard a message each (some 34 bytes a body byte) until the app read it."""
    store = GuardedEventStore(POLICY)
    run(store.open_session("s1"))
    body = _tools_call(5)
    pieces = [body[i:i + 1] for i in range(len(body))]
    status, handed = _posted(store, pieces)
    assert status == 202 and handed == [{"type": "http.request", "body": body, "more_body": False}]
    status, handed = _posted(store, pieces, path="/upload", session=False)  # no call of this server's
    assert status == 202 and len(handed) == len(pieces)
    assert _posted(store, [body[:10]], path="/upload", session=False, stalls=True)[0] == 202  # the app's to wait for


def _bearer(*audience: str, sub: str = "alice") -> list[tuple[bytes, bytes]]:
    claims = {"iss": "https://issuer.example", "sub": sub, "aud": list(audience)}
    token = jwt.encode(claims, "k" * 32, algorithm="HS256")
    return [(b"authorization", f"Bearer {token}".encode())]


def _server_asks(store: GuardedEventStore, stream_id: str, server_request_id: int) -> None:
    """The server sends the client a request (an elicitation) on ``stream_id``, as the SDK's router stores it."""
    token = guard_request.set(GuardRequest("s1", BROAD))
    try:
        run(store.store_event(stream_id, JSONRPCRequest(jsonrpc="2.0", id=server_request_id,
                                                        method="elicitation/create", params={})))
    finally:
        guard_request.reset(token)


def _cancel(request_id: int) -> bytes:
    return json.dumps({"jsonrpc": "2.0", "method": "notifications/cancelled",
                       "params": {"requestId": request_id}}).encode()


def _answer(server_request_id: int) -> bytes:
    return json.dumps({"jsonrpc": "2.0", "id": server_request_id, "result": {"action": "accept"}}).encode()


def test_a_cancel_or_an_answer_acting_on_a_call_in_flight_needs_a_token_that_may_see_the_call():
    """Cancelling a call ends it, and answering what the server asked on its stream (an elicitation) feeds it:
    a token narrower than the call's, or another principal's, acts on neither."""
    store = GuardedEventStore(POLICY)
    run(store.open_session("s1"))
    broad, narrow, mallory = _bearer(SEARCH, FETCH), _bearer(SEARCH), _bearer(SEARCH, FETCH, sub="mallory")
    assert _guarded_post(store, _tools_call(5, "fetch"), headers=broad)[0] == 200
    assert _guarded_post(store, _tools_call(6, "search"), headers=narrow)[0] == 200
    _server_asks(store, "5", 0)  # the server asks the client on fetch's stream
    for act in (_cancel(5), _answer(0), b"[" + _cancel(6) + b"," + _cancel(5) + b"]"):
        for stranger in (narrow, mallory):
            status, answer, reached = _guarded_post(store, act, headers=stranger)
            assert (status, reached) == (403, None)
            assert b"acts on a call this token may not see" in answer
    assert _guarded_post(store, _cancel(6), headers=narrow)[0] == 200  # its own call
    # nothing asked: refused, or the SDK would act on it later, maybe on a request that has that id by then
    assert _guarded_post(store, _answer(1), headers=broad)[0] == 403
    assert _guarded_post(store, _answer(0), headers=broad)[0] == 200
    assert _guarded_post(store, _cancel(5), headers=broad)[0] == 200
    observing = GuardedEventStore(POLICY, mode="observe")
    run(observing.open_session("s1"))
    assert _guarded_post(observing, _tools_call(5, "fetch"), headers=broad)[0] == 200
    assert _guarded_post(observing, _cancel(5), headers=narrow)[0] == 200  # observed, let through


def test_a_cancel_of_a_call_no_longer_in_flight_reaches_the_sdk_its_id_held_while_it_is_handled():
    """A client whose result never came (a half-open connection) cancels the call at its timeout, after the server
    sent the result: that late cancel is the only sign of the loss (the hooks' ``cancelled_late``), so it is not
    refused; a new call may not take its id until the SDK has had it."""
    store = GuardedEventStore(POLICY)
    run(store.open_session("s1"))
    broad, narrow, mallory = _bearer(SEARCH, FETCH), _bearer(SEARCH), _bearer(SEARCH, FETCH, sub="mallory")
    for token in (broad, narrow):  # never in flight here: the SDK ignores it
        assert _guarded_post(store, _cancel(99), headers=token) == (200, b"", _cancel(99))
    assert _guarded_post(store, _tools_call(5, "fetch"), headers=broad)[0] == 200
    store._in_flight.answered("s1", "5")  # its result stored, its POST over: no longer in flight
    # a cancel of it acts on nothing, but the hooks read it as a client that never got the result: it takes a token of
    # the call's principal, whatever its audience (a client's token narrowed as its connection was lost)
    status, answer, reached = _guarded_post(store, _cancel(5), headers=mallory)
    assert (status, reached) == (403, None) and b"principal_mismatch" in answer
    for token in (broad, narrow):
        assert _guarded_post(store, _cancel(5), headers=token) == (200, b"", _cancel(5))
    claimed: list[str | None] = []

    async def app(scope: dict, receive: Any, send: Any) -> None:
        await receive()
        claimed.append(store._in_flight.claim("s1", [("99", (Requirement.of([FETCH]), None))]))  # as it is handled
        await send({"type": "http.response.start", "status": 202, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def receive() -> dict:
        return {"type": "http.request", "body": _cancel(99), "more_body": False}

    async def send(message: dict) -> None:
        pass

    asyncio.run(store.asgi(app)({"type": "http", "path": "/mcp", "method": "POST",
                                 "headers": [(b"mcp-session-id", b"s1"), *broad]}, receive, send))
    assert claimed[0] is not None and "a cancel still being handled" in claimed[0]
    assert _guarded_post(store, _tools_call(99, "fetch"), headers=broad)[0] == 200  # handled: the id is free again


def test_a_cancel_or_an_answer_is_read_as_the_sdk_reads_it_whatever_it_is_dressed_as():
    """A cancel with an ``id`` the SDK cannot take (so a notification to it), an answer with a ``method`` and
    ``params`` the SDK cannot take (so a response to it): checked as what the SDK will take them for."""
    store = GuardedEventStore(POLICY)
    run(store.open_session("s1"))
    broad, narrow = _bearer(SEARCH, FETCH), _bearer(SEARCH)
    assert _guarded_post(store, _tools_call(5, "fetch"), headers=broad)[0] == 200
    _server_asks(store, "5", 0)
    for bad_id in (None, True, 1.5, {}):
        dressed = {**json.loads(_cancel(5)), "id": bad_id}
        assert _guarded_post(store, json.dumps(dressed).encode(), headers=narrow)[::2] == (403, None)
    dressed = {**json.loads(_answer(0)), "method": "x", "params": 5}
    assert _guarded_post(store, json.dumps(dressed).encode(), headers=narrow)[::2] == (403, None)


def test_a_resume_whose_stream_a_new_call_took_while_it_replayed_is_refused_its_live_tail():
    """A client that reads a replay slowly holds it between the check and the SDK taking the live tail; a new
    call given the stream's id meanwhile (it was free: the resumed call was over) would send its events there."""
    store = GuardedEventStore(POLICY)
    session = Session(store)
    first = session.call(5, "search")[0]
    sent = []

    async def send(event):
        sent.append(event)
        if len(sent) == 1:  # while the replay is sent, fetch is posted under id 5
            assert store._in_flight.claim("s1", [("5", (Requirement.of([FETCH]), None))]) is None

    token = guard_request.set(GuardRequest("s1", NARROW))
    try:
        assert run(store.replay_events_after(first, send)) is None  # no live tail: fetch's events would be on it
    finally:
        guard_request.reset(token)
    assert sent[-1].message.params["error"] == "insufficient_audience"
    assert sent[-1].message.params["required_resources"] == [FETCH]

    running = session.call(6, "search", with_result=False)[0]
    stream, _, notices = session.resume(running, NARROW)
    assert (stream, notices) == ("6", [])  # let take the live tail of 6: a new call may not take the id
    assert "resume" in (store._in_flight.claim("s1", [("6", (Requirement.of([FETCH]), None))]) or "")
    answered = session.call(7, "search")[0]
    assert session.resume(answered, NARROW)[0] is None  # its answer replayed: no live tail, no id held for one
    assert store._in_flight.claim("s1", [("7", (Requirement.of([FETCH]), None))]) is None


def test_a_post_the_server_refuses_changes_nothing_the_guard_knows_of_the_session():
    """The SDK authenticates a POST after the guard reads it: one it refuses (no token: 401; another user's
    session: 404) records no requirement (it would fill the session's table of streams, or widen what an id
    the client uses next requires), no owner (the client's DELETE would look foreign) and no answer (the
    server's request would be forgotten and the client's own answer refused)."""
    store = GuardedEventStore(POLICY)
    run(store.open_session("s1"))
    broad = _bearer(SEARCH, FETCH)
    assert _guarded_post(store, _tools_call(5, "fetch"), headers=broad)[0] == 200
    _server_asks(store, "5", 0)
    for refused, headers in ((401, []), (404, _bearer(SEARCH, FETCH, sub="mallory"))):
        assert _guarded_post(store, _tools_call(6, "fetch"), headers=headers, status=refused)[0] == refused
        assert _guarded_post(store, _answer(0), headers=broad, status=refused)[0] == refused
    assert run(store.storage.requirement("s1", "6")) is None
    alice = store.tokens.from_authorization(broad[0][1].decode()).subject_hash
    assert store._in_flight.owners("s1") == [(Requirement.of([FETCH]), alice)]
    assert _guarded_post(store, _answer(0), headers=broad)[0] == 200  # still awaited: the client's answer counts


def _standalone(session: Session, message, auth=OPENER) -> str:
    return session.store_event("_GET_stream", message, auth)


def _sampling(server_request_id: int) -> JSONRPCRequest:
    return JSONRPCRequest(jsonrpc="2.0", id=server_request_id, method="sampling/createMessage",
                          params={"messages": [{"role": "user", "content": {"type": "text", "text": "doc"}}]})


def test_a_standalone_event_requires_what_the_calls_in_flight_when_it_was_stored_required():
    """The SDK sends a sampling or roots request a tool makes on the standalone stream, not its call's: it may
    carry what the call read, so replaying it, or acting on it by answering, takes what seeing the call takes."""
    store = GuardedEventStore(POLICY)
    session = Session(store)
    narrow, broad = (store.tokens.from_authorization(_bearer(*audience)[0][1].decode())
                     for audience in ((SEARCH,), (SEARCH, FETCH)))  # alice's: the session's and the call's
    before = _standalone(session, JSONRPCNotification(jsonrpc="2.0", method="notifications/tools/list_changed"),
                         broad)
    assert _guarded_post(store, _tools_call(5, "fetch"), headers=_bearer(SEARCH, FETCH))[0] == 200
    asked = _standalone(session, _sampling(0), broad)
    stream, delivered, notices = session.resume(before, narrow)
    assert (stream, delivered, notices[0]["error"]) == (None, [], "insufficient_audience")
    assert (notices[0]["event_id"], notices[0]["required_resources"]) == (asked, [FETCH])
    assert session.resume(before, broad)[1] == [asked]
    assert _guarded_post(store, _answer(0), headers=_bearer(SEARCH))[::2] == (403, None)
    assert _guarded_post(store, _answer(0), headers=[])[::2] == (403, None)  # nobody's token: nobody's call
    assert _guarded_post(store, _answer(0), headers=_bearer(SEARCH, FETCH))[0] == 200
    elsewhere = GuardedEventStore(POLICY)  # another process: it never saw what was in flight then
    Session(elsewhere)
    run(elsewhere.storage.require("s1", "_GET_stream", Requirement.of([])))
    assert elsewhere._alone("s1", run(store.storage.get("s1", asked))).requirement is None  # unknown: refused


def test_a_standalone_event_stored_while_another_principals_call_ran_is_nobodys_on_replay_too():
    """Live, a GET stream stops at it; a replay passes no GET chunk through that check (a session the SDK dropped,
    answered from the storage): the opener's resume from her own cursor was replayed a sampling request of the
    call another user posted into her session. It may be his call's or her session's own (a task's log): nobody's."""
    store = GuardedEventStore(POLICY)
    session = Session(store)
    alice, bob = (store.tokens.from_authorization(_bearer(SEARCH, FETCH, sub=sub)[0][1].decode())
                  for sub in ("alice", "bob"))
    hers = _standalone(session, JSONRPCNotification(jsonrpc="2.0", method="notifications/tools/list_changed"), alice)
    assert _guarded_post(store, _tools_call(5, "fetch"), headers=_bearer(SEARCH, FETCH, sub="bob"))[0] == 200
    asked = _standalone(session, _sampling(0), alice)  # the SDK's message router: the opener's context
    _, delivered, (notice,) = session.resume(hers, alice)
    assert (delivered, notice["error"], notice["event_id"]) == ([], "principal_mismatch", asked)
    assert store._alone("s1", run(store.storage.get("s1", asked))).subject not in (alice.subject_hash, bob.subject_hash)
    assert session.resume(hers, bob)[1] == []


def test_what_the_session_sends_tied_to_no_call_while_another_principals_call_runs_is_nobodys():
    """Behind a gateway, Bob's call runs in Alice's session while her task logs on the standalone stream: the event
    may be his call's or her session's own. Recorded as his call's alone, his GET read her log live (and, in prefix
    mode, his replay did)."""
    store = GuardedEventStore(POLICY, policy_mode="prefix")
    session = Session(store)
    alice, bob = (store.tokens.from_authorization(_bearer(SEARCH, FETCH, sub=sub)[0][1].decode())
                  for sub in ("alice", "bob"))
    first = _standalone(session, JSONRPCNotification(jsonrpc="2.0", method="notifications/tools/list_changed"), alice)
    assert _guarded_post(store, _tools_call(5, "fetch"), headers=_bearer(SEARCH, FETCH, sub="bob"))[0] == 200
    log = _standalone(session, JSONRPCNotification(jsonrpc="2.0", method="notifications/message",
                                                   params={"level": "info", "data": "hers"}), alice)
    assert {owner[1] for owner in store._in_flight.alone("s1", log) or ()} == {alice.subject_hash, bob.subject_hash}
    for who in (alice, bob):
        _, delivered, (notice,) = session.resume(first, who)
        assert (delivered, notice["error"]) == ([], "principal_mismatch")


def test_a_post_of_another_principal_than_the_sessions_opener_is_answered_as_the_sdk_answers_it_and_claims_nothing():
    """Behind a gateway the SDK binds a session to no user: Bob could post calls into Alice's session, whose events
    and whose claims (even of POSTs the SDK then refused) made her standalone stream's events nobody's, a denial
    of service. A POST whose token is not the opener's principal gets the SDK's own answer to a credential not the
    session's, before the SDK sees it."""
    store = GuardedEventStore(POLICY)
    Session(store)
    alice = store.tokens.from_authorization(_bearer(SEARCH, FETCH)[0][1].decode())
    store._in_flight.opened("s1", (NO_REQUIREMENT, alice.subject_hash))  # her initialize, as ``_born`` records it
    status, answer, reached = _guarded_post(store, _tools_call(5, "fetch"), headers=_bearer(SEARCH, FETCH, sub="bob"))
    assert (status, json.loads(answer)["error"]["message"], reached) == (404, "Session not found", None)
    assert store._in_flight.owner("s1", "5") is None
    assert _guarded_post(store, _tools_call(5, "fetch"), headers=_bearer(SEARCH))[0] == 200  # hers, narrower or not


def test_the_openers_own_token_reaches_the_sdk_when_it_expired_or_did_not_verify_and_another_principals_does_not():
    """The binding reads the principal off the claims: the opener's own token that expired (or that a key fetch
    failed to verify) gets the SDK's 401, and its client a fresh one, not a 404 that loses the session."""
    store = GuardedEventStore(POLICY, token_reader=TokenReader(key="k" * 32))
    Session(store)
    expired = jwt.encode({"iss": "https://issuer.example", "sub": "alice", "aud": [SEARCH, FETCH], "exp": 1},
                         "k" * 32, algorithm="HS256")
    alice = store.tokens.from_authorization(f"Bearer {expired}")
    assert alice.verification == "failed"
    store._in_flight.opened("s1", (NO_REQUIREMENT, alice.subject_hash))
    assert _guarded_post(store, _tools_call(5, "search"), headers=[(b"authorization", f"Bearer {expired}".encode())],
                         status=401)[0] == 401  # the SDK's answer
    assert _guarded_post(store, _tools_call(6, "search"), headers=_bearer(SEARCH, FETCH, sub="bob"))[0] == 404
    # ending the session takes a verified token, the opener's own too: where nothing in front of the SDK authenticates,
    # a forged one claiming the opener would end it
    assert _guarded_post(store, b"", headers=[(b"authorization", f"Bearer {expired}".encode())], status=401,
                         method="DELETE")[::2] == (403, None)


def test_a_calls_events_are_the_principals_that_posted_it_where_the_sessions_opener_is_not_known():
    """The opener is remembered for the most recently active sessions of the process: past them another principal's
    POST reaches the SDK, whose message router stores the call's events in the opener's context. They are still its
    poster's to replay, not the opener's (read as hers, her resume was replayed his result, and he was refused)."""
    store = GuardedEventStore(POLICY)
    session = Session(store)  # opened without its initialize seen here: its opener unknown
    alice, bob = (store.tokens.from_authorization(_bearer(SEARCH, FETCH, sub=sub)[0][1].decode())
                  for sub in ("alice", "bob"))
    assert _guarded_post(store, _tools_call(5, "fetch"), headers=_bearer(SEARCH, FETCH, sub="bob"))[0] == 200
    ids = [session.store_event("5", message, alice) for message in (None, progress(0), result(5))]
    _, delivered, (notice,) = session.resume(ids[0], alice)
    assert (delivered, notice["error"]) == ([], "principal_mismatch")
    assert session.resume(ids[0], bob)[1] == ids[1:]


def test_a_get_stream_ends_with_an_error_frame_at_the_first_standalone_event_its_token_may_not_see():
    """Live, the SDK writes standalone events to whichever GET stream holds them: a narrower token's stream
    stops there, its cursor at the last event it was sent."""
    store = GuardedEventStore(POLICY)
    session = Session(store)
    alice = store.tokens.from_authorization(_bearer(SEARCH)[0][1].decode())  # her task's, after her call: hers
    first = _standalone(session, JSONRPCNotification(jsonrpc="2.0", method="notifications/tools/list_changed"), alice)
    assert _guarded_post(store, _tools_call(5, "fetch"), headers=_bearer(SEARCH, FETCH))[0] == 200
    asked = _standalone(session, _sampling(0), alice)  # the SDK's message router: the opener's context
    frames = [f"event: message\r\nid: {event_id}\r\ndata: {{}}\r\n\r\n".encode() for event_id in (first, asked)]

    def get(headers):
        sent: list[dict] = []

        async def app(scope, receive, send):
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream")]})
            for frame in frames:
                await send({"type": "http.response.body", "body": frame, "more_body": True})

        async def send(message):
            sent.append(message)

        async def receive():
            return {"type": "http.disconnect"}

        asyncio.run(store.asgi(app)({"type": "http", "path": "/mcp", "method": "GET",
                                     "headers": [(b"mcp-session-id", b"s1"), *headers]}, receive, send))
        return [SSEParser().feed(m["body"]) for m in sent[1:]], sent[-1].get("more_body", False)

    narrow, more = get(_bearer(SEARCH))
    assert [frame.id for frame in narrow[0]] == [first] and not more
    refusal = json.loads(narrow[1][0].data)
    assert (narrow[1][0].type, refusal["error"], refusal["event_id"], refusal["cursor"]) == (
        "error", "insufficient_audience", asked, first)
    assert [frames[0].id for frames in get(_bearer(SEARCH, FETCH))[0]] == [first, asked]
    frames[1] = b"event: message\r\nid: unstored-1\r\ndata: {}\r\n\r\n"  # the storage failed to keep it
    unknown, _ = get(_bearer(SEARCH, FETCH))
    assert json.loads(unknown[1][0].data)["error"] == "requirement_unknown"  # unknown whose: refused, not let by
    empty_cursor, _ = get([*_bearer(SEARCH, FETCH), (b"last-event-id", b"")])  # the SDK: a fresh stream too
    assert json.loads(empty_cursor[1][0].data)["error"] == "requirement_unknown"
    frames[1] = frames[0]
    bob, _ = get(_bearer(SEARCH, FETCH, sub="bob"))  # what her task sent with no call in flight: hers alone
    assert json.loads(bob[0][0].data)["error"] == "principal_mismatch"


def test_the_endpoint_is_the_path_the_router_routes_under_a_mount():
    """Starlette's ``Mount`` (and a server's ``--root-path``) keeps the whole path and names its prefix in
    ``root_path``: the guard's endpoint check, as the SDK's routes, reads the path within the app."""
    assert route_path({"path": "/api/mcp", "root_path": "/api"}) == "/mcp"
    assert route_path({"path": "/mcp", "root_path": "/api"}) == "/mcp"  # an older server: the prefix taken off
    assert route_path({"path": "/mcp"}) == "/mcp"
    # a root ``/m`` before ``cp`` (a request target with no slash): Starlette routes ``/mcp``, and so does the guard
    assert route_path({"path": "/mcp", "root_path": "/m"}) == "/mcp"
    assert route_path({"path": "/api", "root_path": "/api"}) == ""


def test_a_stored_message_that_does_not_read_back_is_a_storage_error_the_guard_answers_explicitly():
    """A message built without validation is sent and stored, yet its JSON does not parse: a resume must get an error
    frame, not end silently on an exception the guard does not catch."""
    storage = InMemoryEventStorage()
    run(storage.open("s"))
    unread = JSONRPCNotification.model_construct(jsonrpc="2.0", params={"progress": 1})  # no method
    with pytest.warns(UserWarning, match="serializer warnings"):  # pydantic says so as it writes it, as it does live
        event_id = run(storage.append("s", "7", unread, None))
    assert event_id is not None
    with pytest.raises(StorageError, match="does not read back"):
        run(storage.get("s", event_id))
