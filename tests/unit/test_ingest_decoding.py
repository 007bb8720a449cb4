"""The lean OTLP reader reads what protobuf reads: attribute values, span fields, batches split in runs; what
OTLP does not allow is refused span by span, in protobuf and in JSON; bodies are decompressed as HTTP says."""

from __future__ import annotations

import gzip
import hashlib
import json
import random
import zlib
from bisect import bisect_left
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, InstrumentationScope, KeyValue
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span, Status

from mcp_stream_exporter import semconv as sc
from mcp_stream_exporter.detector import Detector, otlp
from mcp_stream_exporter.detector.events import MAX_CHARS, Operation, Rejected, StreamEnd, lifecycle
from mcp_stream_exporter.detector.events import Span as ModelSpan
from mcp_stream_exporter.detector.ingest import JSON, PROTOBUF, decode, decompress
from mcp_stream_exporter.detector.limits import IngestError, IngestLimits
from mcp_stream_exporter.detector.metrics import BOUNDS, OperationCounts
from mcp_stream_exporter.detector.otlp import _any, _value, decode_protobuf
from mcp_stream_exporter.redaction import redact

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
    if isinstance(value, AnyValue):
        return KeyValue(key=key, value=value)
    if isinstance(value, list):
        return KeyValue(key=key, value=AnyValue(array_value=ArrayValue(values=[AnyValue(string_value=v)
                                                                               for v in value])))
    scalar = AnyValue(int_value=value) if isinstance(value, int) else AnyValue(string_value=value)
    return KeyValue(key=key, value=scalar)


def _span(i: int, attributes: dict[str, Any], kind: int = Span.SPAN_KIND_CLIENT, name: str = "s",
          error: bool = False, exception: str | None = "TimeoutError", duration_ns: int = 500_000_000) -> Span:
    span = Span(trace_id=i.to_bytes(16, "big"), span_id=(i + 1).to_bytes(8, "big"), name=name, kind=kind,
                start_time_unix_nano=1_000_000_000, end_time_unix_nano=1_000_000_000 + duration_ns,
                attributes=[_kv(k, v) for k, v in attributes.items()],
                status=Status(code=Status.STATUS_CODE_ERROR if error else Status.STATUS_CODE_UNSET))
    if exception is not None:
        span.events.add(name="exception").attributes.append(_kv("exception.type", exception))
    return span


def _request(*spans: Span) -> bytes:
    return ExportTraceServiceRequest(resource_spans=[ResourceSpans(scope_spans=[ScopeSpans(
        spans=spans)])]).SerializeToString()


def test_rules_read_sdk_spans_become_operations_healthy_ones_are_counted_model_spans_become_their_events() -> None:
    failed = _span(1, {sc.MCP_METHOD_NAME: "tools/call", sc.JSONRPC_REQUEST_ID: "3", "http.url": "x"},
                   name="MCP send tools/call fetch", error=True)
    healthy = _span(7, {sc.MCP_METHOD_NAME: "tools/call", sc.GEN_AI_TOOL_NAME: "fetch"},
                    kind=Span.SPAN_KIND_SERVER, exception=None)
    model = _span(3, {sc.SPAN: sc.SPAN_STREAM, sc.ROLE: sc.ROLE_CLIENT, sc.STREAM_KIND: "post",
                      sc.END_REASON: sc.END_DROPPED, sc.PENDING_REQUEST_IDS: ["3"], sc.EVENTS_COUNT: 2,
                      "app.secret": "kept out"})
    outside = _span(5, {"http.method": "GET"})
    batch = decode_protobuf(_request(failed, healthy, model, outside), IngestLimits())
    operation, stream, counts = list(batch.spans)
    assert batch.count == 4
    assert isinstance(operation, Operation)
    assert (operation.role, operation.method, operation.tool, operation.timed_out, operation.trace_id) == (
        sc.ROLE_CLIENT, "tools/call", "fetch", True, (1).to_bytes(16, "big").hex())
    assert isinstance(stream, StreamEnd)
    assert (stream.at.role, stream.kind, stream.reason, stream.pending_ids, stream.events) == (
        sc.ROLE_CLIENT, "post", sc.END_DROPPED, ("3",), 2)
    assert isinstance(counts, OperationCounts) and counts.taken == 2  # the healthy span, and the one outside
    ((key, (buckets, last)),) = counts.counts.items()
    assert key == (sc.ROLE_SERVER, "tools/call", "fetch", "", None, None)
    assert buckets[BOUNDS.index(0.5)] == 1 and buckets[-1] == 0.5
    assert last[BOUNDS.index(0.5)] == ((7).to_bytes(16, "big").hex(), (8).to_bytes(8, "big").hex(), 0.5, 1.5)
    _, outcome = Detector().read(decode_protobuf(_request(failed, healthy, model, outside), IngestLimits()).spans,
                                 "otlp_http")
    assert outcome.accepted == 4


