"""The call/stream tracker both hooks share: outcomes, pending lists, bounds."""

from __future__ import annotations

import asyncio
import gc
import itertools
import json
import time
import types

import pytest
from opentelemetry.context import Context
from opentelemetry.sdk.trace import SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from mcp_stream_exporter import semconv as sc
from mcp_stream_exporter.auth import ABSENT, TokenReader, ToolPolicy
from mcp_stream_exporter.detector import Detector, DetectorConfig
from mcp_stream_exporter.detector.embedded import span_of
from mcp_stream_exporter.exchange import CONTENT_SSE
from mcp_stream_exporter.hooks import _spans, _tracking
from mcp_stream_exporter.hooks._observer import _EXCHANGE, WireObserver, _Exchange
from mcp_stream_exporter.hooks._spans import DeviationTracer
from mcp_stream_exporter.hooks._tracking import Requirements, Tracker
from mcp_stream_exporter.scope import RequestScope
from mcp_stream_exporter.sse import SSEFrame, SSEParser, render
from mcp_stream_exporter.wire import TOOLS_CALL, classify, classify_body, request_message, result_id


def _tracker(role=sc.ROLE_CLIENT, **kw):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return Tracker(provider.get_tracer("t"), role, **kw), exporter


def _request(rid, tool="fetch"):
    return classify(f'{{"jsonrpc":"2.0","id":{rid},"method":"tools/call","params":{{"name":"{tool}"}}}}')[0]


def _response(rid):
    return classify(f'{{"jsonrpc":"2.0","id":{rid},"result":{{}}}}')


def _by(exporter, kind, *, moving=False):
    """The spans of ``kind``; with ``moving``, a resume's told as it first moved its calls on (``END_OPEN``) too."""
    return [s for s in exporter.get_finished_spans() if s.attributes[sc.SPAN] == kind
            and (moving or s.attributes.get(sc.END_REASON) != sc.END_OPEN)]


def test_a_stream_that_ends_before_the_terminal_event_lists_the_call_as_pending():
    tracker, exporter = _tracker()
    call = tracker.start_call("s", _request(1), "2025-11-25", ABSENT, stateless=False)
    stream = tracker.open_stream(sc.STREAM_KIND_POST, "s", [call], {}, ABSENT, 200)
    tracker.frame(stream, SSEFrame("", id="e1"), [])
    tracker.end_stream(stream, sc.END_CLEAN, 200)
    (span,) = _by(exporter, sc.SPAN_STREAM)
    assert span.attributes[sc.PENDING_REQUEST_IDS] == ("1",)
    assert span.attributes[sc.END_REASON] == sc.END_CLEAN
    assert _by(exporter, sc.SPAN_CALL) == []  # resumable: a resume may still deliver it
    assert tracker.calls_of_cursor("s", "e1") == (call,)
    resume = tracker.open_stream(sc.STREAM_KIND_RESUME, "s", tracker.calls_of_cursor("s", "e1"), {}, ABSENT, 200)
    tracker.frame(resume, SSEFrame('{"jsonrpc":"2.0","id":1,"result":{}}', id="e2"), _response(1))
    (call_span,) = _by(exporter, sc.SPAN_CALL)
    assert call_span.attributes[sc.TERMINAL_EVENT_ID] == "e2"
    assert call_span.attributes[sc.TERMINAL_STREAM_KIND] == sc.STREAM_KIND_RESUME
    assert call_span.attributes[sc.CALL_STREAMS] == 2
    assert tracker.calls_of_cursor("s", "e1") == ()


def _progress(token):
    return classify(f'{{"jsonrpc":"2.0","method":"notifications/progress","params":{{"progressToken":{token},'
                    f'"progress":1}}}}')


def test_a_resume_that_moves_its_call_on_says_so_at_once_in_a_span_ended_there_before_its_own_ends():
    """A tool that polls may run on a resume long after the clean end before it: the detector learns of the
    resume when it first moves the call on (``END_OPEN``), not only when it ends."""
    tracker, exporter = _tracker()
    call = tracker.start_call("s", _request(1), "2025-11-25", ABSENT, stateless=False)
    post = tracker.open_stream(sc.STREAM_KIND_POST, "s", [call], {}, ABSENT, 200)
    tracker.frame(post, SSEFrame("", id="e1"), [])
    tracker.end_stream(post, sc.END_CLEAN, 200)  # the server closed it: the client polls
    resume = tracker.open_stream(sc.STREAM_KIND_RESUME, "s", tracker.calls_of_cursor("s", "e1"), {}, ABSENT, 200)
    tracker.frame(resume, SSEFrame("", id="e2"), [])  # a priming event moves nothing
    assert [s.attributes[sc.END_REASON] for s in _by(exporter, sc.SPAN_STREAM, moving=True)] == [sc.END_CLEAN]
    for n in (3, 4):
        tracker.frame(resume, SSEFrame('{"jsonrpc":"2.0","method":"notifications/progress"}', id=f"e{n}"), _progress(1))
    _, moving = _by(exporter, sc.SPAN_STREAM, moving=True)
    assert (moving.attributes[sc.END_REASON], moving.attributes[sc.STREAM_KIND]) == (sc.END_OPEN, sc.STREAM_KIND_RESUME)
    assert (moving.attributes[sc.EVENT_LAST_ID], moving.attributes[sc.PENDING_REQUEST_IDS]) == ("e3", ("1",))
    assert moving.parent.span_id == resume.span.get_span_context().span_id  # told once, inside the resume's span
    later = time.time_ns() + 61 * 1_000_000_000  # and again, at most once a minute, while it moves the call on
    tracker.frame(resume, SSEFrame('{"jsonrpc":"2.0","method":"notifications/progress"}', id="e5"), _progress(1),
                  later)
    tracker.frame(resume, SSEFrame('{"jsonrpc":"2.0","method":"notifications/progress"}', id="e6"), _progress(1),
                  later + 1)
    tracker.frame(resume, SSEFrame('{"jsonrpc":"2.0","id":1,"result":{}}', id="e7"), _response(1))
    tracker.end_stream(resume, sc.END_CLEAN, 200)
    assert [s.attributes[sc.END_REASON] for s in _by(exporter, sc.SPAN_STREAM, moving=True)] == [
        sc.END_CLEAN, sc.END_OPEN, sc.END_OPEN, sc.END_CLEAN]


def _resumed(tracker, session="s", rid=1):
    """A call of ``session`` whose POST ended clean with it pending, and the resume that carries it now."""
    call = tracker.start_call(session, _request(rid), "2025-11-25", ABSENT, stateless=False)
    post = tracker.open_stream(sc.STREAM_KIND_POST, session, [call], {}, ABSENT, 200)
    tracker.frame(post, SSEFrame("", id=f"e{rid}"), [])
    tracker.end_stream(post, sc.END_CLEAN, 200)
    return tracker.open_stream(sc.STREAM_KIND_RESUME, session, tracker.calls_of_cursor(session, f"e{rid}"), {},
                               ABSENT, 200)


def _resume_end(exporter):
    (span,) = [s for s in _by(exporter, sc.SPAN_STREAM) if s.attributes[sc.STREAM_KIND] == sc.STREAM_KIND_RESUME]
    return span


@pytest.mark.parametrize("status", [200, 204])
def test_a_stream_that_ends_clean_while_its_sessions_delete_is_accepted_ended_with_the_session(status):
    """The SDK closes a session's streams as it accepts its DELETE, before it answers it: a call its client
    leaves behind as it exits is no silent loss. The span waits for the answer, and keeps when the stream ended."""
    tracker, exporter = _tracker()
    resume = _resumed(tracker)
    delete = tracker.deleting("s")
    before = time.time_ns()
    tracker.end_stream(resume, sc.END_CLEAN, 200)
    assert _by(exporter, sc.SPAN_STREAM)[1:] == []  # the POST's only: the resume's waits for the DELETE's answer
    tracker.deleted("s", delete, status)
    span = _resume_end(exporter)
    assert span.attributes[sc.END_REASON] == sc.END_TERMINATED
    assert span.attributes[sc.PENDING_REQUEST_IDS] == ("1",)
    assert before <= span.end_time <= time.time_ns()
    later = _resumed(tracker, rid=2)  # one that ends after the answer ended with the session too
    tracker.end_stream(later, sc.END_CLEAN, 200)
    assert _by(exporter, sc.SPAN_STREAM)[-1].attributes[sc.END_REASON] == sc.END_TERMINATED


