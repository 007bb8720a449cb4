"""Scale-out: two detector processes fed by a router that hashes `mcp.session.id` as the collector's
load-balancing exporter does (`routing_key: attributes`, key `mcp.session.id=<value>|`, spans without it
on the key `mcp.session.id=|`) produce, summed, the same findings and counters as one process fed
everything.

The exporter routes each trace's share of a batch whole, by its first span's key: a span without a session
(the SDK's own, or the application's) at its head would take a session's spans to another detector. The
collector of helm/examples/otel-collector-loadbalancing.yaml keeps the spans that carry a session and those
that do not in two pipelines, so that each span goes where its own key says, whatever the batches."""

from __future__ import annotations

import random
import time
import zlib
from collections import Counter
from typing import Any

import pytest
from mcp.shared.exceptions import MCPError
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from prometheus_client.parser import text_string_to_metric_families

from mcp_stream_exporter import semconv as sc

from harness import detector_process, incident, play_incident, spans

pytestmark = [pytest.mark.e2e, pytest.mark.anyio, pytest.mark.timeout(240)]

GRACE = ("--clean-end-grace-s=1", "--reissue-grace-s=1")
COUNTERS = ("mcp_stream_findings_total", "mcp_stream_silent_losses_total", "mcp_stream_resumes_total",
            "mcp_stream_audience_gaps_total", "mcp_stream_stream_ends_total", "mcp_stream_calls_total",
            "mcp_client_operation_duration_seconds_count", "mcp_server_operation_duration_seconds_count",
            "mcp_stream_detector_spans_received_total", "mcp_stream_calls_in_flight")


def routing_key(span: Any) -> str:
    return f"{sc.MCP_SESSION_ID}={(span.attributes or {}).get(sc.MCP_SESSION_ID, '')}|"


def backend_of(key: str, backends: int) -> int:
    return zlib.crc32(key.encode()) % backends


def routed_by_the_collector(batches: list[list[Any]], backends: int) -> list[list[Any]]:
    """Each batch through the example collector's two pipelines (spans with ``mcp.session.id``, spans without),
    each pipeline's share split by trace, and each trace's share sent whole to the backend of its first span's key
    (the load-balancing exporter: ``batchpersignal.SplitTraces``, then ``routingIdentifiersFromTraces``)."""
    shards: list[list[Any]] = [[] for _ in range(backends)]
    for batch in batches:
        for with_session in (True, False):
            by_trace: dict[int, list[Any]] = {}
            for span in batch:
                if ((span.attributes or {}).get(sc.MCP_SESSION_ID) is not None) == with_session:
                    by_trace.setdefault(span.context.trace_id, []).append(span)
            for share in by_trace.values():
                shards[backend_of(routing_key(share[0]), backends)].extend(share)
    return shards


async def _scenario(kind: str) -> list[Any]:
    async with incident("legacy", guarded=kind == "guarded") as lab:
        _, fetch = await play_incident(lab, fetch_timeout=20 if kind == "guarded" else 2.5)
        if kind == "guarded":
            assert isinstance(fetch, MCPError)
            await lab.recover(fetch, "fetch", {"url": "u", "steps": 4})
    return spans()


def _in_order(shard: list[Any]) -> list[Any]:
    return sorted(shard, key=lambda span: (span.end_time, span.context.span_id))


def _findings(*services: Any) -> Counter[tuple[str, ...]]:
    return Counter((f["rule"], f["severity"], f["tool"] or "", f["session_id"] or "", f["request_id"] or "")
                   for s in services for f in s.findings())


def _counters(*services: Any) -> Counter[tuple[str, tuple[tuple[str, str], ...]]]:
    total: Counter[tuple[str, tuple[tuple[str, str], ...]]] = Counter()
    for service in services:
        for family in text_string_to_metric_families(service.metrics()):
            for sample in family.samples:
                if sample.name in COUNTERS:
                    total[(sample.name, tuple(sorted(sample.labels.items())))] += sample.value
    return +total  # zero series are the same as absent ones when summing


def _settled(service: Any, timeout_s: float = 20) -> None:
    """Findings stop changing once the 1 s grace periods have run out (the service ticks every 0.5 s)."""
    deadline, last, stable_since = time.monotonic() + timeout_s, None, time.monotonic()
    while time.monotonic() < deadline:
        now = _findings(service)
        if now != last:
            last, stable_since = now, time.monotonic()
        elif time.monotonic() - stable_since > 3:
            return
        time.sleep(0.25)
    raise AssertionError("findings did not settle")


async def test_two_detectors_behind_a_session_hash_router_sum_to_one_detector():
    recorded: list[Any] = []
    keys: set[str] = set()
    for kind in ("naive", "guarded") * 6:  # bounded; until both backends get sessions (random ids: 1 in 2,048 never)
        recorded += await _scenario(kind)
        keys = {routing_key(s) for s in recorded if (s.attributes or {}).get(sc.MCP_SESSION_ID)}
        if len(keys) >= 3 and len({backend_of(k, 2) for k in keys}) == 2:
            break
    assert len({backend_of(k, 2) for k in keys}) == 2, "the sessions never split across both backends"

    shards: list[list[Any]] = [[], []]
    for span in recorded:
        shards[backend_of(routing_key(span), 2)].append(span)
    # batches cut anywhere (an exporter flushes by size or time): the collector's routing is each span's own
    rng = random.Random(7)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(recorded)), rng.randint(1, 12)))
        batches = [recorded[i:j] for i, j in zip([0, *cuts], [*cuts, len(recorded)], strict=True)]
        assert [[id(s) for s in shard] for shard in map(_in_order, routed_by_the_collector(batches, 2))] == [
            [id(s) for s in shard] for shard in map(_in_order, shards)]

    with detector_process(*GRACE) as one, detector_process(*GRACE) as a, detector_process(*GRACE) as b:
        assert one.post(encode_spans(recorded).SerializeToString()).status_code == 200
        for service, shard in zip((a, b), shards, strict=True):
            assert service.post(encode_spans(shard).SerializeToString()).status_code == 200
        for service in (one, a, b):
            _settled(service)
        assert _findings(a, b) == _findings(one)
        assert {r for r, *_ in _findings(one)} >= {"clean_end_pending", "narrowed_resume"}
        assert _counters(a, b) == _counters(one)
