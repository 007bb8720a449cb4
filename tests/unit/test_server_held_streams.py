"""The server ends a held POST stream whose chunks are each one whole frame in the SDK's form, ending with
its call's result, from one read of each chunk, without the SSE parser; whatever else a stream carried,
what it emits is what reading it in full emits. Driven through the server instrumentation's ASGI observer,
EventStore wrapper and middleware, around an app that stores and sends each event as the MCP SDK does (one
frame a chunk, in store order), and hands the call to its middleware after its response started, as a
resumable session mostly does; or never, as an app the middleware is not installed in."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest
from asgi_post import post
from mcp_types import JSONRPCError, JSONRPCMessage, JSONRPCResponse
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from mcp_stream_exporter.auth import ToolPolicy
from mcp_stream_exporter.hooks import ServerInstrumentation
from mcp_stream_exporter.lab import IncidentEventStore
from mcp_stream_exporter.sse import SSEFrame, render
from mcp_stream_exporter.wire import REFUSED_ERROR_CODE

_CALL = b'{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"search","arguments":{"q":"x"}}}'
_PROGRESS = render(SSEFrame('{"jsonrpc":"2.0","method":"notifications/progress","params":{"progress":1}}'))
_RESULT = JSONRPCResponse(jsonrpc="2.0", id=7, result={"content": [], "isError": False})
_TOOL_ERROR = JSONRPCResponse(jsonrpc="2.0", id=7, result={"content": [], "isError": True})
_REFUSED = JSONRPCError(jsonrpc="2.0", id=7, error={"code": REFUSED_ERROR_CODE, "message": "narrower token"})


def _frame(event_id: str, message: JSONRPCMessage | None) -> bytes:
    """What the SDK sends for a stored event: a priming event without an event type, a message with one."""
    if message is None:
        return render(SSEFrame("", None, event_id))
    return render(SSEFrame(message.model_dump_json(by_alias=True, exclude_none=True), "message", event_id))


def _sdk_like_post(result: JSONRPCMessage, *, extra: bytes | JSONRPCMessage = b"", wire_id: str | None = None,
                   coalesce: bool = False, sent: JSONRPCMessage | None = None) -> Any:
    """One POST answered as the SDK answers it: the priming event and the result, each stored, then sent.
    ``extra``: a chunk something else adds before the result, or a message stored on the stream and sent
    before it; ``wire_id``: the id the result goes out with, if not the one stored; ``coalesce``: the
    priming event and the result in one chunk; ``sent``: what goes out in the result's place (``None``
    with ``wire_id=""``: nothing)."""

    def app(store: Any, instr: ServerInstrumentation | None) -> Any:
        async def asgi(scope: Any, receive: Any, send: Any) -> None:
            request = json.loads((await receive())["body"])
            stream_id = str(request["id"])
            priming = _frame(await store.store_event(stream_id, None), None)
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream")]})
            if instr is not None:  # the SDK's middleware, handed the call before its handler runs
                ctx = SimpleNamespace(method="tools/call", request_id=request["id"], params=request["params"],
                                      request=SimpleNamespace(scope=scope))
                instr.middleware(ctx, lambda ctx: None)  # type: ignore[arg-type]
            if not coalesce:
                await send({"type": "http.response.body", "body": priming, "more_body": True})
            if isinstance(extra, bytes) and extra:
                await send({"type": "http.response.body", "body": extra, "more_body": True})
            elif not isinstance(extra, bytes):
                chunk = _frame(await store.store_event(stream_id, extra), extra)
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            event_id = await store.store_event(stream_id, result)
            answer = b"" if wire_id == "" else _frame(wire_id or event_id, sent or result)
            if answer:
                await send({"type": "http.response.body", "body": priming + answer if coalesce else answer,
                            "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        return asgi

    return app


def _run(build: Any, *, unparsed: bool, handed_over: bool = True) -> tuple[list[Any], list[bool]]:
    """The spans one POST leaves, and whether its end was settled unparsed (``unparsed=False``: every
    held stream is read in full, as before there was another way). ``handed_over``: the SDK's middleware
    is handed the call (else the observer reads it from the body when something needs it)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    instr = ServerInstrumentation(tracer_provider=provider)
    settled: list[bool] = []
    settle = instr.observer._settled_unparsed

    def counted_settle(ex: Any) -> bool:
        settled.append(settle(ex) if unparsed else False)
        return settled[-1]

    instr.observer._settled_unparsed = counted_settle  # type: ignore[method-assign]
    app = instr.asgi(build(instr.event_store(IncidentEventStore(ToolPolicy())), instr if handed_over else None))
    post(app, _CALL, [(b"mcp-session-id", b"s1"), (b"mcp-protocol-version", b"2025-11-25")])
    spans = [(s.name, dict(s.attributes or {}), [(e.name, dict(e.attributes or {})) for e in s.events])
             for s in exporter.get_finished_spans()]
    return spans, settled


