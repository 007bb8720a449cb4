"""What the server hooks' EventStore wrapper keeps of each stream: bounded, oldest first out."""

from __future__ import annotations

import asyncio

import pytest
from mcp.server.streamable_http import EventCallback, EventMessage, EventStore
from mcp_types import JSONRPCMessage, JSONRPCNotification
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from mcp_stream_exporter import scope as request_scope
from mcp_stream_exporter import semconv as sc
from mcp_stream_exporter.auth import ABSENT
from mcp_stream_exporter.hooks import ServerInstrumentation
from mcp_stream_exporter.hooks._recorder import StoreRecorder
from mcp_stream_exporter.hooks._spans import DeviationTracer
from mcp_stream_exporter.hooks._tracking import Requirements, Tracker


def _recorder(**bounds: int) -> StoreRecorder:
    tracer = DeviationTracer(TracerProvider())
    return StoreRecorder(Tracker(tracer, sc.ROLE_SERVER), tracer, Requirements(10), **bounds)


@pytest.mark.parametrize("bound", [0, 1, 2, 5])
def test_a_stream_keeps_its_last_events_up_to_the_bound(bound):
    recorder = _recorder(max_events_per_stream=bound)
    events = ["1", "2", "3", "4"]
    for event_id in events:
        recorder.on_stored("s", "7", event_id, JSONRPCNotification(jsonrpc="2.0", method="notifications/progress"))
    assert recorder.buffered_after("s", "7", "unknown-cursor") == events[len(events) - min(bound, 4):]


def test_negative_bounds_are_refused_rather_than_silently_keeping_nothing():
    with pytest.raises(ValueError, match="must not be negative"):
        _recorder(max_events_per_stream=-1)
    with pytest.raises(ValueError, match="must not be negative"):
        _recorder(max_streams=-1)


def _progress() -> JSONRPCNotification:
    return JSONRPCNotification(jsonrpc="2.0", method="notifications/progress")


def test_a_replay_sees_every_event_stored_before_it_whether_or_not_a_batch_indexed_it_yet():
    recorder = _recorder()
    for n in range(3):  # fewer than a batch: still in the journal
        recorder.on_stored("s", "7", f"e{n}", _progress())
    assert recorder.stream_of("s", "e1") == "7"
    assert recorder.buffered_after("s", "7", "e0") == ["e1", "e2"]
    recorder.on_stored("s", "7", "e3", _progress())  # after a read: the next read sees it too
    assert recorder.buffered_after("s", "7", "e1") == ["e2", "e3"]


