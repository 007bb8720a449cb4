"""Overhead of the hooks on an MCP tools/call round trip: instrumented (B) against uninstrumented (A).

Method (../shared/reference/benchmarking.md): each configuration runs in its own worker process (a
process can install one TracerProvider), both with the SDK's own OpenTelemetry spans on and a
dropping exporter, so the only difference is our hooks. Fresh worker pairs alternate A,B / B,A; each
reports the median round trip of its block and the process CPU time per call (client and server
share the process, so that is the whole cost, and it moves less with machine noise than wall time);
the results are the medians of the per-pair ratios B/A.
Bounded: PAIRS x 2 workers x CALLS calls per mode.

    python bench/hooks_overhead.py [--pairs 8] [--calls 200] [--modes legacy,default]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Sequence


def _worker(instrumented: bool, mode: str, calls: int) -> tuple[float, float]:
    import httpx2
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client
    from mcp_types import CallToolRequest, CallToolRequestParams, CallToolResult
    from opentelemetry import trace
    from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

    from mcp_stream_exporter import instrument_client, instrument_server
    from mcp_stream_exporter.lab import (
        BASE_RESOURCE,
        FETCH_RESOURCE,
        SEARCH_RESOURCE,
        BearerAuth,
        IncidentEventStore,
        TokenIssuer,
        build_incident_server,
        incident_policy,
        serve,
    )

    class Drop(SpanExporter):
        def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(Drop()))
    trace.set_tracer_provider(provider)
    warnings.filterwarnings("ignore")
    logging.disable(logging.INFO)

    async def run() -> tuple[float, float]:
        issuer = TokenIssuer()
        policy = incident_policy()
        store = IncidentEventStore(policy)
        server = build_incident_server(issuer, store=store, step_delay=0)
        auth = BearerAuth(issuer.mint([BASE_RESOURCE, SEARCH_RESOURCE, FETCH_RESOURCE]))
        if instrumented:
            app = instrument_server(server, policy=policy, event_store=store)
            http = instrument_client(auth=auth, policy=policy)
        else:
            app = server.streamable_http_app(event_store=store)
            http = httpx2.AsyncClient(auth=auth, timeout=httpx2.Timeout(30.0, read=300.0))
        options = {"mode": "legacy"} if mode == "legacy" else {}
        request = CallToolRequest(params=CallToolRequestParams(name="search", arguments={"query": "q"}))
        async with serve(app) as port, http, Client(
                streamable_http_client(f"http://127.0.0.1:{port}/mcp", http_client=http), **options) as client:
            for _ in range(20):  # warm-up
                await client.session.send_request(request, CallToolResult)
            timings = []
            cpu = time.process_time()
            for _ in range(calls):
                t = time.perf_counter()
                await client.session.send_request(request, CallToolResult)
                timings.append(time.perf_counter() - t)
            cpu = time.process_time() - cpu
        return statistics.median(timings) * 1000, cpu / calls * 1000

    return asyncio.run(run())


def _spawn(instrumented: bool, mode: str, calls: int) -> tuple[float, float]:
    out = subprocess.run([sys.executable, __file__, "--worker", "B" if instrumented else "A", "--mode", mode,
                          "--calls", str(calls)], check=True, capture_output=True, text=True, timeout=300)
    wall, cpu = out.stdout.strip().splitlines()[-1].split()
    return float(wall), float(cpu)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--modes", default="legacy,default")
    parser.add_argument("--worker", choices=["A", "B"])
    parser.add_argument("--mode", default="legacy")
    args = parser.parse_args()
    if args.worker:
        print(*_worker(args.worker == "B", args.mode, args.calls))
        return
    report = {}
    for mode in args.modes.split(","):
        a_ms, b_ms, ratios, cpu_ratios = [], [], [], []
        for pair in range(args.pairs):
            order = (False, True) if pair % 2 == 0 else (True, False)
            result = {flag: _spawn(flag, mode, args.calls) for flag in order}
            a_ms.append(result[False][0])
            b_ms.append(result[True][0])
            ratios.append(result[True][0] / result[False][0])
            cpu_ratios.append(result[True][1] / result[False][1])
        report[mode] = {
            "pairs": args.pairs, "calls_per_block": args.calls,
            "uninstrumented_median_ms": round(statistics.median(a_ms), 3),
            "instrumented_median_ms": round(statistics.median(b_ms), 3),
            "ratio_median": round(statistics.median(ratios), 3),
            "ratio_min": round(min(ratios), 3), "ratio_max": round(max(ratios), 3),
            "cpu_ratio_median": round(statistics.median(cpu_ratios), 3),
            "cpu_ratio_min": round(min(cpu_ratios), 3), "cpu_ratio_max": round(max(cpu_ratios), 3),
        }
        print(f"{mode}: instrumented/uninstrumented median ratio {report[mode]['ratio_median']} "
              f"(spread {report[mode]['ratio_min']}..{report[mode]['ratio_max']}; "
              f"{report[mode]['uninstrumented_median_ms']} ms vs {report[mode]['instrumented_median_ms']} ms); "
              f"CPU per call ratio {report[mode]['cpu_ratio_median']}",
              flush=True)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
