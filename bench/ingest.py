"""Detector throughput against a bare OTLP decode of the same payloads, and memory per tracked call.

Payload: OTLP protobuf batches encoded by the OpenTelemetry SDK's own encoder from spans shaped
like the hooks' (docs/span-model.md): per session, one healthy call (the SDK's client and server
spans) and one deviating call as in the incident (a dropped POST, three resumes ending clean with the
call pending and a narrowed token, a truncated replay, the call span). Each round times, on the same
batches and alternating which goes first, (A) the bare decode, ``ExportTraceServiceRequest.FromString``,
and (B) the detector's whole path: decode, read every span into the model, apply to the ledger,
rules and metrics. Reported: the median over rounds of rate(B) / rate(A) (target >= 0.5).

A second baseline, (W), decodes and reads every span's fields and attributes into Python (the least
any Python consumer of OTLP does): rate(B) / rate(W) shows what the ledger and rules themselves cost.

Memory: tracemalloc's traced bytes after ingesting N calls into a fresh detector (spans already
decoded), divided by N: a tracked call (its POST dropped with it pending, owed a result; target
<= 1 KiB) and a lost call with its findings and their evidence (the incident's shape).
Bounded: ROUNDS x SESSIONS.

    python bench/ingest.py [--sessions 2000] [--rounds 7] [--memory-calls 20000]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
import tracemalloc

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from mcp_stream_exporter import semconv as sc
from mcp_stream_exporter.detector import Detector, DetectorConfig
from mcp_stream_exporter.detector.ingest import spans_of

FETCH = "https://mcp.example.com/tools/fetch"
SEARCH = "https://mcp.example.com/tools/search"
BATCH = 512


def _sessions(n: int, *, lost: bool = True) -> list:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("bench")
    for i in range(n):
        session = f"session-{i:08d}"
        with (tracer.start_as_current_span("MCP send tools/call search", kind=SpanKind.CLIENT, attributes={
                  sc.MCP_METHOD_NAME: "tools/call", sc.JSONRPC_REQUEST_ID: "2"}),
              tracer.start_as_current_span("tools/call search", kind=SpanKind.SERVER, attributes={
                  sc.MCP_METHOD_NAME: "tools/call", sc.JSONRPC_REQUEST_ID: "2", sc.GEN_AI_TOOL_NAME: "search"})):
            pass
        common = {sc.ROLE: sc.ROLE_CLIENT, sc.ERA: sc.ERA_RESUMABLE, sc.MCP_SESSION_ID: session,
                  sc.MCP_PROTOCOL_VERSION: "2025-11-25"}
        stream = {**common, sc.SPAN: sc.SPAN_STREAM, sc.STREAM_REQUEST_IDS: ["3"], sc.GEN_AI_TOOL_NAME: "fetch",
                  sc.HTTP_REQUEST_METHOD: "GET", sc.STREAM_CONTENT: "sse", sc.HTTP_RESPONSE_STATUS_CODE: 200}
        with tracer.start_as_current_span("MCP call tools/call fetch", attributes={
                **common, sc.SPAN: sc.SPAN_CALL, sc.JSONRPC_REQUEST_ID: "3", sc.GEN_AI_TOOL_NAME: "fetch",
                sc.REQUIRED_RESOURCES: [FETCH], sc.CALL_OUTCOME: sc.OUTCOME_CANCELLED, sc.CALL_STREAMS: 4}):
            with tracer.start_as_current_span("MCP stream post", kind=SpanKind.CLIENT, attributes={
                    **stream, sc.STREAM_KIND: "post", sc.END_REASON: "dropped", sc.PENDING_REQUEST_IDS: ["3"],
                    sc.EVENTS_COUNT: 2, sc.EVENT_FIRST_ID: "4", sc.EVENT_LAST_ID: "6"}):
                pass
            for _ in range(3 if lost else 0):
                with tracer.start_as_current_span("MCP stream resume", kind=SpanKind.CLIENT, attributes={
                        **stream, sc.STREAM_KIND: "resume", sc.END_REASON: "clean", sc.RESUME_CURSOR: "6",
                        sc.PENDING_REQUEST_IDS: ["3"], sc.EVENTS_COUNT: 0, sc.AUTH_AUDIENCE: [SEARCH],
                        sc.AUTH_FINGERPRINT: "0123456789abcdef", sc.REQUIRED_RESOURCES: [FETCH],
                        sc.AUTH_MISSING_RESOURCES: [FETCH]}):
                    pass
            if not lost:
                continue
            with tracer.start_as_current_span("MCP replay", attributes={
                    **common, sc.ROLE: sc.ROLE_SERVER, sc.SPAN: sc.SPAN_REPLAY, sc.RESUME_CURSOR: "6",
                    sc.JSONRPC_REQUEST_ID: "3", sc.REPLAY_DECISION: sc.REPLAY_TRUNCATED, sc.REPLAY_BUFFERED: 4,
                    sc.REPLAY_SENT: 0, sc.REPLAY_OFFENDING_EVENT_ID: "8", sc.AUTH_AUDIENCE: [SEARCH],
                    sc.REQUIRED_RESOURCES: [FETCH], sc.AUTH_MISSING_RESOURCES: [FETCH]}):
                pass
    return list(exporter.get_finished_spans())


def _batches(spans: list) -> list[bytes]:
    return [encode_spans(spans[i:i + BATCH]).SerializeToString() for i in range(0, len(spans), BATCH)]


def _bare(batches: list[bytes]) -> float:
    started = time.perf_counter()
    for body in batches:
        ExportTraceServiceRequest.FromString(body)
    return time.perf_counter() - started


def _walk(batches: list[bytes]) -> float:
    """The least any Python consumer does: decode, and read each span's fields and attributes."""
    started = time.perf_counter()
    for body in batches:
        for _ in spans_of(ExportTraceServiceRequest.FromString(body)):
            pass
    return time.perf_counter() - started


