"""A resumable session's POST body of one call is left for the SDK's own parse: its SSE answer is held before
the SDK's middleware hands the call over, and the call joins it when it does. Whatever comes first (a cancel
of the call, its result stored, the response, the middleware, or nothing at all), what the hooks emit is
what reading the body as it came emits. Driven through the server instrumentation's ASGI observer, event
store wrapper and middleware, around apps that act in the order each case needs."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from types import SimpleNamespace
from typing import Any

import jwt
import pytest
from mcp_types import JSONRPCResponse
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from mcp_stream_exporter import semconv as sc
from mcp_stream_exporter.auth import Requirement, ToolPolicy
from mcp_stream_exporter.hooks import ServerInstrumentation
from mcp_stream_exporter.lab import IncidentEventStore
from mcp_stream_exporter.sse import SSEFrame, render

_LEGACY = [(b"mcp-session-id", b"s1"), (b"mcp-protocol-version", b"2025-11-25")]
# a token whose audience is known, and is not the resource ``search`` requires under ``_POLICY``
_TOKEN = jwt.encode({"aud": "https://a.example"}, "a key of at least thirty-two bytes", algorithm="HS256")
_POLICY = ToolPolicy({"search": Requirement.of(["https://b.example"])})
_SSE = [(b"content-type", b"text/event-stream")]
_SDK_SPAN = SpanContext(0x1F, 0x2F, is_remote=False, trace_flags=TraceFlags(1))


def _call(request_id: int, tool: str = "search") -> bytes:
    return json.dumps({"jsonrpc": "2.0", "id": request_id, "method": "tools/call",
                       "params": {"name": tool, "arguments": {"q": "x"}}}, separators=(",", ":")).encode()


def _cancel(request_id: int) -> bytes:
    return json.dumps({"jsonrpc": "2.0", "method": "notifications/cancelled",
                       "params": {"requestId": request_id}}, separators=(",", ":")).encode()


Step = Callable[[Any, Any], Awaitable[None]]  # what the app does at one point of an exchange: (scope, send)


class _Server:
    """The instrumented app; each POST's inner app runs the steps its test gives it, in order."""

    def __init__(self, policy: ToolPolicy | None = None) -> None:
        self.headers = list(_LEGACY) + ([(b"authorization", f"Bearer {_TOKEN}".encode())] if policy else [])
        self.exporter = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.instr = ServerInstrumentation(policy=policy, tracer_provider=provider)
        self.store = self.instr.event_store(IncidentEventStore(ToolPolicy()))
        self.app = self.instr.asgi(self._inner)
        self._steps: list[list[Step]] = []

    async def _inner(self, scope: Any, receive: Any, send: Any) -> None:
        scope["request"] = json.loads((await receive())["body"])
        for step in self._steps.pop(0):
            await step(scope, send)

    async def post(self, body: bytes, *steps: Step) -> None:
        self._steps.append(list(steps))
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive() -> dict[str, Any]:
            return messages.pop(0) if messages else {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            return None

        await self.app({"type": "http", "path": "/mcp", "method": "POST", "headers": self.headers}, receive, send)

    def spans(self) -> list[tuple[str, dict[str, Any], str | None]]:
        return [(s.name, dict(s.attributes or {}), s.parent.span_id if s.parent else None)
                for s in self.exporter.get_finished_spans()]


async def _start(scope: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": _SSE})


def _hand_over(server: _Server) -> Step:
    """The SDK's middleware, handed the call, its own span current."""

    async def step(scope: Any, send: Any) -> None:
        request = scope["request"]
        ctx = SimpleNamespace(method="tools/call", request_id=request["id"], params=request["params"],
                              request=SimpleNamespace(scope=scope))
        token = trace.context_api.attach(trace.set_span_in_context(NonRecordingSpan(_SDK_SPAN)))
        try:
            server.instr.middleware(ctx, lambda ctx: None)  # type: ignore[arg-type]
        finally:
            trace.context_api.detach(token)
    return step


def _stored(server: _Server, result: bool = True, sent: bool = True) -> Step:
    """An event of the call's stream stored, then sent: its result, or a priming event."""

    async def step(scope: Any, send: Any) -> None:
        request_id = scope["request"]["id"]
        message = JSONRPCResponse(jsonrpc="2.0", id=request_id, result={"content": []}) if result else None
        event_id = await server.store.store_event(str(request_id), message)
        data = message.model_dump_json(by_alias=True, exclude_none=True) if message else ""
        if sent:
            chunk = render(SSEFrame(data, "message" if message else None, event_id))
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
    return step


async def _end(scope: Any, send: Any) -> None:
    await send({"type": "http.response.body", "body": b"", "more_body": False})


def _also(server: _Server, body: bytes, status: int = 202) -> Step:
    """Another POST of the session, whole, at this point of this one (a cancel answered 202)."""

    async def step(scope: Any, send: Any) -> None:
        async def accepted(scope: Any, send: Any) -> None:
            await send({"type": "http.response.start", "status": status, "headers": []})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        await server.post(body, accepted)
    return step


def _run(build: Callable[[_Server], Awaitable[None]], policy: ToolPolicy | None = None) -> _Server:
    server = _Server(policy)
    asyncio.run(build(server))
    return server


def test_the_healthy_path_handed_over_after_its_response_started_leaves_no_span_and_nothing_kept():
    async def build(server: _Server) -> None:
        await server.post(_call(7), _start, _stored(server, result=False), _hand_over(server), _stored(server), _end)
    server = _run(build)
    assert server.spans() == []
    assert server.instr.tracker._calls == {} and server.instr.tracker._held == {}
    assert server.instr.tracker._unread == {}


@pytest.mark.parametrize("response_first", [True, False], ids=["after-its-response-started", "before-anything"])
def test_a_cancel_of_a_call_not_yet_handed_over_cancels_it(response_first):
    async def build(server: _Server) -> None:
        before = [_start] if response_first else []
        after = [] if response_first else [_start]
        await server.post(_call(7), *before, _also(server, _cancel(7)), *after, _hand_over(server), _end)
    (call,) = [a for _, a, _ in _run(build).spans() if a[sc.SPAN] == sc.SPAN_CALL]
    assert call[sc.CALL_OUTCOME] == sc.OUTCOME_CANCELLED


@pytest.mark.parametrize("status", [401, 403, 404])
def test_a_cancel_the_server_refused_cancels_nothing(status):
    """The guard's 403 (a token that may not see the call), the SDK's 401 or 404: the call runs on, and a
    cancel anyone could post must not end what the hooks track of it."""
    async def build(server: _Server) -> None:
        await server.post(_call(7), _start, _hand_over(server), _also(server, _cancel(7), status),
                          _stored(server, result=False), _end)
    server = _run(build)
    assert not [a for _, a, _ in server.spans() if a.get(sc.CALL_OUTCOME) == sc.OUTCOME_CANCELLED]
    (call,) = server.instr.tracker._calls.values()
    assert not call.done  # still owed its result, which the SDK may yet store


def test_a_result_stored_before_the_call_is_handed_over_or_ever_is_recorded_on_it():
    async def build(server: _Server) -> None:
        await server.post(_call(7), _stored(server, sent=False), _start, _end)  # no middleware, result never sent
    server = _run(build)
    (call,) = [(a, s) for _, a, s in server.spans() if a[sc.SPAN] == sc.SPAN_CALL]
    assert call[0][sc.CALL_OUTCOME] == sc.OUTCOME_RESULT and call[0][sc.TERMINAL_EVENT_ID] == "1"


def test_a_body_that_names_tools_call_but_holds_none_is_no_call_and_leaves_nothing_held():
    body = b'{"jsonrpc":"2.0","id":3,"method":"resources/read","params":{"uri":"docs://tools/call"}}'

    async def build(server: _Server) -> None:
        await server.post(body, _start, _stored(server), _end)
        await server.post(_cancel(99), _start, _end)  # a look-up in the session afterwards
    server = _run(build)
    assert server.spans() == []
    assert server.instr.tracker._held == {} and server.instr.tracker._unread == {}


def test_a_call_that_deviates_when_handed_over_has_the_span_it_had_when_its_body_was_read():
    """A token that lacks the tool's resource gives the call a span at once: parented as where its body
    came, never by the SDK's span current where the SDK hands it over."""
    async def build(server: _Server) -> None:
        await server.post(_call(7), _start, _hand_over(server), _stored(server), _end)
    calls = [(a, parent) for _, a, parent in _run(build, _POLICY).spans() if a[sc.SPAN] == sc.SPAN_CALL]
    assert [(a[sc.JSONRPC_REQUEST_ID], parent) for a, parent in calls] == [("7", None)]


def test_a_call_not_yet_handed_over_when_the_tracker_shuts_down_is_evicted_as_any_pending_call():
    async def build(server: _Server) -> None:
        async def shut_down(scope: Any, send: Any) -> None:
            server.instr.tracker.shutdown()
        await server.post(_call(7), _start, shut_down)
    (call,) = [a for _, a, _ in _run(build).spans() if a[sc.SPAN] == sc.SPAN_CALL]
    assert call[sc.CALL_OUTCOME] == sc.OUTCOME_EVICTED


def _json_answer(scope: Any, send: Any) -> Awaitable[None]:
    """The SDK's JSON answer (``json_response=True``): its response starts only after the result was stored."""
    async def step() -> None:
        body = JSONRPCResponse(jsonrpc="2.0", id=scope["request"]["id"], result={"content": []})
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body.model_dump_json(by_alias=True, exclude_none=True)
                    .encode(), "more_body": False})
    return step()


def test_a_result_stored_before_its_json_answer_started_is_delivered_by_it_and_leaves_no_span():
    async def build(server: _Server) -> None:
        await server.post(_call(7), _hand_over(server), _stored(server, sent=False), _json_answer)
    server = _run(build)
    assert server.spans() == [] and server.instr.tracker._calls == {}


def test_a_result_stored_while_its_exchange_lasted_that_never_answered_is_stored_with_no_stream():
    async def build(server: _Server) -> None:
        await server.post(_call(7), _hand_over(server), _stored(server, sent=False))  # no response at all
    (call,) = [a for _, a, _ in _run(build).spans() if a[sc.SPAN] == sc.SPAN_CALL]
    assert call[sc.CALL_OUTCOME] == sc.OUTCOME_RESULT and call[sc.TERMINAL_EVENT_ID] == "1"
    assert sc.TERMINAL_STREAM_KIND not in call  # what the detector reads as stored, not delivered
