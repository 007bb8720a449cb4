"""OTLP in: decoding with limits, a bounded queue in front of the detector, and the gRPC receiver.

Every refusal has a clear answer (OTLP/HTTP spec): 400 for a body that does not decode, 413 for one
too large before or after decompression (a gzip bomb is refused while inflating, never inflated
whole), 415 for an unknown content type, and 429/503 with ``Retry-After`` when the queue is full.
Spans that decode but break the span model are refused one by one in the OTLP partial-success
answer; the rest of their batch is kept.
"""

from __future__ import annotations

import base64
import json
import threading
import time
import zlib
from collections import deque
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf import json_format
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span as OtlpSpan
from opentelemetry.proto.trace.v1.trace_pb2 import Status

from mcp_stream_exporter.detector.credentials import bearer_matches
from mcp_stream_exporter.detector.detector import Detector, Outcome
from mcp_stream_exporter.detector.events import KIND_CLIENT, KIND_INTERNAL, KIND_SERVER, Lifecycle, Span, origin_of

ExportRequest = trace_service_pb2.ExportTraceServiceRequest
ExportResponse = trace_service_pb2.ExportTraceServiceResponse

PROTOBUF = "application/x-protobuf"
JSON = "application/json"
_KINDS = {OtlpSpan.SPAN_KIND_CLIENT: KIND_CLIENT, OtlpSpan.SPAN_KIND_SERVER: KIND_SERVER}
_MAX_ARRAY = 1_000  # values kept from one array attribute


@dataclass(frozen=True, slots=True)
class IngestLimits:
    max_body_bytes: int = 4 * 1024 * 1024  # as received (compressed or not)
    max_decompressed_bytes: int = 16 * 1024 * 1024
    max_spans_per_request: int = 10_000
    max_queued_spans: int = 200_000
    retry_after_s: int = 2


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


def decode(body: bytes, content_type: str, limits: IngestLimits) -> Any:
    """An ``ExportTraceServiceRequest`` from an OTLP/HTTP body (already decompressed)."""
    media = content_type.split(";", 1)[0].strip().lower()
    request = ExportRequest()
    try:
        if media == PROTOBUF:
            request.ParseFromString(body)
        elif media == JSON:
            json_format.ParseDict(_hex_ids_to_base64(json.loads(body)), request, ignore_unknown_fields=True)
        else:
            raise IngestError(415, f"unsupported Content-Type {media[:60]!r}: use {PROTOBUF} or {JSON}",
                              "bad_encoding")
    except (DecodeError, json_format.ParseError, ValueError, TypeError, RecursionError) as exc:
        raise IngestError(400, f"not an OTLP ExportTraceServiceRequest: {str(exc)[:200]}", "malformed") from None
    return request


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


def spans_of(request: Any) -> Iterator[Span]:
    """Every span of a request, read as the detector reads it."""
    for resource_spans in request.resource_spans:
        origin = origin_of(_attributes(resource_spans.resource.attributes))
        for scope_spans in resource_spans.scope_spans:
            for s in scope_spans.spans:
                exceptions = tuple(str(_attributes(e.attributes).get("exception.type", ""))
                                   for e in s.events if e.name == "exception")
                yield Span(
                    trace_id=s.trace_id.hex(), span_id=s.span_id.hex(),
                    parent_span_id=s.parent_span_id.hex() or None, name=s.name,
                    kind=_KINDS.get(s.kind, KIND_INTERNAL), start_ns=s.start_time_unix_nano,
                    end_ns=s.end_time_unix_nano, attributes=_attributes(s.attributes),
                    exception_types=exceptions,
                    error=s.status.code == Status.STATUS_CODE_ERROR, origin=origin)


def count_spans(request: Any) -> int:
    return sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)


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
        self._batches: deque[tuple[list[Lifecycle], float]] = deque()
        self._queued = 0
        self._cond = threading.Condition()
        self._closed = False
        self._tick_interval_s = tick_interval_s
        self._worker = threading.Thread(target=self._run, name="mcp-stream-detector-ingest", daemon=True)
        self._worker.start()

    @property
    def queued(self) -> int:
        return self._queued

    @property
    def accepting(self) -> bool:
        return not self._closed and self._worker.is_alive()

    def offer(self, events: list[Lifecycle]) -> bool:
        with self._cond:
            if self._closed or (self._queued and self._queued + len(events) > self.limits.max_queued_spans):
                return False
            self._batches.append((events, time.monotonic()))
            self._queued += len(events)
            self._cond.notify()
        return True

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
            events, arrived = batch
            try:
                self.detector.apply(events)
            finally:
                with self._cond:
                    self._queued -= len(events)
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


def receive(queue: IngestQueue, request: Any, transport: str) -> Outcome | None:
    """Read a decoded request's spans and queue what the ledger needs; None when the queue is full."""
    limit = queue.limits.max_spans_per_request
    spans = count_spans(request)
    if spans > limit:
        raise IngestError(413, f"{spans} spans in one request; at most {limit}: send smaller batches",
                          "too_many_spans")
    events, outcome = queue.detector.read(spans_of(request), transport)
    if events and not queue.offer(events):
        return None
    return outcome


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, queue: IngestQueue, token: str | None) -> None:
        self._queue = queue
        self._token = token

    def Export(self, request: Any, context: grpc.ServicerContext) -> Any:
        if self._token is not None:
            sent = dict(context.invocation_metadata()).get("authorization", "")
            if not bearer_matches(str(sent), self._token):
                self._queue.detector.metrics.requests_rejected.labels("unauthorized").inc()
                context.abort(grpc.StatusCode.UNAUTHENTICATED, "a bearer token is required")
        rejected = self._queue.detector.metrics.requests_rejected
        try:
            outcome = receive(self._queue, request, "otlp_grpc")
        except IngestError as exc:
            rejected.labels(exc.metric_reason).inc()
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, exc.reason)
        if outcome is None:  # OTLP/gRPC: UNAVAILABLE is retryable with backoff
            rejected.labels("queue_full").inc()
            context.abort(grpc.StatusCode.UNAVAILABLE, "ingest queue full; retry with backoff")
        return partial_success(outcome)


def serve_grpc(queue: IngestQueue, host: str, port: int, token: str | None = None,
               tls: tuple[bytes, bytes] | None = None) -> tuple[grpc.Server, int]:
    """The OTLP/gRPC receiver (what the Collector's loadbalancing exporter speaks); returns it and its port."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="mcp-stream-otlp-grpc"),
                         options=[("grpc.max_receive_message_length", queue.limits.max_body_bytes)])
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(  # type: ignore[no-untyped-call]
        _TraceService(queue, token), server)
    address = f"{host}:{port}"
    bound = (server.add_secure_port(address, grpc.ssl_server_credentials([tls])) if tls
             else server.add_insecure_port(address))
    server.start()
    return server, bound

