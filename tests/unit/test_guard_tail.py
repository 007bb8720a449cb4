"""The live tail of a resumed call's stream, sent by the guard from its storage (no HTTP): what the call
stores while its replay is being sent is never lost, each event is checked as a replayed one is, and the
tail ends only with the call's answer or an error frame. Driven on one event loop: the tests know when the
tail waits because they see it ask the storage, never by sleeping."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import anyio
import pytest
from mcp.server.streamable_http import EventMessage
from mcp_types import JSONRPCNotification, JSONRPCRequest, JSONRPCResponse

from mcp_stream_exporter.auth import AuthView, Requirement, ToolPolicy
from mcp_stream_exporter.exchange import STANDALONE_STREAM_ID
from mcp_stream_exporter.guard import GuardedEventStore, InMemoryEventStorage, SharedEventStorage, TailableEventStorage
from mcp_stream_exporter.guard import store as guard_store
from mcp_stream_exporter.guard.storage import StorageError, StoredEvent
from mcp_stream_exporter.guard.store import _current as guard_request
from mcp_stream_exporter.guard.store import _Request as GuardRequest

pytestmark = pytest.mark.anyio

SEARCH = "https://mcp.example.com/tools/search"
FETCH = "https://mcp.example.com/tools/fetch"
POLICY = ToolPolicy({"search": Requirement.of([SEARCH]), "fetch": Requirement.of([FETCH])})
BROAD = AuthView(audience=frozenset({SEARCH, FETCH}), fingerprint="b", verification="unverified")
NARROW = AuthView(audience=frozenset({SEARCH}), fingerprint="n", verification="unverified")
OPENER = AuthView()
BOUND_S = 5  # a tail that never comes is a failure, not a hang


def progress(n: int) -> JSONRPCNotification:
    return JSONRPCNotification(jsonrpc="2.0", method="notifications/progress", params={"progress": n})


def result(request_id: int) -> JSONRPCResponse:
    return JSONRPCResponse(jsonrpc="2.0", id=request_id, result={"content": []})


async def stored(store: GuardedEventStore, stream_id: str, message: JSONRPCNotification | JSONRPCResponse | None,
                 ) -> str:
    """An event the session's call stores (the SDK's message router, in the session's context)."""
    token = guard_request.set(GuardRequest("s1", OPENER))
    try:
        return await store.store_event(stream_id, message)
    finally:
        guard_request.reset(token)


async def lost(store: GuardedEventStore, stream_id: str, message: JSONRPCNotification | JSONRPCResponse) -> str:
    """An event the storage fails to keep (Redis down a moment): the id the guard hands the SDK instead."""
    storage = store.storage
    kept = storage.append

    async def failing(*args: object, **kwargs: object) -> str | None:
        raise StorageError("down")

    storage.append = failing  # type: ignore[method-assign]
    try:
        return await stored(store, stream_id, message)
    finally:
        storage.append = kept  # type: ignore[method-assign]


async def a_call(store: GuardedEventStore, request_id: int, tool: str) -> list[str]:
    """A call whose POST is gone (the client's connection dropped): its priming event and two progress events."""
    await store.record_call("s1", str(request_id), tool)
    return [await stored(store, str(request_id), None)] + [await stored(store, str(request_id), progress(n))
                                                           for n in range(2)]


async def a_session() -> tuple[InMemoryEventStorage, GuardedEventStore, list[str]]:
    """A guard on in-memory storage, its session ``s1`` open with fetch's call 2 in it (``a_call``): its events' ids."""
    storage = InMemoryEventStorage()
    store = GuardedEventStore(POLICY, storage=storage)
    await store.open_session("s1")
    return storage, store, await a_call(store, 2, "fetch")


async def resume(store: GuardedEventStore, cursor: str, auth: AuthView, sent: list[EventMessage],
                 during: Callable[[], Awaitable[None]] | None = None) -> str | None:
    """A resume as the SDK runs it; ``during`` runs while its first event is being sent (a client reading it)."""

    async def send(event: EventMessage) -> None:
        sent.append(event)
        if during is not None and len(sent) == 1:
            await during()

    token = guard_request.set(GuardRequest("s1", auth))
    try:
        return await store.replay_events_after(cursor, send)
    finally:
        guard_request.reset(token)


