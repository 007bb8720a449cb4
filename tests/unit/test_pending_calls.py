"""A stateless call (2026-07-28) of one POST, which nothing deviates in when it goes out, is left pending on
both sides: started as a call of ours only if its JSON answer is anything but its result, or never comes.
Whatever the answer, what the hooks emit is what starting it when its request went out emits: no span on
the healthy path (its result, or a JSON-RPC error for it), and otherwise the call, started then, with its
POST. Driven through the client's tap over ``httpx2.MockTransport``, and through the server's ASGI observer
and middleware around an app that answers as the SDK does (the middleware handed the call first)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import httpx2
import jwt
import pytest
from asgi_post import post
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from mcp_stream_exporter import semconv as sc
from mcp_stream_exporter.auth import Requirement, ToolPolicy, canonical_resource
from mcp_stream_exporter.hooks import ClientInstrumentation, ServerInstrumentation
from mcp_stream_exporter.hooks.client import ClientTap

_STATELESS = "2026-07-28"
_CALL = b'{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"fetch","arguments":{"url":"u"}}}'
_RESULT = b'{"jsonrpc":"2.0","id":1,"result":{"content":[],"isError":false}}'
_TOOL_ERROR = b'{"jsonrpc":"2.0","id":1,"result":{"content":[],"isError":true}}'
_ERROR = b'{"jsonrpc":"2.0","id":1,"error":{"code":-32602,"message":"bad arguments"}}'
_ERROR_OF_NONE = b'{"jsonrpc":"2.0","id":null,"error":{"code":-32700,"message":"parse error"}}'
_SPACED_RESULT = b'{"jsonrpc": "2.0", "id": 1, "result": {}}'  # its result, not in the SDK's form
_HEALTHY = [_RESULT, _TOOL_ERROR, _ERROR, _SPACED_RESULT]
_HEALTHY_IDS = ["result", "tool-error", "jsonrpc-error", "result-not-in-sdk-form"]
_SDK_SPAN = SpanContext(0x1F, 0x2F, is_remote=False, trace_flags=TraceFlags(1))


def _provider() -> tuple[TracerProvider, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


def _ours(exporter: InMemorySpanExporter, kind: str) -> list[Any]:
    return [s for s in exporter.get_finished_spans() if (s.attributes or {}).get(sc.SPAN) == kind]


# --- client ---


_HEADERS = {"mcp-protocol-version": _STATELESS, "content-type": "application/json"}


def _tapped(instrumentation: ClientInstrumentation, *answers: httpx2.Response | Exception) -> httpx2.AsyncClient:
    """A client through the tap whose requests get ``answers`` in turn (an exception raised)."""
    left = iter(answers)

    def respond(request: httpx2.Request) -> httpx2.Response:
        answer = next(left)
        if isinstance(answer, Exception):
            raise answer
        return answer

    return httpx2.AsyncClient(transport=ClientTap(httpx2.MockTransport(respond), instrumentation))


async def _client_exchange(answer: httpx2.Response | Exception, *, close_unread: bool = False
                           ) -> InMemorySpanExporter:
    provider, exporter = _provider()
    http = _tapped(ClientInstrumentation(tracer_provider=provider), answer)
    async with http:
        try:
            async with http.stream("POST", "http://mcp.test/mcp", content=_CALL, headers=_HEADERS) as response:
                if not close_unread:
                    await response.aread()
        except httpx2.ConnectError:
            pass
    return exporter


class _Body(httpx2.AsyncByteStream):
    """A response body read as it comes (a body given as ``content`` is read before the tap sees it)."""

    def __init__(self, body: bytes) -> None:
        self._body = body

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield self._body


def _answer(status: int, body: bytes, content: str = "application/json") -> httpx2.Response:
    return httpx2.Response(status, headers={"content-type": content}, stream=_Body(body))


def _json(status: int, body: bytes) -> httpx2.Response:
    return _answer(status, body)


@pytest.mark.anyio
@pytest.mark.parametrize("body", _HEALTHY, ids=_HEALTHY_IDS)
async def test_a_clients_pending_call_answered_with_its_result_or_an_error_for_it_leaves_no_span(body):
    exporter = await _client_exchange(_json(200, body))
    assert exporter.get_finished_spans() == ()


@pytest.mark.anyio
async def test_a_clients_pending_call_answered_with_something_else_is_started_and_owed_by_its_post():
    exporter = await _client_exchange(_json(200, _ERROR_OF_NONE))
    (call,) = _ours(exporter, sc.SPAN_CALL)
    (post,) = _ours(exporter, sc.SPAN_STREAM)
    assert call.attributes[sc.CALL_OUTCOME] == sc.OUTCOME_NO_TERMINAL
    assert call.attributes[sc.ERA] == sc.ERA_STATELESS
    assert call.attributes[sc.GEN_AI_TOOL_NAME] == "fetch"
    assert call.start_time <= post.start_time  # started as of its request, not of its answer
    assert post.attributes[sc.END_REASON] == sc.END_CLEAN
    assert post.attributes[sc.PENDING_REQUEST_IDS] == ("1",)


@pytest.mark.anyio
@pytest.mark.parametrize(("answer", "reason"), [
    (httpx2.ConnectError("refused"), sc.END_DROPPED),
    (_json(503, b'{"error":"unavailable"}'), sc.END_HTTP_ERROR),
    (_answer(200, b": ping\r\n\r\n", "text/event-stream"), sc.END_CLEAN),
], ids=["no-response", "http-error", "sse-without-its-result"])
async def test_a_clients_pending_call_whose_answer_is_no_json_result_is_started_with_its_post(answer, reason):
    exporter = await _client_exchange(answer)
    (call,) = _ours(exporter, sc.SPAN_CALL)
    (post,) = _ours(exporter, sc.SPAN_STREAM)
    assert call.attributes[sc.CALL_OUTCOME] == sc.OUTCOME_NO_TERMINAL
    assert post.attributes[sc.END_REASON] == reason
    assert post.attributes[sc.PENDING_REQUEST_IDS] == ("1",)


@pytest.mark.anyio
@pytest.mark.parametrize("request_id", [b'"1"', b"null", b'"server-error"', b"0"],
                         ids=["its-id", "no-id", "a-servers-own-id", "another-id"])
@pytest.mark.parametrize("status", [400, 404])
async def test_a_clients_pending_call_answered_with_a_json_rpc_error_at_an_http_error_status_is_answered(
        status, request_id):
    """The 2026-07-28 SDK server answers some JSON-RPC errors at 400 or 404, the SDK hands them to the caller as its
    request's, whatever id they name (none; an old SDK's ``server-error`` for an expired session): the call's
    answer, at an HTTP error's end, not a call its stream left owed nor a stranger's result (``foreign_result``)."""
    body = b'{"jsonrpc":"2.0","id":%s,"error":{"code":-32602,"message":"x must be a date"}}' % request_id
    exporter = await _client_exchange(_json(status, body))
    (post,) = _ours(exporter, sc.SPAN_STREAM)
    assert post.attributes[sc.END_REASON] == sc.END_HTTP_ERROR
    assert post.attributes[sc.TERMINAL_REQUEST_IDS] == ("1",) and sc.PENDING_REQUEST_IDS not in post.attributes
    assert [c.attributes[sc.CALL_OUTCOME] for c in _ours(exporter, sc.SPAN_CALL)] in ([], [sc.OUTCOME_ERROR])


@pytest.mark.anyio
async def test_a_clients_pending_call_whose_answer_is_closed_unread_is_cancelled():
    exporter = await _client_exchange(_json(200, _RESULT), close_unread=True)
    (call,) = _ours(exporter, sc.SPAN_CALL)
    assert call.attributes[sc.CALL_OUTCOME] == sc.OUTCOME_CANCELLED  # the era's cancel: the client closed it


@pytest.mark.anyio
async def test_a_call_whose_token_lacks_what_its_tool_requires_is_never_left_pending():
    provider, exporter = _provider()
    fetch = canonical_resource("https://fetch.example")
    policy = ToolPolicy({"fetch": Requirement(frozenset({fetch}))})
    instrumentation = ClientInstrumentation(policy=policy, tracer_provider=provider)
    http = httpx2.AsyncClient(transport=ClientTap(httpx2.MockTransport(lambda r: _json(200, _RESULT)),
                                                  instrumentation))
    token = jwt.encode({"aud": "https://other.example"}, "a key of at least thirty-two bytes", algorithm="HS256")
    headers = {"mcp-protocol-version": _STATELESS, "authorization": f"Bearer {token}"}
    async with http:
        await http.post("http://mcp.test/mcp", content=_CALL, headers=headers)
    (call,) = _ours(exporter, sc.SPAN_CALL)  # a deviation at once: its span, though its result came
    assert call.attributes[sc.AUTH_MISSING_RESOURCES] == (fetch,)
    assert call.attributes[sc.CALL_OUTCOME] == sc.OUTCOME_RESULT


@pytest.mark.anyio
async def test_a_clients_pending_call_keeps_the_session_its_request_had_when_the_answer_names_another():
    """A server may answer a request without a session with one (as a resumable server answers a call
    without ``initialize``): the call is its request's, started late or not."""
    answer = httpx2.Response(400, headers={"content-type": "application/json", "mcp-session-id": "s9"},
                             stream=_Body(_ERROR_OF_NONE))
    exporter = await _client_exchange(answer)
    (call,) = _ours(exporter, sc.SPAN_CALL)
    (post,) = _ours(exporter, sc.SPAN_STREAM)
    assert sc.MCP_SESSION_ID not in call.attributes
    assert post.attributes[sc.MCP_SESSION_ID] == "s9"
    assert post.attributes[sc.PENDING_REQUEST_IDS] == ("1",)