@pytest.mark.parametrize("result", [_RESULT, _TOOL_ERROR], ids=["result", "tool_error"])
def test_a_stream_of_whole_sdk_frames_ending_with_its_calls_result_ends_it_unparsed_and_leaves_no_span(result):
    spans, settled = _run(_sdk_like_post(result), unparsed=True)
    assert settled == [True]
    assert spans == []
    assert _run(_sdk_like_post(_RESULT, extra=_PROGRESS), unparsed=True)[1] == [True]  # a notification before


_OTHER_RESULT = JSONRPCResponse(jsonrpc="2.0", id=8, result={})


@pytest.mark.parametrize(("build", "deviates"), [
    (_sdk_like_post(_RESULT, extra=b": ping - 2026-12-02\r\n\r\n"), False),
    (_sdk_like_post(_RESULT, coalesce=True), False),  # two frames in one chunk
    (_sdk_like_post(_RESULT, extra=render(SSEFrame("upstream failed", "error", "e-x"))), True),
    (_sdk_like_post(_RESULT, extra=_frame("e-x", _OTHER_RESULT)), True),  # another call's result, unstored
    (_sdk_like_post(_RESULT, extra=_OTHER_RESULT), True),  # another call's result stored on this stream
    (_sdk_like_post(_RESULT, sent=_OTHER_RESULT), True),  # the store's result id, another call's result
    (_sdk_like_post(_RESULT, wire_id=""), True),  # stored, never sent: the call is still pending
    (_sdk_like_post(_REFUSED), False),  # an error ends the call: read, so a refusal is recorded on it
], ids=["ping", "coalesced", "error-frame", "foreign-result", "foreign-result-stored", "foreign-result-as-stored",
        "result-never-sent", "refusal"])
def test_a_stream_that_carried_anything_else_is_read_and_emits_what_reading_it_in_full_emits(build, deviates):
    spans, settled = _run(build, unparsed=True)
    assert True not in settled
    read_spans, _ = _run(build, unparsed=False)
    assert spans == read_spans
    assert bool(spans) == deviates


@pytest.mark.parametrize("build", [
    _sdk_like_post(_RESULT), _sdk_like_post(_RESULT, extra=_PROGRESS),
    _sdk_like_post(_RESULT, extra=render(SSEFrame("upstream failed", "error", "e-x"))),
    _sdk_like_post(_RESULT, extra=_OTHER_RESULT), _sdk_like_post(_RESULT, wire_id=""), _sdk_like_post(_REFUSED),
], ids=["result", "progress", "error-frame", "foreign-result-stored", "result-never-sent", "refusal"])
def test_a_call_the_sdk_never_hands_over_is_read_from_its_body_and_emits_what_one_handed_over_emits(build):
    handed, _ = _run(build, unparsed=True)
    assert _run(build, unparsed=True, handed_over=False)[0] == handed
    assert _run(build, unparsed=False, handed_over=False)[0] == handed