class Waits:
    """The storage's ``wait_after``, counted: ``parked(n)`` returns once the tail has asked for its n-th wait, and
    so waits (nothing in the tail yields but the storage's wait)."""

    def __init__(self, storage: InMemoryEventStorage) -> None:
        self.entered = 0
        self._entered = anyio.Event()
        self._wait = storage.wait_after
        storage.wait_after = self.wait_after  # type: ignore[method-assign]

    async def wait_after(self, session_id: str, event_id: str, timeout_s: float) -> list[StoredEvent]:
        self.entered += 1
        self._entered.set()
        self._entered = anyio.Event()
        return await self._wait(session_id, event_id, timeout_s)

    async def parked(self, times: int) -> None:
        while self.entered < times:
            await self._entered.wait()


def ids_of(sent: list[EventMessage]) -> list[str | None]:
    return [event.event_id for event in sent]


def notice(event: EventMessage) -> dict[str, object]:
    assert event.event_id is None and isinstance(event.message, JSONRPCNotification)
    assert isinstance(event.message.params, dict)
    return event.message.params


async def test_what_a_call_stores_while_its_replay_is_sent_follows_it_up_to_the_answer():
    """The SDK takes a resumed stream only after an await of its own: its events stored meanwhile were lost."""
    store = GuardedEventStore(POLICY)
    await store.open_session("s1")
    ids = await a_call(store, 2, "fetch")
    later: list[str] = []

    async def the_call_goes_on() -> None:
        later.append(await stored(store, "2", progress(9)))
        later.append(await stored(store, "2", result(2)))

    sent: list[EventMessage] = []
    with anyio.fail_after(BOUND_S):
        stream = await resume(store, ids[1], BROAD, sent, during=the_call_goes_on)
    assert stream is None  # the SDK never takes the stream: nothing of it goes to a stream nobody reads
    assert ids_of(sent) == ids[2:] + later


async def test_a_live_tail_waits_for_the_calls_next_event_and_holds_its_id_until_the_answer():
    storage, store, ids = await a_session()
    assert isinstance(storage, TailableEventStorage)
    assert not isinstance(storage, SharedEventStorage)  # it answers no other process's resumes
    waits = Waits(storage)
    sent: list[EventMessage] = []
    streams: list[str | None] = []

    async def resumed() -> None:
        streams.append(await resume(store, ids[1], BROAD, sent))

    with anyio.fail_after(BOUND_S):
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(resumed)
            await waits.parked(1)
            assert ids_of(sent) == ids[2:]
            reuse = store._in_flight.claim("s1", [("2", (Requirement.of([SEARCH]), None))])
            assert "resume" in (reuse or "")  # no new call may take the id whose live tail is being sent
            step = await stored(store, "2", progress(9))
            await waits.parked(2)  # woken by the append, sent it, waits again
            assert ids_of(sent) == [*ids[2:], step]
            answer = await stored(store, "2", result(2))
    assert streams == [None]
    assert ids_of(sent) == [*ids[2:], step, answer]  # the answer ends it


async def test_a_live_tail_ends_with_an_error_frame_when_the_session_ends_under_it():
    storage, store, ids = await a_session()
    waits = Waits(storage)
    sent: list[EventMessage] = []
    with anyio.fail_after(BOUND_S):
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(resume, store, ids[1], BROAD, sent)
            await waits.parked(1)
            await storage.close("s1")  # its client deleted it
    *replayed, ended = sent
    assert ids_of(replayed) == ids[2:]
    assert notice(ended)["error"] == "session_ended"
    assert notice(ended)["cursor"] == ids[-1]  # the last event sent: never past an undelivered one