# --- server ---


def _server_exchange(answer: bytes | None, *, status: int = 200, disconnect: bool = False,
                     session: bytes | None = None) -> InMemorySpanExporter:
    """One stateless POST of one call: the SDK's middleware is handed the call, then the app answers with
    ``answer`` as a JSON body (None: no response at all), or the client goes away after its headers."""
    provider, exporter = _provider()
    instr = ServerInstrumentation(tracer_provider=provider)

    async def app(scope: Any, receive: Any, send: Any) -> None:
        request = json.loads((await receive())["body"])
        ctx = SimpleNamespace(method="tools/call", request_id=request["id"], params=request["params"],
                              request=SimpleNamespace(scope=scope))
        token = trace.context_api.attach(trace.set_span_in_context(NonRecordingSpan(_SDK_SPAN)))
        try:
            instr.middleware(ctx, lambda ctx: None)  # type: ignore[arg-type]
        finally:
            trace.context_api.detach(token)
        if answer is None:
            return
        headers = [(b"content-type", b"application/json")] + ([(b"mcp-session-id", session)] if session else [])
        await send({"type": "http.response.start", "status": status, "headers": headers})
        if disconnect:  # gone before the body: the SDK's send fails, and the body never goes
            await receive()
            return
        await send({"type": "http.response.body", "body": answer, "more_body": False})

    post(instr.asgi(app), _CALL, [(b"mcp-protocol-version", _STATELESS.encode())])
    return exporter


