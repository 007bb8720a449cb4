"""OTLP in: bodies received with limits, and a bounded queue in front of the detector.

Every refusal has a clear answer (OTLP/HTTP spec): 400 for a body that does not decode, 413 for one
too large before or after decompression (a gzip bomb is refused while inflating, never inflated
whole), 415 for an unknown content type, and 429/503 with ``Retry-After`` when the queue is full or
every decoding slot is taken. Spans that decode but break the span model are refused one by one in
the OTLP partial-success answer; the rest of their batch is kept.

A protobuf body is read by ``otlp``; a JSON body's values are counted before it is parsed, and it is
then read as protobuf, by the same reader within the same limits.
"""

from __future__ import annotations

import base64
import json
import logging
import re
import threading
import time
import zlib
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Final

from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.proto.trace.v1.trace_pb2 import Span as OtlpSpan

from mcp_stream_exporter.detector import sizes
from mcp_stream_exporter.detector.detector import Detector, Event, Outcome
from mcp_stream_exporter.detector.limits import IngestError, IngestLimits, busy
from mcp_stream_exporter.detector.metrics import OperationCounts
from mcp_stream_exporter.detector.otlp import Batch, decode_protobuf
from mcp_stream_exporter.redaction import redact

__all__ = ["JSON", "PROTOBUF", "Batch", "BodyHold", "IngestError", "IngestLimits", "IngestQueue", "busy", "decode",
           "decode_protobuf", "decompress", "partial_success", "receive"]

log = logging.getLogger("mcp_stream_exporter.detector")
ExportRequest = trace_service_pb2.ExportTraceServiceRequest
ExportResponse = trace_service_pb2.ExportTraceServiceResponse
# events applied under the detector's lock at once: a batch of thousands of wide spans would hold ``/api`` and
# ``/metrics`` for seconds, and the ledger's memory is accounted for after each
_APPLY_CHUNK = 256

PROTOBUF = "application/x-protobuf"
JSON = "application/json"


# input handed to zlib at a time: where a gzip member ends, zlib copies the rest of what it was handed, so a
# body of many tiny members costs a copy of this much each, not of the whole rest of the body
_INFLATE_FEED = 4096
_NOT_NUL = re.compile(rb"[^\0]")


def decompress(body: bytes, encoding: str | None, limits: IngestLimits) -> bytes:
    """The body as sent, decoded: every member of a gzip body (RFC 1952: as ``gzip -d`` reads one), within
    ``max_decompressed_bytes`` altogether, refused (413) while inflating, never inflated whole."""
    coding = content_coding(encoding)
    if coding == "identity":
        return body
    if coding not in ("gzip", "deflate"):
        raise IngestError(415, f"unsupported Content-Encoding {coding[:40]!r}: use gzip or none", "bad_encoding")
    wbits = 47 if coding == "gzip" else 15  # 47: gzip or zlib header
    room = limits.max_decompressed_bytes
    out: list[bytes] = []
    view = memoryview(body)
    pos = 0
    inflater = zlib.decompressobj(wbits=wbits)
    while True:
        if inflater.eof:  # a member's end: another member follows, or the end
            pos -= len(inflater.unused_data)
            if coding == "gzip":  # NUL padding after a member is skipped, as gzip.decompress skips it
                found = _NOT_NUL.search(body, pos)
                pos = len(body) if found is None else found.start()
            if pos == len(body):
                return b"".join(out)
            if coding != "gzip":
                raise IngestError(400, f"data after the end of the {coding} stream", "malformed")
            inflater = zlib.decompressobj(wbits=wbits)
        if pos == len(body):
            raise IngestError(400, f"body is a truncated {coding} stream", "malformed")
        fed = view[pos:pos + _INFLATE_FEED]
        pos += len(fed)
        try:
            part = inflater.decompress(fed, room + 1)
        except zlib.error as exc:
            raise IngestError(400, f"body does not decompress as {coding}: {exc}", "malformed") from None
        room -= len(part)
        if room < 0:
            raise IngestError(413, f"decompressed body exceeds {limits.max_decompressed_bytes} bytes", "too_large")
        out.append(part)


def content_coding(encoding: str | None) -> str:
    """A Content-Encoding as one coding's name: case-insensitive (RFC 9110 8.4.1), ``x-gzip`` as ``gzip``."""
    coding = (encoding or "").strip().lower() or "identity"
    return "gzip" if coding == "x-gzip" else coding


def decode(body: bytes, content_type: str, limits: IngestLimits) -> Batch:
    """The spans of an OTLP/HTTP body (already decompressed), or the reason it is refused."""
    media = content_type.split(";", 1)[0].strip().lower()
    if media == PROTOBUF:
        return decode_protobuf(body, limits)
    if media == JSON:
        return _decode_json(body, limits)
    raise IngestError(415, f"unsupported Content-Type {media[:60]!r}: use {PROTOBUF} or {JSON}", "bad_encoding")