@pytest.mark.parametrize("status", [403, 404, None])
def test_a_clean_end_during_a_refused_or_unanswered_delete_is_still_a_clean_end_with_its_call_pending(status):
    tracker, exporter = _tracker()
    resume = _resumed(tracker)
    first, second = tracker.deleting("s"), tracker.deleting("s")  # two at once: the stream waits for both
    tracker.end_stream(resume, sc.END_CLEAN, 200)
    tracker.deleted("s", first, status)
    assert _by(exporter, sc.SPAN_STREAM)[1:] == []
    tracker.deleted("s", second, 401)
    span = _resume_end(exporter)
    assert span.attributes[sc.END_REASON] == sc.END_CLEAN
    assert span.attributes[sc.PENDING_REQUEST_IDS] == ("1",)
    again = _resumed(tracker, rid=2)
    tracker.end_stream(again, sc.END_CLEAN, 200)
    assert _by(exporter, sc.SPAN_STREAM)[-1].attributes[sc.END_REASON] == sc.END_CLEAN


def test_a_delete_accepted_after_a_stream_ended_did_not_end_it_whoever_kept_another_delete_open():
    """Anyone may send a DELETE naming a session and never finish it: the client's own DELETE at exit, begun after
    its narrowed resume ended clean, made that loss ``terminated`` while the other kept the session's ends held."""
    tracker, exporter = _tracker()
    resume = _resumed(tracker)
    other = tracker.deleting("s")  # its body never comes
    tracker.end_stream(resume, sc.END_CLEAN, 200)  # the loss
    tracker.cancel(("s", "1"))  # its caller gives up meanwhile: the stream still left it pending as it ended
    own = tracker.deleting("s")
    tracker.deleted("s", own, 200)
    assert [s.attributes[sc.SPAN] for s in _by(exporter, sc.SPAN_STREAM)[1:]] == []  # waits on the one it ended in
    tracker.deleted("s", other, 404)
    span = _resume_end(exporter)
    assert (span.attributes[sc.END_REASON], span.attributes[sc.PENDING_REQUEST_IDS]) == (sc.END_CLEAN, ("1",))


def test_with_no_asyncio_loop_a_held_end_is_released_by_the_next_stream_that_ends(monkeypatch):
    """Under trio there is no asyncio loop to time a hold: a loss held for a DELETE never answered came out only at
    shutdown, which the hooks never reach on a server that runs."""
    tracker, exporter = _tracker()
    resume, other = _resumed(tracker), _resumed(tracker, session="t", rid=2)
    tracker.deleting("s")
    tracker.end_stream(resume, sc.END_CLEAN, 200)
    assert [s.attributes[sc.STREAM_KIND] for s in _by(exporter, sc.SPAN_STREAM)] == [sc.STREAM_KIND_POST] * 2
    monkeypatch.setattr(_tracking, "_DELETE_WAIT_S", 0.0)  # its wait is over
    tracker.end_stream(other, sc.END_CLEAN, 200)
    ends = [(s.attributes[sc.MCP_SESSION_ID], s.attributes[sc.END_REASON])
            for s in _by(exporter, sc.SPAN_STREAM) if s.attributes[sc.STREAM_KIND] == sc.STREAM_KIND_RESUME]
    assert ends == [("s", sc.END_CLEAN), ("t", sc.END_CLEAN)]


@pytest.mark.parametrize("rest", [{"type": "http.request", "body": b"c", "more_body": False},
                                  {"type": "http.disconnect"}])
def test_the_server_counts_a_delete_once_the_sdk_can_act_on_it_its_body_read_whole_or_its_client_gone(rest):
    """The SDK reads a DELETE's body whole before it ends the session (or acts on what it has when its client
    leaves): a stream that ends before then is not the DELETE's doing, one that ends after is."""
    tracker, exporter = _tracker()
    early, late = _resumed(tracker), _resumed(tracker, rid=2)
    observer = WireObserver(tracker, Requirements(100), ToolPolicy(), TokenReader(), "/mcp")
    messages = iter([{"type": "http.request", "body": b"ab", "more_body": True}, rest])

    async def receive():
        return next(messages)

    async def send(message):
        return None

    async def sdk(scope, receive, send):
        await receive()
        tracker.end_stream(early, sc.END_CLEAN, 200)  # the body not yet whole: the SDK has not acted
        await receive()
        tracker.end_stream(late, sc.END_CLEAN, 200)  # closed as the SDK ends the session
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    scope = {"type": "http", "path": "/mcp", "method": "DELETE", "headers": [(b"mcp-session-id", b"s")]}
    asyncio.run(observer.asgi(sdk)(scope, receive, send))
    ends = {s.attributes[sc.PENDING_REQUEST_IDS]: s.attributes[sc.END_REASON] for s in _by(exporter, sc.SPAN_STREAM)
            if s.attributes[sc.STREAM_KIND] == sc.STREAM_KIND_RESUME}
    assert ends == {("1",): sc.END_CLEAN, ("2",): sc.END_TERMINATED}


def test_a_redirected_delete_ends_no_session():
    """``DELETE /mcp/`` is Starlette's 307, from anyone: the SDK never saw it, the session lives on."""
    tracker, exporter = _tracker()
    tracker.deleted("s", tracker.deleting("s"), 307)
    resume = _resumed(tracker)
    tracker.end_stream(resume, sc.END_CLEAN, 200)
    assert _resume_end(exporter).attributes[sc.END_REASON] == sc.END_CLEAN


def test_a_delete_never_answered_holds_a_clean_end_back_only_a_moment(monkeypatch):
    """A DELETE whose body never comes is one the SDK is not running: the streams that end meanwhile are told as
    they ended, not held until its connection closes (a loss hidden for as long as anyone likes)."""
    monkeypatch.setattr(_tracking, "_DELETE_WAIT_S", 0.0)

    async def scenario():
        tracker, exporter = _tracker()
        resume = _resumed(tracker)
        delete = tracker.deleting("s")
        tracker.end_stream(resume, sc.END_CLEAN, 200)
        for _ in range(3):  # the release is the loop's next callback: no time passes
            await asyncio.sleep(0)
        span = _resume_end(exporter)
        tracker.deleted("s", delete, 200)  # answered after all: too late to change what was told
        return span

    span = asyncio.run(scenario())
    assert (span.attributes[sc.END_REASON], span.attributes[sc.PENDING_REQUEST_IDS]) == (sc.END_CLEAN, ("1",))


def test_a_clean_end_before_the_delete_or_in_another_session_is_a_clean_end_and_shutdown_ends_what_waits():
    """A loss the client walks away from (its resume ended clean, then it deletes the session) stays a loss."""
    tracker, exporter = _tracker()
    lost = _resumed(tracker)
    tracker.end_stream(lost, sc.END_CLEAN, 200)
    other = _resumed(tracker, session="t", rid=2)
    waiting = _resumed(tracker, session="u", rid=3)
    delete = tracker.deleting("s")
    tracker.deleting("u")
    tracker.end_stream(other, sc.END_CLEAN, 200)
    tracker.end_stream(waiting, sc.END_CLEAN, 200)
    tracker.deleted("s", delete, 200)
    tracker.shutdown()
    resumes = [s for s in _by(exporter, sc.SPAN_STREAM) if s.attributes[sc.STREAM_KIND] == sc.STREAM_KIND_RESUME]
    assert [(s.attributes[sc.PENDING_REQUEST_IDS], s.attributes[sc.END_REASON]) for s in resumes] == [
        (("1",), sc.END_CLEAN), (("2",), sc.END_CLEAN), (("3",), sc.END_CLEAN)]


def test_stateless_call_without_terminal_ends_as_no_terminal_with_its_stream():
    tracker, exporter = _tracker()
    call = tracker.start_call(None, _request(1), "2026-07-28", ABSENT, stateless=True)
    stream = tracker.open_stream(sc.STREAM_KIND_POST, None, [call], {}, ABSENT, 200)
    tracker.end_stream(stream, sc.END_DROPPED)
    (span,) = _by(exporter, sc.SPAN_CALL)
    assert span.attributes[sc.CALL_OUTCOME] == sc.OUTCOME_NO_TERMINAL
    assert tracker.call((None, "1")) is None


def test_a_stateless_calls_stream_broken_once_its_client_closed_was_closed_by_it_no_break_to_reissue():
    """The application closed its HTTP client with the call in flight: the read that fails then is its own close
    (the era's cancel), not a break its client should re-issue the call after (``not_reissued``)."""
    tracker, exporter = _tracker()
    call = tracker.start_call(None, _request(1), "2026-07-28", ABSENT, stateless=True)
    stream = tracker.open_stream(sc.STREAM_KIND_POST, None, [call], {}, ABSENT, 200)
    tracker.client_closed()
    tracker.end_stream(stream, sc.END_DROPPED)
    (span,) = _by(exporter, sc.SPAN_CALL)
    assert span.attributes[sc.CALL_OUTCOME] == sc.OUTCOME_CANCELLED
    assert _by(exporter, sc.SPAN_STREAM)[0].attributes[sc.END_REASON] == sc.END_CLOSED


