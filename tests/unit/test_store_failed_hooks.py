"""The server hooks when the author's ``EventStore.store_event`` raises: the SDK's message router dies with the
session's messages, so the calls it owed end ``store_failed``; the exception goes on unchanged."""

from __future__ import annotations

import pytest
from mcp.server.streamable_http import EventCallback, EventId, EventMessage, EventStore, StreamId
from mcp_types import JSONRPCMessage, JSONRPCNotification, JSONRPCResponse
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from mcp_stream_exporter import scope as request_scope
from mcp_stream_exporter import semconv as sc
from mcp_stream_exporter.auth import ABSENT
from mcp_stream_exporter.hooks._recorder import StoreRecorder
from mcp_stream_exporter.hooks._spans import Call, DeviationTracer
from mcp_stream_exporter.hooks._tracking import Requirements, Tracker
from mcp_stream_exporter.wire import classify

pytestmark = pytest.mark.anyio
SECRET = "redis://:hunter2@cache:6379"


class StoreDown(ConnectionError):
    """What a Redis store raises when its server is down; its message names the server, password included."""


class _Store(EventStore):
    """Stores everything until ``down``, then raises (``StoreDown``) for every message (not a priming event)."""

    def __init__(self) -> None:
        self.down = False
        self.raised: list[BaseException] = []
        self._ids = 0

    async def store_event(self, stream_id: StreamId, message: JSONRPCMessage | None) -> EventId:
        if self.down:
            error = StoreDown(f"{SECRET} unreachable")
            self.raised.append(error)
            raise error
        self._ids += 1
        return str(self._ids)

    async def replay_events_after(self, last_event_id: EventId, send_callback: EventCallback) -> StreamId | None:
        return None


def _server(inner: _Store | None = None) -> tuple[Tracker, _Store, EventStore, InMemorySpanExporter]:
    """The server's tracker, the author's store (``inner``) and the hooks' store around it, and what they export."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = DeviationTracer(provider)
    tracker = Tracker(tracer, sc.ROLE_SERVER)
    inner = inner or _Store()
    return tracker, inner, StoreRecorder(tracker, tracer, Requirements(10)).event_store(inner), exporter


def _call(tracker: Tracker, session: str, rid: int) -> Call:
    request = classify(f'{{"jsonrpc":"2.0","id":{rid},"method":"tools/call","params":{{"name":"fetch"}}}}')[0]
    call = tracker.start_call(session, request, "2025-11-25", ABSENT, stateless=False)
    tracker.open_stream(sc.STREAM_KIND_POST, session, [call], {}, ABSENT, 200)  # its POST, open
    return call


def _result(rid: int) -> JSONRPCResponse:
    return JSONRPCResponse(jsonrpc="2.0", id=rid, result={"content": []})


def _outcomes(exporter: InMemorySpanExporter) -> dict[tuple[str, str], tuple[str, str | None]]:
    """Each call span's (session, request id) -> its outcome and ``error.type``."""
    return {(s.attributes[sc.MCP_SESSION_ID], s.attributes[sc.JSONRPC_REQUEST_ID]):
            (s.attributes[sc.CALL_OUTCOME], s.attributes.get(sc.ERROR_TYPE))
            for s in exporter.get_finished_spans() if s.attributes[sc.SPAN] == sc.SPAN_CALL}


async def _store(store: EventStore, session: str, stream_id: str, message: JSONRPCMessage | None) -> None:
    """``store_event`` as the SDK's message router calls it: in a context whose request scope names the session."""
    token = request_scope.bind(request_scope.RequestScope(session, ABSENT))
    try:
        await store.store_event(stream_id, message)
    finally:
        request_scope.unbind(token)


async def test_the_stores_exception_goes_on_unchanged_and_every_call_the_session_owed_ends_store_failed():
    tracker, inner, store, exporter = _server()
    for session, rid in (("s", 1), ("s", 2), ("other", 1)):
        _call(tracker, session, rid)
    answered = _call(tracker, "s", 3)
    await _store(store, "s", "3", _result(3))  # stored before the failure: the router sent it
    inner.down = True
    with pytest.raises(StoreDown) as raised:
        await _store(store, "s", "1", JSONRPCNotification(jsonrpc="2.0", method="notifications/progress"))
    assert raised.value is inner.raised[0]  # the very exception, which the SDK's router logs as it dies
    error_type = f"{__name__}.StoreDown"
    assert _outcomes(exporter) == {("s", "1"): (sc.OUTCOME_STORE_FAILED, error_type),
                                   ("s", "2"): (sc.OUTCOME_STORE_FAILED, error_type)}  # the other session's goes on
    assert all(s.status.status_code == StatusCode.ERROR for s in exporter.get_finished_spans())
    assert SECRET not in "".join(s.to_json() for s in exporter.get_finished_spans())
    assert not answered.done  # its result is on its way on its POST


