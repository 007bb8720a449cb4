"""The semconv duration histograms: each bucket's exemplar is the last SDK span that landed in it (trace and
span id, in the OpenMetrics exposition only), and the transport and protocol version labels are bounded."""

from __future__ import annotations

import sys
from dataclasses import replace
from typing import Any

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span
from prometheus_client import generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.openmetrics.parser import text_string_to_metric_families
from promtool import promtool

from mcp_stream_exporter import semconv as sc
from mcp_stream_exporter.detector import Detector
from mcp_stream_exporter.detector.limits import IngestLimits
from mcp_stream_exporter.detector.otlp import decode_protobuf

from spans import S, sdk_call

CLIENT = "mcp_client_operation_duration_seconds"
SERVER = "mcp_server_operation_duration_seconds"
START_NS = 1_764_000_000 * S


def _sdk_span(n: int, duration_s: float, *, server: bool = False, trace_id: bytes | None = None,
              **attributes: str) -> Span:
    """The SDK's span of a ``tools/call search`` as OTLP carries it (the server's names its tool)."""
    values = {sc.MCP_METHOD_NAME: "tools/call", sc.JSONRPC_REQUEST_ID: str(n), **attributes}
    if server:
        values[sc.GEN_AI_TOOL_NAME] = "search"
    return Span(trace_id=trace_id or n.to_bytes(16, "big"), span_id=n.to_bytes(8, "big"),
                name="tools/call search" if server else "MCP send tools/call search",
                kind=Span.SPAN_KIND_SERVER if server else Span.SPAN_KIND_CLIENT,
                start_time_unix_nano=START_NS + n * S, end_time_unix_nano=START_NS + n * S + int(duration_s * S),
                attributes=[KeyValue(key=k, value=AnyValue(string_value=v)) for k, v in values.items()])


def _over_otlp(*spans: Span) -> Detector:
    """A detector fed ``spans`` as the service reads an OTLP/protobuf request (the lean path)."""
    request = ExportTraceServiceRequest(resource_spans=[ResourceSpans(scope_spans=[ScopeSpans(spans=spans)])])
    detector = Detector()
    detector.consume(decode_protobuf(request.SerializeToString(), IngestLimits()).spans, "otlp_http")
    return detector


def _buckets(detector: Detector, metric: str) -> dict[str, Any]:
    """le -> the bucket sample (with its exemplar) of ``metric``'s one series, from the OpenMetrics exposition."""
    (family,) = [f for f in text_string_to_metric_families(generate_openmetrics(detector.registry).decode())
                 if f.name == metric]
    return {s.labels["le"]: s for s in family.samples if s.name == f"{metric}_bucket"}


def test_each_bucket_carries_the_last_span_that_landed_in_it_as_an_openmetrics_exemplar():
    detector = _over_otlp(_sdk_span(1, 0.03), _sdk_span(2, 0.04), _sdk_span(3, 1.5))
    buckets = _buckets(detector, CLIENT)
    assert buckets["0.05"].value == 2 and buckets["2.0"].value == 3
    assert buckets["0.05"].exemplar.labels == {"trace_id": (2).to_bytes(16, "big").hex(),
                                               "span_id": (2).to_bytes(8, "big").hex()}
    assert buckets["0.05"].exemplar.value == pytest.approx(0.04)
    assert float(buckets["0.05"].exemplar.timestamp) == pytest.approx((START_NS + 2 * S) / S + 0.04, abs=1e-6)
    assert buckets["2.0"].exemplar.labels["trace_id"] == (3).to_bytes(16, "big").hex()
    assert [le for le, sample in buckets.items() if sample.exemplar is not None] == ["0.05", "2.0"]


def test_a_later_batch_replaces_the_exemplar_of_the_buckets_it_lands_in_only():
    detector = _over_otlp(_sdk_span(1, 0.03), _sdk_span(2, 1.5))
    detector.consume([sdk_call(sc.ROLE_CLIENT, "search", request_id="9", span_id="00000000000000aa")])  # 1 µs
    detector.consume([sdk_call(sc.ROLE_CLIENT, "search", request_id="9", span_id="00000000000000bb")])
    exemplars = {le: s.exemplar and s.exemplar.labels["span_id"] for le, s in _buckets(detector, CLIENT).items()}
    assert (exemplars["0.01"], exemplars["0.05"], exemplars["2.0"]) == (
        "00000000000000bb", (1).to_bytes(8, "big").hex(), (2).to_bytes(8, "big").hex())


def test_the_plain_text_format_has_no_exemplars_and_passes_promtool():
    detector = _over_otlp(_sdk_span(1, 0.03), _sdk_span(2, 0.2, server=True))
    text = generate_latest(detector.registry).decode()
    assert f'{CLIENT}_bucket{{' in text and f'{SERVER}_bucket{{' in text and "trace_id" not in text
    check = promtool("check", "metrics", stdin=text)
    assert check.returncode == 0, check.stdout + check.stderr