def test_a_clients_call_whose_post_brought_no_event_id_ends_with_it_for_nothing_can_resume_it():
    """A server without an event store (or a stream cut before its first event): the client holds no cursor, and
    the SDK fails the call to its caller at once; the call is over, not pending until it is evicted."""
    tracker, exporter = _tracker()
    call = tracker.start_call("s", _request(1), "2025-11-25", ABSENT, stateless=False)
    stream = tracker.open_stream(sc.STREAM_KIND_POST, "s", [call], {}, ABSENT, 200)
    tracker.end_stream(stream, sc.END_DROPPED)
    (span,) = _by(exporter, sc.SPAN_CALL)
    assert span.attributes[sc.CALL_OUTCOME] == sc.OUTCOME_NO_TERMINAL
    assert tracker.call(("s", "1")) is None


def test_a_server_sending_another_calls_terminal_on_a_stream_delivers_that_call_there():
    tracker, exporter = _tracker(sc.ROLE_SERVER)
    mine = tracker.start_call("s", _request(1), None, ABSENT, stateless=False)
    other = tracker.start_call("s", _request(2), None, ABSENT, stateless=False)
    stream = tracker.open_stream(sc.STREAM_KIND_RESUME, "s", [mine], {}, ABSENT, 200)
    tracker.frame(stream, SSEFrame("x", id="e9"), _response(2))
    tracker.end_stream(stream, sc.END_CLEAN)
    (span,) = _by(exporter, sc.SPAN_STREAM)
    assert span.attributes[sc.STREAM_REQUEST_IDS] == ("1",)
    assert span.attributes[sc.TERMINAL_REQUEST_IDS] == ("2",)
    assert span.attributes[sc.PENDING_REQUEST_IDS] == ("1",)
    assert other.done and not mine.done


def test_another_calls_response_in_a_clients_sse_answers_the_streams_own_call_and_not_the_one_it_names():
    """The SDK client hands any response in the SSE of a stream it opened for one request to that request's caller,
    as its result (``foreign_result``: a wrong answer, not a timeout); a JSON answer goes by its id."""
    for kind in (sc.STREAM_KIND_RESUME, sc.STREAM_KIND_POST):
        tracker, exporter = _tracker()
        mine = tracker.start_call("s", _request(1), None, ABSENT, stateless=False)
        other = tracker.start_call("s", _request(2), None, ABSENT, stateless=False)
        stream = tracker.open_stream(kind, "s", [mine], {}, ABSENT, 200)
        tracker.frame(stream, SSEFrame("x", id="e9"), _response(2))
        tracker.end_stream(stream, sc.END_CLEAN)
        span = next(s for s in _by(exporter, sc.SPAN_STREAM) if s.attributes.get(sc.TERMINAL_REQUEST_IDS))
        assert span.attributes[sc.STREAM_REQUEST_IDS] == ("1",)
        assert span.attributes[sc.TERMINAL_REQUEST_IDS] == ("2",)
        assert sc.PENDING_REQUEST_IDS not in span.attributes
        assert mine.done and not other.done
        detector = Detector(DetectorConfig(), clock=itertools.repeat(span.end_time).__next__)
        detector.consume([span_of(s) for s in exporter.get_finished_spans()])
        assert [f.rule for f in detector.findings] == ["foreign_result"]
    tracker, _ = _tracker()
    mine = tracker.start_call("s", _request(1), None, ABSENT, stateless=False)
    other = tracker.start_call("s", _request(2), None, ABSENT, stateless=False)
    stream = tracker.open_stream(sc.STREAM_KIND_POST, "s", [mine], {}, ABSENT, 200)
    tracker.frame(stream, None, _response(2))
    assert other.done and not mine.done


def test_a_stream_flooded_with_other_calls_results_still_tells_the_detector_its_own_call_is_pending():
    tracker, exporter = _tracker(sc.ROLE_SERVER)
    call = tracker.start_call("s", _request(1), "2025-11-25", ABSENT, stateless=False)
    stream = tracker.open_stream(sc.STREAM_KIND_RESUME, "s", [call], {}, ABSENT, 200)
    for n in range(2, 2 + 3 * sc.MAX_ITEMS):
        tracker.frame(stream, SSEFrame("x", id=f"e{n}"), _response(n))
    tracker.end_stream(stream, sc.END_CLEAN)
    (span,) = _by(exporter, sc.SPAN_STREAM)
    assert span.attributes[sc.TERMINAL_REQUEST_IDS] == tuple(str(n) for n in range(2, 2 + sc.MAX_ITEMS))
    assert span.attributes[sc.PENDING_REQUEST_IDS] == ("1",)
    detector = Detector(DetectorConfig(), clock=lambda: span.end_time)
    outcome = detector.consume([span_of(span)])
    assert outcome.rejected_count == 0  # a list past the bound would have had the whole span refused
    assert [f.rule for f in detector.findings] == ["foreign_result"]


def test_a_result_delivered_twice_on_one_stream_is_listed_twice_for_duplicate_terminal():
    tracker, exporter = _tracker()
    call = tracker.start_call("s", _request(1), "2025-11-25", ABSENT, stateless=False)
    stream = tracker.open_stream(sc.STREAM_KIND_RESUME, "s", [call], {}, ABSENT, 200)
    tracker.frame(stream, SSEFrame("x", id="e1"), _response(1))
    tracker.frame(stream, SSEFrame("x", id="e2"), _response(1))
    tracker.end_stream(stream, sc.END_CLEAN)
    (span,) = _by(exporter, sc.SPAN_STREAM)
    assert span.attributes[sc.TERMINAL_REQUEST_IDS] == ("1", "1")
    detector = Detector(DetectorConfig(), clock=lambda: span.end_time)
    detector.consume([span_of(span)])
    assert [f.rule for f in detector.findings] == ["duplicate_terminal"]


@pytest.mark.parametrize(("tools", "named"), [(("search",), "search"), (("search", "search"), "search"),
                                              (("search", "fetch"), None), (("é" * 5,), None), (("t" * 129,), None)])
def test_a_stream_of_copies_of_healthy_path_results_names_their_one_tool_kept_short(tools, named):
    """Copies alone of results their POSTs delivered on the healthy path (no span) name the calls' tool when they are
    all of one; a name longer or other than MCP's tool names (128 ASCII characters) is kept by no answered call: a
    client's own, kept for each of 10,000 calls."""
    tracker, exporter = _tracker()
    for rid, tool in enumerate(tools):
        tracker.answered_healthy(("s", str(rid)), tool)
    copies = tracker.open_stream(sc.STREAM_KIND_GET, "s", [], {}, ABSENT, 200)
    for rid in range(len(tools)):
        tracker.frame(copies, SSEFrame("x", id=f"e{rid}"), _response(rid))
    tracker.end_stream(copies, sc.END_CLEAN)
    (span,) = _by(exporter, sc.SPAN_STREAM)
    assert span.attributes[sc.REPEATED_REQUEST_IDS] == tuple(str(rid) for rid in range(len(tools)))
    assert span.attributes.get(sc.GEN_AI_TOOL_NAME) == named


def test_a_streams_own_answered_calls_stay_listed_past_a_flood_of_other_results():
    tracker, exporter = _tracker()
    calls = [tracker.start_call("s", _request(n), None, ABSENT, stateless=False) for n in (1, 2)]
    stream = tracker.open_stream(sc.STREAM_KIND_POST, "s", calls, {}, ABSENT, 200)
    for n in range(10, 10 + sc.MAX_ITEMS):
        tracker.frame(stream, SSEFrame("x"), _response(n))
    for _ in range(3):  # past the bound, its own call's result is listed once
        tracker.frame(stream, SSEFrame("x"), _response(2))
    tracker.end_stream(stream, sc.END_CLEAN)
    (span,) = _by(exporter, sc.SPAN_STREAM)
    listed = span.attributes[sc.TERMINAL_REQUEST_IDS]
    assert len(listed) == sc.MAX_ITEMS and listed[0] == "2" and listed.count("2") == 1 and "10" in listed
    assert span.attributes[sc.PENDING_REQUEST_IDS] == ("1",)


def test_an_event_id_of_any_length_is_indexed_for_resumes_by_a_digest_past_the_bound():
    tracker, _ = _tracker()
    call = tracker.start_call("s", _request(1), None, ABSENT, stateless=False)
    stream = tracker.open_stream(sc.STREAM_KIND_POST, "s", [call], {}, ABSENT, 200)
    longest, long = "e" * sc.MAX_CHARS, "e" * 1_000_000
    tracker.frame(stream, SSEFrame("", id=longest), [])
    tracker.frame(stream, SSEFrame("", id=long), [])
    assert tracker.calls_of_cursor("s", longest) == tracker.calls_of_cursor("s", long) == (call,)
    assert tracker.calls_of_cursor("s", long[:-1]) == ()
    assert max(len(event_id) for _, event_id in tracker._event_index) <= sc.MAX_CHARS


