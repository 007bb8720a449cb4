"""The SDK and httpx2 internals the hooks rely on. If an SDK 2.x or httpx2 release changes one of
them, this fails loudly here instead of the hooks going quiet in production."""

from __future__ import annotations

import inspect

import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.server.lowlevel import Server
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.streamable_http import GET_STREAM_KEY, EventStore
from mcp_types import JSONRPCNotification, JSONRPCResponse

from mcp_stream_exporter import instrument_client, instrument_server
from mcp_stream_exporter import semconv as sc
from mcp_stream_exporter.exchange import STANDALONE_STREAM_ID, request_id_of, stream_id_of
from mcp_stream_exporter.lab import serve

from harness import span_exporter, spans


def test_httpx2_async_client_keeps_its_transport_in_underscore_transport_and_a_proxys_in_its_mounts():
    client = httpx2.AsyncClient(mounts={"http://proxied.example": httpx2.AsyncHTTPTransport()})
    assert isinstance(client._transport, httpx2.AsyncBaseTransport)
    tapped = instrument_client(client)
    assert tapped is client
    assert type(client._transport).__name__ == "ClientTap"
    (mounted,) = client._mounts.values()
    assert type(mounted).__name__ == "ClientTap"
    assert client._transport_for_url(httpx2.URL("http://proxied.example/mcp")) is mounted


def test_httpx2_builds_a_responses_decoder_from_its_codings_with_multidecoder():
    """coding.py decodes a compressed answer's copy with ``httpx2._decoders.MultiDecoder``, as ``Response`` does:
    the codings in the order applied, the unknown ones left out, each decoded in pieces."""
    from httpx2._decoders import MultiDecoder

    decoder = MultiDecoder(["deflate", "no-such-coding", "gzip"])
    assert [type(child).__name__ for child in decoder.children] == ["GZipDecoder", "DeflateDecoder"]
    assert list(MultiDecoder(["gzip"]).decode(b"")) == []


def test_httpx2_headers_keep_each_name_raw_and_lower_cased_beside_its_value():
    """The client hooks read request and response headers off ``Headers._list`` (raw name, lower-cased
    name, value) rather than building ``Headers.raw`` and lowering every name again."""
    headers = httpx2.Headers([(b"Mcp-Session-Id", b"s1"), (b"Content-Type", b"text/event-stream")])
    assert headers._list == [(b"Mcp-Session-Id", b"mcp-session-id", b"s1"),
                             (b"Content-Type", b"content-type", b"text/event-stream")]


def test_event_store_interface_is_the_two_methods_the_wrapper_delegates():
    assert set(EventStore.__abstractmethods__) == {"store_event", "replay_events_after"}
    assert list(inspect.signature(EventStore.store_event).parameters) == ["self", "stream_id", "message"]
    assert list(inspect.signature(EventStore.replay_events_after).parameters) == [
        "self", "last_event_id", "send_callback"]


def test_mcpserver_exposes_a_mutable_middleware_list_and_accepts_an_event_store():
    server = MCPServer("contract")
    before = len(server.middleware)
    instrument_server(server)
    assert len(server.middleware) == before + 1
    assert "event_store" in inspect.signature(MCPServer.streamable_http_app).parameters
    # the sessions it holds, by id: the server's hooks ask whether a 404's session is gone (``hooks.server._holds``)
    assert server.session_manager._server_instances == {}
    assert "self._server_instances.pop(session_id, None)" in inspect.getsource(type(server.session_manager))
    # it builds its app with its low-level server's, which the instrumentor wraps (``hooks.server.builds``)
    assert "return self._lowlevel_server.streamable_http_app(" in inspect.getsource(MCPServer.streamable_http_app)
    assert isinstance(server._lowlevel_server, Server) and server.middleware is server._lowlevel_server.middleware