async def test_a_live_event_the_token_may_not_see_ends_the_tail_with_an_error_frame_and_nothing_after_it():
    """What a stream requires only grows (its id used again for fetch): the tail checks each event as a replay
    does, not only the requirement it saw when the resume began."""
    store = GuardedEventStore(POLICY)
    await store.open_session("s1")
    ids = await a_call(store, 2, "search")
    later: list[str] = []

    async def widened() -> None:
        await store.record_call("s1", "2", "fetch")
        later.append(await stored(store, "2", progress(9)))
        later.append(await stored(store, "2", result(2)))

    sent: list[EventMessage] = []
    with anyio.fail_after(BOUND_S):
        assert await resume(store, ids[1], NARROW, sent, during=widened) is None
    *replayed, refused = sent
    assert ids_of(replayed) == ids[2:]
    assert notice(refused)["error"] == "insufficient_audience"
    assert notice(refused)["event_id"] == later[0]
    assert notice(refused)["missing_resources"] == [FETCH]
    assert notice(refused)["cursor"] == ids[-1]


async def test_only_a_call_whose_post_ended_is_tailed_here_and_the_standalone_stream_is_left_to_the_sdk():
    """While the call's POST is open the SDK sends its events there and would send a resume none: the resume
    ends after its replay. The standalone stream has no answer to end a tail: the SDK keeps it."""
    store = GuardedEventStore(POLICY)
    await store.open_session("s1")
    ids = await a_call(store, 2, "fetch")
    assert store._in_flight.claim("s1", [("2", (Requirement.of([FETCH]), None))]) is None  # its POST is open
    sent: list[EventMessage] = []
    with anyio.fail_after(BOUND_S):
        assert await resume(store, ids[1], BROAD, sent) is None
    assert ids_of(sent) == ids[2:]

    store._in_flight.ended("s1", ["2"])  # the POST is gone, the call runs on
    answer: list[str] = []

    async def answered() -> None:
        answer.append(await stored(store, "2", result(2)))

    sent = []
    with anyio.fail_after(BOUND_S):
        assert await resume(store, ids[1], BROAD, sent, during=answered) is None
    assert ids_of(sent) == ids[2:] + answer

    alone = await stored(store, STANDALONE_STREAM_ID, progress(0))
    assert await resume(store, alone, BROAD, []) == STANDALONE_STREAM_ID


async def test_a_live_tail_the_sessions_cap_outran_ends_with_unknown_cursor_never_past_a_dropped_event():
    """A client reading slowly while the call stores more than the session holds: what it did not get is gone,
    and its cursor may not move past it."""
    store = GuardedEventStore(POLICY, storage=InMemoryEventStorage(max_events_per_session=4))
    await store.open_session("s1")
    ids = await a_call(store, 2, "fetch")

    async def outran() -> None:
        for n in range(6):
            await stored(store, "2", progress(10 + n))
        await stored(store, "2", result(2))

    sent: list[EventMessage] = []
    with anyio.fail_after(BOUND_S):
        assert await resume(store, ids[1], BROAD, sent, during=outran) is None
    *replayed, refused = sent
    assert ids_of(replayed) == ids[2:]
    assert notice(refused)["error"] == "unknown_cursor"
    assert notice(refused)["cursor"] == ids[-1]


async def test_a_live_tail_ends_with_an_error_frame_when_the_storage_failed_to_keep_an_event_of_its_stream():
    """An event the storage could not keep (Redis down a moment) never comes to a tail that reads the storage: if
    it was the answer, the tail would wait on it for ever. It ends instead, explicitly, at the last event sent."""
    storage, store, ids = await a_session()
    waits = Waits(storage)
    sent: list[EventMessage] = []
    with anyio.fail_after(BOUND_S):
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(resume, store, ids[1], BROAD, sent)
            await waits.parked(1)
            assert (await lost(store, "2", result(2))).startswith("unstored-")
            await stored(store, "3", progress(1))  # another stream's event wakes the tail
    *replayed, ended = sent
    assert ids_of(replayed) == ids[2:]
    assert (notice(ended)["error"], notice(ended)["cursor"]) == ("store_unavailable", ids[-1])