def test_error_frames_are_recorded_and_do_not_complete_the_call():
    tracker, exporter = _tracker()
    call = tracker.start_call("s", _request(1), None, ABSENT, stateless=False)
    stream = tracker.open_stream(sc.STREAM_KIND_RESUME, "s", [call], {}, ABSENT, 200)
    tracker.frame(stream, SSEFrame('{"error":"insufficient_audience"}', event="error"), [])
    tracker.end_stream(stream, sc.END_CLEAN)
    (span,) = _by(exporter, sc.SPAN_STREAM)
    assert span.attributes[sc.ERROR_FRAMES_COUNT] == 1
    assert [e.name for e in span.events] == [sc.EVENT_ERROR_FRAME]
    assert not call.done


def test_a_long_stream_not_yet_a_span_keeps_only_the_frames_its_span_would_keep():
    limit = SpanLimits().max_events
    tracker, exporter = _tracker()
    call = tracker.start_call("s", _request(1), None, ABSENT, stateless=False)
    stream = tracker.open_stream(sc.STREAM_KIND_POST, "s", [call], {}, ABSENT, 200)
    progress = classify('{"jsonrpc":"2.0","method":"notifications/progress","params":{}}')
    for n in range(3 * limit):
        tracker.frame(stream, SSEFrame("", id=f"e{n}"), progress)
        assert len(stream._events or ()) <= limit  # bounded while the stream is followed, not only once a span
    tracker.end_stream(stream, sc.END_CLEAN, 200)
    (span,) = _by(exporter, sc.SPAN_STREAM)
    assert [e.attributes[sc.EVENT_ID] for e in span.events] == [f"e{n}" for n in range(2 * limit, 3 * limit)]
    assert span.attributes[sc.EVENTS_COUNT] == 3 * limit


def test_an_error_frame_that_quotes_a_credential_is_recorded_without_it():
    tracker, exporter = _tracker()
    call = tracker.start_call("s", _request(1), None, ABSENT, stateless=False)
    stream = tracker.open_stream(sc.STREAM_KIND_RESUME, "s", [call], {}, ABSENT, 200)
    jwt = "eyJhbGciOiJSUzI1NiJ9.eyJhdWQiOiJ4In0.c2lnbmF0dXJl"
    quoted = "x" * 2000 + f'{{"error":"invalid_token","authorization":"Bearer {jwt}"}}'
    tracker.frame(stream, SSEFrame(f"token {jwt} refused", event="error"), [])
    tracker.frame(stream, SSEFrame(quoted[:1000] + jwt + quoted[1000:], event="error"), [])  # across the cut
    tracker.end_stream(stream, sc.END_CLEAN)
    (span,) = _by(exporter, sc.SPAN_STREAM)
    recorded = [e.attributes[sc.ERROR_FRAME_DATA] for e in span.events if e.name == sc.EVENT_ERROR_FRAME]
    assert recorded[0] == "token [redacted] refused"
    assert len(recorded) == 2 and not any(jwt[:20] in r for r in recorded)


def test_cancel_and_eviction_end_pending_calls():
    tracker, exporter = _tracker(max_calls=2)
    for rid in (1, 2, 3):
        tracker.start_call("s", _request(rid), None, ABSENT, stateless=False)
    tracker.cancel(("s", "3"))
    outcomes = {s.attributes[sc.JSONRPC_REQUEST_ID]: s.attributes[sc.CALL_OUTCOME]
                for s in _by(exporter, sc.SPAN_CALL)}
    assert outcomes == {"1": sc.OUTCOME_EVICTED, "3": sc.OUTCOME_CANCELLED}
    tracker.shutdown()
    assert len(_by(exporter, sc.SPAN_CALL)) == 3


def test_a_post_that_delivers_its_calls_terminal_emits_no_span():
    tracker, exporter = _tracker()
    call = tracker.start_call("s", _request(1), None, ABSENT, stateless=False)
    stream = tracker.open_stream(sc.STREAM_KIND_POST, "s", [call], {}, ABSENT, 200)
    tracker.frame(stream, SSEFrame("", id="e1"), [])
    tracker.frame(stream, SSEFrame('{"jsonrpc":"2.0","id":1,"result":{}}', id="e2"), _response(1))
    tracker.end_stream(stream, sc.END_CLOSED, 200)
    assert exporter.get_finished_spans() == ()
    assert call.done


def test_a_result_stored_with_no_stream_open_ends_the_call_span_then_and_a_resume_still_carries_the_call():
    tracker, exporter = _tracker()
    call = tracker.start_call("s", _request(1), None, ABSENT, stateless=False)
    post = tracker.open_stream(sc.STREAM_KIND_POST, "s", [call], {}, ABSENT, 200)
    tracker.frame(post, SSEFrame("", id="e1"), [])
    tracker.end_stream(post, sc.END_DROPPED)
    tracker.stored(call, "e2", sc.OUTCOME_RESULT)  # nothing open carries it
    (span,) = _by(exporter, sc.SPAN_CALL)
    assert (span.attributes[sc.CALL_OUTCOME], span.attributes[sc.TERMINAL_EVENT_ID]) == (sc.OUTCOME_RESULT, "e2")
    assert sc.TERMINAL_STREAM_KIND not in span.attributes
    resume = tracker.open_stream(sc.STREAM_KIND_RESUME, "s", tracker.calls_of_cursor("s", "e1"), {}, ABSENT, 200)
    tracker.frame(resume, SSEFrame('{"jsonrpc":"2.0","id":1,"result":{}}', id="e2"), _response(1))
    tracker.end_stream(resume, sc.END_CLEAN)
    assert call.done and len(_by(exporter, sc.SPAN_CALL)) == 1  # its span is not touched again
    (resumed,) = [s for s in _by(exporter, sc.SPAN_STREAM) if s.attributes.get(sc.TERMINAL_REQUEST_IDS)]
    assert resumed.attributes[sc.TERMINAL_REQUEST_IDS] == ("1",)


def test_a_result_stored_while_a_stream_is_open_that_ends_without_it_ends_the_call_span_as_of_its_store():
    tracker, exporter = _tracker(sc.ROLE_SERVER)
    call = tracker.start_call("s", _request(1), None, ABSENT, stateless=False)
    post = tracker.open_stream(sc.STREAM_KIND_POST, "s", [call], {}, ABSENT, 200)
    tracker.frame(post, SSEFrame("", id="e1"), [])
    tracker.stored(call, "e2", sc.OUTCOME_RESULT, at_ns=1_000)  # its POST is open: the POST may carry it
    assert _by(exporter, sc.SPAN_CALL) == []
    ended = time.time_ns()
    tracker.end_stream(post, sc.END_DROPPED)  # it did not: the client must resume for it
    (span,) = _by(exporter, sc.SPAN_CALL)
    assert (span.attributes[sc.CALL_OUTCOME], span.attributes[sc.TERMINAL_EVENT_ID]) == (sc.OUTCOME_RESULT, "e2")
    assert sc.TERMINAL_STREAM_KIND not in span.attributes and span.end_time == 1_000
    tracker.cancel(("s", "1"))  # as its client left: out of the server's hands since the stream's end, not the store
    (late,) = [s for s in _by(exporter, sc.SPAN_CALL) if s.attributes[sc.CALL_OUTCOME] == sc.OUTCOME_CANCELLED_LATE]
    assert late.start_time >= ended


def _resume_replaying():
    """A server's call whose POST ended (a tool that polls), resumed, the resume's replay under way."""
    tracker, exporter = _tracker(sc.ROLE_SERVER)
    call = tracker.start_call("s", _request(1), None, ABSENT, stateless=False)
    post = tracker.open_stream(sc.STREAM_KIND_POST, "s", [call], {}, ABSENT, 200)
    tracker.frame(post, SSEFrame("", id="e1"), [])
    tracker.end_stream(post, sc.END_CLEAN)
    resume = tracker.open_stream(sc.STREAM_KIND_RESUME, "s", tracker.calls_of_cursor("s", "e1"), {}, ABSENT, 200)
    call.replaying += 1
    return tracker, exporter, call, resume