@pytest.mark.parametrize("count", [63, 64, 65, 200])
def test_events_indexed_in_batches_keep_store_order_across_streams_and_the_bounds(count):
    recorder = _recorder(max_events_per_stream=50, max_streams=30)
    for n in range(count):  # two streams, interleaved, across as many batches as it takes
        recorder.on_stored(None, "a" if n % 2 else "b", str(n), _progress())
    kept_a = [str(n) for n in range(count) if n % 2][-50:]
    assert recorder.buffered_after(None, "a", "unknown-cursor") == kept_a
    cursor = str((count - 10) // 2 * 2)  # an event of "b": "a"'s after it in store order
    assert recorder.stream_of(None, cursor) == "b"
    assert recorder.buffered_after(None, "a", cursor) == [e for e in kept_a if int(e) > int(cursor)]
    assert recorder.stream_of("s", cursor) is None  # another session's event of the same id: none of it


def test_streams_past_the_bound_go_oldest_first_when_indexed_in_a_batch():
    recorder = _recorder(max_streams=2)
    for stream in ("1", "2", "3"):
        recorder.on_stored("s", stream, f"e{stream}", _progress())
    assert recorder.buffered_after("s", "1", "unknown-cursor") == []
    assert recorder.buffered_after("s", "3", "unknown-cursor") == ["e3"]


def test_the_events_kept_of_all_streams_are_as_many_as_the_index_holds_oldest_streams_first():
    """Each stream's bound times the streams' would let 10,000 long streams hold some 700 MB."""
    recorder = _recorder(max_events_per_stream=1000, max_streams=10)  # the index: 100 events
    for stream in range(5):
        for n in range(60):
            recorder.on_stored("s", str(stream), f"e{stream}-{n}", _progress())
    recorder.buffered_after("s", "4", "unknown-cursor")  # brought up to date
    assert sum(len(events) // 2 for events in recorder._stored.values()) <= 100
    assert recorder.buffered_after("s", "4", "unknown-cursor") == [f"e4-{n}" for n in range(60)]
    assert recorder.buffered_after("s", "0", "unknown-cursor") == []


class _Replaying(EventStore):
    """Numbers what it stores; replays the ids it is told, and stores ``meanwhile`` events of another session
    after the first, as a busy server's other sessions do while a replay waits on its client."""

    def __init__(self, replay: list[str], meanwhile: int = 0, before: int = 0) -> None:
        self.stored = 0
        self.replay, self.meanwhile, self.before = replay, meanwhile, before
        self.store: EventStore = self

    async def store_event(self, stream_id: str, message: JSONRPCMessage | None) -> str:
        self.stored += 1
        return f"e{self.stored}"

    async def replay_events_after(self, last_event_id: str, send_callback: EventCallback) -> str:
        for n, event_id in enumerate(self.replay):
            await send_callback(EventMessage(_progress(), event_id))
            if n == 0:
                await self._others(self.meanwhile)
        return "7"

    async def _others(self, count: int) -> None:
        """``count`` events of another session, stored through the observed store."""
        other = request_scope.bind(request_scope.RequestScope("other", ABSENT))
        try:
            for _ in range(count):
                await self.store.store_event("9", _progress())
        finally:
            request_scope.unbind(other)


def _replayed(inner: _Replaying) -> tuple[str, ...] | None:
    """The foreign event ids of one replay of session ``s``'s stream ``7`` from its first event (four events, after
    the first of them ``before`` of another session; an index of ten events)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    store = ServerInstrumentation(tracer_provider=provider, max_streams=1).event_store(inner)
    inner.store = store

    async def sent(event: EventMessage) -> None:
        return None

    async def run() -> None:
        bound = request_scope.bind(request_scope.RequestScope("s", ABSENT))
        try:
            await store.store_event("7", _progress())
            await inner._others(inner.before)  # push the cursor, e1, out of the index
            for _ in range(3):
                await store.store_event("7", _progress())
            await store.replay_events_after("e1", sent)
        finally:
            request_scope.unbind(bound)

    asyncio.run(run())
    (replay,) = [s for s in exporter.get_finished_spans() if s.attributes[sc.SPAN] == sc.SPAN_REPLAY]
    return replay.attributes.get(sc.REPLAY_FOREIGN_EVENT_IDS)  # type: ignore[return-value]


def test_a_replay_names_foreign_an_id_the_store_never_returned_but_not_one_the_index_let_go_of():
    """The index holds ten events here: twenty of another session stored while the replay waits push the
    replayed stream's own events out of it, and its later events read as unknown, not as another stream's."""
    assert _replayed(_Replaying(["e2", "e3", "e4"], meanwhile=20)) is None
    assert _replayed(_Replaying(["e2", "x9", "e4"])) == ("x9",)
    # the cursor let go of before the replay (its stream quiet while the server stored on): the replay continues no
    # stream known here, and nothing it sends is another stream's
    assert _replayed(_Replaying(["e22", "e23", "e24"], before=20)) is None


def test_an_event_id_a_store_gave_on_two_streams_of_a_session_is_neither_streams_and_resumes_none():
    """MCP wants event ids unique in a session; a store numbering each stream from 1 is not. A resume from such an id
    was taken for the last stream that stored it, whose call (answered, healthy) was paged truncated."""
    recorder = _recorder()
    recorder.on_stored("s", "2", "1", _progress())
    recorder.on_stored("s", "3", "1", _progress())
    recorder.on_stored("s", "3", "2", _progress())
    recorder.on_stored("t", "9", "1", _progress())  # another session's is its own
    assert recorder.stream_of("s", "1") is None and recorder.reused("s", "1")
    assert recorder.stream_of("s", "2") == "3" and not recorder.reused("s", "2")
    assert recorder.stream_of("t", "1") == "9"
    assert recorder.resumed_stream("s", "1") == (None, None)


def test_a_replay_from_a_cursor_given_on_two_streams_names_none_of_its_events_foreign():
    """Which stream it continues is not known: none of what it sends is another's (stream 3's own "2" was)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    recorder = ServerInstrumentation(tracer_provider=provider).recorder

    class PerStream(_Replaying):
        async def store_event(self, stream_id: str, message: JSONRPCMessage | None) -> str:
            return {"2": "1", "3": "1"}[stream_id] if not self.stored else str(self.stored)

    inner = PerStream(["2"])
    store = recorder.event_store(inner)

    async def run() -> None:
        bound = request_scope.bind(request_scope.RequestScope("s", ABSENT))
        try:
            await store.store_event("2", _progress())
            await store.store_event("3", _progress())
            inner.stored = 2
            await store.store_event("3", _progress())  # "2", stream 3's alone

            async def sent(event: EventMessage) -> None:
                return None

            await store.replay_events_after("1", sent)
        finally:
            request_scope.unbind(bound)

    asyncio.run(run())
    (replay,) = [s for s in exporter.get_finished_spans() if s.attributes[sc.SPAN] == sc.SPAN_REPLAY]
    assert sc.REPLAY_FOREIGN_EVENT_IDS not in replay.attributes