@pytest.mark.parametrize("body", _HEALTHY, ids=_HEALTHY_IDS)
def test_a_servers_pending_call_answered_with_its_result_or_an_error_for_it_leaves_no_span(body):
    assert _server_exchange(body).get_finished_spans() == ()


def test_a_servers_call_answered_with_nothing_at_all_leaves_no_span():
    assert _server_exchange(None).get_finished_spans() == ()  # no stream to judge it: as when it was started


@pytest.mark.parametrize(("answer", "status", "disconnect", "reason"), [
    (_ERROR_OF_NONE, 200, False, sc.END_CLEAN),
    (_ERROR_OF_NONE, 500, False, sc.END_HTTP_ERROR),
    (_RESULT, 200, True, sc.END_DROPPED),
], ids=["another-answer", "http-error", "client-gone"])
def test_a_servers_pending_call_otherwise_answered_is_started_as_when_it_was_handed_over(answer, status,
                                                                                      disconnect, reason):
    exporter = _server_exchange(answer, status=status, disconnect=disconnect)
    (call,) = _ours(exporter, sc.SPAN_CALL)
    (post,) = _ours(exporter, sc.SPAN_STREAM)
    assert call.attributes[sc.ERA] == sc.ERA_STATELESS
    assert call.attributes[sc.POLICY_DECISION] == "unknown_tool"  # what the policy said when it came
    assert [(lk.context.span_id, lk.attributes[sc.LINK_TYPE]) for lk in call.links if
            lk.attributes[sc.LINK_TYPE] == sc.LINK_SDK_REQUEST] == [(_SDK_SPAN.span_id, sc.LINK_SDK_REQUEST)]
    assert call.start_time <= post.start_time
    assert post.attributes[sc.END_REASON] == reason
    assert post.attributes[sc.PENDING_REQUEST_IDS] == ("1",)
    assert call.attributes[sc.CALL_OUTCOME] == sc.OUTCOME_NO_TERMINAL