def test_a_result_stored_while_a_resume_of_its_stream_replays_and_unsent_when_the_replay_returns_is_unsent():
    """The SDK takes a resume for the call's stream only once its replay returns, and drops what the call stores
    meanwhile: the resume stays open without it. (A store that sends the live tail itself, the guard's, sends it
    before its replay returns.)"""
    tracker, exporter, call, resume = _resume_replaying()
    tracker.stored(call, "e2", sc.OUTCOME_RESULT, at_ns=1_000)
    assert _by(exporter, sc.SPAN_CALL) == []  # the store's replay may send it yet
    tracker.replayed(call, ())
    (stored,) = _by(exporter, sc.SPAN_CALL)
    assert stored.attributes[sc.CALL_OUTCOME] == sc.OUTCOME_RESULT and sc.TERMINAL_STREAM_KIND not in stored.attributes
    assert stored.end_time == 1_000
    tracker.cancel(("s", "1"))  # at its caller's timeout, long after: a late cancel
    (late,) = [s for s in _by(exporter, sc.SPAN_CALL) if s.attributes[sc.CALL_OUTCOME] == sc.OUTCOME_CANCELLED_LATE]
    assert late.attributes[sc.TERMINAL_EVENT_ID] == "e2" and late.start_time == 1_000
    tracker.end_stream(resume, sc.END_DROPPED)


def test_a_result_a_resume_carries_before_its_replay_returns_ends_the_call_on_that_resume():
    tracker, exporter, call, resume = _resume_replaying()
    tracker.stored(call, "e2", sc.OUTCOME_RESULT)
    tracker.replayed(call, ("e2",))  # the store sent it in its live tail (the guard's), yet to pass the wire
    tracker.frame(resume, SSEFrame('{"jsonrpc":"2.0","id":1,"result":{}}', id="e2"), _response(1))
    tracker.end_stream(resume, sc.END_CLEAN)
    (span,) = _by(exporter, sc.SPAN_CALL)
    assert span.attributes[sc.TERMINAL_STREAM_KIND] == sc.STREAM_KIND_RESUME


def test_a_result_queued_on_a_stream_open_for_it_is_no_late_cancel_when_its_client_cancels_first():
    """Stored behind earlier messages on a slow stream, the result is not out yet: a cancel then is a caller that
    gave up before it came."""
    tracker, exporter = _tracker(sc.ROLE_SERVER)
    call = tracker.start_call("s", _request(1), None, ABSENT, stateless=False)
    post = tracker.open_stream(sc.STREAM_KIND_POST, "s", [call], {}, ABSENT, 200)
    tracker.frame(post, SSEFrame("", id="e1"), [])
    tracker.stored(call, "e2", sc.OUTCOME_RESULT, at_ns=time.time_ns() - 5 * 10**9)
    tracker.cancel(("s", "1"))
    tracker.end_stream(post, sc.END_DROPPED)
    (span,) = _by(exporter, sc.SPAN_CALL)
    assert span.attributes[sc.CALL_OUTCOME] == sc.OUTCOME_CANCELLED


def test_a_server_stream_that_ends_before_its_calls_tool_answered_says_so_where_the_server_sees_its_stores():
    def ended(sees_stores: bool, stateless: bool = False, stored: bool = False):
        tracker, exporter = _tracker(sc.ROLE_SERVER)
        tracker.sees_stores = sees_stores
        call = tracker.start_call("s", _request(1), None, ABSENT, stateless=stateless)
        stream = tracker.open_stream(sc.STREAM_KIND_RESUME, "s", [call], {}, ABSENT, 200)
        if stored:
            tracker.stored(call, "e9", sc.OUTCOME_RESULT)
        tracker.end_stream(stream, sc.END_CLEAN)
        (span,) = _by(exporter, sc.SPAN_STREAM)
        return span.attributes.get(sc.RUNNING_REQUEST_IDS)

    assert ended(True) == ("1",)
    assert ended(True, stored=True) is None  # its result exists: this end may have lost it
    assert ended(False) is None  # no store seen: nothing says whether it answered
    assert ended(True, stateless=True) is None  # never stored: its stream's end without it is its end


def test_a_stateless_reissue_with_the_same_fingerprint_gets_a_span_and_another_call_does_not():
    tracker, exporter = _tracker()
    computed: list[str] = []

    def identify(fingerprint: str):
        def compute(tool: str | None, arguments: object) -> str:
            assert (tool, arguments) == ("fetch", None)  # what the request named
            computed.append(fingerprint)
            return fingerprint
        return compute

    healthy = tracker.start_call(None, _request(1), "2026-07-28", ABSENT, stateless=True, identify=identify("a"))
    assert computed == []  # nothing broke: no fingerprint is computed on the healthy path
    tracker.end_stream(tracker.open_stream(sc.STREAM_KIND_POST, None, [healthy], {}, ABSENT, 200), sc.END_DROPPED)
    other = tracker.start_call(None, _request(2), "2026-07-28", ABSENT, stateless=True, identify=identify("b"))
    reissue = tracker.start_call(None, _request(3), "2026-07-28", ABSENT, stateless=True, identify=identify("a"))
    broken, marker = _by(exporter, sc.SPAN_CALL)
    assert broken.attributes[sc.CALL_ARGUMENTS_HASH] == "a"
    assert other.span is None  # same tool, other arguments: not the re-issue, still on the healthy path
    assert reissue.span is not None  # the re-issue: a span of ours, whatever becomes of it
    # and, at once, a span of its start: the detector learns of the re-issue before the call ends
    assert marker.attributes[sc.CALL_OUTCOME] == sc.OUTCOME_REISSUED
    assert marker.attributes[sc.CALL_ARGUMENTS_HASH] == "a" and marker.attributes[sc.JSONRPC_REQUEST_ID] == "3"
    # in the broken call's trace, linked to the re-issue's own span: a Collector sampling by trace keeps the break and
    # the word of its re-issue together, or neither
    assert (marker.context.trace_id, marker.parent.span_id) == (broken.context.trace_id, broken.context.span_id)
    (link,) = marker.links
    assert link.context.span_id == reissue.span.get_span_context().span_id
    assert link.attributes == {sc.LINK_TYPE: sc.LINK_REISSUE}
    assert computed == ["a", "b", "a"]


def test_each_reissue_is_told_in_the_trace_of_the_oldest_broken_call_alike_whose_span_is_kept(monkeypatch):
    monkeypatch.setattr(_tracking, "_MAX_ALIKE_SPANS", 1)
    tracker, exporter = _tracker(broken=_tracking.BrokenCalls())
    alike = [tracker.start_call(None, _request(rid), "2026-07-28", ABSENT, stateless=True, identify=lambda t, a: "a")
             for rid in (1, 2)]
    for call in alike:  # two calls alike under way broke; the first one's span context is not kept
        tracker.end_stream(tracker.open_stream(sc.STREAM_KIND_POST, None, [call], {}, ABSENT, 200), sc.END_DROPPED)
    first, second = (tracker.start_call(None, _request(rid), "2026-07-28", ABSENT, stateless=True,
                                        identify=lambda t, a: "a") for rid in (3, 4))
    assert first.span is not None and second.span is not None  # each a re-issue
    spans = _by(exporter, sc.SPAN_CALL)
    broken = {s.attributes[sc.JSONRPC_REQUEST_ID]: s for s in spans if s.attributes[sc.CALL_OUTCOME] != "reissued"}
    told = {s.attributes[sc.JSONRPC_REQUEST_ID]: s for s in spans if s.attributes[sc.CALL_OUTCOME] == "reissued"}
    assert told["3"].parent.span_id == first.span.get_span_context().span_id  # its own: the oldest's context is gone
    assert told["4"].context.trace_id == broken["2"].context.trace_id
    assert not tracker.reissues_possible()


def test_a_re_issue_whose_broken_calls_print_was_dropped_past_the_bound_is_still_told(monkeypatch):
    """More distinct broken calls than the bound: the oldest prints go, and for a while every stateless call is told
    as a possible re-issue, so the detector sees the one sent again rather than paging its call ``not_reissued``."""
    monkeypatch.setattr(_tracking, "_MAX_BROKEN", 2)
    tracker, exporter = _tracker()

    def fingerprinted(print_: str):
        return lambda tool, arguments: print_

    broken = [tracker.start_call(None, _request(n), "2026-07-28", ABSENT, stateless=True,
                                 identify=fingerprinted(f"p{n}")) for n in (1, 2, 3)]
    tracker.end_stream(tracker.open_stream(sc.STREAM_KIND_POST, None, broken, {}, ABSENT, 200), sc.END_DROPPED)
    assert "p1" not in tracker._broken and tracker.reissues_possible()
    again = tracker.start_call(None, _request(4), "2026-07-28", ABSENT, stateless=True, identify=fingerprinted("p1"))
    assert again.span is not None
    markers = [s for s in _by(exporter, sc.SPAN_CALL) if s.attributes[sc.CALL_OUTCOME] == sc.OUTCOME_REISSUED]
    assert [m.attributes[sc.CALL_ARGUMENTS_HASH] for m in markers] == ["p1"]
    tracker._broken.clear()  # the watch ends with it
    assert not tracker.reissues_possible()