async def test_a_session_deleted_while_its_opening_is_retried_is_not_re_created(monkeypatch):
    monkeypatch.setattr(guard_store, "_REOPEN_EVERY_S", 0.0)
    storage = InMemoryEventStorage()
    store = GuardedEventStore(POLICY, storage=storage)
    opening = storage.open
    answered = anyio.Event()

    async def down(session_id: str) -> None:
        raise StorageError("down")

    async def answering(session_id: str) -> None:  # one round trip away, during which the DELETE is accepted
        await answered.wait()
        await opening(session_id)

    storage.open = down  # type: ignore[method-assign]
    await store._born(GuardRequest("s1", OPENER))
    storage.open = answering  # type: ignore[method-assign]
    with anyio.fail_after(BOUND_S):
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(stored, store, "2", progress(1))  # its next event: the opening tried again
            await anyio.wait_all_tasks_blocked()
            await store._ended("s1")
            answered.set()
    assert not await storage.is_open("s1")
    # and two events at once while the opening is slow: one tries, neither takes the other's success for an end
    store = GuardedEventStore(POLICY, storage=storage)
    storage.open = down  # type: ignore[method-assign]
    await store._born(GuardRequest("s1", OPENER))
    storage.open = answering  # type: ignore[method-assign]
    answered = anyio.Event()
    with anyio.fail_after(BOUND_S):
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(stored, store, "2", progress(1))
            tasks.start_soon(stored, store, "3", progress(1))
            await anyio.wait_all_tasks_blocked()
            answered.set()
    assert await storage.is_open("s1")


async def test_a_loss_after_a_priming_event_or_on_another_stream_a_session_wide_replay_sends_is_told_too():
    """A loss is placed among every event stored in its session: after a priming event (which no replay sends) it is
    still after the cursor; and a resume that replays the whole session is stopped by another stream's loss too."""
    for replay, lost_on, cursor_of in (("stream", STANDALONE_STREAM_ID, STANDALONE_STREAM_ID), ("session", "3", "2")):
        store = GuardedEventStore(POLICY, storage=InMemoryEventStorage(), replay=replay)
        await store.open_session("s1")
        await a_call(store, 2, "fetch")
        await a_call(store, 3, "search")
        cursor = await stored(store, cursor_of, progress(1))
        await stored(store, lost_on, None)  # the priming event of a resume the SDK took, or a stream's first
        await lost(store, lost_on, progress(2))
        await stored(store, lost_on, progress(3))
        sent: list[EventMessage] = []
        with anyio.fail_after(BOUND_S):
            await resume(store, cursor, BROAD, sent)
        assert notice(sent[-1])["error"] == "store_unavailable"
        assert [e for e in ids_of(sent) if e is not None] == []  # nothing past the loss, and nothing before it


async def test_a_loss_while_the_tail_waits_stops_it_before_whatever_comes_next_and_is_told_to_every_resume_after():
    """A loss appends nothing, so it does not wake a waiting tail: what comes next does (the answer, here), and the
    tail stops before it: the client never gets the answer past a gap, nor a cursor past the loss."""
    storage, store, ids = await a_session()
    waits = Waits(storage)
    sent: list[EventMessage] = []
    with anyio.fail_after(BOUND_S):
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(resume, store, ids[2], BROAD, sent)
            await waits.parked(1)
            await lost(store, "2", progress(7))  # an elicitation, in life: its tool waits for the answer to it
            await stored(store, "2", result(2))
    assert ids_of(sent) == [None] and notice(sent[0]) == {**notice(sent[0]), "error": "store_unavailable",
                                                          "cursor": ids[2]}
    again: list[EventMessage] = []
    with anyio.fail_after(BOUND_S):
        await resume(store, ids[2], BROAD, again)  # as the frame says: from its cursor, later
    assert ids_of(again) == [None] and notice(again[0])["error"] == "store_unavailable"


