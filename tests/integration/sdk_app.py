"""An MCP server and client on the SDK alone, no hook called by hand: what ``opentelemetry-instrument`` runs in
test_instrumentor.py. One ``tools/call`` over real HTTP on 127.0.0.1; prints its result and every span
finished, as one JSON document."""

from __future__ import annotations

import asyncio
import json

from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.server.mcpserver import MCPServer
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from mcp_stream_exporter.lab import serve


async def main() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    server = MCPServer("probe")

    @server.tool()
    def echo(text: str) -> str:
        return text

    async with (serve(server.streamable_http_app()) as port,
                Client(streamable_http_client(f"http://127.0.0.1:{port}/mcp"), mode="legacy") as client):
        result = await client.call_tool("echo", {"text": "hello"})
    print(json.dumps({
        "result": result.content[0].text,  # type: ignore[union-attr]
        "spans": [{"name": s.name, "scope": s.instrumentation_scope.name, "version": s.instrumentation_scope.version,
                   "schema_url": s.instrumentation_scope.schema_url, "attributes": dict(s.attributes or {})}
                  for s in exporter.get_finished_spans() if s.instrumentation_scope is not None],
    }))


if __name__ == "__main__":
    asyncio.run(main())
