"""A replay is attributed to the calls the resume really carries (the server hook's EventStore wrapper
around the lab's session-wide store, driven through the SDK's EventStore API with SDK messages)."""

from __future__ import annotations

import asyncio
import contextlib

from mcp.server.streamable_http import EventMessage, EventStore
from mcp_types import JSONRPCMessage, JSONRPCNotification, JSONRPCResponse
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from mcp_stream_exporter import scope as request_scope
from mcp_stream_exporter import semconv as sc
from mcp_stream_exporter.auth import ABSENT, ToolPolicy
from mcp_stream_exporter.detector import Detector
from mcp_stream_exporter.detector.embedded import span_of
from mcp_stream_exporter.hooks import ServerInstrumentation
from mcp_stream_exporter.hooks._spans import Stream
from mcp_stream_exporter.hooks._tracking import Tracker
from mcp_stream_exporter.lab import IncidentEventStore
from mcp_stream_exporter.sse import SSEFrame
from mcp_stream_exporter.wire import classify, classify_frame

SESSION = "s1"


def _progress(tool: str, step: int) -> JSONRPCNotification:
    return JSONRPCNotification(jsonrpc="2.0", method="notifications/progress",
                               params={"progressToken": tool, "progress": step, "message": f"{tool} step {step}"})


def _request(rid: int, tool: str) -> bytes:
    return f'{{"jsonrpc":"2.0","id":{rid},"method":"tools/call","params":{{"name":"{tool}"}}}}'.encode()


def _recorded(session_wide: bool) -> tuple[InMemorySpanExporter, EventStore, Tracker]:
    """The server hooks' EventStore wrapper around the lab's store, and where their spans go."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    instr = ServerInstrumentation(tracer_provider=provider)
    store = instr.event_store(IncidentEventStore(ToolPolicy(), session_wide_filter=session_wide))
    return exporter, store, instr.tracker


async def _session_wide_replay_story() -> list:
    """search and fetch; fetch's POST drops; its first resume gets search's progress from the
    session-wide store and breaks; its second resume is from a search event, its next cursor."""
    exporter, store, tracker = _recorded(session_wide=True)
    bound = request_scope.bind(request_scope.RequestScope(SESSION, ABSENT))

    def open_stream(kind: str, calls: list, cursor: str | None = None) -> Stream:
        stream = tracker.open_stream(kind, SESSION, calls, {sc.RESUME_CURSOR: cursor} if cursor else {}, ABSENT, 200)
        assert stream is not None
        return stream

    def send(stream: Stream, event_id: str, message: JSONRPCMessage) -> None:
        data = message.model_dump_json(by_alias=True, exclude_none=True)
        tracker.frame(stream, SSEFrame(data, id=event_id), classify_frame(data))

    async def store_and_send(stream: Stream, stream_id: str, message: JSONRPCMessage) -> str:
        event_id = await store.store_event(stream_id, message)
        send(stream, event_id, message)
        return event_id

    async def resume(cursor: str) -> Stream:
        stream = open_stream(sc.STREAM_KIND_RESUME, list(tracker.calls_of_cursor(SESSION, cursor)), cursor)

        async def replayed(event: EventMessage) -> None:
            assert event.event_id is not None
            send(stream, event.event_id, event.message)

        await store.replay_events_after(cursor, replayed)
        return stream

    try:
        (search_msg,), (fetch_msg,) = classify(_request(1, "search")), classify(_request(2, "fetch"))
        search = tracker.start_call(SESSION, search_msg, "2025-11-25", ABSENT, stateless=False)
        fetch = tracker.start_call(SESSION, fetch_msg, "2025-11-25", ABSENT, stateless=False)
        search_post, fetch_post = open_stream(sc.STREAM_KIND_POST, [search]), open_stream(sc.STREAM_KIND_POST, [fetch])
        fetch_cursor = await store_and_send(fetch_post, "2", _progress("fetch", 1))
        tracker.end_stream(fetch_post, sc.END_DROPPED)  # the cut
        await store_and_send(search_post, "1", _progress("search", 1))
        next_cursor = await store_and_send(search_post, "1", _progress("search", 2))
        first = await resume(fetch_cursor)  # hands search's progress to fetch's stream, then breaks
        tracker.end_stream(first, sc.END_DROPPED)
        await store_and_send(search_post, "1", JSONRPCResponse(jsonrpc="2.0", id=1, result={"content": []}))
        tracker.end_stream(search_post, sc.END_CLEAN)  # search got its result on its own POST
        await store.store_event("2", _progress("fetch", 2))
        second = await resume(next_cursor)  # from a search event: the cursor fetch's stream ended at
        tracker.end_stream(second, sc.END_CLEAN)
    finally:
        request_scope.unbind(bound)
    return list(exporter.get_finished_spans())


def test_a_resume_from_another_calls_event_is_attributed_to_the_call_whose_stream_it_continues():
    spans = asyncio.run(_session_wide_replay_story())
    replays = [s for s in spans if s.attributes[sc.SPAN] == sc.SPAN_REPLAY]
    assert [s.attributes[sc.JSONRPC_REQUEST_ID] for s in replays] == ["2", "2"]  # fetch's, both
    second = replays[1]
    assert second.attributes[sc.REPLAY_STREAM_ID] == "2"
    assert second.attributes[sc.REPLAY_BUFFERED] == 1  # fetch step 2: stored on fetch's stream after the cursor
    detector = Detector()
    detector.consume([span for span in map(span_of, spans) if span is not None])
    # fetch's resume was handed search's events, its result among them (the SDK gives it to fetch's caller)
    assert {(f.rule, f.request_id) for f in detector.findings} == {("cross_stream_replay", "2"),
                                                                   ("foreign_result", "2")}
    assert not [f for f in detector.findings if f.request_id == "1"]  # search got its result: nothing on it


async def _replay_cut_short(session_wide: bool) -> list:
    """fetch's POST drops after its first progress; search stores two events; fetch's resume is cancelled as it
    sends its first event (its client left: sse-starlette cancels the replay), the store's others unsent."""
    exporter, store, tracker = _recorded(session_wide)
    bound = request_scope.bind(request_scope.RequestScope(SESSION, ABSENT))

    async def client_leaves(event: EventMessage) -> None:
        raise asyncio.CancelledError

    try:
        (search_msg,), (fetch_msg,) = classify(_request(1, "search")), classify(_request(2, "fetch"))
        tracker.start_call(SESSION, search_msg, "2025-11-25", ABSENT, stateless=False)
        fetch = tracker.start_call(SESSION, fetch_msg, "2025-11-25", ABSENT, stateless=False)
        fetch_post = tracker.open_stream(sc.STREAM_KIND_POST, SESSION, [fetch], {}, ABSENT, 200)
        assert fetch_post is not None
        cursor = await store.store_event("2", _progress("fetch", 1))
        tracker.end_stream(fetch_post, sc.END_DROPPED)
        await store.store_event("1", _progress("search", 1))
        await store.store_event("2", _progress("fetch", 2))
        await store.store_event("2", _progress("fetch", 3))
        with contextlib.suppress(asyncio.CancelledError):
            await store.replay_events_after(cursor, client_leaves)
    finally:
        request_scope.unbind(bound)
    return list(exporter.get_finished_spans())