async def test_events_dropped_for_a_session_the_storage_no_longer_holds_are_its_end_not_a_storage_failure():
    """Redis evicted the session's opening key alone (a per-key eviction policy): its later events are dropped, not
    failed. A resume is told the session is gone (start anew), not to resume later from a storage that answers."""
    storage, store, ids = await a_session()

    async def dropped(*args: object) -> None:
        return None

    async def gone(session_id: str) -> bool:
        return False

    storage.append, storage.is_open = dropped, gone  # type: ignore[method-assign,assignment]
    await stored(store, "2", progress(7))
    sent: list[EventMessage] = []
    with anyio.fail_after(BOUND_S):
        await resume(store, ids[1], BROAD, sent)
    assert ids_of(sent) == [ids[2], None] and notice(sent[-1])["error"] == "session_ended"


async def test_a_lost_priming_event_and_the_losses_of_a_call_before_on_a_reused_id_refuse_no_resume():
    """No replay sends a priming event, so losing one loses nothing; and a call that takes an answered call's id
    starts with none of its losses (a resume of it was refused for good)."""
    store = GuardedEventStore(POLICY, storage=InMemoryEventStorage())
    await store.open_session("s1")
    await a_call(store, 2, "fetch")
    await lost(store, "2", progress(7))
    await lost(store, "2", result(2))  # answered, unstored: the id is free again
    ids = await a_call(store, 2, "fetch")  # a new call on it
    await lost(store, "2", None)  # type: ignore[arg-type]  # a resume's priming event, unstored
    answer = await stored(store, "2", result(2))
    sent: list[EventMessage] = []
    with anyio.fail_after(BOUND_S):
        await resume(store, ids[1], BROAD, sent)
    assert ids_of(sent) == [ids[2], answer]


async def test_a_session_the_sdk_opened_while_the_storage_failed_is_opened_at_its_next_call_and_resumable(
        monkeypatch):
    """Redis down as the session was born: its opening was lost, and every later event of it was dropped as a
    session not open's, for good (its resumes refused long after Redis came back)."""
    monkeypatch.setattr(guard_store, "_REOPEN_EVERY_S", 0.0)
    storage = InMemoryEventStorage()
    store = GuardedEventStore(POLICY, storage=storage)
    opening = storage.open

    async def down(session_id: str) -> None:
        raise StorageError("down")

    storage.open = down  # type: ignore[method-assign]
    await store._born(GuardRequest("s1", OPENER))  # the initialize response names it
    storage.open = opening  # type: ignore[method-assign]
    ids = await a_call(store, 2, "fetch")
    answer = await stored(store, "2", result(2))
    sent: list[EventMessage] = []
    with anyio.fail_after(BOUND_S):
        await resume(store, ids[0], BROAD, sent)
    assert ids_of(sent) == [ids[1], ids[2], answer]


async def test_an_event_lost_after_the_resumes_cursor_ends_its_replay_there_with_an_error_frame_never_a_gap():
    """Not stored, after the client's cursor: no replay can send it. What was stored before it is sent, then the
    refusal; the stored events after it (the answer, here) never make the stream look whole."""
    store = GuardedEventStore(POLICY, storage=InMemoryEventStorage())
    await store.open_session("s1")
    ids = await a_call(store, 2, "fetch")
    await lost(store, "2", progress(7))  # after ids[2]: a Redis blip while the client's stream was down
    await stored(store, "2", progress(8))
    await stored(store, "2", result(2))
    for cursor, before in ((ids[1], [ids[2]]), (ids[2], [])):
        sent: list[EventMessage] = []
        with anyio.fail_after(BOUND_S):
            await resume(store, cursor, BROAD, sent)
        assert ids_of(sent) == [*before, None]  # then the error frame
        assert notice(sent[-1]) == {**notice(sent[-1]), "error": "store_unavailable", "cursor": ids[2]}


async def test_an_answer_stored_here_that_the_storage_no_longer_has_ends_the_tail_instead_of_a_wait_forever(
        monkeypatch):
    """A storage restored from an older copy (Redis after a crash, with RDB or AOF lag, or failed over to a lagging
    replica) lost the answer this process stored after the client's cursor: no wait brings it back."""
    monkeypatch.setattr(guard_store, "_TAIL_WAIT_S", 0.01)
    storage, store, ids = await a_session()
    answer = await stored(store, "2", result(2))
    del storage._sessions["s1"].events[answer]  # what the older copy did not have
    sent: list[EventMessage] = []
    with anyio.fail_after(BOUND_S):
        await resume(store, ids[1], BROAD, sent)
    assert ids_of(sent) == [ids[2], None]
    assert notice(sent[-1]) == {**notice(sent[-1]), "error": "unknown_cursor", "cursor": ids[2]}


