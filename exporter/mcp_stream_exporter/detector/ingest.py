"""OTLP in: decoding with limits, a bounded queue in front of the detector, and the gRPC receiver.

Every refusal has a clear answer (OTLP/HTTP spec): 400 for a body that does not decode, 413 for one
too large before or after decompression (a gzip bomb is refused while inflating, never inflated
whole), 415 for an unknown content type, and 429/503 with ``Retry-After`` when the queue is full or
every decoding slot is taken. Spans that decode but break the span model are refused one by one in
the OTLP partial-success answer; the rest of their batch is kept.

Decoding costs are known before anything is built: a protobuf body is walked at the wire level to
find its spans (counted, and each one's size checked) and then decoded one span at a time, so a
request never exists whole as objects; a JSON body's values are counted before it is parsed.
"""

from __future__ import annotations

import base64
import json
import logging
import threading
import time
import zlib
from bisect import bisect_left
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent import futures
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, json_format, message_factory
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import ScopeSpans, Status
from opentelemetry.proto.trace.v1.trace_pb2 import Span as OtlpSpan

from mcp_stream_exporter import semconv as sc
from mcp_stream_exporter.detector.connections import ConnectionLimits
from mcp_stream_exporter.detector.credentials import bearer_matches
from mcp_stream_exporter.detector.detector import Detector, Event, Outcome
from mcp_stream_exporter.detector.events import (
    KIND_CLIENT,
    KIND_INTERNAL,
    KIND_SERVER,
    MAX_CHARS,
    READ_KEYS,
    Operation,
    Rejected,
    Span,
    operation,
    origin_of,
    read_by_rules,
    weight,
)
from mcp_stream_exporter.detector.metrics import BOUNDS, OperationCounts, Sample, new_tally
from mcp_stream_exporter.detector.redaction import redact

log = logging.getLogger("mcp_stream_exporter.detector")
ExportRequest = trace_service_pb2.ExportTraceServiceRequest
ExportResponse = trace_service_pb2.ExportTraceServiceResponse

PROTOBUF = "application/x-protobuf"
JSON = "application/json"
_KINDS: dict[int, str] = {OtlpSpan.SPAN_KIND_CLIENT: KIND_CLIENT, OtlpSpan.SPAN_KIND_SERVER: KIND_SERVER}
_MAX_ARRAY = 1_000  # values kept from one array attribute
_ERROR = Status.STATUS_CODE_ERROR
_EXCEPTION_TYPE = "exception.type"


@dataclass(frozen=True, slots=True)
class IngestLimits:
    max_body_bytes: int = 4 * 1024 * 1024  # as received (compressed or not)
    max_decompressed_bytes: int = 16 * 1024 * 1024
    max_spans_per_request: int = 10_000
    max_queued_spans: int = 200_000
    retry_after_s: int = 2
    max_queued_bytes: int = 32 * 1024 * 1024  # an estimate of the events waiting (events.weight)
    max_span_bytes: int = 256 * 1024  # one encoded span (or resource): what decoding it may cost
    max_json_values: int = 200_000  # values in a JSON body, counted before it is parsed
    max_decoding: int = 2  # requests decoded at once (HTTP and gRPC together); others wait their turn
    decoding_wait_s: float = 5.0  # then 429 with Retry-After
    max_buffered_bytes: int = 32 * 1024 * 1024  # request bodies held at once, received or waiting
    body_timeout_s: float = 30.0  # to receive a whole body; then 408


