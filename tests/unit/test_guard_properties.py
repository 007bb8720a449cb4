"""Property: under any schedule of calls, drops, token refreshes and resumes, and an adversary who
reuses request ids in and across sessions, fills the guard's tables from other sessions, presents
failed, absent, opaque, narrower or another principal's tokens and resumes from any cursor seen
anywhere, the guard

- never delivers an event to a session other than the one that stored it,
- never delivers an event to a token that does not cover its call's requirement (a failed, unverified
  under verification, or opaque token covers nothing that requires something; another principal's
  token covers nothing of the session),
- delivers each honest call's events in order with no gap, and its terminal event exactly once, or
  gives an explicit error."""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mcp_types import JSONRPCNotification, JSONRPCResponse

from mcp_stream_exporter.auth import NO_REQUIREMENT, AuthView, Requirement, TokenReader, ToolPolicy
from mcp_stream_exporter.guard import GuardedEventStore, InMemoryEventStorage
from mcp_stream_exporter.guard.redis_storage import RedisEventStorage
from mcp_stream_exporter.guard.store import _current as guard_request
from mcp_stream_exporter.guard.store import _Request as GuardRequest

SEARCH = "https://mcp.example.com/tools/search"
FETCH = "https://mcp.example.com/tools/fetch"
POLICY = ToolPolicy({"search": Requirement.of([SEARCH]), "fetch": Requirement.of([FETCH])})
AUDIENCES = [frozenset(), frozenset({SEARCH}), frozenset({FETCH}), frozenset({SEARCH, FETCH})]
SESSIONS = ["s1", "s2", "s3"]
OPENERS = {"s1": "alice", "s2": "bob", "s3": None}  # the subject each session was opened with (s3: no auth)
OTHERS = ["evil1", "evil2", "evil3"]  # sessions the adversary opens to fill the tables
VERIFICATIONS = ["verified", "unverified", "failed", "opaque", "absent"]
LOOP = asyncio.new_event_loop()
pytestmark = pytest.mark.fuzz  # thousands of adversarial schedules: `make test` runs them, `make test-fast` not
REPLAYED = [0]  # events honest resumes got: the properties must not hold only because everything is refused

tokens = st.builds(
    lambda audience, verification, subject: AuthView(
        audience=audience if verification not in ("opaque", "absent") else frozenset(),
        subject_hash=subject if verification not in ("opaque", "absent") else None,
        fingerprint=None if verification == "absent" else "t", verification=verification),
    st.sampled_from(AUDIENCES), st.sampled_from(VERIFICATIONS), st.sampled_from(["alice", "bob", "mallory", None]))


@dataclass
class Call:
    session: str
    request_id: str
    tool: str
    steps: int  # progress events before the result
    honest: bool = True  # an adversary's call reusing an id is not owed anything
    produced: int = 0  # events stored so far (priming included)
    stored: list[str] = field(default_factory=list)  # event ids in store order
    delivered: list[str] = field(default_factory=list)
    terminal_delivered: int = 0
    error: bool = False
    live: bool = True  # the client's connection carries this stream now
    cursor: str | None = None

    @property
    def finished_producing(self) -> bool:
        return self.produced > self.steps + 1

    @property
    def requirement(self) -> Requirement:
        return POLICY.requirement(self.tool) or NO_REQUIREMENT


def _message(call: Call):
    if call.produced == 0:
        return None  # priming
    if call.produced <= call.steps:
        return JSONRPCNotification(jsonrpc="2.0", method="notifications/progress", params={"p": call.produced})
    return JSONRPCResponse(jsonrpc="2.0", id=int(call.request_id), result={"from": call.session})


class ClientLeft(Exception):
    """A resume's client goes away while its live tail waits."""