def _varied_sdk_spans(n: int) -> list[Span]:
    """SDK request spans of every shape their labels can take: methods, tools named or not, error types,
    JSON-RPC codes, timeouts by code or exception, error statuses, kinds, durations, a span too long."""
    methods = ["tools/call", "tools/list", "initialize", "ping", "made/up"]
    extras: list[dict[str, Any]] = [{}, {sc.ERROR_TYPE: "tool_error"}, {sc.RPC_RESPONSE_STATUS_CODE: "-32001"},
                                    {sc.ERROR_TYPE: "-32602", sc.RPC_RESPONSE_STATUS_CODE: "-32602"},
                                    {sc.NETWORK_TRANSPORT: "tcp", sc.MCP_PROTOCOL_VERSION: "2025-11-25"},
                                    {sc.ERROR_TYPE: "Bearer eyJhbGciOi.x.y"}, {sc.MCP_METHOD_NAME: "x" * 300},
                                    {sc.GEN_AI_TOOL_NAME: AnyValue()},
                                    {sc.GEN_AI_TOOL_NAME: AnyValue(bytes_value=b"t")},
                                    {sc.GEN_AI_TOOL_NAME: AnyValue(int_value=3)}]
    spans = []
    for i in range(n):
        method = methods[i % len(methods)]
        attributes = {sc.MCP_METHOD_NAME: method, sc.JSONRPC_REQUEST_ID: str(i), **extras[i // 2 % len(extras)]}
        if i % 3 == 0:
            attributes[sc.GEN_AI_TOOL_NAME] = f"tool-{i % 4}"
        kind = (Span.SPAN_KIND_CLIENT, Span.SPAN_KIND_SERVER, Span.SPAN_KIND_INTERNAL)[i % 7 % 3]
        spans.append(_span(2 * i, attributes, kind=kind, name=f"MCP send {method} tool-{i % 5}", error=i % 11 == 0,
                           exception=("TimeoutError", "ValueError", None, None, None)[i // 5 % 5],
                           duration_ns=(i * 7_919_000) % 9_000_000_000))
    return spans


def test_healthy_sdk_spans_counted_at_once_give_the_labels_counts_and_exemplars_of_reading_each_one() -> None:
    from mcp_stream_exporter.detector import otlp as ingest

    spans = _varied_sdk_spans(700)
    events, outcome = Detector().read(decode_protobuf(_request(*spans), IngestLimits()).spans, "otlp_http")
    one_by_one = [ingest._read(s, "", "") for s in ingest._LeanScopeSpans.FromString(
        ScopeSpans(spans=spans).SerializeToString()).spans]
    expected_events, expected_outcome = Detector().read(one_by_one, "otlp_http")
    assert (outcome.accepted, outcome.rejected) == (expected_outcome.accepted, expected_outcome.rejected)
    assert outcome.rejected and any(isinstance(e, Operation) for e in events)
    (counts,) = [e for e in events if isinstance(e, OperationCounts)]
    (expected,) = [e for e in expected_events if isinstance(e, OperationCounts)]
    assert counts.taken == expected.taken
    def tallied(c: OperationCounts) -> dict[Any, Any]:  # per key: counts per bucket, the durations' sum
        return {k: (b[:-1], round(b[-1], 6)) for k, (b, _) in c.counts.items()}

    assert tallied(counts) == tallied(expected)
    timing = {(s.trace_id.hex(), s.span_id.hex()): ((s.end_time_unix_nano - s.start_time_unix_nano) / 1e9,
                                                  s.end_time_unix_nano / 1e9) for s in spans}
    for key, (_, last) in counts.counts.items():  # an exemplar: one of the batch's spans of that key and bucket
        assert [s is None for s in last] == [s is None for s in expected.counts[key][1]]
        for bucket, sample in enumerate(last):
            assert sample is None or (timing[sample[:2]] == pytest.approx(sample[2:])
                                      and bisect_left(BOUNDS, sample[2]) == bucket)
    assert [e for e in events if not isinstance(e, OperationCounts)] == [
        e for e in expected_events if not isinstance(e, OperationCounts)]


def test_the_memo_of_sdk_span_labels_is_bounded_in_entries_and_in_the_bytes_of_each() -> None:
    from mcp_stream_exporter.detector import otlp as ingest

    tools = [f"tool-{i}" for i in range(ingest._LABELS_MAX + 100)] + ["t" * 600, "tool-1"]
    spans = [_span(2 * i, {sc.MCP_METHOD_NAME: "tools/call", sc.GEN_AI_TOOL_NAME: tool}, kind=Span.SPAN_KIND_SERVER,
                   exception=None) for i, tool in enumerate(tools)]
    _, outcome = Detector().read(decode_protobuf(_request(*spans), IngestLimits()).spans, "otlp_http")
    assert outcome.accepted == len(tools) - 1 and outcome.rejected  # the 600-character tool breaks the model
    assert 0 < len(ingest._LABELS) <= ingest._LABELS_MAX
    assert all(sum(len(v or b"") for v in values) + len(name or "") <= ingest._LABELS_KEY_MAX_BYTES
               for _, _, values, name in ingest._LABELS)


def test_a_batch_decoded_in_runs_of_spans_yields_every_span_once_in_order() -> None:
    spans = [_span(i, {sc.SPAN: sc.SPAN_STREAM, sc.ROLE: sc.ROLE_SERVER, sc.STREAM_KIND: "get",
                       sc.END_REASON: sc.END_CLEAN, "filler": "f" * 900}, kind=Span.SPAN_KIND_SERVER)
             for i in range(2, 202, 2)]
    request = ExportTraceServiceRequest(resource_spans=[ResourceSpans(scope_spans=[ScopeSpans(spans=spans[:60]),
                                                                                    ScopeSpans(spans=spans[60:])])])
    batch = decode_protobuf(request.SerializeToString(), IngestLimits(max_span_bytes=4096))  # runs of ~4 spans
    read = list(batch.spans)
    assert batch.count == len(read) == 100
    assert [r.at.span_id for r in read if isinstance(r, StreamEnd)] == [s.span_id.hex() for s in spans]


def test_a_sdk_span_that_breaks_the_model_is_refused_with_its_reason() -> None:
    spans = [_span(1, {sc.MCP_METHOD_NAME: "x" * 300}, exception=None), _span(3, {sc.MCP_METHOD_NAME: "ping"})]
    _, outcome = Detector().read(decode_protobuf(_request(*spans), IngestLimits()).spans, "otlp_http")
    assert outcome.accepted == 1
    assert outcome.rejected == {f"{sc.MCP_METHOD_NAME} longer than 256 characters": 1}


def test_model_attribute_values_are_memoised_short_and_bounded_and_read_the_same() -> None:
    from mcp_stream_exporter.detector import otlp as ingest

    ids = [f"request-{i}" for i in range(ingest._MODEL_VALUES_MAX[str] + 100)] + ["r" * 300, "request-1"]
    stream = {sc.SPAN: sc.SPAN_STREAM, sc.ROLE: sc.ROLE_CLIENT, sc.STREAM_KIND: "post", sc.END_REASON: sc.END_CLEAN}
    spans = [_span(2 * i + 2, {**stream, sc.PENDING_REQUEST_IDS: [request_id] * (1 + i % 40),
                               sc.EVENT_LAST_ID: request_id, sc.EVENTS_COUNT: i}, exception=None)
             for i, request_id in enumerate(ids)]  # from 2: an id of zeros is none
    read = list(decode_protobuf(_request(*spans), IngestLimits()).spans)
    expected = [((request_id,) * (1 + i % 40), request_id, i) for i, request_id in enumerate(ids)]
    del expected[-2]  # its ids are longer than the readers take as they are: read one value at a time
    assert [(e.pending_ids, e.last_event_id, e.events) for e in read if isinstance(e, StreamEnd)] == expected
    assert [s.span_id for s in read if isinstance(s, ModelSpan)] == [spans[-2].span_id.hex()]
    (long,), outcome = Detector().read(decode_protobuf(_request(spans[-2]), IngestLimits()).spans, "otlp_http")
    digest = f"[sha256:{hashlib.sha256(b'r' * 300).hexdigest()[:32]}]"  # kept as a digest, never cut
    assert outcome.rejected == {} and long.last_event_id == digest
    assert long.pending_ids == (digest,) * (1 + (len(ids) - 2) % 40)
    for kind, memo in ingest._MODEL_VALUES.items():
        assert 0 < len(memo) <= ingest._MODEL_VALUES_MAX[kind]
        assert all(len(encoded) <= ingest._MODEL_VALUE_MAX_BYTES and type(value) is kind
                   for encoded, value in memo.items())
    # an array decodes to more than its bytes: only a few values are kept
    assert all(len(value) <= ingest._MODEL_VALUE_MAX_ITEMS for value in ingest._MODEL_VALUES[tuple].values())


def test_exemplars_of_a_batch_read_in_runs_hold_no_decoded_span_past_its_run() -> None:
    """A run's decoded objects must be freed with it (a large request's memory bound): the exemplar a run
    leaves in a bucket is read off its span before the next run is decoded."""
    spans = [_span(2 * i, {sc.MCP_METHOD_NAME: "ping", "filler": "f" * 900} if i % 2 else
                   {sc.SPAN: sc.SPAN_STREAM, "filler": "f" * 900}, kind=Span.SPAN_KIND_SERVER, exception=None,
                   duration_ns=(i % 3) * 40_000_000) for i in range(40)]
    reader = decode_protobuf(_request(*spans), IngestLimits(max_span_bytes=1000)).spans  # a run a span
    assert isinstance(reader, Iterator)
    model = 0
    for read in reader:
        if not isinstance(read, OperationCounts):  # a model span, each in its own run, after an SDK span's run
            model += 1
            held = [x for _, last in reader.gi_frame.f_locals["tallies"].values() for x in last]  # type: ignore[attr-defined]
            assert all(x is None or type(x) is tuple for x in held)
    assert model == 20


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field."""
    size, length = len(payload), bytearray()
    while size >= 0x80:
        length.append(size & 0x7F | 0x80)
        size >>= 7
    return bytes([number << 3 | 2]) + bytes(length) + bytes([size]) + payload


def test_a_status_sent_in_two_parts_is_read_merged_as_protobuf_reads_it() -> None:
    """A singular message field seen twice is merged: the code in one part, the message in the other."""
    for kind, name in ((Span.SPAN_KIND_SERVER, "tools/call fetch"), (Span.SPAN_KIND_CLIENT, "MCP send tools/call")):
        span = _span(1, {sc.MCP_METHOD_NAME: "tools/call", sc.GEN_AI_TOOL_NAME: "fetch"}, kind=kind, name=name,
                     exception=None)
        span.ClearField("status")
        encoded = (span.SerializeToString() + Span(status=Status(code=Status.STATUS_CODE_ERROR)).SerializeToString()
                   + Span(status=Status(message="x")).SerializeToString())
        merged = Span.FromString(encoded)
        assert (merged.status.code, merged.status.message) == (Status.STATUS_CODE_ERROR, "x")
        body = _field(1, _field(2, _field(2, encoded)))  # resource_spans -> scope_spans -> spans
        events, _ = Detector().read(decode_protobuf(body, IngestLimits()).spans, "otlp_http")
        (counts,) = [e for e in events if isinstance(e, OperationCounts)]
        assert [key[3] for key in counts.counts] == ["error"]
        assert [e.error_type for e in events if isinstance(e, Operation)] == (
            ["error"] if kind == Span.SPAN_KIND_CLIENT else [])


def test_no_memo_keeps_a_token_shaped_value_and_the_values_are_still_read() -> None:
    from mcp_stream_exporter.detector import otlp

    secret = "Bearer s3cr3t-AbCdEf0123456789"
    spans = [_span(1, {sc.MCP_METHOD_NAME: "tools/call", sc.GEN_AI_TOOL_NAME: secret}, kind=Span.SPAN_KIND_SERVER,
                   exception=None),
             _span(3, {sc.MCP_METHOD_NAME: "tools/call"}, name=f"MCP send tools/call {secret}", exception=None),
             _span(5, {sc.SPAN: sc.SPAN_STREAM, sc.EVENT_LAST_ID: secret}, exception=None)]
    read = list(decode_protobuf(_request(*spans), IngestLimits()).spans)
    assert [s.attributes[sc.EVENT_LAST_ID] for s in read if isinstance(s, ModelSpan)] == [secret]
    kept = repr(otlp._LABELS) + repr(otlp._MODEL_VALUES)
    assert "s3cr3t" not in kept


def test_a_tool_that_decodes_to_no_string_lets_the_name_say_it_whatever_its_first_bytes() -> None:
    from mcp_stream_exporter.detector import otlp

    for encoded in (b"\x0a\x01x\x3a\x00", b"\x0a\x01x\x3a\x02\x0a\x00", b"\x3a\x00", b""):  # last value wins
        span = _span(1, {sc.MCP_METHOD_NAME: "tools/call"}, name="MCP send tools/call fetch", exception=None)
        tool = _field(1, sc.GEN_AI_TOOL_NAME.encode()) + _field(2, encoded)  # a KeyValue, sent as it is
        spans = _field(2, span.SerializeToString() + _field(9, tool))  # a ScopeSpans
        events, _ = Detector().read(decode_protobuf(_field(1, _field(2, spans)), IngestLimits()).spans, "otlp_http")
        one_by_one, _ = Detector().read([otlp._read(s, "", "") for s in otlp._LeanScopeSpans.FromString(spans).spans],
                                        "otlp_http")
        (counts,) = [e for e in events if isinstance(e, OperationCounts)]
        (expected,) = [e for e in one_by_one if isinstance(e, OperationCounts)]
        assert list(counts.counts) == list(expected.counts) == [(sc.ROLE_CLIENT, "tools/call", "fetch", "", None, None)]


def test_the_spans_of_one_call_share_their_trace_id_and_id_lists_with_what_the_ledger_keeps() -> None:
    """What the ledger keeps of a span is shared, not copied a span (memory a tracked call)."""
    common = {sc.ROLE: sc.ROLE_CLIENT, sc.ERA: sc.ERA_RESUMABLE, sc.MCP_SESSION_ID: "s-1", sc.STREAM_KIND: "post",
              sc.END_REASON: sc.END_DROPPED, sc.PENDING_REQUEST_IDS: ["3"], sc.STREAM_REQUEST_IDS: ["3"]}
    first, second = (_span(1, {sc.SPAN: sc.SPAN_STREAM, **common}, exception=None) for _ in range(2))
    second.span_id = (9).to_bytes(8, "big")
    a, b = decode_protobuf(_request(first, second), IngestLimits()).spans
    assert isinstance(a, StreamEnd) and isinstance(b, StreamEnd)
    assert a.at.trace_id is b.at.trace_id
    assert a.pending_ids is b.pending_ids is a.request_ids


def _model_span_variants(n: int) -> list[Span]:
    """Model spans of the three kinds, valid and broken in every way a reader checks: missing or unknown
    values, values of the wrong type, too long, token-shaped, with no value, ints as strings, bad ids or times."""
    rng = random.Random(7)
    resources = ["https://mcp.example.com/fetch"]
    base = {
        sc.SPAN_STREAM: {sc.STREAM_KIND: "resume", sc.END_REASON: sc.END_CLEAN, sc.RESUME_CURSOR: "6",
                         sc.PENDING_REQUEST_IDS: ["3"], sc.STREAM_REQUEST_IDS: ["3"], sc.EVENTS_COUNT: 0,
                         sc.HTTP_RESPONSE_STATUS_CODE: 200, sc.AUTH_AUDIENCE: ["https://mcp.example.com/search"],
                         sc.AUTH_FINGERPRINT: "0123456789abcdef", sc.REQUIRED_RESOURCES: resources},
        sc.SPAN_CALL: {sc.JSONRPC_REQUEST_ID: "3", sc.CALL_OUTCOME: sc.OUTCOME_CANCELLED, sc.GEN_AI_TOOL_NAME: "fetch",
                       sc.REQUIRED_RESOURCES: resources, sc.TERMINAL_EVENT_ID: "3_1", sc.CALL_ARGUMENTS_HASH: "ab"},
        sc.SPAN_REPLAY: {sc.RESUME_CURSOR: "6", sc.REPLAY_DECISION: sc.REPLAY_TRUNCATED, sc.REPLAY_BUFFERED: 4,
                         sc.REPLAY_SENT: 0, sc.REPLAY_OFFENDING_EVENT_ID: "8", sc.AUTH_SCOPES: ["read"],
                         sc.REQUIRED_SCOPES: ["read", "write"], sc.AUTH_AUDIENCE: resources},
    }
    bad = ["x" * 300, "Bearer s3cr3t-token", "eyJhbGciOi.eyJzdWIi.sig", 7, "12", "twelve", "", ["a", "b"], ["y" * 300],
           ["z"] * 300, AnyValue(), AnyValue(bool_value=True), AnyValue(double_value=1.5), AnyValue(int_value=-1),
           AnyValue(array_value=ArrayValue(values=[AnyValue(int_value=4), AnyValue(string_value="4")])),
           AnyValue(array_value=ArrayValue(values=[AnyValue(bool_value=False)])), "proxy", "stateless", None]
    keys = sorted({key for attributes in base.values() for key in attributes} | {
        sc.SPAN, sc.ROLE, sc.ERA, sc.MCP_SESSION_ID, sc.AUTH_VERIFICATION, sc.AUTH_MISSING_RESOURCES,
        sc.AUTH_MISSING_SCOPES, sc.ERROR_FRAMES_COUNT, sc.REPLAY_FOREIGN_EVENT_IDS, sc.GUARD_DECISION})
    spans = []
    for i in range(n):
        model = (sc.SPAN_STREAM, sc.SPAN_CALL, sc.SPAN_REPLAY)[i % 3]
        attributes: dict[str, Any] = {sc.SPAN: model, sc.ROLE: sc.ROLE_CLIENT, sc.ERA: sc.ERA_RESUMABLE,
                                      sc.MCP_SESSION_ID: f"session-{i % 5}", **base[model]}
        for _ in range(rng.choice((0, 0, 1, 1, 2, 3))):
            key, value = rng.choice(keys), rng.choice(bad)
            if value is None:
                attributes.pop(key, None)
            else:
                attributes[key] = value
        span = _span(2 * i, attributes, exception=None)
        if i % 17 == 0:
            span.end_time_unix_nano = span.start_time_unix_nano - 1
        if i % 19 == 0:
            span.trace_id = bytes(20)
        if i % 2:
            span.parent_span_id = (i + 5).to_bytes(8, "big")
        spans.append(span)
    return spans


@pytest.mark.parametrize("scope", [sc.INSTRUMENTATION_NAME, "another"])
def test_a_model_span_read_at_once_is_the_event_or_refusal_of_reading_it_value_by_value(scope: str) -> None:
    """Model spans whose values are all as the readers take them become their events straight from the
    encoded values (in the hooks' scope, from whole encoded attributes); any other is read one value at a
    time. Either way, the same event or the same reason as reading every value of the span and then the
    span (``lifecycle``), for every kind of break."""
    spans = _model_span_variants(600)
    origin = "Bearer s3cr3t " + "o" * 300  # cut, then redacted: as every model span's origin is
    request = ExportTraceServiceRequest(resource_spans=[ResourceSpans(
        resource=Resource(attributes=[_kv("service.name", origin)]),
        scope_spans=[ScopeSpans(scope=InstrumentationScope(name=scope), spans=spans)])])
    expected: list[Any] = []
    for s in spans:
        span = ModelSpan(trace_id=s.trace_id.hex(), span_id=s.span_id.hex(),
                         parent_span_id=s.parent_span_id.hex() or None, name=s.name, kind="client",
                         start_ns=s.start_time_unix_nano, end_ns=s.end_time_unix_nano,
                         attributes={kv.key: _value(kv.value) for kv in s.attributes},
                         origin=redact(origin[:MAX_CHARS]))
        try:
            expected.append(lifecycle(span))
        except Rejected as rejected:
            expected.append(str(rejected))
    outside = expected.count(None)  # its mcp_stream.span taken away: counted, not read
    expected = [e for e in expected if e is not None]
    biggest = max(len(s.SerializeToString()) for s in spans)
    for limits in (IngestLimits(), IngestLimits(), IngestLimits(max_span_bytes=biggest)):  # again from the memos;
        read: list[Any] = []  # in runs of a span or two (after a span of no model, the rest of a run is read apart)
        for r in decode_protobuf(request.SerializeToString(), limits).spans:
            try:
                read.append(lifecycle(r) if isinstance(r, ModelSpan) else str(r) if isinstance(r, Rejected) else r)
            except Rejected as rejected:
                read.append(str(rejected))
        assert read[:-1] == expected
        assert isinstance(read[-1], OperationCounts) and read[-1].taken == outside
    taken = [e for e in expected if not isinstance(e, str)]
    assert 100 < len(taken) < len(expected)  # both ways are tried
    assert all("s3cr3t" not in repr(memo) for memo in (otlp._MODEL_VALUES, otlp._LABELS, otlp._KEY_VALUES,
                                                         otlp._NOT_READ))


def _read_all(body: bytes, limits: IngestLimits) -> tuple[list[Any], dict[str, int], int]:
    events, outcome = Detector().read(decode_protobuf(body, limits).spans, "otlp_http")
    return ([(e.taken, e.counts) if isinstance(e, OperationCounts) else e for e in events], outcome.rejected,
            outcome.accepted)


def test_any_span_in_the_hooks_scope_is_read_as_in_any_other_scope() -> None:
    """The hooks' scope is read from its encoded attributes; a span there that is no model span (the SDK's,
    one outside the model, one whose mcp_stream.span has no value) is read as any other scope's, and so is
    the whole batch: the same events, counts, exemplars and refusals."""
    spans = [*_model_span_variants(120), *_varied_sdk_spans(120),
             _span(9001, {sc.SPAN: AnyValue(), sc.MCP_METHOD_NAME: "tools/call", sc.ERROR_TYPE: "-32001"}),
             _span(9003, {sc.SPAN: AnyValue(kvlist_value={}), sc.ROLE: sc.ROLE_CLIENT}), _span(9005, {"x": "y"})]
    for i, span in enumerate(spans):
        span.attributes.append(_kv("mcp_stream.unread", f"value-{i % 7}"))  # a key the model does not read

    def value(text: str) -> bytes:
        return AnyValue(string_value=text).SerializeToString()

    odd = [  # KeyValues in shapes an encoder may send and upb reads alike
        _field(2, value("tools/call")) + _field(1, sc.MCP_METHOD_NAME.encode()),  # the value first
        _field(1, sc.ERROR_TYPE.encode()),  # no value
        _field(1, sc.END_REASON.encode()) + _field(2, value("r" * 200)),  # a value's length in two bytes
        _field(1, sc.END_REASON.encode()) + _field(2, value(sc.END_CLEAN)) + b"\x28\x01",  # a field besides
        _field(1, b"x") + _field(1, sc.ROLE.encode()) + _field(2, value(sc.ROLE_SERVER)),  # the key twice
        _field(1, sc.SPAN.encode()) + _field(2, value(sc.SPAN_CALL)),  # a key again: the last one counts
    ]
    encoded = [span.SerializeToString() + b"".join(_field(9, kv) for kv in odd[:i % 7]) for i, span in enumerate(spans)]
    repeated = _field(9, _field(1, sc.STREAM_REQUEST_IDS.encode()) + _field(2, value("r")))
    encoded[::40] = [e + repeated * 100 for e in encoded[::40]]  # a key a hundred times: more KeyValues than the hooks'

    def body(scope: str) -> bytes:
        return _field(1, _field(2, _field(1, _field(1, scope.encode())) + b"".join(_field(2, e) for e in encoded)))

    for limits in (IngestLimits(), IngestLimits(max_span_bytes=max(map(len, encoded)))):  # runs of a span or two
        ours, another = _read_all(body(sc.INSTRUMENTATION_NAME), limits), _read_all(body("another"), limits)
        assert ours == another
        assert len(ours[0]) > 50 and ours[1] and ours[2] > 100


def test_the_memo_of_encoded_attributes_is_bounded_keeps_no_token_and_shares_values() -> None:
    stream = {sc.SPAN: sc.SPAN_STREAM, sc.ROLE: sc.ROLE_CLIENT, sc.STREAM_KIND: "post", sc.END_REASON: sc.END_CLEAN}
    ids = [f"request-{i}" for i in range(otlp._KEY_VALUES_MAX + 100)]
    spans = [_span(2 * i + 2, {**stream, sc.PENDING_REQUEST_IDS: [request_id], sc.STREAM_REQUEST_IDS: [request_id],
                               "filler": "f" * (i % 200), "app.auth": f"Bearer s3cr3t{i % 3}",
                               sc.EVENT_LAST_ID: "Bearer s3cr3t" if i % 5 else request_id},
                   exception=None) for i, request_id in enumerate(ids)]  # from 2: an id of zeros is none
    request = ExportTraceServiceRequest(resource_spans=[ResourceSpans(scope_spans=[ScopeSpans(
        scope=InstrumentationScope(name=sc.INSTRUMENTATION_NAME), spans=spans)])])
    read = list(decode_protobuf(request.SerializeToString(), IngestLimits()).spans)
    assert [(e.pending_ids, e.last_event_id) for e in read if isinstance(e, StreamEnd)] == [
        ((request_id,), request_id) for i, request_id in enumerate(ids) if not i % 5]
    assert all(e.pending_ids is e.request_ids for e in read if isinstance(e, StreamEnd))
    assert 0 < len(otlp._KEY_VALUES) <= otlp._KEY_VALUES_MAX
    assert all(len(encoded) <= otlp._KEY_VALUE_MAX_BYTES for encoded in otlp._KEY_VALUES)
    assert 0 < len(otlp._NOT_READ) <= otlp._NOT_READ_MAX  # the fillers, 200 of them, each of a key no reader reads
    assert all(len(encoded) <= otlp._KEY_VALUE_MAX_BYTES for encoded in otlp._NOT_READ)
    assert "s3cr3t" not in repr(otlp._KEY_VALUES) + repr(otlp._NOT_READ)


@pytest.mark.parametrize("scope", [sc.INSTRUMENTATION_NAME, "another"])
@pytest.mark.parametrize("attributes", [{sc.SPAN: sc.SPAN_STREAM, sc.ROLE: sc.ROLE_CLIENT}, {sc.ROLE: sc.ROLE_CLIENT}],
                         ids=["model span", "no model span"])
def test_an_attribute_key_that_is_not_utf8_is_refused_as_malformed_in_either_scope(scope: str,
                                                                                   attributes: dict[str, Any]) -> None:
    model = _span(1, attributes, exception=None).SerializeToString()
    bad_key = _field(9, _field(1, b"\xff\xfe") + _field(2, AnyValue(string_value="x").SerializeToString()))
    name = _field(1, scope.encode())
    body = _field(1, _field(2, _field(1, name) + _field(2, model + bad_key)))  # resource_spans -> scope_spans
    with pytest.raises(IngestError) as refused:
        list(decode_protobuf(body, IngestLimits()).spans)
    assert refused.value.status == 400


def test_a_token_is_seen_in_encoded_bytes_whatever_byte_stands_before_it() -> None:
    from mcp_stream_exporter.redaction import holds_token

    secret = b"Bearer " + b"s" * 58  # 65 bytes: its length byte is "A", a word character before "Bearer"
    assert _field(1, secret)[1:2] == b"A"
    assert holds_token(_field(1, secret)) and holds_token(_field(2, _field(1, secret)))


_STREAM = {sc.SPAN: sc.SPAN_STREAM, sc.ROLE: sc.ROLE_CLIENT, sc.STREAM_KIND: "post", sc.END_REASON: sc.END_CLEAN}


def _outcome(body: bytes, content_type: str = PROTOBUF) -> tuple[int, dict[str, int]]:
    _, outcome = Detector().read(decode(body, content_type, IngestLimits()).spans, "otlp_http")
    return outcome.accepted, outcome.rejected


@pytest.mark.parametrize("scope", [sc.INSTRUMENTATION_NAME, "another"])
def test_a_model_span_whose_ids_are_not_of_otlps_lengths_or_all_zero_is_refused(scope: str) -> None:
    def span(trace_id: bytes, span_id: bytes, parent: bytes = b"") -> Span:
        s = _span(1, _STREAM, exception=None)
        s.trace_id, s.span_id, s.parent_span_id = trace_id, span_id, parent
        return s

    trace, one = bytes(range(1, 17)), bytes(range(1, 9))
    broken = [span(b"", one), span(trace, b"abc"), span(trace[:15], one), span(trace, one + b"x"),
              span(trace, one, b"abc"), span(bytes(16), one), span(trace, bytes(8))]
    for s in [span(trace, one), span(trace, one, one), *broken]:
        for unchecked in (s, _span(1, {**_STREAM, sc.EVENTS_COUNT: AnyValue(bool_value=True)}, exception=None)):
            unchecked.trace_id, unchecked.span_id, unchecked.parent_span_id = s.trace_id, s.span_id, s.parent_span_id
        request = ExportTraceServiceRequest(resource_spans=[ResourceSpans(scope_spans=[ScopeSpans(
            scope=InstrumentationScope(name=scope), spans=[s])])])
        accepted, rejected = _outcome(request.SerializeToString())
        assert (accepted, rejected) == ((0, {"trace or span id not of 16 or 8 bytes, or all zero": 1}) if s in broken
                                        else (1, {}))


def test_a_model_span_whose_kind_is_no_span_kind_is_refused_in_protobuf_and_in_json() -> None:
    kinds = [*Span.SpanKind.values(), 6, 99, -1, 2**31 - 1]
    spans = [_span(i + 1, _STREAM, kind=kind, exception=None) for i, kind in enumerate(kinds)]
    for scope in (sc.INSTRUMENTATION_NAME, "another"):
        request = ExportTraceServiceRequest(resource_spans=[ResourceSpans(scope_spans=[ScopeSpans(
            scope=InstrumentationScope(name=scope), spans=spans)])])
        assert _outcome(request.SerializeToString()) == (6, {"the span's kind is no OTLP SpanKind": 4})
    json_kinds = [*Span.SpanKind.keys(), 3, "SPAN_KIND_FOO", "3", "\uff13", True, 3.0, 2**40, 99, None]
    doc = {"resourceSpans": [{"scopeSpans": [{"spans": [
        {**_json_span(i + 1), **({} if kind is None else {"kind": kind})} for i, kind in enumerate(json_kinds)]}]}]}
    assert _outcome(json.dumps(doc).encode(), JSON) == (8, {"the span's kind is no OTLP SpanKind": 7})


def _json_span(i: int, *attributes: dict[str, Any]) -> dict[str, Any]:
    return {"traceId": f"{i:032x}", "spanId": f"{i:016x}", "startTimeUnixNano": "1", "endTimeUnixNano": "2",
            "attributes": [{"key": k, "value": {"stringValue": v}} for k, v in _STREAM.items()] + list(attributes)}


@pytest.mark.parametrize("value", ["\uff11\uff12", "\u0661\u0662", "1_2", "+12", "\t12", "12\n", " 12", "1e3",
                                   "0x10", "", "NaN", "9223372036854775808", "-9223372036854775809", "9" * 5000])
def test_a_json_int_that_is_no_decimal_int64_refuses_its_span_as_a_string_in_protobuf_does(value: str) -> None:
    """protobuf's JSON parser reads an int64 string with ``int()`` (taking fullwidth digits, "1_2" or "+12" for
    12) or refuses the whole batch; OTLP/JSON writes a decimal int64. Any other string refuses its span, if a
    reader reads it, and the rest of the batch is kept."""
    count = {"key": sc.EVENTS_COUNT, "value": {"intValue": value}}
    ids = {"key": sc.STREAM_REQUEST_IDS, "value": {"arrayValue": {"values": [{"intValue": value}]}}}
    unread = {"key": "app.count", "value": {"intValue": value}}
    doc = {"resourceSpans": [{"scopeSpans": [{"spans": [
        _json_span(1, count), _json_span(2, ids), _json_span(3, unread), _json_span(4, {**count, "value": {
            "intValue": "-12"}}), _json_span(5, {**count, "value": {"intValue": 12}})]}]}]}
    assert _outcome(json.dumps(doc).encode(), JSON) == (2, {f"{sc.EVENTS_COUNT} must be an integer": 1,
                                                            f"{sc.STREAM_REQUEST_IDS} must be a list of strings": 1,
                                                            f"{sc.EVENTS_COUNT} must not be negative": 1})


@pytest.mark.parametrize("original", ["resource_spans", "scope_spans", "trace_id", "int_value", "array_value",
                                      "start_time_unix_nano", "parent_span_id", "kvlist_value"])
def test_otlp_json_in_protobuf_s_original_field_names_is_refused_whole(original: str) -> None:
    """OTLP/JSON's keys are lowerCamelCase; protobuf's parser reads the original names too, which would pass by
    the checks of OTLP/JSON's ids and int64s (``+5`` read as 5), written as they are or with escapes. An attribute
    named so, or a value that says so, is no key: the batch is read."""
    camel = {"resource_spans": "resourceSpans", "scope_spans": "scopeSpans", "trace_id": "traceId",
             "int_value": "intValue", "array_value": "arrayValue", "start_time_unix_nano": "startTimeUnixNano",
             "parent_span_id": "parentSpanId", "kvlist_value": "kvlistValue"}[original]
    named = {"key": original, "value": {"stringValue": f'"{original}": 1'}}
    values = [{"key": "app.n", "value": {"intValue": "5"}},
              {"key": "app.list", "value": {"arrayValue": {"values": [{"stringValue": "a"}]}}},
              {"key": "app.map", "value": {"kvlistValue": {"values": [{"key": "k", "value": {"stringValue": "v"}}]}}}]
    span = {**_json_span(1, named, *values), "parentSpanId": f"{7:016x}"}
    doc = {"resourceSpans": [{"scopeSpans": [{"spans": [span]}]}]}
    assert _outcome(json.dumps(doc).encode(), JSON) == (1, {})
    escaped = original.replace("_", "\\u005f", 1)  # json.loads reads it as the name: the bytes do not say it
    for written in (original, escaped):
        with pytest.raises(IngestError) as refused:
            decode(json.dumps(doc).replace(f'"{camel}"', f'"{written}"').encode(), JSON, IngestLimits())
        assert refused.value.status == 400 and original in refused.value.reason


def test_an_int_of_the_model_sent_as_a_string_is_refused_digits_or_not() -> None:
    for value in ("12", "-1", "\u00b2"):
        accepted, rejected = _outcome(_request(_span(1, {**_STREAM, sc.EVENTS_COUNT: value}, exception=None),
                                               _span(3, {**_STREAM, sc.EVENTS_COUNT: 12}, exception=None)))
        assert (accepted, rejected) == (1, {f"{sc.EVENTS_COUNT} must be an integer": 1})


def test_a_content_coding_is_read_whatever_its_case_and_x_gzip_as_gzip() -> None:
    body = b"spans" * 100
    for encoding, sent in [("GZIP", gzip.compress(body)), ("Gzip", gzip.compress(body)),
                           (" x-gzip ", gzip.compress(body)), ("Deflate", zlib.compress(body)), ("IDENTITY", body)]:
        assert decompress(sent, encoding, IngestLimits()) == body
    with pytest.raises(IngestError) as refused:
        decompress(body, "BR", IngestLimits())
    assert refused.value.status == 415


def test_every_member_of_a_gzip_body_is_read_within_one_bound_and_anything_else_after_one_is_a_400() -> None:
    limits = IngestLimits(max_decompressed_bytes=1000)
    members = [gzip.compress(part) for part in (b"a" * 400, b"", b"b" * 400, b"c" * 200)]
    assert decompress(b"".join(members), "gzip", limits) == b"a" * 400 + b"b" * 400 + b"c" * 200
    assert decompress(members[0] + bytes(5000), "gzip", limits) == b"a" * 400  # NUL padding, as gzip -d skips it
    many = gzip.compress(b"x") * 5000  # a decompressor each, the bound across them all
    with pytest.raises(IngestError) as refused:
        decompress(many, "gzip", limits)
    assert (refused.value.status, refused.value.metric_reason) == (413, "too_large")
    assert decompress(many, "gzip", IngestLimits()) == b"x" * 5000
    for garbage in (b"trailing garbage", gzip.compress(b"d")[:-3], bytes(3) + b"x"):
        with pytest.raises(IngestError) as refused:
            decompress(b"".join(members) + garbage, "gzip", IngestLimits())
        assert (refused.value.status, refused.value.metric_reason) == (400, "malformed")
    with pytest.raises(IngestError) as refused:  # zlib streams are not members: one only
        decompress(zlib.compress(b"a") + zlib.compress(b"b"), "deflate", limits)
    assert refused.value.status == 400
