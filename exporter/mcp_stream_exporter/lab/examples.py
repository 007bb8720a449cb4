"""The incident as OTLP/JSON, for ``docs/examples/``: what the hooks and the SDK emit, side by side.

A producer of the span model for another SDK can diff its own output against these files, post them
to ``mcp-stream-exporter serve`` and get the findings in ``incident.findings.json``. Regenerate with
``python -m mcp_stream_exporter.lab.examples docs/examples`` (ids and session ids change on every run;
times are rebased to 2026-01-01T00:00:00Z so that only what the hooks do shows in a diff).
"""

from __future__ import annotations

import asyncio
import base64
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from google.protobuf import json_format
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from mcp_stream_exporter import semconv as sc
from mcp_stream_exporter.detector import Detector, DetectorConfig, RuleConfig
from mcp_stream_exporter.detector.embedded import span_of
from mcp_stream_exporter.lab.scenario import incident

EPOCH_NS = 1_767_225_600 * 10**9  # 2026-01-01T00:00:00Z: every file starts here
SIDES = {sc.ROLE_CLIENT: "mcp-client", sc.ROLE_SERVER: "mcp-server"}  # role -> the file's service.name
_ID_KEYS = ("traceId", "spanId", "parentSpanId")


async def record() -> list[ReadableSpan]:
    """Run the incident (search and fetch, the drop, the narrowing refresh, the silent replay) on the
    real SDK and return every span: the SDK's and the hooks'. Needs the global provider unset."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    async with incident("legacy") as lab:
        lab.proxy.arm(b"fetch step 1", on_cut=lab.refresh_narrows)
        await asyncio.gather(lab.call("search", {"query": "q", "steps": 4}),
                             lab.call("fetch", {"url": "u", "steps": 4}, timeout=2.5), return_exceptions=True)
    return list(exporter.get_finished_spans())


def side(span: ReadableSpan) -> str | None:
    """Which side emitted a span: ours say so; the SDK's are CLIENT or SERVER spans with ``mcp.*``."""
    attributes = span.attributes or {}
    role = attributes.get(sc.ROLE)
    if isinstance(role, str):
        return role
    if sc.MCP_METHOD_NAME in attributes and span.kind in (SpanKind.CLIENT, SpanKind.SERVER):
        return sc.ROLE_CLIENT if span.kind == SpanKind.CLIENT else sc.ROLE_SERVER
    return None


def otlp_json(spans: Sequence[ReadableSpan], service_name: str, shift_ns: int) -> dict[str, Any]:
    """An OTLP/JSON ``ExportTraceServiceRequest``: hex ids, times moved by ``shift_ns``."""
    request = encode_spans([_rebased(s, shift_ns, service_name) for s in spans])
    doc: dict[str, Any] = json_format.MessageToDict(request)
    _hex_ids(doc)
    return doc


def expected_findings(spans: Sequence[ReadableSpan]) -> list[dict[str, Any]]:
    """What the detector finds in these spans once the grace period has passed: rule and tool (which
    sides a finding lists depends on the order the sides' spans arrive in)."""
    now = max(s.end_time or 0 for s in spans)
    detector = Detector(DetectorConfig(rules=RuleConfig(clean_end_grace_s=1)), clock=lambda: now)
    detector.consume([c for c in map(span_of, spans) if c is not None])
    now += 10**10
    detector.tick()
    return sorted(({"rule": f.rule, "tool": f.tool} for f in detector.findings), key=lambda f: str(f["rule"]))


def write(directory: Path, spans: Sequence[ReadableSpan]) -> None:
    shift = EPOCH_NS - min(s.start_time or 0 for s in spans)
    directory.mkdir(parents=True, exist_ok=True)
    for role, service_name in SIDES.items():
        mine = [s for s in spans if side(s) == role]
        text = json.dumps(otlp_json(mine, service_name, shift), indent=1, sort_keys=True)
        (directory / f"incident-{role}.otlp.json").write_text(text + "\n")
    findings = json.dumps(expected_findings(spans), indent=1)
    (directory / "incident.findings.json").write_text(findings + "\n")


def _rebased(span: ReadableSpan, shift_ns: int, service_name: str) -> ReadableSpan:
    return ReadableSpan(
        name=span.name, context=span.context, parent=span.parent, resource=Resource({"service.name": service_name}),
        attributes=span.attributes, events=[_event(e, shift_ns) for e in span.events], links=span.links,
        kind=span.kind, status=span.status, start_time=(span.start_time or 0) + shift_ns,
        end_time=(span.end_time or 0) + shift_ns, instrumentation_scope=span.instrumentation_scope)


def _event(event: Any, shift_ns: int) -> Any:
    return type(event)(event.name, event.attributes, event.timestamp + shift_ns)


def _hex_ids(node: Any) -> None:
    if isinstance(node, list):
        for item in node:
            _hex_ids(item)
    elif isinstance(node, dict):
        for key, value in node.items():
            if key in _ID_KEYS and isinstance(value, str):
                node[key] = base64.b64decode(value).hex()
            else:
                _hex_ids(value)


def main(argv: Sequence[str]) -> None:
    write(Path(argv[0] if argv else "docs/examples"), asyncio.run(record()))


if __name__ == "__main__":
    main(sys.argv[1:])