def _full(batches: list[bytes]) -> float:
    detector = Detector(DetectorConfig())
    started = time.perf_counter()
    for body in batches:
        events, _ = detector.read(spans_of(ExportTraceServiceRequest.FromString(body)), "otlp_http")
        detector.apply(events)
    return time.perf_counter() - started


def _memory_per_call(calls: int, *, lost: bool) -> float:
    spans = list(spans_of(encode_spans(_sessions(calls, lost=lost))))
    events, _ = Detector().read(spans, "bench")
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    detector = Detector(DetectorConfig())
    detector.apply(events)
    gc.collect()
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    assert detector.ledger.calls == calls, detector.ledger.calls
    return (after - before) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--memory-calls", type=int, default=20000)
    args = parser.parse_args()
    spans = _sessions(args.sessions)
    batches = _batches(spans)
    ratios, walk_ratios, bare_rates, full_rates = [], [], [], []
    for r in range(args.rounds):
        order = [_bare, _walk, _full] if r % 2 == 0 else [_full, _walk, _bare]
        took = {f.__name__: f(batches) for f in order}
        bare, walk, full = took["_bare"], took["_walk"], took["_full"]
        bare_rates.append(len(spans) / bare)
        full_rates.append(len(spans) / full)
        ratios.append(bare / full)
        walk_ratios.append(walk / full)
    print(json.dumps({
        "spans_per_round": len(spans), "batches": len(batches), "rounds": args.rounds,
        "bare_decode_spans_per_s": round(statistics.median(bare_rates)),
        "detector_spans_per_s": round(statistics.median(full_rates)),
        "ratio_detector_to_bare": round(statistics.median(ratios), 3),
        "ratio_spread": [round(min(ratios), 3), round(max(ratios), 3)],
        "ratio_detector_to_decode_and_attribute_walk": round(statistics.median(walk_ratios), 3),
        "bytes_per_tracked_call": round(_memory_per_call(args.memory_calls, lost=False)),
        "bytes_per_lost_call_with_its_findings": round(_memory_per_call(args.memory_calls, lost=True)),
    }, indent=2))


if __name__ == "__main__":
    main()