def _original_names(message: Any) -> set[str]:
    """The field names of ``message`` and of every message in it that differ from their JSON names."""
    names: set[str] = set()
    seen: set[str] = set()
    todo = [message]
    while todo:
        descriptor = todo.pop()
        if descriptor.full_name in seen:
            continue
        seen.add(descriptor.full_name)
        for field in descriptor.fields:
            if field.name != field.json_name:
                names.add(field.name)
            if field.message_type is not None:
                todo.append(field.message_type)
    return names


# OTLP/JSON's keys are the lowerCamelCase JSON names only; protobuf's parser reads the original names too
# (``resource_spans``, ``int_value``), which would pass by what ``_as_protobuf_json`` reads and checks
_ORIGINAL_NAMES = frozenset(_original_names(ExportRequest.DESCRIPTOR))
_ORIGINAL_NAME = re.compile(rb'"(%s)"\s*:' % b"|".join(sorted(n.encode() for n in _ORIGINAL_NAMES)))


def _original(name: str) -> IngestError:
    return IngestError(400, f"OTLP/JSON keys are lowerCamelCase, not {name[:40]!r}", "malformed")


def _lower_camel(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys are no original field name (``json.loads``'s hook, for keys with escapes)."""
    for key, _ in pairs:
        if key in _ORIGINAL_NAMES:
            raise _original(key)
    return dict(pairs)


def _decode_json(body: bytes, limits: IngestLimits) -> Batch:
    values = body.count(b",") + body.count(b"{") + body.count(b"[") + 1  # an upper bound, at C speed
    if values > limits.max_json_values:
        raise IngestError(413, f"about {values} JSON values; at most {limits.max_json_values}: send smaller "
                          f"batches, or protobuf", "too_large")
    original = _ORIGINAL_NAME.search(body)
    if original is not None:
        raise _original(original.group(1).decode())
    request = ExportRequest()
    try:
        # a key written with escapes (``"int\u005fvalue"``) is not in the bytes as such: its parsed keys are read
        doc = json.loads(body, object_pairs_hook=_lower_camel) if b"\\" in body else json.loads(body)
        json_format.ParseDict(_as_protobuf_json(doc), request, ignore_unknown_fields=True)
    except (json_format.ParseError, ValueError, TypeError, RecursionError) as exc:
        reason = redact(str(exc)[:400])[:200]
        raise IngestError(400, f"not an OTLP ExportTraceServiceRequest: {reason}", "malformed") from None
    return decode_protobuf(request.SerializeToString(), limits)  # one reader, the same limits


def _as_protobuf_json(doc: Any) -> Any:
    """OTLP/JSON as protobuf's JSON mapping reads it: trace and span ids from hex (OTLP/JSON) to base64 (the
    mapping), and what the mapping's parser would take though OTLP does not allow it made a refusal. A part of
    the wrong type is left as it is: ``ParseDict`` refuses it with its path."""
    if not isinstance(doc, dict):
        raise ValueError("the body must be a JSON object")
    for resource_spans in _objects(doc, "resourceSpans"):
        for scope_spans in _objects(resource_spans, "scopeSpans"):
            for span in _objects(scope_spans, "spans"):
                _rewrite(span)
                _strict(span)
                for link in _objects(span, "links"):
                    _rewrite(link)
    return doc


def _objects(parent: Any, key: str) -> list[Any]:
    items = parent.get(key) if isinstance(parent, dict) else None
    return items if isinstance(items, list) else []


# protobuf's parser reads more than OTLP/JSON allows, and reads it as a valid value: an int64 string through
# ``int()`` (fullwidth or Arabic-Indic digits, "1_2", "+5", "\t12"), a kind that is no SpanKind as UNSPECIFIED
# (an unknown name, 2**40) or as a kind it does not name (true, a fullwidth digit). What OTLP/JSON writes: an
# int64 in decimal, a kind's number or name.
_INT64_TEXT = re.compile(r"-?[0-9]{1,19}")
_INT64 = range(-(2**63), 2**63)
_KIND_NUMBERS = frozenset(OtlpSpan.SpanKind.values())
_KIND_NAMES = frozenset(OtlpSpan.SpanKind.keys())


def _strict(span: dict[str, Any]) -> None:
    """A span's int attribute (or array item) or kind that OTLP/JSON does not allow, made one the span model's
    readers refuse, as they refuse one of the wrong type in protobuf: an int as a double (which no reader
    takes), the kind as a number of no SpanKind. The span is refused if a reader reads it."""
    kind = span.get("kind")
    if kind is not None and not ((type(kind) is int and kind in _KIND_NUMBERS)
                                 or (type(kind) is str and kind in _KIND_NAMES)):
        span["kind"] = -1
    for attribute in _objects(span, "attributes"):
        value = attribute.get("value") if isinstance(attribute, dict) else None
        if isinstance(value, dict):
            _strict_int(value)
            array = value.get("arrayValue")
            for item in _objects(array, "values"):
                _strict_int(item)


def _strict_int(value: Any) -> None:
    text = value.get("intValue") if isinstance(value, dict) else None
    if isinstance(text, str) and not (_INT64_TEXT.fullmatch(text) and int(text) in _INT64):
        del value["intValue"]
        value["doubleValue"] = "NaN"


# what an id that is no hex becomes: one byte, an id of neither 16 nor 8, which the span model's readers refuse with
# the span alone (base64, what protobuf's generic JSON mapping writes, in one span loses no other span of the batch)
_NOT_HEX: Final = base64.b64encode(b"\xff").decode()


def _rewrite(obj: Any) -> None:
    if not isinstance(obj, dict):
        raise ValueError("a span or link must be a JSON object")
    for key in ("traceId", "spanId", "parentSpanId"):
        value = obj.get(key)
        if isinstance(value, str) and value:
            try:
                obj[key] = base64.b64encode(bytes.fromhex(value)).decode()
            except ValueError:
                obj[key] = _NOT_HEX


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
        self._holds: set[BodyHold] = set()  # bodies being received, which may make way (``reserve``)
        self._worker = threading.Thread(target=self._run, name="mcp-stream-detector-ingest", daemon=True)
        self._worker.start()
        detector.metrics.ingest_queue_spans.set_function(lambda: self._queued)  # read at scrape time

    @property
    def queued(self) -> int:
        return self._queued

    @property
    def buffered(self) -> int:
        """Bytes of request bodies held (``reserve``)."""
        return self._buffered

    @property
    def accepting(self) -> bool:
        return not self._closed and self._worker.is_alive()

    def offer(self, events: list[Event]) -> bool:
        size = sum(e.weight() if isinstance(e, OperationCounts) else sizes.event(e) for e in events)
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
            raise busy()
        try:
            yield
        finally:
            self._decoding.release()

    def hold(self, wake: Callable[[], None]) -> BodyHold:
        """A body about to be received, reserved chunk by chunk (``reserve``); ``wake`` (thread-safe, quick) tells
        its receiver it made way for another (``BodyHold.evicted``)."""
        hold = BodyHold(time.monotonic(), wake)
        with self._cond:
            self._holds.add(hold)
        return hold

    def keep(self, hold: BodyHold) -> bool:
        """The body is in whole: what it reserved is its receiver's to ``release``; False if it made way first."""
        with self._cond:
            self._holds.discard(hold)
            if hold.evicted:
                return False
            hold.reserved = 0
            return True

    def let_go(self, hold: BodyHold) -> None:
        """The body will not be kept (refused, cut, made way): what it reserved is released."""
        with self._cond:
            self._holds.discard(hold)
            self._buffered -= hold.reserved
            hold.reserved = 0

    def reserve(self, size: int, hold: BodyHold | None = None) -> bool:
        """Room for ``size`` more bytes of request bodies (all requests together, HTTP's and gRPC's), for ``hold``
        if given; False when full. When full, the bodies begun before this one and still coming past
        ``body_grace_s`` make way, the longest first: a few slow senders would otherwise hold the buffer, and turn
        every sender away, until their bodies' timeout."""
        with self._cond:
            if hold is not None and hold.evicted:  # it made way already: no room made for it
                return False
            if self._buffered + size > self.limits.max_buffered_bytes and not self._make_room(size, hold):
                return False
            self._buffered += size
            if hold is not None:
                hold.reserved += size
            return True

    def _make_room(self, size: int, hold: BodyHold | None) -> bool:
        """Room made by the slow bodies begun before ``hold``, the longest first, as few as will do; none made way
        if all of them would not make enough."""
        before = time.monotonic() - self.limits.body_grace_s
        if hold is not None:
            before = min(before, hold.since)
        short = self._buffered + size - self.limits.max_buffered_bytes
        slow: list[BodyHold] = []
        for other in sorted(self._holds, key=lambda h: h.since):
            if other.since > before or short <= 0:
                break
            if other is not hold and other.reserved and not other.evicted:
                slow.append(other)
                short -= other.reserved
        if short > 0:
            return False
        for other in sorted(slow, key=lambda h: h.reserved):  # those the others make room without: kept
            if other.reserved <= -short:
                slow.remove(other)
                short += other.reserved
        for other in slow:
            other.evicted = True
            self._buffered -= other.reserved
            other.reserved = 0
            other.wake()
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
                for start in range(0, len(events), _APPLY_CHUNK):
                    if start:
                        time.sleep(0)  # the lock let go, and the GIL: a reader waiting for it gets its turn
                    self.detector.apply(events[start:start + _APPLY_CHUNK],
                                        judge=start + _APPLY_CHUNK >= len(events))
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

    def close(self, timeout_s: float = 10.0) -> bool:
        """Apply what was accepted, within ``timeout_s``; whether all of it was."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._worker.join(timeout_s)
        return not self._worker.is_alive()


@dataclass(slots=True, eq=False)
class BodyHold:
    """A request body being received: since when (``time.monotonic``), what of it is reserved in the bodies'
    buffer, and whether it made way for another (its reservation released, its receiver woken to refuse it)."""

    since: float
    wake: Callable[[], None]
    reserved: int = 0
    evicted: bool = False


def receive(queue: IngestQueue, batch: Batch, transport: str) -> Outcome | None:
    """Read a decoded request's spans and queue what the ledger needs; None when the queue is full."""
    events, outcome = queue.detector.read(batch.spans, transport)
    if events and not queue.offer(events):
        return None
    return outcome