def test_a_replay_its_client_left_midway_still_tells_what_it_sent_and_pages_a_foreign_event():
    spans = asyncio.run(_replay_cut_short(session_wide=True))
    (replay,) = [s for s in spans if s.attributes[sc.SPAN] == sc.SPAN_REPLAY]
    assert replay.attributes[sc.REPLAY_DECISION] == sc.REPLAY_INTERRUPTED
    assert replay.attributes[sc.REPLAY_SENT] == 1
    assert replay.attributes[sc.REPLAY_FOREIGN_EVENT_IDS] == ("2",)  # search's progress, handed to fetch's stream
    detector = Detector()
    assert not detector.consume([span for span in map(span_of, spans) if span is not None]).rejected
    assert {f.rule for f in detector.findings} == {"cross_stream_replay"}


def test_a_replay_its_client_left_midway_is_no_truncation():
    spans = asyncio.run(_replay_cut_short(session_wide=False))
    (replay,) = [s for s in spans if s.attributes[sc.SPAN] == sc.SPAN_REPLAY]
    assert replay.attributes[sc.REPLAY_DECISION] == sc.REPLAY_INTERRUPTED
    assert sc.REPLAY_OFFENDING_EVENT_ID not in replay.attributes
    detector = Detector()
    detector.consume([span for span in map(span_of, spans) if span is not None])
    assert [f.rule for f in detector.findings] == []


def test_an_event_sent_on_two_streams_continues_either_calls_stream():
    """A session-wide replay hands fetch's event to search's resume: fetch's client may still resume from it."""
    tracker = ServerInstrumentation(tracer_provider=TracerProvider()).tracker
    (search_msg,), (fetch_msg,) = classify(_request(1, "search")), classify(_request(2, "fetch"))
    search = tracker.start_call(SESSION, search_msg, "2025-11-25", ABSENT, stateless=False)
    fetch = tracker.start_call(SESSION, fetch_msg, "2025-11-25", ABSENT, stateless=False)
    streams = []
    for calls, cursor in (([fetch], None), ([search], "5")):  # fetch's POST, then search's resume, send event 6
        stream = tracker.open_stream(sc.STREAM_KIND_POST if cursor is None else sc.STREAM_KIND_RESUME, SESSION,
                                     calls, {sc.RESUME_CURSOR: cursor} if cursor else {}, ABSENT, 200)
        assert stream is not None
        data = _progress("fetch", 1).model_dump_json(by_alias=True, exclude_none=True)
        tracker.frame(stream, SSEFrame(data, id="6"), classify_frame(data))
        streams.append(stream)
    assert tracker.calls_of_cursor(SESSION, "6") == (fetch, search)
    tracker.end_stream(streams[0], sc.END_DROPPED)  # fetch's POST stopped there: its client resumes from it
    assert tracker.calls_of_cursor(SESSION, "6") == (fetch,)
