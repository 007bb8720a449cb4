"""What /metrics says about the detector itself beyond its findings: the ingest queue's depth, read at
scrape time, and the process it runs in (process_*), in an exposition promtool accepts."""

from __future__ import annotations

from prometheus_client import generate_latest
from promtool import promtool

from mcp_stream_exporter import semconv as sc
from mcp_stream_exporter.detector import Detector
from mcp_stream_exporter.detector.ingest import IngestLimits, IngestQueue

from spans import call, stream


def _sample(detector: Detector, name: str) -> float | None:
    return detector.registry.get_sample_value(name)


def test_the_ingest_queue_gauge_counts_the_spans_waiting_for_the_ledger():
    detector = Detector()
    queue = IngestQueue(detector, IngestLimits())
    try:
        events, _ = detector.read([stream(sc.ROLE_CLIENT, "post", "dropped"), call(sc.ROLE_CLIENT, "result")],
                                  "otlp_http")
        assert len(events) == 2
        with detector.lock:  # the worker cannot apply anything: what is offered stays queued
            assert queue.offer(events) and queue.offer(events[:1])
            assert _sample(detector, "mcp_stream_detector_ingest_queue_spans") == 3
        assert queue.wait_idle(10)
        assert _sample(detector, "mcp_stream_detector_ingest_queue_spans") == 0
    finally:
        queue.close()


def test_without_a_queue_the_gauge_says_zero_and_the_process_metrics_are_there():
    detector = Detector()
    assert _sample(detector, "mcp_stream_detector_ingest_queue_spans") == 0
    for name in ("process_resident_memory_bytes", "process_cpu_seconds_total", "process_open_fds",
                 "process_start_time_seconds"):
        assert _sample(detector, name) is not None, name


def test_the_exposition_passes_promtool():
    check = promtool("check", "metrics", stdin=generate_latest(Detector().registry).decode())
    assert check.returncode == 0, check.stdout + check.stderr
