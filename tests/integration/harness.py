"""Real servers on 127.0.0.1 for the integration tests, and span look-ups by the span model."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

import uvicorn
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from mcp_stream_exporter import semconv as sc

_EXPORTER: InMemorySpanExporter | None = None


def span_exporter() -> InMemorySpanExporter:
    """One global provider for the whole run (OTel allows one), so the SDK's own spans are real too."""
    global _EXPORTER
    if _EXPORTER is None:
        _EXPORTER = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(_EXPORTER))
        trace.set_tracer_provider(provider)
    return _EXPORTER


@contextlib.asynccontextmanager
async def serve(app: Any) -> AsyncIterator[int]:
    """Serve ``app`` with uvicorn on an ephemeral 127.0.0.1 port; yields the port."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on"))
    task = asyncio.create_task(server.serve())
    for _ in range(500):
        if server.started:
            break
        await asyncio.sleep(0.01)
    assert server.started, "uvicorn did not start"
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield port
    finally:
        server.should_exit = True
        await task


def ours(spans: Sequence[ReadableSpan], kind: str, role: str | None = None, **attrs: Any) -> list[ReadableSpan]:
    """Spans of the span model of one kind (stream, call, replay), filtered by role and attributes."""
    out = []
    for s in spans:
        a = s.attributes or {}
        if a.get(sc.SPAN) != kind or (role is not None and a.get(sc.ROLE) != role):
            continue
        if all(a.get(k.replace("__", ".")) == v for k, v in attrs.items()):
            out.append(s)
    return out