class IngestError(Exception):
    """A request refused whole: the HTTP status and a reason the sender can act on."""

    def __init__(self, status: int, reason: str, metric_reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason
        self.metric_reason = metric_reason


def decompress(body: bytes, encoding: str | None, limits: IngestLimits) -> bytes:
    if encoding in (None, "", "identity"):
        return body
    if encoding not in ("gzip", "deflate"):
        raise IngestError(415, f"unsupported Content-Encoding {encoding[:40]!r}: use gzip or none", "bad_encoding")
    inflater = zlib.decompressobj(wbits=47 if encoding == "gzip" else 15)  # 47: gzip or zlib header
    try:
        out = inflater.decompress(body, limits.max_decompressed_bytes + 1)
    except zlib.error as exc:
        raise IngestError(400, f"body does not decompress as {encoding}: {exc}", "malformed") from None
    if len(out) > limits.max_decompressed_bytes or inflater.unconsumed_tail:
        raise IngestError(413, f"decompressed body exceeds {limits.max_decompressed_bytes} bytes", "too_large")
    return out


@dataclass(frozen=True, slots=True)
class Batch:
    """A decoded request: its spans counted up front, read one at a time."""

    count: int
    spans: Iterable[Span | Operation | OperationCounts]


def decode(body: bytes, content_type: str, limits: IngestLimits) -> Batch:
    """The spans of an OTLP/HTTP body (already decompressed), or the reason it is refused."""
    media = content_type.split(";", 1)[0].strip().lower()
    if media == PROTOBUF:
        return decode_protobuf(body, limits)
    if media == JSON:
        return _decode_json(body, limits)
    raise IngestError(415, f"unsupported Content-Type {media[:60]!r}: use {PROTOBUF} or {JSON}", "bad_encoding")


def decode_protobuf(body: bytes, limits: IngestLimits) -> Batch:
    try:
        located = _locate_spans(memoryview(body), limits)
    except DecodeError as exc:
        raise IngestError(400, f"not an OTLP ExportTraceServiceRequest: {exc}", "malformed") from None
    return Batch(sum(n for _, _, n in located), _decoded_spans(located))


def _decode_json(body: bytes, limits: IngestLimits) -> Batch:
    values = body.count(b",") + body.count(b"{") + body.count(b"[") + 1  # an upper bound, at C speed
    if values > limits.max_json_values:
        raise IngestError(413, f"about {values} JSON values; at most {limits.max_json_values}: send smaller "
                          f"batches, or protobuf", "too_large")
    request = ExportRequest()
    try:
        json_format.ParseDict(_hex_ids_to_base64(json.loads(body)), request, ignore_unknown_fields=True)
    except (json_format.ParseError, ValueError, TypeError, RecursionError) as exc:
        reason = redact(str(exc)[:400])[:200]
        raise IngestError(400, f"not an OTLP ExportTraceServiceRequest: {reason}", "malformed") from None
    return decode_protobuf(request.SerializeToString(), limits)  # one reader, the same limits


def _check_span_count(count: int, limits: IngestLimits) -> None:
    if count > limits.max_spans_per_request:
        raise IngestError(413, f"more than {limits.max_spans_per_request} spans in one request: send smaller "
                          "batches", "too_many_spans")


# --- the protobuf wire format, walked without decoding: ExportTraceServiceRequest.resource_spans (1) ->
# ResourceSpans.resource (1) and .scope_spans (2) -> ScopeSpans.spans (2) ---

_VARINT, _FIXED64, _LENGTH, _FIXED32 = 0, 1, 2, 5


def _locate_spans(body: memoryview, limits: IngestLimits) -> list[tuple[str, memoryview, int]]:
    """(origin, encoded spans, how many) for runs of consecutive spans of the request, each run at most
    ``max_span_bytes`` (or one span) and decoded as one ``ScopeSpans``; refused as soon as there are too
    many (spans, or fields around them) or one is too large. A scope within that bound, nearly every
    exporter's, is one run whose spans upb counts (as bytes, no message built); a larger one is walked
    here, at most a few steps per span."""
    fields = [_fields_around_spans(limits)]  # fields walked, left
    located: list[tuple[str, memoryview, int]] = []
    count = 0
    for resource_spans in _messages(body, 1, fields, limits):
        resource = bytearray()
        scopes: list[memoryview] = []
        for number, value, _, _ in _length_fields(resource_spans, fields, limits):
            if number == 1:
                resource += value
            elif number == 2:
                scopes.append(value)
        origin = _resource_origin(resource, limits)
        for scope in scopes:
            if len(scope) <= limits.max_span_bytes:
                spans = len(_SkeletonScopeSpans.FromString(scope).spans)
                fields[0] -= spans
                count += spans
                _check_span_count(count, limits)
                if spans:
                    located.append((origin, scope, spans))
                continue
            run_start = run_end = run_spans = 0
            for number, span, start, end in _length_fields(scope, fields, limits):
                if number != 2:
                    continue
                if len(span) > limits.max_span_bytes:
                    raise IngestError(413, f"a span of {len(span)} bytes; at most {limits.max_span_bytes}",
                                      "too_large")
                count += 1
                _check_span_count(count, limits)
                if run_spans and end - run_start > limits.max_span_bytes:
                    located.append((origin, scope[run_start:run_end], run_spans))
                    run_spans = 0
                if not run_spans:
                    run_start = start
                run_end = end
                run_spans += 1
            if run_spans:
                located.append((origin, scope[run_start:run_end], run_spans))
    return located


def _fields_around_spans(limits: IngestLimits) -> int:
    """Spans, and the resource and scope messages around them, a request may carry."""
    return 3 * limits.max_spans_per_request + 64


def _too_many_fields(limits: IngestLimits) -> IngestError:
    return IngestError(413, f"too many fields around the spans; at most {limits.max_spans_per_request} spans per "
                       "request", "too_many_spans")


def _messages(buf: memoryview, number: int, fields: list[int], limits: IngestLimits) -> Iterator[memoryview]:
    for n, value, _, _ in _length_fields(buf, fields, limits):
        if n == number:
            yield value


def _length_fields(buf: memoryview, fields: list[int],
                   limits: IngestLimits) -> Iterator[tuple[int, memoryview, int, int]]:
    """The length-delimited fields of one message (the only kind the walk descends into): number,
    value, and where the whole field starts and ends in ``buf``."""
    pos, end = 0, len(buf)
    while pos < end:
        fields[0] -= 1
        if fields[0] < 0:
            raise _too_many_fields(limits)
        start = pos
        key = buf[pos]
        if key < 0x80:  # a one-byte varint: every field number the walk descends into
            pos += 1
        else:
            key, pos = _varint(buf, pos)
        wire = key & 7
        if wire == _LENGTH:
            length, pos = _varint(buf, pos)
            if pos + length > end:
                raise DecodeError("truncated message")
            yield key >> 3, buf[pos:pos + length], start, pos + length
            pos += length
        elif wire == _VARINT:
            _, pos = _varint(buf, pos)
        elif wire in (_FIXED64, _FIXED32):
            pos += 8 if wire == _FIXED64 else 4
        else:
            raise DecodeError(f"wire type {wire} where a message field was expected")
        if pos > end:
            raise DecodeError("truncated message")


def _varint(buf: memoryview, pos: int) -> tuple[int, int]:
    if pos + 1 < len(buf) and buf[pos + 1] < 0x80 <= buf[pos]:  # two bytes: most spans' lengths
        return (buf[pos] & 0x7F) | (buf[pos + 1] << 7), pos + 2
    value = shift = 0
    while shift < 64:
        if pos >= len(buf):
            raise DecodeError("truncated varint")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
    raise DecodeError("varint longer than 10 bytes")


def _resource_origin(encoded: bytearray, limits: IngestLimits) -> str:
    if len(encoded) > limits.max_span_bytes:
        raise IngestError(413, f"a resource of {len(encoded)} bytes; at most {limits.max_span_bytes}", "too_large")
    return _origin(_attributes(Resource.FromString(bytes(encoded)).attributes))


def _origin(resource: dict[str, Any]) -> str:
    """The emitting process, cut and redacted once for all the spans of its resource."""
    return redact(origin_of(resource)[:MAX_CHARS])


def _decoded_spans(located: list[tuple[str, memoryview, int]]) -> Iterator[Span | Operation | OperationCounts]:
    """Each span, read (``_read``), except the SDK's healthy request spans, nearly all of real traffic:
    those are counted at once into the batch's :class:`OperationCounts` (yielded last), with no
    :class:`Operation` each, from a memo of their labels by their raw attribute values."""
    tallies: dict[Any, tuple[list[float], list[Any]]] = {}
    taken = 0
    for origin, encoded, _ in located:
        try:
            spans = _LeanScopeSpans.FromString(encoded).spans  # upb reads any buffer
        except DecodeError as exc:
            raise IngestError(400, f"a span does not decode: {exc}", "malformed") from None
        for span in spans:
            attributes = span.attributes
            if sc.SPAN not in attributes:  # not one of the model's spans
                values = tuple(map(attributes.get, _SDK_KEYS))
                if values[0] is None:
                    taken += 1  # outside the model: nothing of it is read
                    continue
                if not span.events:
                    raw = (span.kind, span.status, values, span.name if values[1] is None else None)
                    key = _LABELS.get(raw, _UNKNOWN)
                    if key is _UNKNOWN:
                        key = _labels(raw)
                    if key is not None:
                        start, end = span.start_time_unix_nano, span.end_time_unix_nano
                        duration = (end - start) / 1e9 if end > start else 0.0
                        tally = tallies.get(key)
                        if tally is None:
                            tally = tallies[key] = new_tally()
                        bucket = bisect_left(BOUNDS, duration)
                        tally[0][bucket] += 1
                        tally[0][-1] += duration
                        tally[1][bucket] = span
                        taken += 1
                        continue
            try:
                read = _read(span, origin)
            except UnicodeDecodeError:
                raise IngestError(400, _NOT_UTF8, "malformed") from None
            yield read
    if taken:
        for _, last in tallies.values():
            last[:] = map(_sample, last)
        yield OperationCounts(tallies, taken)


def _sample(span: Any) -> Sample | None:
    """A bucket's last span as its exemplar, if its ids can be one (W3C lengths: longer would break
    OpenMetrics' 128 characters of exemplar labels, and Prometheus' whole scrape)."""
    if span is None or len(span.trace_id) > 16 or len(span.span_id) > 8:
        return None
    start, end = span.start_time_unix_nano, span.end_time_unix_nano
    duration = (end - start) / 1e9 if end > start else 0.0
    return span.trace_id.hex(), span.span_id.hex(), duration, start / 1e9 + duration


# --- the lean schema: OTLP's ScopeSpans and Span as the detector decodes them. Wire-compatible with
# OTLP: ``attributes`` (repeated KeyValue {1: key, 2: AnyValue}) is read as a map of key -> encoded
# AnyValue, so upb indexes the keys and only the values the detector reads are decoded; fields it
# never reads (trace state, links, dropped counts, ...) are skipped as unknown. ---

_T = descriptor_pb2.FieldDescriptorProto
_LEAN = "mcp_stream_exporter.lean"


def _field(message: Any, name: str, number: int, kind: int, type_name: str | None = None,
           repeated: bool = False) -> None:
    field = message.field.add(name=name, number=number, type=kind,
                              label=_T.LABEL_REPEATED if repeated else _T.LABEL_OPTIONAL)
    if type_name is not None:
        field.type_name = f".{_LEAN}.{type_name}"


def _attribute_map(message: Any, owner: str, number: int) -> None:
    entry = message.nested_type.add(name="AttributesEntry")
    entry.options.map_entry = True
    _field(entry, "key", 1, _T.TYPE_STRING)
    _field(entry, "value", 2, _T.TYPE_BYTES)
    _field(message, "attributes", number, _T.TYPE_MESSAGE, f"{owner}.AttributesEntry", repeated=True)


def _number(descriptor: Any, name: str) -> int:
    return int(descriptor.fields_by_name[name].number)


def _lean_schema() -> tuple[Any, Any, Any]:
    """The lean ScopeSpans, its skeleton whose spans stay bytes (to count them before anything is
    decoded), and the span's status (kept encoded: nearly always empty, and a memo key as it is)."""
    number = {name: f.number for name, f in OtlpSpan.DESCRIPTOR.fields_by_name.items()}
    file = descriptor_pb2.FileDescriptorProto(name="mcp_stream_exporter/lean_otlp.proto", package=_LEAN,
                                              syntax="proto3")
    status = file.message_type.add(name="Status")
    _field(status, "code", _number(Status.DESCRIPTOR, "code"), _T.TYPE_INT32)
    span = file.message_type.add(name="Span")
    for name, kind in (("trace_id", _T.TYPE_BYTES), ("span_id", _T.TYPE_BYTES), ("parent_span_id", _T.TYPE_BYTES),
                       ("name", _T.TYPE_STRING), ("kind", _T.TYPE_INT32), ("start_time_unix_nano", _T.TYPE_FIXED64),
                       ("end_time_unix_nano", _T.TYPE_FIXED64)):
        _field(span, name, number[name], kind)
    _attribute_map(span, "Span", number["attributes"])
    event = span.nested_type.add(name="Event")
    _field(event, "name", _number(OtlpSpan.Event.DESCRIPTOR, "name"), _T.TYPE_STRING)
    _attribute_map(event, "Span.Event", _number(OtlpSpan.Event.DESCRIPTOR, "attributes"))
    _field(span, "events", number["events"], _T.TYPE_MESSAGE, "Span.Event", repeated=True)
    _field(span, "status", number["status"], _T.TYPE_BYTES)  # read by _error, once per distinct encoding
    spans = _number(ScopeSpans.DESCRIPTOR, "spans")
    _field(file.message_type.add(name="ScopeSpans"), "spans", spans, _T.TYPE_MESSAGE, "Span", repeated=True)
    _field(file.message_type.add(name="SkeletonScopeSpans"), "spans", spans, _T.TYPE_BYTES, repeated=True)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    scope_spans, skeleton, lean_status = (message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{_LEAN}.{n}"))
                                          for n in ("ScopeSpans", "SkeletonScopeSpans", "Status"))
    return scope_spans, skeleton, lean_status


_LeanScopeSpans, _SkeletonScopeSpans, _LeanStatus = _lean_schema()


def _error(status: bytes) -> bool:
    """Whether an encoded span status says error."""
    try:
        return bool(status) and _LeanStatus.FromString(status).code == _ERROR
    except DecodeError as exc:
        raise IngestError(400, f"a span does not decode: {exc}", "malformed") from None
# the keys of the SDK's request spans that their labels are made of
_SDK_KEYS = (sc.MCP_METHOD_NAME, sc.GEN_AI_TOOL_NAME, sc.ERROR_TYPE, sc.RPC_RESPONSE_STATUS_CODE, sc.NETWORK_TRANSPORT,
             sc.MCP_PROTOCOL_VERSION)
# (kind, encoded status, encoded values of _SDK_KEYS, the name when no tool is set) -> the span's labels,
# or None for a span read one by one (rules read it, or it breaks the model). Methods, tools, codes and
# versions repeat span after span, so a look-up replaces reading; bounded: emptied when full.
_LABELS: dict[Any, Any] = {}
_LABELS_MAX = 4096
_LABELS_KEY_MAX_BYTES = 512
_UNKNOWN = object()


def _labels(raw: tuple[int, bytes, tuple[bytes | None, ...], str | None]) -> Any:
    kind, status, values, name = raw
    role = _KINDS.get(kind)
    labels = None
    if role is not None:
        attributes = {key: _any(value) for key, value in zip(_SDK_KEYS, values, strict=True)
                      if value is not None}
        with suppress(Rejected):
            e = operation(role, name or "", attributes, (), _error(status), "", "", 0, 0, "")
            labels = None if read_by_rules(e) else OperationCounts.key(e)
    if sum(len(v) for v in values if v is not None) + len(status) + len(name or "") <= _LABELS_KEY_MAX_BYTES:
        if len(_LABELS) >= _LABELS_MAX:
            _LABELS.clear()
        _LABELS[raw] = labels
    return labels


# encoded value -> value, for the model's attributes: a call's ids, its session, tool, token view and
# resources repeat on each of its spans, and roles, kinds and reasons on all. Bounded: short values
# only, emptied when full.
_MODEL_VALUES: dict[bytes, Any] = {}
_MODEL_VALUES_MAX = 8192
_MODEL_VALUE_MAX_BYTES = 256


def _model_value(encoded: bytes) -> Any:
    value = _any(encoded)
    if len(encoded) <= _MODEL_VALUE_MAX_BYTES:
        if len(_MODEL_VALUES) >= _MODEL_VALUES_MAX:
            _MODEL_VALUES.clear()
        _MODEL_VALUES[encoded] = value
    return value


def _any(encoded: bytes) -> Any:
    """An encoded AnyValue's value. The shapes of nearly every attribute (a short string, an int, an
    array of short strings) are read without building messages; anything else by protobuf."""
    size = len(encoded)
    if size >= 2 and encoded[1] < 0x80:
        tag = encoded[0]
        if tag == 0x0A and encoded[1] == size - 2:  # string_value
            return _utf8(encoded[2:])
        if tag == 0x2A and encoded[1] == size - 2:  # array_value
            values = _strings(encoded, 2)
            if values is not None:
                return values
        if tag == 0x18 and size == 2:  # int_value, 0..127
            return encoded[1]
    try:
        return _value(AnyValue.FromString(encoded))
    except DecodeError as exc:
        raise IngestError(400, f"a span does not decode: {exc}", "malformed") from None


def _strings(encoded: bytes, pos: int) -> tuple[str, ...] | None:
    """An ArrayValue of short strings only (each value {1: {1: text}}); None for any other shape."""
    values: list[str] = []
    end = len(encoded)
    while pos < end:
        if pos + 4 > end or encoded[pos] != 0x0A or encoded[pos + 2] != 0x0A or encoded[pos + 1] >= 0x80:
            return None
        length = encoded[pos + 3]
        if length >= 0x80 or encoded[pos + 1] != length + 2 or pos + 4 + length > end:
            return None
        if len(values) < _MAX_ARRAY:
            values.append(_utf8(encoded[pos + 4:pos + 4 + length]))
        pos += 4 + length
    return tuple(values)


def _utf8(raw: bytes) -> str:
    try:
        return raw.decode()
    except UnicodeDecodeError:
        raise IngestError(400, _NOT_UTF8, "malformed") from None


_NOT_UTF8 = "a span does not decode: a string attribute is not UTF-8"


def _hex_ids_to_base64(doc: Any) -> Any:
    """OTLP/JSON writes trace and span ids as hex; protobuf's JSON mapping expects base64. A part of the
    wrong type is left as it is: ``ParseDict`` refuses it with its path."""
    if not isinstance(doc, dict):
        raise ValueError("the body must be a JSON object")
    for resource_spans in _objects(doc, "resourceSpans"):
        for scope_spans in _objects(resource_spans, "scopeSpans"):
            for span in _objects(scope_spans, "spans"):
                _rewrite(span)
                for link in _objects(span, "links"):
                    _rewrite(link)
    return doc


def _objects(parent: Any, key: str) -> list[Any]:
    items = parent.get(key) if isinstance(parent, dict) else None
    return items if isinstance(items, list) else []


def _rewrite(obj: Any) -> None:
    if not isinstance(obj, dict):
        raise ValueError("a span or link must be a JSON object")
    for key in ("traceId", "spanId", "parentSpanId"):
        value = obj.get(key)
        if isinstance(value, str) and value:
            try:
                obj[key] = base64.b64encode(bytes.fromhex(value)).decode()
            except ValueError:
                raise ValueError(f"{key} must be hex") from None


def _value(v: AnyValue) -> Any:
    which = v.WhichOneof("value")
    if which == "string_value":  # nearly every attribute of the span model
        return v.string_value
    if which == "array_value":
        return tuple(_value(x) for x in v.array_value.values[:_MAX_ARRAY])
    if which in _SCALARS:
        return getattr(v, which)
    return None  # kvlist and bytes: not in the span model


_SCALARS = frozenset({"int_value", "bool_value", "double_value"})


def _attributes(kvs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


def _read(s: Any, origin: str) -> Span | Operation:
    """A lean-decoded span as the detector reads it: only the values of the keys it reads are decoded
    (none for a span outside the model), and the SDK's request spans become their :class:`Operation` at
    once, with no :class:`Span` between (one that breaks the model stays a span, for ``Detector.read``
    to refuse with its reason)."""
    encoded = s.attributes
    model = sc.SPAN in encoded
    if model:
        attributes = {}
        for key, value in encoded.items():
            if key in READ_KEYS:
                decoded = _MODEL_VALUES.get(value)
                attributes[key] = decoded if decoded is not None else _model_value(value)
    elif sc.MCP_METHOD_NAME in encoded:
        attributes = {key: _any(encoded[key]) for key in _SDK_KEYS if key in encoded}
    else:
        attributes = {}  # outside the model: nothing of it is read
    kind = _KINDS.get(s.kind, KIND_INTERNAL)
    exceptions = tuple(str(_any(e.attributes[_EXCEPTION_TYPE]) if _EXCEPTION_TYPE in e.attributes else "")
                       for e in s.events if e.name == "exception") if s.events else ()
    error = _error(s.status)
    if not model and attributes and kind != KIND_INTERNAL:
        with suppress(Rejected):
            return operation(kind, s.name, attributes, exceptions, error, s.trace_id.hex(), s.span_id.hex(),
                             s.start_time_unix_nano, s.end_time_unix_nano, origin)
    return Span(trace_id=s.trace_id.hex(), span_id=s.span_id.hex(), parent_span_id=s.parent_span_id.hex() or None,
                name=s.name, kind=kind, start_ns=s.start_time_unix_nano, end_ns=s.end_time_unix_nano,
                attributes=attributes, exception_types=exceptions, error=error, origin=origin)


def partial_success(outcome: Outcome) -> Any:
    response = ExportResponse()
    if outcome.rejected:
        response.partial_success.rejected_spans = outcome.rejected_count
        response.partial_success.error_message = outcome.message()[:1000]
    return response


class IngestQueue:
    """Lifecycle events waiting for the ledger, bounded, drained by one worker thread: backpressure,
    not growth. ``offer`` never blocks; when full, the sender is told to retry later. ``close`` stops
    taking batches and drains what was accepted (graceful shutdown finishes in-flight ingest)."""

    def __init__(self, detector: Detector, limits: IngestLimits, tick_interval_s: float = 0.5) -> None:
        self.detector = detector
        self.limits = limits
        self._batches: deque[tuple[list[Event], float, int]] = deque()
        self._queued = 0
        self._queued_bytes = 0
        self._cond = threading.Condition()
        self._closed = False
        self._tick_interval_s = tick_interval_s
        self._decoding = threading.BoundedSemaphore(limits.max_decoding)
        self._buffered = 0
        self._worker = threading.Thread(target=self._run, name="mcp-stream-detector-ingest", daemon=True)
        self._worker.start()
        detector.metrics.ingest_queue_spans.set_function(lambda: self._queued)  # read at scrape time

    @property
    def queued(self) -> int:
        return self._queued

    @property
    def accepting(self) -> bool:
        return not self._closed and self._worker.is_alive()

    def offer(self, events: list[Event]) -> bool:
        size = sum(e.weight() if type(e) is OperationCounts else weight(e) for e in events)
        with self._cond:
            if self._closed or (self._queued and (self._queued + len(events) > self.limits.max_queued_spans
                                                  or self._queued_bytes + size > self.limits.max_queued_bytes)):
                return False
            self._batches.append((events, time.monotonic(), size))
            self._queued += len(events)
            self._queued_bytes += size
            self._cond.notify()
        return True

    @contextmanager
    def decoding(self) -> Iterator[None]:
        """One of the few decoding slots, waited for in turn; 429 if none frees up in time."""
        if not self._decoding.acquire(timeout=self.limits.decoding_wait_s):
            raise IngestError(429, "every decoding slot is busy; retry after the given delay", "busy")
        try:
            yield
        finally:
            self._decoding.release()

    def reserve(self, size: int) -> bool:
        """Room for ``size`` more bytes of request bodies (all requests together); False when full."""
        with self._cond:
            if self._buffered + size > self.limits.max_buffered_bytes:
                return False
            self._buffered += size
            return True

    def release(self, size: int) -> None:
        with self._cond:
            self._buffered -= size

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._batches and not self._closed:
                    self._cond.wait(self._tick_interval_s)
                if not self._batches and self._closed:
                    return
                batch = self._batches.popleft() if self._batches else None
            if batch is None:
                self.detector.tick()
                continue
            events, arrived, size = batch
            try:
                self.detector.apply(events)
            except Exception:  # a bug must not stop ingest: log its cause, count it, go on
                log.exception("a batch could not be applied", extra={"events": len(events)})
                self.detector.metrics.errors.labels("ingest").inc()
            finally:
                with self._cond:
                    self._queued -= len(events)
                    self._queued_bytes -= size
                    self._cond.notify_all()
                self.detector.metrics.ingest_latency.observe(time.monotonic() - arrived)

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until every accepted batch is in the ledger; False if that took longer than ``timeout_s``."""
        with self._cond:
            return self._cond.wait_for(lambda: self._queued == 0, timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._worker.join(timeout_s)


def receive(queue: IngestQueue, batch: Batch, transport: str) -> Outcome | None:
    """Read a decoded request's spans and queue what the ledger needs; None when the queue is full."""
    events, outcome = queue.detector.read(batch.spans, transport)
    if events and not queue.offer(events):
        return None
    return outcome


class _TraceService:
    """OTLP/gRPC ``Export``, taking the request's bytes: decoded like an HTTP body (bounded, span by span)."""

    def __init__(self, queue: IngestQueue, token: str | None) -> None:
        self._queue = queue
        self._token = token

    def export(self, body: bytes, context: grpc.ServicerContext) -> Any:
        rejected = self._queue.detector.metrics.requests_rejected
        if self._token is not None:
            sent = dict(context.invocation_metadata()).get("authorization", "")
            if not bearer_matches(str(sent), self._token):
                rejected.labels("unauthorized").inc()
                context.abort(grpc.StatusCode.UNAUTHENTICATED, "a bearer token is required")
        try:
            with self._queue.decoding():
                outcome = receive(self._queue, decode_protobuf(body, self._queue.limits), "otlp_grpc")
        except IngestError as exc:
            rejected.labels(exc.metric_reason).inc()
            status = grpc.StatusCode.UNAVAILABLE if exc.status == 429 else grpc.StatusCode.INVALID_ARGUMENT
            context.abort(status, exc.reason)
        if outcome is None:  # OTLP/gRPC: UNAVAILABLE is retryable with backoff
            rejected.labels("queue_full").inc()
            context.abort(grpc.StatusCode.UNAVAILABLE, "ingest queue full; retry with backoff")
        return partial_success(outcome)


def serve_grpc(queue: IngestQueue, host: str, port: int, token: str | None = None,
               tls: tuple[bytes, bytes] | None = None,
               connection: ConnectionLimits | None = None) -> tuple[grpc.Server, int]:
    """The OTLP/gRPC receiver (what the Collector's loadbalancing exporter speaks); returns it and its port."""
    connection = connection or ConnectionLimits()
    limits = queue.limits
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=limits.max_decoding, thread_name_prefix="mcp-stream-otlp-grpc"),
        maximum_concurrent_rpcs=4 * limits.max_decoding,  # beyond: RESOURCE_EXHAUSTED, the sender retries
        options=[("grpc.max_receive_message_length", min(limits.max_body_bytes, limits.max_decompressed_bytes)),
                 ("grpc.max_connection_idle_ms", int(connection.idle_timeout_s * 1000)),
                 ("grpc.max_concurrent_streams", 16)])
    service = _TraceService(queue, token)
    handler: grpc.RpcMethodHandler[bytes, Any] = grpc.unary_unary_rpc_method_handler(
        service.export, request_deserializer=None, response_serializer=ExportResponse.SerializeToString)  # raw bytes in
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "opentelemetry.proto.collector.trace.v1.TraceService", {"Export": handler}),))
    address = f"{host}:{port}"
    bound = (server.add_secure_port(address, grpc.ssl_server_credentials([tls])) if tls
             else server.add_insecure_port(address))
    server.start()
    return server, bound