def test_the_server_runner_awaits_whatever_a_middleware_returns():
    """The hooks' server middleware is a plain function returning the rest of the chain's awaitable (no
    coroutine of its own around every handler): the SDK must await what a middleware returns."""
    from mcp.server import runner

    source = inspect.getsource(runner._apply_middleware)
    assert "return middleware(ctx, call_next)" in source
    assert "partial(_apply_middleware, middleware, call)" in inspect.getsource(runner.ServerRunner)


def test_an_event_without_id_is_rendered_as_an_id_less_message_frame_the_guard_can_rewrite():
    """guard.py sends its refusal through the replay callback as an EventMessage without an id, and
    rewrites that frame into `event: error` on the wire. Pins the transport's rendering."""
    from mcp.server.streamable_http import EventMessage, StreamableHTTPServerTransport

    from mcp_stream_exporter.guard.error_frame import REFUSAL_METHOD, refusal_notice, rewrite_refusal
    from mcp_stream_exporter.sse import SSEFrame, SSEParser, render

    notice = refusal_notice({"error": "insufficient_audience", "cursor": "6"})
    assert isinstance(notice, EventMessage)
    transport = StreamableHTTPServerTransport.__new__(StreamableHTTPServerTransport)
    data = StreamableHTTPServerTransport._create_event_data(transport, notice)
    assert data == {"event": "message", "data": data["data"]}  # no "id": the client's cursor stays
    assert REFUSAL_METHOD in data["data"]
    wire = render(SSEFrame(data["data"], event=data["event"]))
    (frame,) = SSEParser().feed(rewrite_refusal(wire))
    assert (frame.event, frame.id) == ("error", None)


def test_the_otel_sdk_provider_shares_its_span_processor_so_our_always_on_tracer_exports_where_it_does():
    """hooks._spans.DeviationTracer builds a provider with an always-on sampler around the
    application provider's ``_active_span_processor``: our spans go to the same exporters whatever
    the application's sampler."""
    from opentelemetry.sdk.trace import SynchronousMultiSpanProcessor, TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF

    from mcp_stream_exporter.hooks._spans import DeviationTracer

    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=ALWAYS_OFF)
    assert isinstance(provider._active_span_processor, SynchronousMultiSpanProcessor)
    assert "active_span_processor" in inspect.signature(TracerProvider).parameters
    provider.add_span_processor(SimpleSpanProcessor(exporter))  # added after: still shared
    tracer = DeviationTracer(provider)
    provider.get_tracer("app").start_span("the application's, sampled out").end()
    tracer.start_span("ours").end()
    assert [s.name for s in exporter.get_finished_spans()] == ["ours"]


def test_otel_sdk_spans_keep_their_name_and_context_in_the_fields_the_span_index_reads():
    """hooks._sdk_spans.SdkSpans reads ``_name`` and ``_context`` off every span started and ended, and the
    span id at index ``_SPAN_ID`` of that tuple, not the properties and ``get_span_context()`` around them."""
    from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor, TracerProvider

    from mcp_stream_exporter.hooks._sdk_spans import _SPAN_ID

    seen: list[tuple[str, object, object]] = []

    class Probe(SpanProcessor):
        def on_start(self, span: Span, parent_context: object = None) -> None:
            seen.append(("start", span._name == span.name, span._context is span.get_span_context()))
            assert span._context is not None and span._context[_SPAN_ID] == span.get_span_context().span_id

        def on_end(self, span: ReadableSpan) -> None:
            seen.append(("end", span._name == span.name, span._context is span.context))

    provider = TracerProvider()
    provider.add_span_processor(Probe())
    provider.get_tracer("app").start_span("MCP send tools/call search").end()
    assert seen == [("start", True, True), ("end", True, True)]


