"""The SDK and httpx2 internals the hooks rely on. If an SDK 2.x or httpx2 release changes one of
them, this fails loudly here instead of the hooks going quiet in production."""

from __future__ import annotations

import inspect

import httpx2
from mcp.server.mcpserver import MCPServer
from mcp.server.streamable_http import EventStore

from mcp_stream_exporter import instrument_client, instrument_server


def test_httpx2_async_client_keeps_its_transport_in_underscore_transport():
    client = httpx2.AsyncClient()
    assert isinstance(client._transport, httpx2.AsyncBaseTransport)
    tapped = instrument_client(client)
    assert tapped is client
    assert type(client._transport).__name__ == "ClientTap"


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


def test_an_event_without_id_is_rendered_as_an_id_less_message_frame_the_guard_can_rewrite():
    """guard.py sends its refusal through the replay callback as an EventMessage without an id, and
    rewrites that frame into `event: error` on the wire. Pins the transport's rendering."""
    from mcp.server.streamable_http import EventMessage, StreamableHTTPServerTransport

    from mcp_stream_exporter.guard.store import REFUSAL_METHOD, _refusal, _rewrite_refusal
    from mcp_stream_exporter.sse import SSEFrame, SSEParser, render

    notice = _refusal({"error": "insufficient_audience", "cursor": "6"})
    assert isinstance(notice, EventMessage)
    transport = StreamableHTTPServerTransport.__new__(StreamableHTTPServerTransport)
    data = StreamableHTTPServerTransport._create_event_data(transport, notice)
    assert data == {"event": "message", "data": data["data"]}  # no "id": the client's cursor stays
    assert REFUSAL_METHOD in data["data"]
    wire = render(SSEFrame(data["data"], event=data["event"]))
    (frame,) = SSEParser().feed(_rewrite_refusal(wire))
    assert (frame.event, frame.id) == ("error", None)


def test_the_otel_sdk_provider_shares_its_span_processor_so_our_always_on_tracer_exports_where_it_does():
    """hooks._tracking.DeviationTracer builds a provider with an always-on sampler around the
    application provider's ``_active_span_processor``: our spans go to the same exporters whatever
    the application's sampler."""
    from opentelemetry.sdk.trace import SynchronousMultiSpanProcessor, TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF

    from mcp_stream_exporter.hooks._tracking import DeviationTracer

    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=ALWAYS_OFF)
    assert isinstance(provider._active_span_processor, SynchronousMultiSpanProcessor)
    assert "active_span_processor" in inspect.signature(TracerProvider).parameters
    provider.add_span_processor(SimpleSpanProcessor(exporter))  # added after: still shared
    tracer = DeviationTracer(provider)
    provider.get_tracer("app").start_span("the application's, sampled out").end()
    tracer.start_span("ours").end()
    assert [s.name for s in exporter.get_finished_spans()] == ["ours"]