class World:
    def __init__(self, store: GuardedEventStore, tokens: dict[str, AuthView]) -> None:
        self.store = store
        self.tokens = tokens  # each session's honest client's current token
        self.calls: list[Call] = []
        self.owner: dict[tuple[str, str], Call] = {}  # (session, event id) -> the call that stored it
        self._wait_after = store.storage.wait_after
        store.storage.wait_after = self._client_leaves

    async def _client_leaves(self, session_id: str, event_id: str, timeout_s: float):
        """A resume's live tail takes what is stored already; where it would wait, its client leaves."""
        events = await self._wait_after(session_id, event_id, 0)
        if not events:
            raise ClientLeft
        return events

    def _run(self, session: str, coro_factory, auth: AuthView):
        token = guard_request.set(GuardRequest(session, auth))
        try:
            return LOOP.run_until_complete(coro_factory())
        except ClientLeft:
            return None  # the resume's connection is gone: nothing carries its stream live
        finally:
            guard_request.reset(token)

    def opener(self, session: str) -> AuthView:
        return AuthView(subject_hash=OPENERS[session])

    def covers(self, auth: AuthView, session: str, call: Call) -> bool:
        """The oracle: may this token see this call's events in this session?"""
        opener = OPENERS[session]
        if opener is not None and auth.subject_hash != opener:
            return False
        if call.requirement == NO_REQUIREMENT:
            return True
        trusted = auth.verification == "verified" or (auth.verification == "unverified"
                                                       and not self.store.tokens.verifies)
        if auth.verification == "opaque":
            return self.store.opaque == "allow"
        return trusted and auth.grants(call.requirement)

    def produce(self, call: Call) -> None:
        if call.finished_producing:
            return
        message = _message(call)
        event_id = self._run(call.session, lambda: self.store.store_event(call.request_id, message),
                             self.opener(call.session))
        call.produced += 1
        call.stored.append(event_id)
        self.owner[(call.session, event_id)] = call
        if call.live and not call.error:
            self._deliver(call, event_id, message is not None and call.produced == call.steps + 2)

    def _deliver(self, call: Call, event_id: str, terminal: bool) -> None:
        call.delivered.append(event_id)
        call.cursor = event_id
        if terminal:
            call.terminal_delivered += 1

    def replay(self, session: str, cursor: str, auth: AuthView) -> None:
        """The adversary resumes ``session`` from any ``cursor`` with any token."""
        sent = []

        async def collect(event):
            sent.append(event)

        self._run(session, lambda: self.store.replay_events_after(cursor, collect), auth)
        for event in sent:
            if event.event_id is not None:
                self._check(session, auth, event.event_id)
        assert sum(e.event_id is None for e in sent) <= 1

    def _check(self, session: str, auth: AuthView, event_id: str) -> Call:
        owner = self.owner.get((session, event_id))
        assert owner is not None, "an event of another session was replayed"
        assert self.covers(auth, session, owner), "an event was replayed to a token that does not cover it"
        return owner

    def resume(self, call: Call) -> None:
        """The honest client resumes its call's stream from its cursor with its session's token."""
        if call.live or call.error or call.cursor is None:
            return
        sent = []

        async def collect(event):
            sent.append(event)

        auth = self.tokens[call.session]
        stream = self._run(call.session, lambda: self.store.replay_events_after(call.cursor, collect), auth)
        cursors = [call.cursor]
        for event in sent:
            if event.event_id is None:
                call.error = True  # the explicit error frame
                assert event.message.params["cursor"] in cursors  # never past an undelivered event
                continue
            cursors.append(event.event_id)
            REPLAYED[0] += 1
            if self._check(call.session, auth, event.event_id) is call:
                self._deliver(call, event.event_id, isinstance(event.message, JSONRPCResponse))
        call.live = stream is not None


ops = st.lists(st.one_of(
    st.tuples(st.sampled_from(["produce", "drop", "resume"]), st.integers(0, 7)),
    st.tuples(st.just("refresh"), st.sampled_from(SESSIONS), tokens),
    st.tuples(st.just("reuse"), st.integers(0, 7), st.sampled_from(["search", "fetch", "other"])),
    st.tuples(st.just("flood"), st.sampled_from(SESSIONS + OTHERS), st.integers(1, 20)),
    st.tuples(st.just("attack"), st.sampled_from(SESSIONS), st.integers(0, 200), tokens),
), max_size=40)