async def test_a_failure_on_the_standalone_stream_loses_the_sessions_calls_too():
    tracker, inner, store, exporter = _server()
    _call(tracker, "s", 1)
    inner.down = True
    with pytest.raises(StoreDown):
        await _store(store, "s", "_GET_stream", JSONRPCNotification(jsonrpc="2.0", method="notifications/message"))
    assert _outcomes(exporter) == {("s", "1"): (sc.OUTCOME_STORE_FAILED, f"{__name__}.StoreDown")}


async def test_a_priming_event_that_fails_to_store_ends_nothing_its_post_is_answered_500():
    tracker, inner, store, exporter = _server()
    _call(tracker, "s", 1)
    inner.down = True
    with pytest.raises(StoreDown):
        await _store(store, "s", "1", None)
    tracker.cancel(("s", "1"))  # the session lives on: its client's cancel is a cancel
    assert _outcomes(exporter) == {("s", "1"): (sc.OUTCOME_CANCELLED, None)}


async def test_a_call_the_session_starts_after_its_store_failed_ends_store_failed_as_it_starts():
    """The router is gone: nothing will send its result, whether its client cancels it at its timeout or only drops
    its stream; another session's call is not touched, and a cancel of the lost call changes nothing."""
    tracker, inner, store, exporter = _server()
    inner.down = True
    with pytest.raises(StoreDown):
        await _store(store, "s", "_GET_stream", JSONRPCNotification(jsonrpc="2.0", method="notifications/message"))
    assert tracker.store_failed_in("s") and not tracker.store_failed_in("other")
    tracker.doomed(_call(tracker, "s", 7))  # as the observer does once the SDK hands the call over
    tracker.doomed(_call(tracker, "other", 7))
    assert _outcomes(exporter) == {("s", "7"): (sc.OUTCOME_STORE_FAILED, f"{__name__}.StoreDown")}
    tracker.cancel(("s", "7"))
    tracker.cancel(("other", "7"))
    assert _outcomes(exporter) == {("s", "7"): (sc.OUTCOME_STORE_FAILED, f"{__name__}.StoreDown"),
                                   ("other", "7"): (sc.OUTCOME_CANCELLED, None)}


class _WritesThenRaises(_Store):
    """Writes the message, then raises (a Redis timeout after the write landed): the event is there, its id unknown
    to the hooks; a replay of its stream sends it."""

    def __init__(self) -> None:
        super().__init__()
        self.written: list[tuple[StreamId, EventId]] = []

    async def store_event(self, stream_id: StreamId, message: JSONRPCMessage | None) -> EventId:
        self._ids += 1
        self.written.append((stream_id, str(self._ids)))
        if message is not None and self.down:
            raise StoreDown(f"{SECRET} timed out")
        return str(self._ids)

    async def replay_events_after(self, last_event_id: EventId, send_callback: EventCallback) -> StreamId | None:
        stream_id = next(s for s, e in self.written if e == last_event_id)
        after = [e for s, e in self.written if s == stream_id and int(e) > int(last_event_id)]
        for event_id in after:
            await send_callback(EventMessage(_result(int(stream_id)), event_id))
        return stream_id


async def test_a_replay_of_an_event_the_store_wrote_before_it_raised_is_no_other_streams():
    """The one event whose id the hooks never learned is the failed session's own: no cross-stream replay (a
    critical page for a caller that got its result)."""
    tracker, inner, store, exporter = _server(_WritesThenRaises())
    _call(tracker, "s", 1)
    await _store(store, "s", "1", None)  # the POST's priming event: the client's cursor
    inner.down = True
    with pytest.raises(StoreDown):
        await _store(store, "s", "1", _result(1))
    token = request_scope.bind(request_scope.RequestScope("s", ABSENT))
    try:
        sent: list[EventMessage] = []

        async def send(event: EventMessage) -> None:
            sent.append(event)

        assert await store.replay_events_after("1", send) == "1"
    finally:
        request_scope.unbind(token)
    assert [e.event_id for e in sent] == ["2"]
    (replay,) = [s for s in exporter.get_finished_spans() if s.attributes[sc.SPAN] == sc.SPAN_REPLAY]
    assert sc.REPLAY_FOREIGN_EVENT_IDS not in replay.attributes