def test_a_servers_pending_call_keeps_the_session_its_request_had_when_the_answer_names_one():
    exporter = _server_exchange(_ERROR_OF_NONE, session=b"s9")  # a layer of the app gave the answer a session
    (call,) = _ours(exporter, sc.SPAN_CALL)
    assert sc.MCP_SESSION_ID not in call.attributes
    assert call.attributes[sc.CALL_OUTCOME] == sc.OUTCOME_NO_TERMINAL


@pytest.mark.anyio
async def test_a_stateless_call_redirected_while_another_s_break_awaits_its_reissue_loses_nothing():
    """A call that goes out while another call's stream broke is started at once (it may be that one's re-issue);
    redirected (the SDK sends it again where it points, or fails it), it is left to the request that follows, as a
    call left pending is: not a broken call owed a re-issue of its own."""
    provider, exporter = _provider()
    instrumentation = ClientInstrumentation(tracer_provider=provider)
    other = _CALL.replace(b'"id":1', b'"id":2').replace(b'"fetch"', b'"search"')
    http = _tapped(instrumentation, httpx2.ConnectError("reset"),
                   httpx2.Response(307, headers={"location": "http://x.test/mcp"}))
    async with http:
        with pytest.raises(httpx2.ConnectError):
            await http.post("http://mcp.test/mcp", content=_CALL, headers=_HEADERS)  # broken: owed a re-issue
        assert instrumentation.tracker.reissues_possible()
        redirected = await http.post("http://mcp.test/mcp", content=other, headers=_HEADERS)
    assert redirected.status_code == 307
    ended = {(s.attributes or {}).get(sc.JSONRPC_REQUEST_ID): (s.attributes or {}).get(sc.CALL_OUTCOME)
             for s in _ours(exporter, sc.SPAN_CALL)}
    assert ended == {"1": sc.OUTCOME_NO_TERMINAL}
    assert [(s.attributes or {}).get(sc.END_REASON) for s in _ours(exporter, sc.SPAN_STREAM)] == [sc.END_DROPPED]


@pytest.mark.anyio
@pytest.mark.parametrize(("status", "outcome"), [
    (400, sc.OUTCOME_ERROR), (404, sc.OUTCOME_ERROR), (413, sc.OUTCOME_ERROR), (401, sc.OUTCOME_NO_TERMINAL),
    (403, sc.OUTCOME_NO_TERMINAL), (408, sc.OUTCOME_NO_TERMINAL), (429, sc.OUTCOME_NO_TERMINAL),
    (500, sc.OUTCOME_NO_TERMINAL), (502, sc.OUTCOME_NO_TERMINAL), (504, sc.OUTCOME_NO_TERMINAL)])
async def test_a_stateless_call_refused_with_a_client_error_is_answered_and_one_failed_by_a_server_error_is_broken(
        status, outcome):
    """A gateway's or a server's refusal with no JSON-RPC error in it (a body too large, a bad request): the SDK
    fails the call with it, the tool never ran, and the same call sent again gets the same answer: an answer
    (``error``), no break owed a re-issue. A 5xx (or a timeout, a rate limit) may come after the tool ran: its
    call is broken, as by a cut stream, and owed its re-issue. A 401 or 403 too: an auth flow (the SDK's OAuth
    provider) sends the same request again with another token, and a loss of that one must not go unseen."""
    exporter = await _client_exchange(_answer(status, b"Request body too large", "text/plain"))
    (call,) = _ours(exporter, sc.SPAN_CALL)
    (post,) = _ours(exporter, sc.SPAN_STREAM)
    assert (call.attributes[sc.CALL_OUTCOME], post.attributes[sc.END_REASON]) == (outcome, sc.END_HTTP_ERROR)
