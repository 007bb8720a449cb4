"""The client's deferred answer: a single call's SSE answer on its POST opens no stream while it shows the
healthy path, and anything else is followed exactly as if it had been from the response's start.

Driven through the real ``httpx2`` client and the tap, over ``httpx2.MockTransport`` answering with the
chunks each case needs, read one chunk at a time."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence

import httpx2
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from mcp_stream_exporter import semconv as sc
from mcp_stream_exporter.hooks import ClientInstrumentation
from mcp_stream_exporter.hooks._tracking import Tracker
from mcp_stream_exporter.hooks.client import ClientTap

pytestmark = pytest.mark.anyio

_CALL = b'{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"fetch","arguments":{}}}'
_HEADERS = {"mcp-session-id": "s1", "mcp-protocol-version": "2025-06-18", "content-type": "application/json"}
PRIMING = b"id: e0\r\ndata: \r\nretry: 1000\r\n\r\n"


def _result(request_id: int, event_id: str) -> bytes:
    return f'id: {event_id}\r\ndata: {{"jsonrpc":"2.0","id":{request_id},"result":{{}}}}\r\n\r\n'.encode()


class _Chunks(httpx2.AsyncByteStream):
    """A response body that comes in exactly these chunks, then ends or breaks with ``error``."""

    def __init__(self, chunks: Sequence[bytes], error: Exception | None) -> None:
        self._chunks, self._error = chunks, error

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self._chunks:
            yield chunk
        if self._error is not None:
            raise self._error


async def _exchange(chunks: Sequence[bytes], *, error: Exception | None = None, after: int | None = None,
                    then: Callable[[Tracker], None] | None = None, content: str = "text/event-stream",
                    close: bool = True):
    """One tools/call POST answered with ``chunks`` (an SSE stream, or ``content``), read chunk by chunk;
    the tracker's call still pending after ``after`` chunks were read (or None), when ``then`` acts on
    the tracker, and the spans of ours. ``close``: the client closes after (which ends every call it has)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    instrumentation = ClientInstrumentation(tracer_provider=provider)

    def answer(request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(200, headers={"mcp-session-id": "s1", "content-type": content},
                               stream=_Chunks(chunks, error))

    pending_then = None
    http = httpx2.AsyncClient(transport=ClientTap(httpx2.MockTransport(answer), instrumentation))
    async with http.stream("POST", "http://mcp.test/mcp", content=_CALL, headers=_HEADERS) as response:
        read = 0
        try:
            async for _ in response.aiter_raw():
                read += 1
                if read == after:
                    pending_then = instrumentation.tracker.call(("s1", "1"))
                    if then is not None:
                        then(instrumentation.tracker)
        except httpx2.ReadError:
            pass
    if close:
        await http.aclose()
    return instrumentation, pending_then, exporter.get_finished_spans()


def _ours(spans, kind):
    return [s for s in spans if s.attributes.get(sc.SPAN) == kind]


@pytest.mark.parametrize("chunks", [[PRIMING, _result(1, "e1")], [PRIMING + _result(1, "e1")], [_result(1, "e1")]],
                         ids=["priming-then-result", "one-chunk", "result-alone"])
async def test_a_single_calls_sse_answer_ends_the_call_as_its_result_passes_and_leaves_no_span(chunks):
    instrumentation, pending, spans = await _exchange(chunks, after=len(chunks))
    assert pending is None  # ended with the chunk that carried its result, before the stream's end
    assert instrumentation.tracker.call(("s1", "1")) is None
    assert _ours(spans, sc.SPAN_STREAM) == _ours(spans, sc.SPAN_CALL) == []


async def test_a_deferred_answer_that_deviates_is_a_stream_span_with_every_frame_from_its_start():
    error = b'event: error\r\ndata: {"reason":"refused"}\r\n\r\n'
    _, _, spans = await _exchange([PRIMING, error])
    (stream,) = _ours(spans, sc.SPAN_STREAM)
    assert stream.attributes[sc.END_REASON] == sc.END_CLEAN
    assert stream.attributes[sc.PENDING_REQUEST_IDS] == ("1",)
    assert stream.attributes[sc.ERROR_FRAMES_COUNT] == 1
    assert stream.attributes[sc.EVENT_FIRST_ID] == "e0"  # the frame kept before it deviated
    assert [(e.name, e.attributes.get(sc.FRAME_KIND)) for e in stream.events] == [
        (sc.EVENT_FRAME, sc.FRAME_PRIMING), (sc.EVENT_ERROR_FRAME, sc.FRAME_ERROR_FRAME)]
    assert stream.events[0].timestamp <= stream.events[1].timestamp  # each when it was seen


async def test_a_deferred_answer_cut_after_its_priming_event_owes_its_call_to_a_resume_from_that_event():
    instrumentation, _, spans = await _exchange([PRIMING], error=httpx2.ReadError("cut"), close=False)
    (stream,) = _ours(spans, sc.SPAN_STREAM)
    assert stream.attributes[sc.END_REASON] == sc.END_DROPPED
    assert stream.attributes[sc.PENDING_REQUEST_IDS] == ("1",)
    assert stream.attributes[sc.EVENT_LAST_ID] == "e0"
    (call,) = instrumentation.tracker.calls_of_cursor("s1", "e0")
    assert call.key == ("s1", "1") and not call.done


_AFTER_THE_RESULT = PRIMING + _result(1, "e1") + _result(7, "e2")


@pytest.mark.parametrize("chunks", [
    [PRIMING, _result(1, "e1"), _result(7, "e2")],
    [PRIMING + PRIMING + _result(1, "e1"), _result(7, "e2")],
    [_AFTER_THE_RESULT],
    [PRIMING + _result(1, "e1")[:20], _result(1, "e1")[20:] + _result(7, "e2")],
    [PRIMING, PRIMING.replace(b"e0", b"e00"), _result(1, "e1") + _result(7, "e2")[:9], _result(7, "e2")[9:]],
], ids=["a-frame-a-chunk", "the-result-with-its-priming", "one-chunk", "split-in-the-result", "split-after-it"])
async def test_a_frame_after_the_result_opens_the_stream_and_the_call_stays_answered_on_the_healthy_path(chunks):
    _, _, spans = await _exchange(chunks)
    (stream,) = _ours(spans, sc.SPAN_STREAM)
    primings = [sc.FRAME_PRIMING] * b"".join(chunks).count(b"data: \r\n")
    # every frame from the stream's start, those held before it deviated too
    assert [e.attributes.get(sc.FRAME_KIND) for e in stream.events] == [*primings, sc.FRAME_RESPONSE, sc.FRAME_RESPONSE]
    assert stream.attributes[sc.TERMINAL_REQUEST_IDS] == ("1", "7")  # another call's result on this stream
    assert sc.PENDING_REQUEST_IDS not in stream.attributes
    assert _ours(spans, sc.SPAN_CALL) == []  # its own result came first, on its only stream


async def test_a_notification_before_the_result_is_followed_and_the_call_still_ends_healthy():
    progress = b'data: {"jsonrpc":"2.0","method":"notifications/progress","params":{"progress":1}}\r\n\r\n'
    _, pending, spans = await _exchange([PRIMING, progress, _result(1, "e1")], after=3)
    assert pending is None
    assert _ours(spans, sc.SPAN_STREAM) == _ours(spans, sc.SPAN_CALL) == []


@pytest.mark.parametrize(("chunks", "content"), [
    ([PRIMING, _result(1, "e1")], "text/event-stream"),
    ([b'{"jsonrpc":"2.0","id":1,', b'"result":{}}'], "application/json"),
], ids=["sse", "json"])
async def test_a_call_cancelled_while_its_answer_is_deferred_counts_the_post_that_carried_it(chunks, content):
    _, pending, spans = await _exchange(chunks, after=1, then=lambda tracker: tracker.cancel(("s1", "1")),
                                        content=content)
    assert pending is not None
    (call,) = _ours(spans, sc.SPAN_CALL)
    assert call.attributes[sc.CALL_OUTCOME] == sc.OUTCOME_CANCELLED
    assert call.attributes[sc.CALL_STREAMS] == 1  # its own POST, still deferred when the cancel came