def test_each_of_several_broken_calls_alike_has_its_re_issue_told_and_one_more_call_alike_is_no_re_issue():
    """Two calls with the same arguments broken by one cut, each sent again by its caller: the detector matches a
    re-issue to one broken call, so each re-issue must say so, and a third call alike is a call of its own."""
    tracker, exporter = _tracker()
    broken = [tracker.start_call(None, _request(n), "2026-07-28", ABSENT, stateless=True,
                                 identify=lambda tool, arguments: "a") for n in (1, 2)]
    tracker.end_stream(tracker.open_stream(sc.STREAM_KIND_POST, None, broken, {}, ABSENT, 200), sc.END_DROPPED)
    again = [tracker.start_call(None, _request(n), "2026-07-28", ABSENT, stateless=True,
                                identify=lambda tool, arguments: "a") for n in (3, 4, 5)]
    assert [call.span is not None for call in again] == [True, True, False]
    markers = [s for s in _by(exporter, sc.SPAN_CALL) if s.attributes[sc.CALL_OUTCOME] == sc.OUTCOME_REISSUED]
    assert [m.attributes[sc.JSONRPC_REQUEST_ID] for m in markers] == ["3", "4"]


def _request_with_traceparent(rid, traceparent):
    meta = json.dumps({"traceparent": traceparent})
    body = f'{{"jsonrpc":"2.0","id":{rid},"method":"tools/call","params":{{"name":"fetch","_meta":{meta}}}}}'
    return classify(body)[0]


@pytest.mark.parametrize("traceparent", [
    "x" * 55, "-" * 60, "00-" + "g" * 32 + "-" + "0" * 16 + "-01", "00-0x" + "1" * 30 + "-00f067aa0ba902b7-01",
    "00-4bf92f3577b34da6a3ce929d0e0e4736-00f0_7aa0ba902b7-01",
    "00-4BF92F3577B34DA6A3CE929D0E0E4736-00F067AA0BA902B7-01",
    "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0\u0661", "ab-cd", ""])
def test_a_junk_traceparent_from_the_client_still_lets_the_calls_deviation_spans_out(traceparent):
    tracker, exporter = _tracker()
    call = tracker.start_call("s", _request_with_traceparent(1, traceparent), "2025-11-25", ABSENT, stateless=False)
    stream = tracker.open_stream(sc.STREAM_KIND_POST, "s", [call], {}, ABSENT, 200)
    tracker.end_stream(stream, sc.END_DROPPED, 200)
    tracker.cancel(("s", "1"))
    (span,) = _by(exporter, sc.SPAN_CALL)
    assert span.parent is None, "junk is no parent"
    assert _by(exporter, sc.SPAN_STREAM)


def test_a_well_formed_traceparent_makes_the_sdks_request_span_the_calls_parent():
    tracker, exporter = _tracker()
    tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    call = tracker.start_call("s", _request_with_traceparent(1, tp), "2025-11-25", ABSENT, stateless=False)
    stream = tracker.open_stream(sc.STREAM_KIND_POST, "s", [call], {}, ABSENT, 200)
    tracker.end_stream(stream, sc.END_DROPPED, 200)
    tracker.cancel(("s", "1"))
    (span,) = _by(exporter, sc.SPAN_CALL)
    assert span.parent is not None and format(span.parent.span_id, "016x") == "00f067aa0ba902b7"


def test_a_failed_stream_has_an_error_status_and_type_and_a_clean_end_has_neither():
    from opentelemetry.trace import StatusCode

    tracker, exporter = _tracker()
    for rid, reason, status in ((1, sc.END_DROPPED, 200), (2, sc.END_HTTP_ERROR, 503), (3, sc.END_CLEAN, 200)):
        call = tracker.start_call("s", _request(rid), "2025-11-25", ABSENT, stateless=False)
        tracker.end_stream(tracker.open_stream(sc.STREAM_KIND_POST, "s", [call], {}, ABSENT, status), reason, status)
    dropped, refused, clean = _by(exporter, sc.SPAN_STREAM)
    assert (dropped.status.status_code, dropped.attributes[sc.ERROR_TYPE]) == (StatusCode.ERROR, "dropped")
    assert (refused.status.status_code, refused.attributes[sc.ERROR_TYPE]) == (StatusCode.ERROR, "503")
    assert clean.status.status_code == StatusCode.UNSET and sc.ERROR_TYPE not in clean.attributes
    assert {s.attributes[sc.NETWORK_TRANSPORT] for s in (dropped, refused, clean)} == {"tcp"}


def test_a_json_answer_that_is_its_one_calls_result_ends_the_call_with_no_stream_and_no_span():
    tracker, exporter = _tracker()
    call = tracker.start_call("s", _request(1), "2025-11-25", ABSENT, stateless=False)
    assert tracker.answered([call], _response(1))
    assert call.done and tracker.call(("s", "1")) is None
    assert exporter.get_finished_spans() == ()


@pytest.mark.parametrize(("body", "stream_span"), [
    ('{"jsonrpc":"2.0","id":2,"result":{}}', True),  # another call's result: the call is owed
    ('{"jsonrpc":"2.0","id":1,"error":{"code":-32003,"message":"refused"}}', False),  # an error answers it
    ('{"jsonrpc":"2.0","method":"notifications/message","params":{}}', True),  # no terminal at all
    ('[{"jsonrpc":"2.0","id":1,"result":{}},{"jsonrpc":"2.0","id":2,"result":{}}]', True),  # and another's
    ("not json", True),
])
def test_a_json_answer_that_is_anything_else_leaves_the_call_to_its_stream_followed_in_full(body, stream_span):
    """``answered`` declines and changes nothing: the hooks then open the stream and read the body on it,
    as if it had been followed from the start, and a stream that owes the call, or carried another's
    result, says so."""
    tracker, exporter = _tracker()
    call = tracker.start_call(None, _request(1), "2026-07-28", ABSENT, stateless=True)
    messages = classify(body)
    assert not tracker.answered([call], messages)
    assert not call.done and exporter.get_finished_spans() == ()
    stream = tracker.open_stream(sc.STREAM_KIND_POST, None, [call], {}, ABSENT, 200)
    tracker.frame(stream, None, messages)
    tracker.end_stream(stream, sc.END_CLEAN, 200)
    assert len(_by(exporter, sc.SPAN_STREAM)) == stream_span
    if stream_span and not body.startswith("["):
        assert _by(exporter, sc.SPAN_STREAM)[0].attributes[sc.PENDING_REQUEST_IDS] == ("1",)
        (call_span,) = _by(exporter, sc.SPAN_CALL)
        assert call_span.attributes[sc.CALL_OUTCOME] == sc.OUTCOME_NO_TERMINAL
    else:
        assert call.done and _by(exporter, sc.SPAN_CALL) == []


def test_a_json_answer_to_a_call_that_already_deviated_is_followed_on_its_stream():
    """A call with a span of its own (here: made at call time) records its stream count and terminal stream
    on that span: its answer is never taken off the stream."""
    tracker, _ = _tracker()
    call = tracker.start_call(None, _request(1), "2026-07-28", ABSENT, stateless=True)
    tracker.span_of(call)
    assert not tracker.answered([call], _response(1))
    assert not tracker.answered([call, tracker.start_call(None, _request(2), None, ABSENT, stateless=True)],
                                _response(1))
    assert not call.done


_TOOL_ERROR_BODY = b'{"jsonrpc":"2.0","id":1,"result":{"content":[],"isError":true}}'


def test_a_json_answer_known_by_its_head_ends_a_healthy_call_and_a_deviated_one_still_records_its_tool_error():
    """``answered_by`` never needs a result's ``isError`` (a search of the whole body): it ends only a call
    whose end records no outcome, and declines the rest, whose stream is then read in full and records the
    outcome the body says on the call's span."""
    tracker, exporter = _tracker()
    healthy = tracker.start_call(None, _request(1), "2026-07-28", ABSENT, stateless=True)
    assert tracker.answered_by([healthy], result_id(_TOOL_ERROR_BODY))
    assert healthy.done and exporter.get_finished_spans() == ()

    deviated = tracker.start_call(None, _request(1), "2026-07-28", ABSENT, stateless=True)
    tracker.span_of(deviated)  # e.g. an audience gap at call time
    other = tracker.start_call(None, _request(2), "2026-07-28", ABSENT, stateless=True)
    head = result_id(_TOOL_ERROR_BODY)
    assert not tracker.answered_by([deviated], head) and not tracker.answered_by([other], head)
    assert not tracker.answered_by([deviated, other], head) and not (deviated.done or other.done)
    messages = classify_body(_TOOL_ERROR_BODY)  # what the hooks then read, on the stream they open
    assert not tracker.answered([deviated], messages)
    stream = tracker.open_stream(sc.STREAM_KIND_POST, None, [deviated], {}, ABSENT, 200)
    tracker.frame(stream, None, messages)
    tracker.end_stream(stream, sc.END_CLEAN, 200)
    (call_span,) = _by(exporter, sc.SPAN_CALL)
    assert call_span.attributes[sc.CALL_OUTCOME] == sc.OUTCOME_TOOL_ERROR


