"""How the hooks learn that a caller gave up on a call. The server, when a client cancels a call whose result
already went out on a stream (or was stored with none open): the client never got it (its side of the connection
was lost while the server's stayed open, or it did not resume before its caller gave up), told by a span of its own
from the result's send to the cancel. The client, when the SDK's span of a call ends without its result: in its
caller's timeout (with resumption hints the SDK sends no cancel, and resumes on for no caller), or as the SDK failed
the call itself."""

from __future__ import annotations

import asyncio

import httpx2
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Span, StatusCode

from mcp_stream_exporter import semconv as sc
from mcp_stream_exporter.auth import ABSENT
from mcp_stream_exporter.hooks import instrument_client
from mcp_stream_exporter.hooks._sdk_spans import SdkSpans
from mcp_stream_exporter.hooks._spans import Call, DeviationTracer
from mcp_stream_exporter.hooks._tracking import Tracker
from mcp_stream_exporter.wire import classify


def _tracker(role: str = sc.ROLE_SERVER, max_calls: int = 10_000) -> tuple[Tracker, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return Tracker(DeviationTracer(provider), role, max_calls=max_calls), exporter


def _answered(tracker: Tracker, rid: int, event_id: str | None = "7", session: str | None = "s1") -> Call:
    """A call of ``session`` answered on its POST's SSE stream as event ``event_id``: the healthy path."""
    request = classify(f'{{"jsonrpc":"2.0","id":{rid},"method":"tools/call","params":{{"name":"fetch"}}}}')[0]
    call = tracker.start_call(session, request, "2025-11-25", ABSENT, stateless=False)
    result = classify(f'{{"jsonrpc":"2.0","id":{rid},"result":{{"content":[]}}}}')
    assert tracker.answered([call], result, event_id)
    return call


def test_a_cancel_of_a_call_whose_result_went_out_is_a_span_of_its_own_from_the_send_to_the_cancel():
    tracker, exporter = _tracker()
    _answered(tracker, 3)
    assert exporter.get_finished_spans() == ()  # the healthy path: no span
    tracker.cancel(("s1", "3"))
    (late,) = exporter.get_finished_spans()
    assert late.name == "MCP call tools/call fetch"
    assert {k: late.attributes[k] for k in (sc.SPAN, sc.ROLE, sc.CALL_OUTCOME, sc.JSONRPC_REQUEST_ID, sc.MCP_SESSION_ID,
                                            sc.GEN_AI_TOOL_NAME, sc.TERMINAL_EVENT_ID, sc.ERA)} == {
        sc.SPAN: sc.SPAN_CALL, sc.ROLE: sc.ROLE_SERVER, sc.CALL_OUTCOME: sc.OUTCOME_CANCELLED_LATE,
        sc.JSONRPC_REQUEST_ID: "3", sc.MCP_SESSION_ID: "s1", sc.GEN_AI_TOOL_NAME: "fetch", sc.TERMINAL_EVENT_ID: "7",
        sc.ERA: sc.ERA_RESUMABLE}
    assert late.start_time is not None and late.end_time is not None and late.start_time <= late.end_time
    tracker.cancel(("s1", "3"))  # told once
    assert len(exporter.get_finished_spans()) == 1


def test_a_cancel_of_a_call_with_a_span_that_ended_on_its_result_is_told_too():
    tracker, exporter = _tracker()
    request = classify('{"jsonrpc":"2.0","id":4,"method":"tools/call","params":{"name":"fetch"}}')[0]
    call = tracker.start_call("s1", request, "2025-11-25", ABSENT, stateless=False)
    tracker.span_of(call)  # it deviated (a resume, say): it has a span
    stream = tracker.open_stream(sc.STREAM_KIND_POST, "s1", [call], {}, ABSENT, 200)
    assert stream is not None
    tracker.deliver(stream, classify('{"jsonrpc":"2.0","id":4,"result":{"content":[]}}')[0], "9")
    tracker.cancel(("s1", "4"))
    outcomes = [s.attributes[sc.CALL_OUTCOME] for s in exporter.get_finished_spans()
                if s.attributes[sc.SPAN] == sc.SPAN_CALL]
    assert outcomes == [sc.OUTCOME_RESULT, sc.OUTCOME_CANCELLED_LATE]


def test_no_span_for_a_cancel_of_a_call_never_seen_answered_without_an_event_id_or_on_the_client():
    tracker, exporter = _tracker()
    tracker.cancel(("s1", "3"))  # never seen
    _answered(tracker, 4, event_id=None)  # a JSON answer: its client is failed at once if it loses the connection
    tracker.cancel(("s1", "4"))
    _answered(tracker, 5, session=None)  # no session: nothing to resume
    tracker.cancel((None, "5"))
    client, client_exporter = _tracker(sc.ROLE_CLIENT)
    _answered(client, 6)
    client.cancel(("s1", "6"))
    assert exporter.get_finished_spans() == () and client_exporter.get_finished_spans() == ()


def test_the_server_remembers_its_newest_answered_calls_only():
    tracker, exporter = _tracker(max_calls=2)
    for rid in (1, 2, 3):
        _answered(tracker, rid)
    tracker.cancel(("s1", "1"))  # forgotten: the oldest
    tracker.cancel(("s1", "3"))
    (late,) = exporter.get_finished_spans()
    assert late.attributes[sc.JSONRPC_REQUEST_ID] == "3"


def test_what_the_server_remembers_of_an_answered_call_is_bounded_in_bytes_whatever_its_request_holds():
    """A hostile request's id or tool name can be megabytes: such an id is not remembered, such a name is not kept."""
    tracker, exporter = _tracker()
    long = "x" * (sc.MAX_CHARS + 1)
    request = classify(f'{{"jsonrpc":"2.0","id":"{long}","method":"tools/call","params":{{"name":"fetch"}}}}')[0]
    call = tracker.start_call("s1", request, "2025-11-25", ABSENT, stateless=False)
    assert tracker.answered([call], classify(f'{{"jsonrpc":"2.0","id":"{long}","result":{{}}}}'), "7")
    request = classify(f'{{"jsonrpc":"2.0","id":4,"method":"tools/call","params":{{"name":"{long}"}}}}')[0]
    call = tracker.start_call("s1", request, "2025-11-25", ABSENT, stateless=False)
    assert tracker.answered([call], classify('{"jsonrpc":"2.0","id":4,"result":{}}'), "8")
    tracker.cancel(("s1", long))
    tracker.cancel(("s1", "4"))
    (late,) = exporter.get_finished_spans()
    assert late.attributes[sc.JSONRPC_REQUEST_ID] == "4" and sc.GEN_AI_TOOL_NAME not in late.attributes
    assert late.name == "MCP call tools/call"


def test_a_cancel_of_a_call_whose_result_was_stored_with_no_stream_open_is_told_too():
    """Its POST dropped, its result was stored for a resume that did not come before its caller gave up."""
    tracker, exporter = _tracker()
    request = classify('{"jsonrpc":"2.0","id":5,"method":"tools/call","params":{"name":"fetch"}}')[0]
    call = tracker.start_call("s1", request, "2025-11-25", ABSENT, stateless=False)
    tracker.stored(call, "12", sc.OUTCOME_RESULT)
    tracker.cancel(("s1", "5"))
    stored, late = exporter.get_finished_spans()
    assert (stored.attributes[sc.CALL_OUTCOME], late.attributes[sc.CALL_OUTCOME]) == (sc.OUTCOME_RESULT,
                                                                                    sc.OUTCOME_CANCELLED_LATE)
    assert late.attributes[sc.TERMINAL_EVENT_ID] == "12"
    assert stored.end_time is not None and late.start_time is not None and late.end_time is not None
    assert stored.end_time <= late.start_time <= late.end_time  # from its store to the cancel


def test_a_cancel_of_a_call_in_flight_that_reuses_an_answered_calls_id_is_that_calls_cancel_only():
    tracker, exporter = _tracker()
    _answered(tracker, 3)
    request = classify('{"jsonrpc":"2.0","id":3,"method":"tools/call","params":{"name":"fetch"}}')[0]
    tracker.start_call("s1", request, "2025-11-25", ABSENT, stateless=False)  # MCP forbids it; a client may
    tracker.cancel(("s1", "3"))
    assert [s.attributes[sc.CALL_OUTCOME] for s in exporter.get_finished_spans()] == [sc.OUTCOME_CANCELLED]


def test_the_late_cancels_span_sits_in_the_calls_trace_under_the_sdks_request_span():
    tracker, exporter = _tracker()
    traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    request = classify('{"jsonrpc":"2.0","id":3,"method":"tools/call","params":{"name":"fetch",'
                       f'"_meta":{{"traceparent":"{traceparent}"}}}}}}')[0]
    call = tracker.start_call("s1", request, "2025-11-25", ABSENT, stateless=False)
    assert tracker.answered([call], classify('{"jsonrpc":"2.0","id":3,"result":{}}'), "7")
    tracker.cancel(("s1", "3"))
    (late,) = exporter.get_finished_spans()
    assert late.parent is not None
    assert (format(late.context.trace_id, "032x"), format(late.parent.span_id, "016x")) == (
        "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331")


def _sdk_call(tracker: Tracker, sessions: tuple[str, ...] = ("s1",)) -> Span:
    """The SDK's span of request 3, as the client's index of the SDK's spans sees it start, watched by ``tracker``;
    and that request's call, started in each of ``sessions`` (only the first names the span as its parent, and is
    bound to it, as the client binds the call it starts)."""
    index = SdkSpans()
    index.watch(tracker)
    app = TracerProvider()
    app.add_span_processor(index)
    sdk_span = app.get_tracer("mcp").start_span(f"{sc.SDK_CLIENT_CALL_SPAN} fetch",
                                                attributes={sc.JSONRPC_REQUEST_ID: "3"})
    context = sdk_span.get_span_context()
    traceparent = f"00-{context.trace_id:032x}-{context.span_id:016x}-01"
    for session in sessions:
        request = classify('{"jsonrpc":"2.0","id":3,"method":"tools/call","params":{"name":"fetch",'
                           f'"_meta":{{"traceparent":"{traceparent}"}}}}}}')[0]
        call = tracker.start_call(session, request, "2025-11-25", ABSENT, stateless=False)
        if session == sessions[0]:
            index.bind(sdk_span, tracker, call)
        traceparent = f"00-{context.trace_id:032x}-{1:016x}-01"  # another request's span
    return sdk_span


def test_a_client_call_whose_sdk_span_ends_in_its_timeout_ends_cancelled_even_with_no_cancel_sent():
    """A request with resumption hints: at its caller's timeout the SDK sends no cancel and resumes on for no
    caller. Its span ending with ``TimeoutError`` is the client's only sign of the give-up."""
    tracker, exporter = _tracker(sc.ROLE_CLIENT)
    sdk_span = _sdk_call(tracker, ("s1", "s2"))
    sdk_span.record_exception(TimeoutError())
    sdk_span.set_status(StatusCode.ERROR)
    sdk_span.end()
    (ended,) = exporter.get_finished_spans()  # only the call of the timed-out span: another session's stays
    assert (ended.attributes[sc.MCP_SESSION_ID], ended.attributes[sc.CALL_OUTCOME]) == ("s1", sc.OUTCOME_CANCELLED)
    assert tracker.call(("s2", "3")) is not None and tracker.call(("s1", "3")) is None


def test_a_client_call_the_sdk_failed_itself_ends_no_terminal_as_its_span_ends_in_that_error():
    """Its resumes ran out (``-32000``): the SDK sets the error on its span, and no answer came on the wire (the tap
    reads every answer before the SDK): nothing will deliver the call to anyone."""
    tracker, exporter = _tracker(sc.ROLE_CLIENT)
    sdk_span = _sdk_call(tracker)
    sdk_span.set_status(StatusCode.ERROR, "SSE stream ended and reconnection attempts were exhausted")
    sdk_span.end()
    (ended,) = exporter.get_finished_spans()
    assert ended.attributes[sc.CALL_OUTCOME] == sc.OUTCOME_NO_TERMINAL
    assert tracker.call(("s1", "3")) is None


def test_a_client_call_whose_sdk_span_ends_with_no_error_and_no_result_ends_cancelled():
    """The SDK failed every call of a client whose transport died with ``Connection closed``, which it leaves off the
    span, as OTel leaves a cancelled caller's ``CancelledError``: no caller waits for it any more (the in-flight
    count stayed up for good, and counted it stuck)."""
    tracker, exporter = _tracker(sc.ROLE_CLIENT)
    sdk_span = _sdk_call(tracker)
    sdk_span.end()
    (ended,) = exporter.get_finished_spans()
    assert ended.attributes[sc.CALL_OUTCOME] == sc.OUTCOME_CANCELLED


def test_a_client_call_answered_on_the_wire_is_left_as_it_ended_when_the_sdks_span_ends():
    tracker, exporter = _tracker(sc.ROLE_CLIENT)
    sdk_span = _sdk_call(tracker)
    call = tracker.call(("s1", "3"))
    assert call is not None
    assert tracker.answered([call], classify('{"jsonrpc":"2.0","id":3,"result":{}}'), "9")
    sdk_span.set_status(StatusCode.ERROR, "a JSON-RPC error")
    sdk_span.end()
    assert call.done and exporter.get_finished_spans() == ()  # the healthy path's: no span


def test_a_client_closed_ends_its_calls_in_flight_cancelled_whatever_its_sampler_kept():
    """Its HTTP client closed (the SDK's transport died: every call failed ``Connection closed``), nothing can deliver
    a call of it any more: told by the close itself, as the SDK's spans a sampler dropped cannot tell it."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    client = instrument_client(transport=httpx2.MockTransport(lambda request: httpx2.Response(202)),
                               tracer_provider=provider)
    tracker = client._transport.instrumentation.tracker  # type: ignore[attr-defined]
    request = classify('{"jsonrpc":"2.0","id":3,"method":"tools/call","params":{"name":"fetch"}}')[0]
    tracker.start_call("s1", request, "2025-11-25", ABSENT, stateless=False)
    asyncio.run(client.aclose())
    (ended,) = exporter.get_finished_spans()
    assert ended.attributes[sc.CALL_OUTCOME] == sc.OUTCOME_CANCELLED
