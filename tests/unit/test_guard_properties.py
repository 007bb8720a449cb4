"""Property: under any schedule of calls, drops, token refreshes and resumes, the guard delivers each
call's terminal event exactly once or gives an explicit error; never an event after an undelivered
one; never an event of another session or stream."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mcp_types import JSONRPCNotification, JSONRPCResponse

from mcp_stream_exporter import scope
from mcp_stream_exporter.auth import AuthView, Requirement, ToolPolicy
from mcp_stream_exporter.guard import GuardedEventStore

SEARCH = "https://mcp.example.com/tools/search"
FETCH = "https://mcp.example.com/tools/fetch"
POLICY = ToolPolicy({"search": Requirement.of([SEARCH]), "fetch": Requirement.of([FETCH])})
AUDIENCES = [frozenset(), frozenset({SEARCH}), frozenset({FETCH}), frozenset({SEARCH, FETCH})]
LOOP = asyncio.new_event_loop()


@dataclass
class Call:
    session: str
    request_id: str
    tool: str
    steps: int  # progress events before the result
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


def _message(call: Call):
    if call.produced == 0:
        return None  # priming
    if call.produced <= call.steps:
        return JSONRPCNotification(jsonrpc="2.0", method="notifications/progress", params={"p": call.produced})
    return JSONRPCResponse(jsonrpc="2.0", id=int(call.request_id), result={"from": call.session})


class World:
    def __init__(self, store: GuardedEventStore, audience: dict[str, frozenset[str]]) -> None:
        self.store = store
        self.audience = audience
        self.calls: list[Call] = []
        self.owner: dict[tuple[str, str], Call] = {}  # (session, event id) -> the call that stored it

    def _run(self, session: str, coro_factory, auth: AuthView | None = None):
        token = scope.bind(scope.RequestScope(session, auth or AuthView()))
        try:
            return LOOP.run_until_complete(coro_factory())
        finally:
            scope.unbind(token)

    def produce(self, call: Call) -> None:
        if call.finished_producing:
            return
        message = _message(call)
        event_id = self._run(call.session, lambda: self.store.store_event(call.request_id, message))
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

    def resume(self, call: Call) -> None:
        if call.live or call.error or call.cursor is None:
            return
        sent = []

        async def collect(event):
            sent.append(event)

        auth = AuthView(audience=self.audience[call.session], fingerprint="t")
        stream = self._run(call.session, lambda: self.store.replay_events_after(call.cursor, collect), auth)
        for event in sent:
            if event.event_id is None:
                call.error = True  # the explicit error frame
                assert event.message.params["cursor"] == call.cursor  # never past an undelivered event
                continue
            owner = self.owner[(call.session, event.event_id)]
            assert owner is call, "an event of another session or stream was replayed"
            self._deliver(call, event.event_id, event.message is not None and isinstance(event.message,
                                                                                         JSONRPCResponse))
        call.live = stream is not None


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    policy_mode=st.sampled_from(["all_or_nothing", "prefix"]),
    tools=st.lists(st.tuples(st.sampled_from(["s1", "s2"]), st.sampled_from(["search", "fetch"]),
                             st.integers(0, 3)), min_size=1, max_size=4),
    start_audience=st.sampled_from(AUDIENCES),
    ops=st.lists(st.tuples(st.sampled_from(["produce", "drop", "refresh", "resume"]), st.integers(0, 7),
                           st.sampled_from(AUDIENCES)), max_size=40),
)
def test_every_call_ends_with_its_terminal_once_or_an_explicit_error(policy_mode, tools, start_audience, ops):
    store = GuardedEventStore(POLICY, policy_mode=policy_mode)
    world = World(store, {"s1": start_audience, "s2": start_audience})
    next_id = {"s1": 1, "s2": 1}
    for session, tool, steps in tools:
        next_id[session] += 1
        call = Call(session, str(next_id[session]), tool, steps)
        store.record_call(session, call.request_id, tool)
        world.calls.append(call)
        world.produce(call)  # the priming event, delivered on the POST
    for op, index, audience in ops:
        call = world.calls[index % len(world.calls)]
        if op == "produce":
            world.produce(call)
        elif op == "drop":
            call.live = False
        elif op == "refresh":
            world.audience[call.session] = audience
        else:
            world.resume(call)
    for call in world.calls:  # the server finishes every tool; the client resumes what it can
        while not call.finished_producing:
            world.produce(call)
        world.resume(call)
    for call in world.calls:
        assert call.delivered == call.stored[:len(call.delivered)], "a gap or reordering in delivery"
        assert call.terminal_delivered <= 1
        assert call.terminal_delivered == 1 or call.error, "silent loss: no terminal event and no error"
