"""The lean OTLP reader reads what protobuf reads: attribute values, span fields, batches split in runs."""

from __future__ import annotations

from typing import Any

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span, Status

from mcp_stream_exporter import semconv as sc
from mcp_stream_exporter.detector import Detector
from mcp_stream_exporter.detector.events import Operation
from mcp_stream_exporter.detector.events import Span as ModelSpan
from mcp_stream_exporter.detector.ingest import IngestError, IngestLimits, _any, _value, decode_protobuf

VALUES = [
    AnyValue(string_value="3"), AnyValue(string_value=""), AnyValue(string_value="é" * 200),
    AnyValue(int_value=0), AnyValue(int_value=127), AnyValue(int_value=128), AnyValue(int_value=-1),
    AnyValue(int_value=2**63 - 1), AnyValue(bool_value=True), AnyValue(double_value=0.5), AnyValue(),
    AnyValue(array_value=ArrayValue()),
    AnyValue(array_value=ArrayValue(values=[AnyValue(string_value=s) for s in ("a", "", "ü" * 100)])),
    AnyValue(array_value=ArrayValue(values=[AnyValue(string_value="x" * 200), AnyValue(string_value="y")])),
    AnyValue(array_value=ArrayValue(values=[AnyValue(string_value="a"), AnyValue(int_value=7)])),
    AnyValue(array_value=ArrayValue(values=[AnyValue(string_value=str(i)) for i in range(1500)])),
]


@pytest.mark.parametrize("value", VALUES, ids=range(len(VALUES)))
def test_an_attribute_value_is_read_as_protobuf_reads_it(value: AnyValue) -> None:
    assert _any(value.SerializeToString()) == _value(value)


def test_a_string_attribute_that_is_not_utf8_is_refused_as_malformed() -> None:
    with pytest.raises(IngestError) as refused:
        _any(b"\x0a\x02\xff\xfe")
    assert refused.value.status == 400


def _kv(key: str, value: Any) -> KeyValue:
    if isinstance(value, list):
        return KeyValue(key=key, value=AnyValue(array_value=ArrayValue(values=[AnyValue(string_value=v)
                                                                               for v in value])))
    scalar = AnyValue(int_value=value) if isinstance(value, int) else AnyValue(string_value=value)
    return KeyValue(key=key, value=scalar)


def _span(i: int, attributes: dict[str, Any], kind: int = Span.SPAN_KIND_CLIENT, name: str = "s",
          error: bool = False) -> Span:
    span = Span(trace_id=i.to_bytes(16, "big"), span_id=(i + 1).to_bytes(8, "big"), name=name, kind=kind,
                start_time_unix_nano=1_000_000_000, end_time_unix_nano=1_500_000_000,
                attributes=[_kv(k, v) for k, v in attributes.items()],
                status=Status(code=Status.STATUS_CODE_ERROR if error else Status.STATUS_CODE_UNSET))
    span.events.add(name="exception").attributes.append(_kv("exception.type", "TimeoutError"))
    return span


def test_sdk_spans_become_operations_and_model_spans_keep_only_the_keys_the_detector_reads() -> None:
    sdk = _span(1, {sc.MCP_METHOD_NAME: "tools/call", sc.JSONRPC_REQUEST_ID: "3", "http.url": "x"},
                name="MCP send tools/call fetch", error=True)
    model = _span(3, {sc.SPAN: sc.SPAN_STREAM, sc.ROLE: sc.ROLE_CLIENT, sc.STREAM_KIND: "post",
                      sc.END_REASON: sc.END_DROPPED, sc.PENDING_REQUEST_IDS: ["3"], sc.EVENTS_COUNT: 2,
                      "app.secret": "kept out"})
    outside = _span(5, {"http.method": "GET"})
    request = ExportTraceServiceRequest(resource_spans=[ResourceSpans(scope_spans=[ScopeSpans(
        spans=[sdk, model, outside])])])
    batch = decode_protobuf(request.SerializeToString(), IngestLimits())
    operation, stream, other = list(batch.spans)
    assert batch.count == 3
    assert isinstance(operation, Operation)
    assert (operation.role, operation.method, operation.tool, operation.timed_out, operation.trace_id) == (
        sc.ROLE_CLIENT, "tools/call", "fetch", True, (1).to_bytes(16, "big").hex())
    assert isinstance(stream, ModelSpan) and isinstance(other, ModelSpan)
    assert dict(stream.attributes) == {sc.SPAN: sc.SPAN_STREAM, sc.ROLE: sc.ROLE_CLIENT, sc.STREAM_KIND: "post",
                                       sc.END_REASON: sc.END_DROPPED, sc.PENDING_REQUEST_IDS: ("3",),
                                       sc.EVENTS_COUNT: 2}
    assert stream.exception_types == ("TimeoutError",) and other.attributes == {}


def test_a_batch_decoded_in_runs_of_spans_yields_every_span_once_in_order() -> None:
    spans = [_span(i, {sc.MCP_METHOD_NAME: "ping", "filler": "f" * 900}, kind=Span.SPAN_KIND_SERVER)
             for i in range(0, 200, 2)]
    request = ExportTraceServiceRequest(resource_spans=[ResourceSpans(scope_spans=[ScopeSpans(spans=spans[:60]),
                                                                                    ScopeSpans(spans=spans[60:])])])
    batch = decode_protobuf(request.SerializeToString(), IngestLimits(max_span_bytes=4096))  # runs of ~4 spans
    read = list(batch.spans)
    assert batch.count == len(read) == 100
    assert [r.span_id for r in read] == [s.span_id.hex() for s in spans]


def test_a_sdk_span_that_breaks_the_model_is_refused_with_its_reason() -> None:
    request = ExportTraceServiceRequest(resource_spans=[ResourceSpans(scope_spans=[ScopeSpans(spans=[
        _span(1, {sc.MCP_METHOD_NAME: "x" * 300}), _span(3, {sc.MCP_METHOD_NAME: "ping"})])])])
    _, outcome = Detector().read(decode_protobuf(request.SerializeToString(), IngestLimits()).spans, "otlp_http")
    assert outcome.accepted == 1
    assert outcome.rejected == {f"{sc.MCP_METHOD_NAME} longer than 256 characters": 1}


def test_sdk_attribute_values_are_memoised_short_and_bounded_and_read_the_same() -> None:
    from mcp_stream_exporter.detector import ingest
    tools = [f"tool-{i}" for i in range(3000)] + ["t" * 200, "tool-1"]
    request = ExportTraceServiceRequest(resource_spans=[ResourceSpans(scope_spans=[ScopeSpans(spans=[
        _span(2 * i, {sc.MCP_METHOD_NAME: "tools/call", sc.GEN_AI_TOOL_NAME: tool}, kind=Span.SPAN_KIND_SERVER)
        for i, tool in enumerate(tools)])])])
    operations = list(decode_protobuf(request.SerializeToString(), IngestLimits()).spans)
    assert [o.tool for o in operations] == tools
    assert 0 < len(ingest._SDK_VALUES) <= ingest._SDK_VALUES_MAX
    assert all(len(encoded) <= ingest._SDK_VALUE_MAX_BYTES for encoded in ingest._SDK_VALUES)