SCHEDULES = {
    "policy_mode": st.sampled_from(["all_or_nothing", "prefix"]),
    "replay": st.sampled_from(["stream", "session"]),
    "opaque": st.sampled_from(["refuse", "allow"]),
    "verifies": st.booleans(),
    "calls": st.lists(st.tuples(st.sampled_from(SESSIONS), st.integers(1, 3), st.sampled_from(["search", "fetch"]),
                                st.integers(0, 3)), min_size=1, max_size=4),
    "start": st.sampled_from(AUDIENCES),
    "schedule": ops,
}


@settings(max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**SCHEDULES)
def test_no_event_reaches_another_session_or_an_uncovering_token_and_honest_calls_end_explicitly(
        policy_mode, replay, opaque, verifies, calls, start, schedule):
    storage = InMemoryEventStorage(max_calls_per_session=6, max_events_per_session=40, max_sessions=4)
    play(storage, policy_mode, replay, opaque, verifies, calls, start, schedule)


def test_the_same_properties_hold_on_redis(redis_server):
    """The same adversary against ``RedisEventStorage`` on a real redis-server (a key prefix an example)."""
    client = LOOP.run_until_complete(_redis_client(redis_server.url))
    prefixes = itertools.count()

    @settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(**SCHEDULES)
    def check(policy_mode, replay, opaque, verifies, calls, start, schedule):
        storage = RedisEventStorage(client, prefix=f"prop{next(prefixes)}", max_calls_per_session=6,
                                    max_events_per_session=40)
        play(storage, policy_mode, replay, opaque, verifies, calls, start, schedule)

    REPLAYED[0] = 0
    try:
        check()
    finally:
        LOOP.run_until_complete(client.aclose())
    assert REPLAYED[0] > 0


async def _redis_client(url):
    import redis.asyncio as aioredis

    return aioredis.Redis.from_url(url)


def play(storage, policy_mode, replay, opaque, verifies, calls, start, schedule):
    store = GuardedEventStore(POLICY, policy_mode=policy_mode, replay=replay, opaque=opaque,
                              storage=storage, token_reader=TokenReader(key="k" * 32) if verifies else None)
    honest = {s: AuthView(audience=start, subject_hash=OPENERS[s], fingerprint="h",
                          verification="verified" if verifies else "unverified") for s in SESSIONS}
    for session in SESSIONS:
        LOOP.run_until_complete(store.open_session(session))
    world = World(store, honest)
    used: set[tuple[str, str]] = set()
    for session, request_id, tool, steps in calls:
        call = Call(session, str(request_id), tool, steps, honest=(session, str(request_id)) not in used)
        used.add((session, call.request_id))
        LOOP.run_until_complete(store.record_call(session, call.request_id, tool))
        world.calls.append(call)
        world.produce(call)  # the priming event, delivered on the POST
    for op in schedule:
        kind = op[0]
        if kind == "refresh":
            world.tokens[op[1]] = op[2]
        elif kind == "flood":
            if op[1] in OTHERS:
                LOOP.run_until_complete(store.open_session(op[1]))  # the adversary opens sessions too
            for n in range(op[2]):
                LOOP.run_until_complete(store.record_call(op[1], f"flood-{n}", "search"))
        elif kind == "attack":
            seen = [event_id for _, event_id in world.owner]  # every id handed out in any session
            if seen:
                world.replay(op[1], seen[op[2] % len(seen)], op[3])
        elif kind == "reuse":  # the adversary POSTs another tool with a pending call's id, same session
            victim = world.calls[op[1] % len(world.calls)]
            call = Call(victim.session, victim.request_id, op[2], 1, honest=False, live=False)
            tool = op[2] if op[2] != "other" else None
            LOOP.run_until_complete(store.record_call(call.session, call.request_id, tool))
            world.calls.append(call)
            world.produce(call)
        else:
            call = world.calls[op[1] % len(world.calls)]
            if kind == "produce":
                world.produce(call)
            elif kind == "drop":
                call.live = False
            else:
                world.resume(call)
    for call in world.calls:  # the server finishes every tool; the client resumes what it can
        while not call.finished_producing:
            world.produce(call)
        world.resume(call)
    for call in world.calls:
        if not call.honest:
            continue
        assert call.delivered == call.stored[:len(call.delivered)], "a gap or reordering in delivery"
        assert call.terminal_delivered <= 1
        assert call.terminal_delivered == 1 or call.error, "silent loss: no terminal event and no error"