def test_otel_sdk_spans_keep_status_events_and_attributes_where_a_timed_out_call_is_read():
    """hooks._sdk_spans.SdkSpans reads a span's status code off ``_status._status_code`` on every span ended, and a
    failed call's exception events and request id off ``_events`` and ``_attributes``, as the SDK records them when
    its caller's timeout runs out."""
    from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
    from opentelemetry.trace import StatusCode

    ended: list[ReadableSpan] = []

    class Probe(SpanProcessor):
        def on_end(self, span: ReadableSpan) -> None:
            ended.append(span)

    provider = TracerProvider()
    provider.add_span_processor(Probe())
    with pytest.raises(TimeoutError), provider.get_tracer("app").start_as_current_span(
            "MCP send tools/call search", attributes={"jsonrpc.request.id": "3"}):
        raise TimeoutError
    (span,) = ended
    assert span._status._status_code is span.status.status_code is StatusCode.ERROR
    assert [(e.name, dict(e.attributes or {}).get("exception.type")) for e in span._events] == [
        ("exception", "TimeoutError")]
    assert span._attributes is not None and span._attributes.get("jsonrpc.request.id") == "3"


def test_otel_sdk_spans_keep_attributes_end_time_and_lock_where_the_terminal_annotation_writes():
    """hooks._sdk_spans.annotate writes a healthy call's terminal into the SDK span's ``_attributes``
    (a ``BoundedAttributes``: ``_dict``, ``maxlen``, ``max_value_len``) under ``_lock``, while ``_end_time``
    is None, as ``set_attribute`` does; ``end`` sets ``_end_time`` under that lock."""
    from opentelemetry.attributes import BoundedAttributes
    from opentelemetry.sdk.trace import TracerProvider

    span = TracerProvider().get_tracer("app").start_span("MCP send tools/call search")
    assert type(span._attributes) is BoundedAttributes and span._end_time is None
    assert (span._attributes.maxlen, span._attributes.max_value_len) == (128, None)  # the SDK's default limits
    span.set_attribute("k", "v")
    assert span._attributes._dict == {"k": "v"}
    with span._lock:
        pass  # a context manager the span does not hold between calls
    span.end()
    assert span._end_time is not None and not span.is_recording()
    assert "with self._lock" in inspect.getsource(type(span).end).split("_end_time =")[0]


@pytest.mark.anyio
async def test_the_sdk_files_a_requests_events_under_its_request_id_and_the_rest_under_the_standalone_stream():
    """``exchange.stream_id_of``: the SDK's event store gets a POST's events under the stream id ``str(request
    id)``, and a message related to no request under ``GET_STREAM_KEY``; the hooks and the guard rely on it.
    And the SDK client's span for the call is named as ``semconv.SDK_CLIENT_CALL_SPAN`` says."""
    span_exporter().clear()
    stored: list[tuple[str, object]] = []

    class Recording(EventStore):
        async def store_event(self, stream_id, message):
            stored.append((stream_id, message))
            return str(len(stored))

        async def replay_events_after(self, last_event_id, send_callback):
            return None

    server = MCPServer("contract")

    @server.tool()
    async def ping(ctx: Context) -> str:
        await ctx.report_progress(1, 1, "half way")  # this request's
        await ctx.session.send_tool_list_changed()  # no request's
        return "pong"

    async with (serve(server.streamable_http_app(event_store=Recording())) as port,
                Client(streamable_http_client(f"http://127.0.0.1:{port}/mcp"), mode="legacy") as client):
        async def on_progress(progress: float, total: float | None, message: str | None) -> None:
            pass

        assert (await client.call_tool("ping", {}, progress_callback=on_progress)).content[0].text == "pong"
    assert f"{sc.SDK_CLIENT_CALL_SPAN} ping" in {s.name for s in spans()}
    assert STANDALONE_STREAM_ID == GET_STREAM_KEY
    ((response_stream, response),) = [(s, m) for s, m in stored
                                      if isinstance(m, JSONRPCResponse) and m.result.get("content")]
    assert response_stream == stream_id_of(str(response.id)) == str(response.id)
    assert request_id_of(response_stream) == str(response.id)
    progress = [s for s, m in stored if isinstance(m, JSONRPCNotification) and m.method == "notifications/progress"]
    assert progress == [stream_id_of(str(response.id))]
    changed = [s for s, m in stored if isinstance(m, JSONRPCNotification) and m.method.endswith("list_changed")]
    assert changed == [stream_id_of(None)] and request_id_of(changed[0]) is None


