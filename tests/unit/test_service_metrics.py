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


def test_concurrent_scrapes_share_one_encoding_at_a_time_and_the_liveness_probe_answers_meanwhile():
    import asyncio
    import threading

    import httpx
    from prometheus_client.core import GaugeMetricFamily

    from mcp_stream_exporter.detector.app import create_app

    entered, release = threading.Event(), threading.Event()
    collects: list[int] = []

    class _Slow:  # a registry whose encoding takes as long as the test says
        def collect(self) -> list[GaugeMetricFamily]:
            collects.append(1)
            entered.set()
            assert release.wait(10)
            return [GaugeMetricFamily("slow_encoding", "a test's", value=len(collects))]

    detector = Detector()
    detector.registry.register(_Slow())  # type: ignore[arg-type]

    async def run() -> None:
        transport = httpx.ASGITransport(create_app(detector))
        async with httpx.AsyncClient(transport=transport, base_url="http://detector") as client:
            first = asyncio.create_task(client.get("/metrics"))
            await asyncio.to_thread(entered.wait, 10)
            entered.clear()
            waiting = [asyncio.create_task(client.get("/metrics")) for _ in range(20)]
            assert (await asyncio.wait_for(client.get("/healthz"), 10)).status_code == 200  # the encoding blocked
            release.set()
            answers = [await first, *await asyncio.gather(*waiting)]
        assert all(a.status_code == 200 for a in answers)
        assert "slow_encoding 1.0" in answers[0].text
        assert all("slow_encoding 2.0" in a.text for a in answers[1:])  # the twenty waited for one encoding

    asyncio.run(run())
    assert len(collects) == 2