def test_a_trace_id_longer_than_w3c_is_counted_without_an_exemplar():
    """Exemplar labels over 128 characters would make Prometheus refuse the whole scrape."""
    detector = _over_otlp(_sdk_span(1, 0.03, trace_id=b"\x01" * 64))
    assert _buckets(detector, CLIENT)["0.05"].value == 1
    assert _buckets(detector, CLIENT)["0.05"].exemplar is None


@pytest.mark.parametrize(("attributes", "transport", "version"), [
    ({sc.NETWORK_TRANSPORT: "tcp", sc.MCP_PROTOCOL_VERSION: "2025-06-18"}, "tcp", "2025-06-18"),
    ({sc.NETWORK_TRANSPORT: "pipe", sc.MCP_PROTOCOL_VERSION: "2026-07-28"}, "pipe", "2026-07-28"),
    ({sc.NETWORK_TRANSPORT: "carrier-pigeon", sc.MCP_PROTOCOL_VERSION: "2099-01-01"}, "other", "other"),
    ({sc.NETWORK_TRANSPORT: "Bearer eyJhbGciOi.x.y", sc.MCP_PROTOCOL_VERSION: "s-1f3a"}, "other", "other"),
    ({}, "", ""),
])
def test_transport_and_protocol_version_labels_come_from_closed_sets(attributes, transport, version):
    labels = {"mcp_method_name": "tools/call", "gen_ai_tool_name": "search", "error_type": "",
              "network_transport": transport, "mcp_protocol_version": version}
    over_otlp = _over_otlp(_sdk_span(1, 0.03, server=True, **attributes))
    assert over_otlp.registry.get_sample_value(f"{SERVER}_count", labels) == 1
    embedded = Detector()  # the same span as the embedded detector reads it (a Span, not the lean path)
    span = sdk_call(sc.ROLE_SERVER, "search")
    embedded.consume([replace(span, attributes={**span.attributes, **attributes})])
    assert embedded.registry.get_sample_value(f"{SERVER}_count", labels) == 1


def _held(value: object, seen: set[int] | None = None) -> int:
    """What CPython says ``value`` and everything it holds take, each object once."""
    seen = set() if seen is None else seen
    if id(value) in seen:
        return 0
    seen.add(id(value))
    size = sys.getsizeof(value)
    if isinstance(value, (tuple, list)):
        size += sum(_held(v, seen) for v in value)
    elif isinstance(value, dict):
        size += sum(_held(k, seen) + _held(v, seen) for k, v in value.items())
    else:
        size += sum(_held(getattr(value, name), seen) for name in getattr(type(value), "__slots__", ()))
    return size


def test_a_batchs_operation_counts_are_charged_to_the_ingest_queue_about_what_they_hold() -> None:
    """The queue's byte bound takes OperationCounts.weight (a formula) instead of walking every span a
    batch keeps as an exemplar; it must stay near what they hold, or the bound drifts."""
    from mcp_stream_exporter.detector.metrics import OperationCounts

    spans = [_sdk_span(n, 0.01 * (n % 40), server=n % 2 == 0, **{sc.MCP_PROTOCOL_VERSION: "2025-11-25"})
             for n in range(1, 400)]
    request = ExportTraceServiceRequest(resource_spans=[ResourceSpans(scope_spans=[ScopeSpans(spans=spans)])])
    events, _ = Detector().read(decode_protobuf(request.SerializeToString(), IngestLimits()).spans, "otlp_http")
    (counts,) = [e for e in events if isinstance(e, OperationCounts)]
    held = _held(counts)
    assert 0.7 * held <= counts.weight() <= 1.5 * held


def test_label_sets_past_the_cap_are_counted_under_other_not_as_series_of_their_own():
    """Each label is of a closed set, but a producer that varies them all (error codes, methods, versions) would
    make millions of series: past the cap, new label sets go to one series of their role, all ``other``."""
    from mcp_stream_exporter.detector.metrics import MAX_OPERATION_SERIES

    codes = [str(c) for c in range(-32099, -31999)]
    spans = [_sdk_span(n, 0.01, **{sc.ERROR_TYPE: codes[n % len(codes)], sc.MCP_PROTOCOL_VERSION: version,
                                   "network.transport": transport})
             for n, (version, transport) in enumerate(
                 (v, t) for v in ("2025-03-26", "2025-06-18", "2025-11-25", "2026-07-28", "x")
                 for t in ("tcp", "quic", "udp", "pipe", "unix", "y") for _ in range(100))]
    detector = _over_otlp(*spans)
    (family,) = [f for f in detector.registry.collect() if f.name == CLIENT]
    counts = {tuple(sorted(s.labels.items())): s.value for s in family.samples if s.name == f"{CLIENT}_count"}
    assert len(spans) > MAX_OPERATION_SERIES and len(counts) == MAX_OPERATION_SERIES + 1
    assert sum(counts.values()) == len(spans)
    folded = {k: v for k, v in counts.items() if dict(k)["mcp_method_name"] == "other"}
    assert list(folded.values()) == [len(spans) - MAX_OPERATION_SERIES]