def _sse(event_id, data="", event=None):
    return render(SSEFrame(data, event, event_id))


_PROGRESS = '{"jsonrpc":"2.0","method":"notifications/progress","params":{"progress":1}}'
_RESULT = '{"jsonrpc":"2.0","id":1,"result":{}}'


def _exchange(tracker):
    """A POST of session ``s`` as the server's observer sees it."""
    observer = WireObserver(tracker, Requirements(100), ToolPolicy(), TokenReader(), "/mcp")
    return _Exchange(observer, "POST", 0, None, RequestScope("s"), "2025-11-25")


def _held_exchange(tracker, call, chunks):
    """A POST's SSE stream as the server's observer holds it, not opened as a stream: its chunks, each
    with when it was sent."""
    ex = _exchange(tracker)
    ex.held, ex.deferred, ex.status = list(chunks), CONTENT_SSE, 200
    ex.calls.append(call)
    tracker.hold(ex, ex.calls, "s", resumable=True)
    return ex


def _held_post(tracker, call, chunks):
    """A held POST, its stream opened."""
    ex = _held_exchange(tracker, call, chunks)
    return ex.held_stream(), ex


def test_a_held_stream_that_shows_the_healthy_path_ends_its_call_and_builds_nothing_else():
    tracker, exporter = _tracker()
    call = tracker.start_call("s", _request(1), "2025-11-25", ABSENT, stateless=False)
    stream, _ = _held_post(tracker, call, [(_sse("e1"), 10), (_sse("e2", _RESULT), 20)])
    tracker.end_stream(stream, sc.END_CLEAN, 200)
    assert call.done and stream.ended and call.open_streams == 0
    assert exporter.get_finished_spans() == ()
    assert (stream.events, stream.first_event_id, stream.terminal_ids) == (0, None, ())  # only a span needs them


@pytest.mark.parametrize("reason", [sc.END_CLEAN, sc.END_DROPPED])
def test_a_held_stream_that_deviates_is_read_as_if_followed_with_the_times_its_chunks_were_sent(reason):
    chunks = [(_sse("e1"), 10), (_sse("e2", _PROGRESS)[:9], 20), (_sse("e2", _PROGRESS)[9:], 30)]
    tracker, exporter = _tracker()
    call = tracker.start_call("s", _request(1), "2025-11-25", ABSENT, stateless=False)
    stream, ex = _held_post(tracker, call, chunks)
    tracker.end_stream(stream, reason, 200)
    followed_tracker, followed_exporter = _tracker()
    followed_call = followed_tracker.start_call("s", _request(1), "2025-11-25", ABSENT, stateless=False)
    followed = followed_tracker.open_stream(sc.STREAM_KIND_POST, "s", [followed_call],
                                            ("POST", CONTENT_SSE, "2025-11-25", None), ABSENT, 200)
    parser = SSEParser()
    for chunk, _ in chunks:
        for frame in parser.feed(chunk):
            followed_tracker.frame(followed, frame, classify(frame.data) if frame.data else ())
    followed_tracker.end_stream(followed, reason, 200)
    (held_span,), (followed_span,) = _by(exporter, sc.SPAN_STREAM), _by(followed_exporter, sc.SPAN_STREAM)
    assert held_span.attributes == followed_span.attributes
    assert held_span.attributes[sc.PENDING_REQUEST_IDS] == ("1",)
    assert [(e.name, e.attributes) for e in held_span.events] == [(e.name, e.attributes) for e in followed_span.events]
    assert [e.timestamp for e in held_span.events] == [10, 30]  # the chunk each frame was completed in
    assert ex.held is None


def test_a_resume_from_an_event_of_a_stream_still_held_reads_it_first_and_continues_its_call():
    tracker, _ = _tracker()
    call = tracker.start_call("s", _request(1), "2025-11-25", ABSENT, stateless=False)
    stream, ex = _held_post(tracker, call, [(_sse("e1"), 10)])
    assert tracker.calls_of_cursor("s", "e1") == (call,)
    assert ex.held is None and stream.holder is None and stream.first_event_id == "e1"  # followed from now on
    assert tracker.calls_of_cursor("other-session", "e1") == ()


def test_a_held_post_not_yet_a_stream_is_opened_and_read_when_a_resume_needs_one_of_its_events():
    tracker, _ = _tracker()
    call = tracker.start_call("s", _request(1), "2025-11-25", ABSENT, stateless=False)
    ex = _held_exchange(tracker, call, [(_sse("e1"), 10)])
    assert ex.stream is None and (call.streams, call.open_streams) == (1, 1)  # it carries the call already
    assert tracker.calls_of_cursor("s", "e1") == (call,)
    assert ex.held is None and ex.stream is not None and ex.stream.first_event_id == "e1"
    assert (call.streams, call.held_on) == (1, None)  # counted once, held no more


@pytest.mark.parametrize("answered", [False, True])
def test_a_cancel_while_a_post_is_held_unopened_reads_it_first(answered):
    tracker, exporter = _tracker()
    call = tracker.start_call("s", _request(1), "2025-11-25", ABSENT, stateless=False)
    chunks = [(_sse("e1"), 10)] + ([(_sse("e2", _RESULT), 20)] if answered else [])
    _held_exchange(tracker, call, chunks)
    tracker.cancel(("s", "1"))
    if answered:  # its result was sent before the cancel came: answered, no span
        assert call.done and exporter.get_finished_spans() == ()
    else:
        (span,) = _by(exporter, sc.SPAN_CALL)
        assert span.attributes[sc.CALL_OUTCOME] == sc.OUTCOME_CANCELLED
        assert span.attributes[sc.CALL_STREAMS] == 1


def test_a_cancel_or_eviction_after_the_result_was_held_leaves_the_call_answered():
    tracker, exporter = _tracker(max_calls=1)
    call = tracker.start_call("s", _request(1), "2025-11-25", ABSENT, stateless=False)
    stream, _ = _held_post(tracker, call, [(_sse("e1"), 10), (_sse("e2", _RESULT), 20)])
    tracker.cancel(("s", "1"))
    assert call.done and exporter.get_finished_spans() == ()  # its result came first: no cancelled span
    other = tracker.start_call("s", _request(2), "2025-11-25", ABSENT, stateless=False)
    _held_post(tracker, other, [(_sse("e3", '{"jsonrpc":"2.0","id":2,"result":{}}'), 30)])
    tracker.start_call("s", _request(3), "2025-11-25", ABSENT, stateless=False)  # evicts 2, answered already
    assert other.done and exporter.get_finished_spans() == ()
    tracker.end_stream(stream, sc.END_CLEAN, 200)
    assert exporter.get_finished_spans() == ()


@pytest.mark.parametrize(("stateless", "spanned_first"), [(True, False), (True, True), (False, False), (False, True)])
@pytest.mark.parametrize("pending_at_exchange_end", [False, True])
def test_a_server_call_links_the_sdks_request_span_whenever_it_gets_a_span(stateless, spanned_first,
                                                                            pending_at_exchange_end):
    """``Call.in_sdk_request``: a call keeps the middleware's context and reads the SDK's span off it only
    when it gets a span, or is still pending when its exchange ends (``exchange_over``: a resumable call
    may get one long after, and holds no context meanwhile); one already a span links at once. Either
    way the call's span carries the ``sdk_request`` link."""
    from opentelemetry import context, trace

    tracker, exporter = _tracker()
    call = tracker.start_call(None, _request(1), "2026-07-28", ABSENT, stateless=stateless)
    if spanned_first:
        tracker.span_of(call)
    sdk = trace.get_tracer("sdk", tracer_provider=TracerProvider()).start_span("tools/call fetch")
    call.in_sdk_request(trace.set_span_in_context(sdk, context.get_current()))
    sdk.end()
    if pending_at_exchange_end:
        call.exchange_over()
        assert call._sdk_request is None
    tracker.span_of(call).end()
    (span,) = _by(exporter, sc.SPAN_CALL)
    links = {link.attributes[sc.LINK_TYPE]: link.context.span_id for link in span.links}
    assert links == {sc.LINK_SDK_REQUEST: sdk.get_span_context().span_id}


class _Unreadable(Context):
    """A context that fails the test if anything reads it."""

    def get(self, key: str, default: object = None) -> object:
        raise AssertionError(f"the context was read ({key})")

    def __getitem__(self, key: str) -> object:
        raise AssertionError(f"the context was read ({key})")


