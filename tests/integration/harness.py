"""Real servers on 127.0.0.1 for the integration tests, and span look-ups by the span model."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from mcp_stream_exporter import lab
from mcp_stream_exporter import semconv as sc
from mcp_stream_exporter.lab import Incident

_EXPORTER: InMemorySpanExporter | None = None
TOKENS_USED: list[str] = []  # every bearer a scenario minted; conftest checks none leaked


def span_exporter() -> InMemorySpanExporter:
    """One global provider for the whole run (OTel allows one), so the SDK's own spans are real too."""
    global _EXPORTER
    if _EXPORTER is None:
        _EXPORTER = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(_EXPORTER))
        trace.set_tracer_provider(provider)
    return _EXPORTER


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


@contextlib.asynccontextmanager
async def incident(mode: str | None = "legacy", **options: Any) -> AsyncIterator[Incident]:
    """The lab incident with spans going to the in-memory exporter, cleared first."""
    span_exporter().clear()
    async with lab.incident(mode, **options) as scenario:
        TOKENS_USED.extend((scenario.broad, scenario.narrow))
        yield scenario


def spans() -> list[ReadableSpan]:
    return list(span_exporter().get_finished_spans())
