"""An application that sets its tracer provider after it built its instrumented MCP client (a client made at import
time, tracing configured in ``main``): what test_sampling.py runs in a process of its own (a process has one global
provider). The call's stream is cut and its resumes refused (401), so the SDK fails the call itself; prints the
client's call spans' outcomes and how many calls the embedded detector still counts in flight, as one JSON document."""

from __future__ import annotations

import asyncio
import json

from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from mcp_stream_exporter import instrument_client, instrument_server
from mcp_stream_exporter import semconv as sc
from mcp_stream_exporter.detector import Detector
from mcp_stream_exporter.detector.embedded import DetectorSpanProcessor
from mcp_stream_exporter.lab import (
    BASE_RESOURCE,
    FETCH_RESOURCE,
    SEARCH_RESOURCE,
    BearerAuth,
    IncidentEventStore,
    TokenIssuer,
    build_incident_server,
    incident_policy,
    serve,
)
from mcp_stream_exporter.lab.proxy import CutProxy

ISSUER, POLICY = TokenIssuer(), incident_policy()
AUTH = BearerAuth(ISSUER.mint([BASE_RESOURCE, SEARCH_RESOURCE, FETCH_RESOURCE]))
HTTP = instrument_client(auth=AUTH, policy=POLICY)  # built before the application's tracing is


async def main() -> None:
    exporter, detector = InMemorySpanExporter(), Detector()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    provider.add_span_processor(DetectorSpanProcessor(detector))
    trace.set_tracer_provider(provider)
    store = IncidentEventStore(POLICY)
    server = build_incident_server(ISSUER, store=store)
    app = instrument_server(server, policy=POLICY, event_store=store, retry_interval=200)
    async with serve(app) as port:
        proxy = CutProxy(port)
        await proxy.start()
        try:
            async with HTTP, Client(streamable_http_client(f"http://127.0.0.1:{proxy.port}/mcp", http_client=HTTP),
                                    mode="legacy") as client:
                proxy.arm(b"fetch step 1", on_cut=lambda: setattr(AUTH, "token", "not a token"))
                async def on_progress(progress: float, total: float | None, message: str | None) -> None:
                    pass  # asked for: the tool then sends its steps, and the proxy cuts at the first

                told = False
                try:
                    await client.call_tool("fetch", {"url": "u", "steps": 4}, progress_callback=on_progress)
                except MCPError:
                    told = True
                outcome = {  # before the client closes, which ends whatever calls went through it
                    "told": told,
                    "outcomes": [s.attributes[sc.CALL_OUTCOME] for s in exporter.get_finished_spans()
                                 if (s.attributes or {}).get(sc.SPAN) == sc.SPAN_CALL
                                 and s.attributes.get(sc.ROLE) == sc.ROLE_CLIENT],
                    "in_flight": detector.registry.get_sample_value("mcp_stream_calls_in_flight"),
                }
        finally:
            await proxy.stop()
    print(json.dumps(outcome))


if __name__ == "__main__":
    asyncio.run(main())