@pytest.mark.parametrize("stateless", [True, False])
def test_a_healthy_server_call_never_reads_the_sdks_request_span(stateless):
    tracker, exporter = _tracker()
    call = tracker.start_call(None, _request(1), "2026-07-28", ABSENT, stateless=stateless)
    call.in_sdk_request(_Unreadable())
    if stateless:
        assert tracker.answered([call], _response(1))
    else:
        stream = tracker.open_stream(sc.STREAM_KIND_POST, None, [call], {}, ABSENT, 200)
        tracker.frame(stream, SSEFrame('{"jsonrpc":"2.0","id":1,"result":{}}', id="e1"), _response(1))
        tracker.end_stream(stream, sc.END_CLEAN, 200)
    call.exchange_over()
    assert exporter.get_finished_spans() == ()


def test_an_exchange_that_ends_links_its_pending_calls_to_the_sdks_span_and_keeps_no_context():
    from opentelemetry import context, trace

    tracker, exporter = _tracker()
    pending = tracker.start_call("s", _request(1), None, ABSENT, stateless=False)
    answered = tracker.start_call("s", _request(2), None, ABSENT, stateless=False)
    sdk = trace.get_tracer("sdk", tracer_provider=TracerProvider()).start_span("tools/call fetch")
    pending.in_sdk_request(trace.set_span_in_context(sdk, context.get_current()))
    answered.in_sdk_request(_Unreadable())
    stream = tracker.open_stream(sc.STREAM_KIND_POST, "s", [answered], {}, ABSENT, 200)
    tracker.frame(stream, SSEFrame('{"jsonrpc":"2.0","id":2,"result":{}}', id="e1"), _response(2))
    ex = _exchange(tracker)
    ex.calls += [pending, answered]
    ex.release()
    assert pending._sdk_request is None
    tracker.shutdown()  # evicted: its span, linked to the SDK's request span read when the exchange ended
    (span,) = _by(exporter, sc.SPAN_CALL)
    assert [link.context.span_id for link in span.links] == [sdk.get_span_context().span_id]


def _sdk_client_span(exporter, limits=None):
    provider = TracerProvider(span_limits=limits) if limits is not None else TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider.get_tracer("sdk").start_span("MCP send tools/call fetch", attributes={"a": "1", "b": "2"})


@pytest.mark.parametrize(
    ("limits", "expected"),
    [
        (None, {"a": "1", "b": "2", sc.TERMINAL_STREAM_KIND: sc.STREAM_KIND_POST, sc.TERMINAL_EVENT_ID: "e-long-id"}),
        # a value length limit cuts the event id, as the SDK's set_attribute does
        (SpanLimits(max_span_attribute_length=4),
         {"a": "1", "b": "2", sc.TERMINAL_STREAM_KIND: "post", sc.TERMINAL_EVENT_ID: "e-lo"}),
        # no room for both: the oldest attribute goes, as the SDK's set_attribute drops it
        (SpanLimits(max_span_attributes=3),
         {"b": "2", sc.TERMINAL_STREAM_KIND: sc.STREAM_KIND_POST, sc.TERMINAL_EVENT_ID: "e-long-id"}),
    ],
)
def test_a_healthy_call_records_where_its_terminal_came_on_the_sdks_span_within_the_sdks_limits(limits, expected):
    tracker, ours = _tracker()
    sdk_exporter = InMemorySpanExporter()
    call = tracker.start_call("s", _request(1), None, ABSENT, stateless=False)
    call.sdk_span = sdk = _sdk_client_span(sdk_exporter, limits)
    stream = tracker.open_stream(sc.STREAM_KIND_POST, "s", [call], {}, ABSENT, 200)
    tracker.frame(stream, SSEFrame('{"jsonrpc":"2.0","id":1,"result":{}}', id="e-long-id"), _response(1))
    sdk.end()
    tracker.end_stream(stream, sc.END_CLEAN, 200)
    (span,) = sdk_exporter.get_finished_spans()
    assert dict(span.attributes) == expected
    assert ours.get_finished_spans() == ()


def test_an_sdk_span_that_ended_before_its_calls_terminal_came_is_left_as_it_ended():
    tracker, _ = _tracker()
    sdk_exporter = InMemorySpanExporter()
    call = tracker.start_call("s", _request(1), None, ABSENT, stateless=False)
    call.sdk_span = sdk = _sdk_client_span(sdk_exporter)
    sdk.end()
    stream = tracker.open_stream(sc.STREAM_KIND_POST, "s", [call], {}, ABSENT, 200)
    tracker.frame(stream, SSEFrame('{"jsonrpc":"2.0","id":1,"result":{}}', id="e2"), _response(1))
    (span,) = sdk_exporter.get_finished_spans()
    assert dict(span.attributes) == {"a": "1", "b": "2"}


def test_a_request_refused_before_the_sdk_saw_it_leaves_its_id_to_the_call_the_sdk_runs():
    """Two POSTs of one ``tools/call`` (a retry): the guard answers the second 409 before the SDK hands the first
    over, so the second's body is read first. The first's call, which the SDK runs and answers, is the one its id
    finds: its result's store is no result stored with nothing to carry it (a false ``stored_not_delivered``)."""
    tracker, exporter = _tracker(sc.ROLE_SERVER)
    body = b'{"jsonrpc":"2.0","id":5,"method":"tools/call","params":{"name":"fetch"}}'
    first, second = _exchange(tracker), _exchange(tracker)
    first.unread = body  # left for the SDK's parse
    tracker.unread(first, "s")
    second.observer._read(second, body)  # its 409 started before the SDK ran anything
    second.status = 409
    refused = second.open("application/json")
    assert refused is not None
    tracker.end_stream(refused, sc.END_HTTP_ERROR, 409)
    second.release()
    first.observer.dispatched(types.SimpleNamespace(scope={_EXCHANGE: first}), 5, {"name": "fetch"}, Context())
    (ran,) = first.calls
    assert tracker.call(("s", "5")) is ran
    tracker.stored(ran, "e9", sc.OUTCOME_RESULT)  # still carried by its exchange, as the SDK sends it there
    (refused_call,) = _by(exporter, sc.SPAN_CALL)  # the refused request's, let go of: no result stored unsent
    assert refused_call.attributes[sc.CALL_OUTCOME] == sc.OUTCOME_EVICTED


def test_a_request_id_reused_while_its_call_is_pending_does_not_replace_the_tracked_call():
    """MCP forbids reusing an id in a session (the guard answers 409): the pending call stays the one its id finds."""
    tracker, _ = _tracker()
    pending = tracker.start_call("s1", request_message(5, TOOLS_CALL, {"name": "fetch"}), "2025-11-25", ABSENT, False)
    reused = tracker.start_call("s1", request_message(5, TOOLS_CALL, {"name": "search"}), "2025-11-25", ABSENT, False)
    assert tracker.call(("s1", "5")) is pending and reused is not pending and not pending.done
    assert tracker.call(("s2", "5")) is None


def test_every_tracer_of_one_application_provider_shares_one_always_on_provider_released_with_it():
    """An SDK provider registers an at-fork hook the interpreter keeps for good: one per client would leak."""
    provider = TracerProvider(shutdown_on_exit=False)  # else ``atexit`` holds it
    first = DeviationTracer(provider)._resolve()
    assert all(DeviationTracer(provider)._resolve() is first for _ in range(3))
    assert len(_spans._OWN_TRACERS) >= 1
    count = len(_spans._OWN_TRACERS)
    del provider, first
    gc.collect()
    assert len(_spans._OWN_TRACERS) == count - 1


def test_a_server_lets_go_of_a_sessions_calls_once_its_delete_is_accepted_not_on_a_404():
    """A client that left without resuming its cut call: the call was held until 10,000 newer ones pushed it out,
    some 6 KB each, after the SDK had forgotten its session."""
    tracker, exporter = _tracker(sc.ROLE_SERVER)
    call = tracker.start_call("s", _request(1), "2025-11-25", ABSENT, stateless=False)
    other = tracker.start_call("t", _request(1), "2025-11-25", ABSENT, stateless=False)
    for held in (call, other):
        stream = tracker.open_stream(sc.STREAM_KIND_POST, held.key[0], [held], {}, ABSENT, 200)
        assert stream is not None
        tracker.end_stream(stream, sc.END_DROPPED, 200)
    ex = _exchange(tracker)  # the SDK's 404 for another principal's request names a live session too
    ex.observer._on_response_start(ex, {"type": "http.response.start", "status": 404, "headers": []})
    assert tracker.call(("s", "1")) is call
    tracker.deleted("s", tracker.deleting("s"), 200)
    assert tracker.call(("s", "1")) is None and tracker.call(("t", "1")) is other
    (ended,) = _by(exporter, sc.SPAN_CALL)
    assert ended.attributes[sc.CALL_OUTCOME] == sc.OUTCOME_EVICTED
