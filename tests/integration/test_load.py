"""Load: the real service under a sustained span rate on loopback for 30 seconds (bounded in time and in
count). Memory stays under the chart's limit and flat once the ledger is full, a full queue answers 429
with Retry-After instead of growing, and every span accepted is in the ledger's accounting."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span as OtlpSpan
from prometheus_client.parser import text_string_to_metric_families

from mcp_stream_exporter import semconv as sc

from harness import detector_process, wait_for

pytestmark = [pytest.mark.load, pytest.mark.timeout(240)]

SECONDS = 30.0
MAX_BATCHES = 50_000  # the count cap, whatever the rate
SPANS_PER_BATCH = 100
SENDERS = 4
MAX_SESSIONS = 20_000
MEMORY_LIMIT = 512 * 1024 * 1024  # the Helm chart's default memory limit
_SESSION = "load-" + "0" * 14


def _template() -> bytes:
    """One batch of client resumes that ended cleanly with a call pending, each in its own session;
    session ids are fixed-width placeholders, so a batch is the template with its ids replaced."""
    request = ExportTraceServiceRequest()
    spans = request.resource_spans.add().scope_spans.add().spans
    for i in range(SPANS_PER_BATCH):
        span = OtlpSpan(trace_id=bytes(15) + bytes([i + 1]), span_id=bytes(7) + bytes([i + 1]),
                        name="MCP stream resume", kind=3, start_time_unix_nano=time.time_ns(),
                        end_time_unix_nano=time.time_ns() + 1000)
        for key, value in {sc.SPAN: sc.SPAN_STREAM, sc.ROLE: sc.ROLE_CLIENT, sc.ERA: sc.ERA_RESUMABLE,
                           sc.STREAM_KIND: "resume", sc.END_REASON: sc.END_CLEAN, sc.MCP_SESSION_ID: _SESSION,
                           sc.RESUME_CURSOR: "41"}.items():
            span.attributes.append(KeyValue(key=key, value=AnyValue(string_value=value)))
        span.attributes.append(KeyValue(key=sc.PENDING_REQUEST_IDS, value=AnyValue()))
        span.attributes[-1].value.array_value.values.append(AnyValue(string_value="1"))
        spans.append(span)
    return request.SerializeToString()


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _metric(service, name: str) -> float:
    return sum(s.value for f in text_string_to_metric_families(service.metrics()) for s in f.samples
               if s.name == name)


def test_a_sustained_span_rate_for_30_seconds_is_bounded_backpressured_and_fully_accounted():
    template = _template()
    parts = template.split(_SESSION.encode())
    assert len(parts) == SPANS_PER_BATCH + 1
    stats = {"accepted": 0, "batches": 0, "throttled": 0, "without_retry_after": 0}
    lock = threading.Lock()
    memory: list[tuple[float, int]] = []
    with detector_process(f"--max-sessions={MAX_SESSIONS}", "--max-queued-spans=200",
                          "--clean-end-grace-s=3600") as service:
        started = time.monotonic()
        deadline = started + SECONDS
        stop = threading.Event()

        def watch() -> None:
            while not stop.wait(0.5):
                memory.append((time.monotonic() - started, _rss(service.proc.pid)))

        def send() -> None:
            with httpx.Client(timeout=30) as http:
                while time.monotonic() < deadline:
                    with lock:
                        n = stats["batches"]
                        if n >= MAX_BATCHES:
                            return
                        stats["batches"] += 1
                    ids = [f"load-{n * SPANS_PER_BATCH + i:014d}".encode() for i in range(SPANS_PER_BATCH)]
                    body = parts[0] + b"".join(i + p for i, p in zip(ids, parts[1:], strict=True))
                    answer = http.post(f"{service.url}/v1/traces", content=body,
                                       headers={"content-type": "application/x-protobuf"})
                    with lock:
                        if answer.status_code == 200:
                            stats["accepted"] += SPANS_PER_BATCH
                        elif answer.status_code in (429, 503):
                            stats["throttled"] += 1
                            stats["without_retry_after"] += "retry-after" not in answer.headers
                        else:
                            raise AssertionError(answer.text)
                    if answer.status_code != 200:  # honour Retry-After, scaled down to keep the test short
                        time.sleep(float(answer.headers.get("retry-after", 1)) / 20)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        senders = [threading.Thread(target=send) for _ in range(SENDERS)]
        for t in senders:
            t.start()
        for t in senders:
            t.join(timeout=SECONDS + 60)
        elapsed = time.monotonic() - started

        wait_for(lambda: _metric(service, "mcp_stream_stream_ends_total") == stats["accepted"], 60,
                 "every accepted span applied to the ledger")
        stop.set()
        sessions = _metric(service, "mcp_stream_detector_ledger_sessions")
        evicted = _metric(service, "mcp_stream_detector_ledger_evictions_total")
        rejected = _metric(service, "mcp_stream_detector_ingest_requests_rejected_total")

    peak = max(rss for _, rss in memory)
    settled = [rss for at, rss in memory if at >= 10]
    print(f"\nload: {stats['accepted'] / elapsed:,.0f} spans/s accepted for {elapsed:.0f} s "
          f"({stats['accepted']:,} spans, {stats['throttled']} batches throttled with 429), "
          f"peak RSS {peak / 2**20:.0f} MiB, ledger {sessions:,.0f} sessions, {evicted:,.0f} evicted")
    assert elapsed >= SECONDS
    assert stats["throttled"] and stats["without_retry_after"] == 0, "backpressure, always with Retry-After"
    assert rejected == stats["throttled"], "every throttled batch was a counted queue_full refusal"
    assert sessions <= MAX_SESSIONS and evicted == stats["accepted"] - sessions
    assert peak < MEMORY_LIMIT
    assert max(settled) < 1.25 * min(settled), "memory keeps growing once the ledger is full"