def test_the_session_manager_routes_a_non_handshake_version_sessionless_and_keys_request_streams_by_id():
    """The guard's in-flight table (``guard.inflight``): a POST's request stream is keyed by its JSON-RPC id (a
    reused id in flight takes the stream over), and a request whose first ``MCP-Protocol-Version`` is not a
    handshake-era version never reaches a session's transport, whatever ``Mcp-Session-Id`` it names."""
    from mcp.server import streamable_http, streamable_http_manager

    routing = inspect.getsource(streamable_http_manager.StreamableHTTPSessionManager._handle_request)
    assert "pv is not None and pv not in HANDSHAKE_PROTOCOL_VERSIONS" in routing
    assert routing.index("handle_modern_request") < routing.index("_handle_stateful_request")
    assert "self._request_streams[request_id] = anyio.create_memory_object_stream" in inspect.getsource(
        streamable_http.StreamableHTTPServerTransport)


def test_the_message_router_sends_what_it_stored_only_on_a_request_stream_registered_as_the_store_returns():
    """``hooks.server._routes``: right after a message is stored, with no await between, the SDK's message router
    sends it on the request stream registered under the store's stream id, or drops it; a resumed stream is
    registered only after its replay returned and its priming event went out; the transports are the session
    manager's ``_server_instances``, by session id."""
    from mcp.server import streamable_http, streamable_http_manager

    router = inspect.getsource(streamable_http.StreamableHTTPServerTransport.connect)
    stored = router.index("event_id = await self._event_store.store_event(request_stream_id, message)")
    routed = router.index("if request_stream_id in self._request_streams:", stored)
    assert "await" not in router[router.index("\n", stored):routed]
    resume = inspect.getsource(streamable_http.StreamableHTTPServerTransport._replay_events)
    replayed = resume.index("stream_id = await event_store.replay_events_after(last_event_id, send_event)")
    primed = resume.index("await sse_stream_writer.send(priming_event)", replayed)
    assert primed < resume.index("self._request_streams[stream_id] = anyio.create_memory_object_stream", primed)
    assert "self._server_instances[session_id] = http_transport" in inspect.getsource(
        streamable_http_manager.StreamableHTTPSessionManager)


@pytest.mark.anyio
@pytest.mark.parametrize("options", [{"mode": "legacy"}, {}])
async def test_the_sdk_client_builds_each_post_from_its_message_as_json_which_httpx2_encodes_at_once(options):
    """``hooks.client._reading_json``: the SDK's client POSTs each message as ``json=`` its ``model_dump``, through
    ``AsyncClient.build_request``, and ``httpx2`` encodes it there; so the call the tap takes off that object is the
    one its body carries, as reading the body would give it (its members of JSON's own types: read off the object)."""
    from mcp_stream_exporter.exchange import read_body
    from mcp_stream_exporter.hooks.client import _ASKED

    seen: list[httpx2.Request] = []

    class Recording(httpx2.AsyncHTTPTransport):
        async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
            seen.append(request)
            return await super().handle_async_request(request)

    server = MCPServer("contract")

    @server.tool()
    async def ping() -> str:
        return "pong"

    http = instrument_client(httpx2.AsyncClient(transport=Recording()))
    async with (serve(server.streamable_http_app()) as port, http,
                Client(streamable_http_client(f"http://127.0.0.1:{port}/mcp", http_client=http), **options) as client):
        assert (await client.call_tool("ping", {})).content[0].text == "pong"
    calls = [request for request in seen if request.method == "POST" and read_body(request.content).calls]
    assert calls and all(request.extensions[_ASKED][0] is request.stream for request in calls)
    for request in calls:
        (call,) = request.extensions[_ASKED][1].calls
        assert call._replace(arguments=call.arguments.value()) == read_body(request.content).calls[0]
        assert call.tool == "ping"