@pytest.mark.parametrize("lose", ["the request", "both", "the request, another stream's event kept"])
async def test_a_request_of_the_servers_stored_here_that_the_storage_no_longer_has_ends_the_tail(monkeypatch, lose):
    """The same for what the tool stored after the cursor and then waits on (an elicitation): its answer never comes,
    so neither does the call's: the tail says so instead of waiting with it until the client's timeout. (``both``: a
    progress stored after it is gone too; or another call's event, stored after it, is still there, and the tail reads
    past the request's place.)"""
    monkeypatch.setattr(guard_store, "_TAIL_WAIT_S", 0.01)
    storage, store, ids = await a_session()
    asked = await stored(store, "2", JSONRPCRequest(jsonrpc="2.0", id=9, method="elicitation/create", params={}))
    gone = [asked]
    if lose == "both":
        gone.append(await stored(store, "2", progress(3)))
    elif lose != "the request":
        await store.record_call("s1", "3", "search")
        await stored(store, "3", progress(1))
    for event_id in gone:
        del storage._sessions["s1"].events[event_id]  # what the older copy did not have
    sent: list[EventMessage] = []
    with anyio.fail_after(BOUND_S):
        await resume(store, ids[1], BROAD, sent)
    assert ids_of(sent) == [ids[2], None]
    assert notice(sent[-1]) == {**notice(sent[-1]), "error": "unknown_cursor", "cursor": ids[2]}


async def test_an_answer_of_a_call_before_is_not_what_the_tail_of_a_call_reusing_its_id_waits_for(monkeypatch):
    """The guard lets a call reuse an answered call's id: the answer it remembers is the old call's, which the
    session's cap may evict while the new call runs: that is no answer gone."""
    monkeypatch.setattr(guard_store, "_TAIL_WAIT_S", 0.01)
    storage = InMemoryEventStorage(max_events_per_session=3)
    store = GuardedEventStore(POLICY, storage=storage)
    await store.open_session("s1")
    await a_call(store, 2, "fetch")
    await stored(store, "2", result(2))
    ids = await a_call(store, 2, "fetch")  # its three events evict the first call's
    sent: list[EventMessage] = []
    waits = Waits(storage)
    with anyio.fail_after(BOUND_S):
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(resume, store, ids[1], BROAD, sent)
            await waits.parked(3)  # its tail waited, and found nothing, twice
            answer = await stored(store, "2", result(2))
    assert ids_of(sent) == [ids[2], answer]


async def test_an_event_lost_before_the_resumes_cursor_ends_no_tail_and_a_lost_answer_ends_it_at_once():
    """The client got a lost event live, before its cursor: its tail goes on. The answer lost before the resume
    will never be stored: the tail says so at once instead of waiting for it."""
    storage, store, _ = await a_session()
    await lost(store, "2", progress(7))  # sent live, and the client got it, and the next one, before its stream broke
    later = await stored(store, "2", progress(8))
    sent: list[EventMessage] = []
    waits = Waits(storage)
    with anyio.fail_after(BOUND_S):
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(resume, store, later, BROAD, sent)
            await waits.parked(1)  # the tail waits for what comes after the cursor
            answer = await stored(store, "2", result(2))
    assert ids_of(sent) == [answer]  # up to the answer: no error frame
    await store.record_call("s1", "3", "fetch")
    cursor = await stored(store, "3", None)
    ended: list[EventMessage] = []
    waits = Waits(storage)
    with anyio.fail_after(BOUND_S):
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(resume, store, cursor, BROAD, ended)
            await waits.parked(1)
            await lost(store, "3", result(3))  # call 3's answer, while its resume waits: no wake, no wait for it
    assert ids_of(ended) == [None] and notice(ended[-1])["error"] == "store_unavailable"
