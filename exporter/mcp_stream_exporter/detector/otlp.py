"""OTLP/protobuf -> the detector's input, within limits known before anything is built.

A request is walked at the wire level down to its scopes; a scope's spans are counted (by upb on a
skeleton when the scope is within one decoding's bound, else walked one by one with their sizes
checked), then decoded a run at a time with a lean schema, so it never exists whole as objects. Only what
the detector reads is decoded: a model span's keys it reads, an SDK request span's label keys, nothing
of a span outside the model. The SDK's healthy request spans, nearly all real traffic, become counts
at once (``OperationCounts``) from a memo of their labels by their encoded values. A model span whose
values its readers take as they are becomes its lifecycle event (or its refusal) at once; in the hooks'
scope its attributes are read from a memo of whole encoded KeyValues, which repeat call after call.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Iterator
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import DecodeError
from google.protobuf.unknown_fields import UnknownFieldSet
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, InstrumentationScope
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import ScopeSpans, Status
from opentelemetry.proto.trace.v1.trace_pb2 import Span as OtlpSpan

from mcp_stream_exporter import semconv as sc
from mcp_stream_exporter.detector.events import (
    KIND_CLIENT,
    KIND_INTERNAL,
    KIND_SERVER,
    MAX_CHARS,
    MODEL_KEYS,
    CallEnd,
    Lifecycle,
    Operation,
    Rejected,
    Replay,
    Span,
    StreamEnd,
    clean,
    cut_origin,
    model_event,
    operation,
    origin_of,
    read_by_rules,
)
from mcp_stream_exporter.detector.limits import IngestError, IngestLimits
from mcp_stream_exporter.detector.metrics import BOUNDS, OperationCounts, Sample, new_tally
from mcp_stream_exporter.redaction import holds_token, redact

_KINDS: dict[int, str] = {OtlpSpan.SPAN_KIND_CLIENT: KIND_CLIENT, OtlpSpan.SPAN_KIND_SERVER: KIND_SERVER}
_SPAN_KINDS = frozenset(OtlpSpan.SpanKind.values())
_MAX_ARRAY = 1_000  # values kept from one array attribute
_ERROR = Status.STATUS_CODE_ERROR
_EXCEPTION_TYPE = "exception.type"


@dataclass(frozen=True, slots=True)
class Batch:
    """A decoded request: its spans counted up front, read one at a time."""

    count: int
    spans: Iterable[Span | Lifecycle | Rejected | OperationCounts]


def decode_protobuf(body: bytes, limits: IngestLimits) -> Batch:
    try:
        located = _locate_spans(memoryview(body), limits)
    except DecodeError as exc:
        raise IngestError(400, f"not an OTLP ExportTraceServiceRequest: {exc}", "malformed") from None
    return Batch(sum(run[2] for run in located), _decoded_spans(located))


def _check_span_count(count: int, limits: IngestLimits) -> None:
    if count > limits.max_spans_per_request:
        raise IngestError(413, f"more than {limits.max_spans_per_request} spans in one request: send smaller "
                          "batches", "too_many_spans")


# --- the protobuf wire format, walked without decoding: ExportTraceServiceRequest.resource_spans (1) ->
# ResourceSpans.resource (1) and .scope_spans (2) -> ScopeSpans.spans (2) ---

_VARINT, _FIXED64, _LENGTH, _FIXED32 = 0, 1, 2, 5


def _locate_spans(body: memoryview, limits: IngestLimits) -> list[tuple[str, memoryview, int, bool]]:
    """(origin, encoded spans, how many, whether of the hooks' scope) for runs of consecutive spans of the
    request, each run at most ``max_span_bytes`` (or one span) and decoded as one ``ScopeSpans``; refused as
    soon as there are too many (spans, or fields around them) or one is too large. A scope within that
    bound, nearly every exporter's, is one run whose spans upb counts (as bytes, no message built); a larger
    one is walked here, at most a few steps per span."""
    fields = [_fields_around_spans(limits)]  # fields walked, left
    located: list[tuple[str, memoryview, int, bool]] = []
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
                skeleton = _SkeletonScopeSpans.FromString(scope)
                spans = len(skeleton.spans)
                fields[0] -= spans
                count += spans
                _check_span_count(count, limits)
                if spans:
                    located.append((origin, scope, spans, skeleton.scope.startswith(_OURS)))
                continue
            run_start = run_end = run_spans = 0
            ours = False
            for number, span, start, end in _length_fields(scope, fields, limits):
                if number == 1:
                    ours = span[:len(_OURS)] == _OURS
                if number != 2:
                    continue
                if len(span) > limits.max_span_bytes:
                    raise IngestError(413, f"a span of {len(span)} bytes; at most {limits.max_span_bytes}",
                                      "too_large")
                count += 1
                _check_span_count(count, limits)
                if run_spans and end - run_start > limits.max_span_bytes:
                    located.append((origin, scope[run_start:run_end], run_spans, ours))
                    run_spans = 0
                if not run_spans:
                    run_start = start
                run_end = end
                run_spans += 1
            if run_spans:
                located.append((origin, scope[run_start:run_end], run_spans, ours))
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


def _decoded_spans(located: list[tuple[str, memoryview, int, bool]]
                   ) -> Iterator[Span | Lifecycle | Rejected | OperationCounts]:
    """Each span, read (``_read``, or ``_read_ours`` in the hooks' scope), except the SDK's healthy request
    spans, nearly all of real traffic: those are counted at once into the batch's :class:`OperationCounts`
    (yielded last), with no :class:`Operation` each, from a memo of their labels by their raw attribute
    values."""
    tallies: dict[Any, tuple[list[float], list[Any]]] = {}
    taken = 0
    for origin, encoded, _, ours in located:
        model_origin = cut_origin(origin)  # a model span's, once for the run rather than once a span
        try:  # upb reads any buffer
            spans = (_ModelScopeSpans if ours else _LeanScopeSpans).FromString(encoded).spans
        except DecodeError as exc:
            raise IngestError(400, f"a span does not decode: {exc}", "malformed") from None
        at = 0
        while at < len(spans):
            span = spans[at]
            at += 1
            if ours:
                model = _read_ours(span, origin, model_origin)
                if model is not None:
                    yield model
                    continue
                # no model span: the rest of the run is read as any other scope's (decoded again, once)
                ours = False
                try:
                    spans = _LeanScopeSpans.FromString(encoded).spans
                except DecodeError as exc:
                    raise IngestError(400, f"a span does not decode: {exc}", "malformed") from None
                span = spans[at - 1]
            attributes = span.attributes
            if sc.SPAN in attributes:
                try:
                    yield _read(span, origin, model_origin)
                except UnicodeDecodeError:
                    raise IngestError(400, _NOT_UTF8, "malformed") from None
                continue
            values = tuple(map(attributes.get, _SDK_KEYS))
            if values[0] is None:
                taken += 1  # outside the model: nothing of it is read
                continue
            if not span.events:
                tool = values[1]  # the name says the tool unless a plain short string does (operation())
                raw = (span.kind, span.status.code, values, None if tool is not None and len(tool) > 1
                       and tool[0] == 0x0A and tool[1] == len(tool) - 2 < 0x80 else span.name)
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
                yield _read_sdk(span, values, origin)
            except UnicodeDecodeError:
                raise IngestError(400, _NOT_UTF8, "malformed") from None
        for _, last in tallies.values():  # exemplars read now: a run's decoded objects are freed with it
            last[:] = map(_sample, last)
    if taken:
        yield OperationCounts(tallies, taken)


def _sample(span: Any) -> Sample | None:
    """A bucket's last span as its exemplar, if its ids can be one (W3C lengths: longer would break
    OpenMetrics' 128 characters of exemplar labels, and Prometheus' whole scrape; such a span leaves its
    bucket without one for this run, the price of not reading every span's ids); an earlier run's
    exemplar as it is."""
    if span is None or type(span) is tuple:
        return span
    if len(span.trace_id) > 16 or len(span.span_id) > 8:
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


def _lean_schema() -> tuple[Any, Any, Any, Any, Any]:
    """The lean ScopeSpans and Span; ScopeSpans whose spans keep their attributes as encoded KeyValues (the
    hooks' scope: :func:`_read_ours`) and a KeyValue; the skeleton whose spans stay bytes (to count them
    before anything is decoded), with its scope still encoded."""
    number = {name: f.number for name, f in OtlpSpan.DESCRIPTOR.fields_by_name.items()}
    file = descriptor_pb2.FileDescriptorProto(name="mcp_stream_exporter/lean_otlp.proto", package=_LEAN,
                                              syntax="proto3")
    status = file.message_type.add(name="Status")
    _field(status, "code", _number(Status.DESCRIPTOR, "code"), _T.TYPE_INT32)
    key_value = file.message_type.add(name="KeyValue")
    _field(key_value, "key", 1, _T.TYPE_STRING)
    _field(key_value, "value", 2, _T.TYPE_BYTES)
    for span_name in ("Span", "ModelSpan"):
        span = file.message_type.add(name=span_name)
        for name, kind in (("trace_id", _T.TYPE_BYTES), ("span_id", _T.TYPE_BYTES), ("parent_span_id", _T.TYPE_BYTES),
                           ("name", _T.TYPE_STRING), ("kind", _T.TYPE_INT32), ("start_time_unix_nano", _T.TYPE_FIXED64),
                           ("end_time_unix_nano", _T.TYPE_FIXED64)):
            _field(span, name, number[name], kind)
        if span_name == "Span":
            _attribute_map(span, "Span", number["attributes"])
            event = span.nested_type.add(name="Event")
            _field(event, "name", _number(OtlpSpan.Event.DESCRIPTOR, "name"), _T.TYPE_STRING)
            _attribute_map(event, "Span.Event", _number(OtlpSpan.Event.DESCRIPTOR, "attributes"))
        else:
            _field(span, "attributes", number["attributes"], _T.TYPE_BYTES, repeated=True)
        _field(span, "events", number["events"], _T.TYPE_MESSAGE, "Span.Event", repeated=True)
        _field(span, "status", number["status"], _T.TYPE_MESSAGE, "Status")
    spans = _number(ScopeSpans.DESCRIPTOR, "spans")
    _field(file.message_type.add(name="ScopeSpans"), "spans", spans, _T.TYPE_MESSAGE, "Span", repeated=True)
    _field(file.message_type.add(name="ModelScopeSpans"), "spans", spans, _T.TYPE_MESSAGE, "ModelSpan", repeated=True)
    skeleton_spans = file.message_type.add(name="SkeletonScopeSpans")
    _field(skeleton_spans, "scope", _number(ScopeSpans.DESCRIPTOR, "scope"), _T.TYPE_BYTES)  # not decoded: _OURS
    _field(skeleton_spans, "spans", spans, _T.TYPE_BYTES, repeated=True)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    scope_spans, lean_span, model_scope_spans, lean_key_value, skeleton = (
        message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{_LEAN}.{name}"))
        for name in ("ScopeSpans", "Span", "ModelScopeSpans", "KeyValue", "SkeletonScopeSpans"))
    return scope_spans, lean_span, model_scope_spans, lean_key_value, skeleton


_LeanScopeSpans, _LeanSpan, _ModelScopeSpans, _LeanKeyValue, _SkeletonScopeSpans = _lean_schema()
# the hooks' scope (InstrumentationScope.name first, as encoders write it): model spans, whose attributes repeat
# call after call. Only which schema a scope's spans are decoded with: either reads any span alike.
_OURS = bytes([_number(InstrumentationScope.DESCRIPTOR, "name") << 3 | _LENGTH, len(sc.INSTRUMENTATION_NAME)]) + (
    sc.INSTRUMENTATION_NAME.encode())


# the keys of the SDK's request spans that their labels are made of
_SDK_KEYS = (sc.MCP_METHOD_NAME, sc.GEN_AI_TOOL_NAME, sc.ERROR_TYPE, sc.RPC_RESPONSE_STATUS_CODE, sc.NETWORK_TRANSPORT,
             sc.MCP_PROTOCOL_VERSION)
# the keys besides the model's that lifecycle reads of a span whose mcp_stream.span has no value (an SDK span's)
_SDK_READ_KEYS = (sc.MCP_METHOD_NAME, sc.ERROR_TYPE, sc.RPC_RESPONSE_STATUS_CODE)
# (kind, status code, encoded values of _SDK_KEYS, the name unless a plain string names the tool) -> the
# span's labels, or None for a span read one by one (rules read it, or it breaks the model). Methods,
# tools, codes and versions repeat span after span, so a look-up replaces reading; emptied when full.
_LABELS: dict[Any, Any] = {}
_LABELS_MAX = 1024  # a process-wide cache outside every budget: about 0.5 MiB at most
_LABELS_KEY_MAX_BYTES = 256
_UNKNOWN = object()


def _remember(memo: dict[Any, Any], most: int, key: Any, value: Any) -> None:
    """``key``'s value kept in a bounded memo, emptied when full: a memo of values that repeat, where
    one that never repeats only loses the gain."""
    if len(memo) >= most:
        memo.clear()
    memo[key] = value


def _labels(raw: tuple[int, int, tuple[bytes | None, ...], str | None]) -> Any:
    """A memo key's labels, read as a span read one by one would be (``operation``), and remembered."""
    kind, code, values, name = raw
    role = _KINDS.get(kind)
    labels = None
    if role is not None:
        attributes = {key: _any(value) for key, value in zip(_SDK_KEYS, values, strict=True)
                      if value is not None}
        with suppress(Rejected):
            e = operation(role, name or "", attributes, (), code == _ERROR, "", "", 0, 0, "")
            labels = None if read_by_rules(e) else OperationCounts.key(e)
    encoded = b"".join(v for v in values if v is not None) + (name or "").encode()
    if len(encoded) <= _LABELS_KEY_MAX_BYTES and not holds_token(encoded):  # a memo keeps no credential
        _remember(_LABELS, _LABELS_MAX, raw, labels)
    return labels


_TRACE_IDS: dict[bytes, str] = {}  # trace id -> its hex; emptied when full
_TRACE_IDS_MAX = 1024


def _trace_id(raw: bytes) -> str:
    """A trace id in hex, one string for the spans of a trace (a call, its streams and replays): the
    ledger keeps one copy instead of one a span."""
    hexed = _TRACE_IDS.get(raw)
    if hexed is None:
        if len(raw) > 16:  # longer than W3C's: not remembered
            return raw.hex()
        hexed = raw.hex()
        _remember(_TRACE_IDS, _TRACE_IDS_MAX, raw, hexed)
    return hexed


# encoded value -> value, for the model's attributes, one memo per type its readers take (MODEL_KEYS): a
# call's ids, its session, tool, token view and resources repeat on each of its spans, and roles, kinds and
# reasons on all. Only values the readers take as they are (``clean``): a hit needs no checking. Bounded:
# short values only, each memo emptied when full.
_MODEL_VALUES: dict[type, dict[bytes, Any]] = {str: {}, tuple: {}, int: {}}
_MODEL_VALUES_MAX = {str: 1024, tuple: 768, int: 256}  # process-wide caches outside every budget: 0.5 MiB at most
_MODEL_VALUE_MAX_BYTES = 80  # session and request ids, tools, resources; a longer value is decoded each time
_MODEL_VALUE_MAX_ITEMS = 8  # an array decodes to more than its bytes: a few values each (ids, resources)
_MEMO_OF_KEY = {key: _MODEL_VALUES[kind] for key, kind in MODEL_KEYS.items()}


def _model_value(key: str, encoded: bytes) -> tuple[Any, bool]:
    """A model attribute's value, and whether its readers take it as it is (then remembered)."""
    value = _any(encoded)
    kind = MODEL_KEYS[key]
    if not clean(value, kind):
        return value, False
    if (value is not None and len(encoded) <= _MODEL_VALUE_MAX_BYTES
            and (kind is not tuple or len(value) <= _MODEL_VALUE_MAX_ITEMS)
            and not holds_token(encoded)):  # a memo keeps no credential
        _remember(_MODEL_VALUES[kind], _MODEL_VALUES_MAX[kind], encoded, value)
    return value, True


# encoded KeyValue of the hooks' scope -> (key, value): a model key's value its readers take as it is.
# Bounded: short KeyValues only, none holding a token, emptied when full.
_KEY_VALUES: dict[bytes, tuple[str, Any]] = {}
_KEY_VALUES_MAX = 2048  # a process-wide cache outside every budget: about 0.5 MiB at most
_KEY_VALUE_MAX_BYTES = 128  # a key and a short value
# and those of keys no reader reads (the hooks' protocol version, HTTP method, ...), apart: a flood of them
# empties only this one
_NOT_READ: dict[bytes, None] = {}
_NOT_READ_MAX = 512


def _model_key_value(encoded: bytes, key: str, kind: type, raw: bytes) -> tuple[Any, bool]:
    """A model key's value from its encoded KeyValue, and whether the readers take it as it is; remembered
    when it may be, the value shared with every other key's (``_model_value``)."""
    value = _MODEL_VALUES[kind].get(raw)
    taken = True
    if value is None:
        value, taken = _model_value(key, raw)
    if (taken and value is not None and len(encoded) <= _KEY_VALUE_MAX_BYTES
            and (kind is not tuple or len(value) <= _MODEL_VALUE_MAX_ITEMS)
            and not holds_token(encoded)):  # a memo keeps no credential
        _remember(_KEY_VALUES, _KEY_VALUES_MAX, encoded, (key, value))
    return value, taken


# a span of the hooks' scope carries a few dozen attributes at most; one with more (a key repeated, keys no
# reader reads) is read as any other scope's, where the map keeps each key once without a Python step each
_OURS_MAX_ATTRIBUTES = 2 * len(MODEL_KEYS)
_KEY_NAMES = {key.encode(): key for key in MODEL_KEYS}
_SPAN_KEY = sc.SPAN.encode()


def _key_of(encoded: bytes) -> tuple[str, bytes] | None:
    """An encoded KeyValue's key and encoded value, as upb reads them (its usual shape read here); None for
    one upb's map leaves out (a field besides key and value)."""
    size = len(encoded)
    if size >= 2 and encoded[0] == 0x0A and encoded[1] < 0x80:  # key first, its length in one byte
        end = 2 + encoded[1]
        value = None
        if end == size:
            value = b""  # no value: as protobuf reads it, an empty AnyValue
        elif end + 2 <= size and encoded[end] == 0x12 and encoded[end + 1] == size - end - 2 < 0x80:
            value = encoded[end + 2:]
        if value is not None:
            name = encoded[2:end]
            key = _KEY_NAMES.get(name)
            return (key if key is not None else _utf8(name)), value
    try:
        key_value = _LeanKeyValue.FromString(encoded)
    except DecodeError as exc:
        raise IngestError(400, f"a span does not decode: {exc}", "malformed") from None
    if len(UnknownFieldSet(key_value)):
        return None
    return key_value.key, key_value.value


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


def _read(s: Any, origin: str, model_origin: str) -> Span | Lifecycle | Rejected:
    """A lean-decoded span as the detector reads it: only the values of the keys it reads are decoded
    (none for a span outside the model). A model span whose values are all ``clean`` becomes its event (or
    its refusal) at once, the SDK's request spans their :class:`Operation`, with no :class:`Span` between;
    any other stays a span, for ``Detector.read`` to read one value at a time, or refuse with its reason.
    ``origin`` is already cut and redacted; ``model_origin`` is ``cut_origin(origin)``, a model event's."""
    encoded = s.attributes
    model = sc.SPAN in encoded
    attributes: dict[str, Any]
    if model:
        attributes = {}
        as_they_are = True
        for key in encoded:  # not .items(): a map's is a Python generator, half of this loop's cost
            memo = _MEMO_OF_KEY.get(key)
            if memo is not None:
                value = encoded[key]
                decoded = memo.get(value)
                if decoded is None:
                    decoded, taken = _model_value(key, value)
                    as_they_are = as_they_are and taken
                attributes[key] = decoded
        if attributes[sc.SPAN] is not None:
            return _model(s, attributes, as_they_are, origin, model_origin)
        # a key with no value: read as lifecycle reads a span without it
        attributes.update((key, _any(encoded[key])) for key in _SDK_READ_KEYS if key in encoded)
    elif sc.MCP_METHOD_NAME in encoded:
        return _read_sdk(s, tuple(map(encoded.get, _SDK_KEYS)), origin)
    else:
        attributes = {}  # outside the model: nothing of it is read
    return _span(s, attributes, origin)


def _read_sdk(s: Any, values: tuple[bytes | None, ...], origin: str) -> Span | Operation:
    """An SDK request span (its ``mcp.method.name`` set) as its :class:`Operation`, from the encoded values of
    ``_SDK_KEYS``; one that breaks the model stays a span, for ``Detector.read`` to refuse with its reason."""
    attributes = {key: _any(value) for key, value in zip(_SDK_KEYS, values, strict=True) if value is not None}
    kind = _KINDS.get(s.kind, KIND_INTERNAL)
    if kind != KIND_INTERNAL:
        with suppress(Rejected):
            return operation(kind, s.name, attributes, _exceptions(s), s.status.code == _ERROR, s.trace_id.hex(),
                             s.span_id.hex(), s.start_time_unix_nano, s.end_time_unix_nano, origin)
    return _span(s, attributes, origin)


def _read_ours(s: Any, origin: str, model_origin: str) -> Span | StreamEnd | CallEnd | Replay | Rejected | None:
    """A span of the hooks' scope, its attributes still encoded KeyValues, read as ``_read`` reads a model
    span; None for one that is not (no ``mcp_stream.span``, or no value), to be read as any other scope's.
    The hooks' attributes repeat call after call, key and value alike: a memo of whole encoded KeyValues
    replaces finding each key, then its value; a KeyValue it misses is read only once the span may be a
    model span."""
    key_values = s.attributes  # upb makes the container at each access: once
    if len(key_values) > _OURS_MAX_ATTRIBUTES:
        return None  # read by upb's map, each key once: a KeyValue at a time is for the hooks' few
    attributes: dict[str, Any] = {}
    missed = False
    for encoded in key_values:
        pair = _KEY_VALUES.get(encoded)
        if pair is not None:
            key, value = pair
            attributes[key] = value
        elif encoded not in _NOT_READ:
            missed = True
    as_they_are = True
    if missed:
        if sc.SPAN not in attributes and _SPAN_KEY not in b"".join(key_values):
            return None  # no KeyValue can hold the key
        attributes = {}
        for encoded in key_values:  # again, in order: the last of a key counts
            pair = _KEY_VALUES.get(encoded)
            if pair is None:
                if encoded in _NOT_READ:
                    continue
                read = _key_of(encoded)
                if read is None:
                    continue
                key, raw = read
                kind = MODEL_KEYS.get(key)
                if kind is None:
                    if len(encoded) <= _KEY_VALUE_MAX_BYTES and not holds_token(encoded):  # no credential kept
                        _remember(_NOT_READ, _NOT_READ_MAX, encoded, None)
                    continue
                value, taken = _model_key_value(encoded, key, kind, raw)
                as_they_are = as_they_are and taken
            else:
                key, value = pair
            attributes[key] = value
    if attributes.get(sc.SPAN) is None:
        return None
    return _model(s, attributes, as_they_are, origin, model_origin)



def _model(s: Any, attributes: dict[str, Any], as_they_are: bool, origin: str,
           model_origin: str) -> Span | StreamEnd | CallEnd | Replay | Rejected:
    """A model span's event, or its refusal, from values all ``clean``; else a span, read one value at a time."""
    if s.kind not in _SPAN_KINDS:  # else read as INTERNAL: a producer that sends no OTLP kind is told so
        return Rejected("the span's kind is no OTLP SpanKind")
    if not as_they_are:
        return _span(s, attributes, origin)
    try:
        return model_event(attributes, (_trace_id(s.trace_id), s.span_id.hex(), s.parent_span_id.hex() or None,
                                        s.start_time_unix_nano, s.end_time_unix_nano, model_origin),
                           checked=False)
    except Rejected as rejected:
        return rejected


def _span(s: Any, attributes: dict[str, Any], origin: str) -> Span:
    return Span(trace_id=_trace_id(s.trace_id), span_id=s.span_id.hex(), parent_span_id=s.parent_span_id.hex() or None,
                name=s.name, kind=_KINDS.get(s.kind, KIND_INTERNAL), start_ns=s.start_time_unix_nano,
                end_ns=s.end_time_unix_nano, attributes=attributes, exception_types=_exceptions(s),
                error=s.status.code == _ERROR, origin=origin)


def _exceptions(s: Any) -> tuple[str, ...]:
    return tuple(str(_any(e.attributes[_EXCEPTION_TYPE]) if _EXCEPTION_TYPE in e.attributes else "")
                 for e in s.events if e.name == "exception") if s.events else ()
