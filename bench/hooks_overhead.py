"""Overhead of the hooks on an MCP tools/call round trip: instrumented (B) against uninstrumented (A).

Method: both configurations run side by side in one process,
each with its own server and client on 127.0.0.1, with the SDK's own OpenTelemetry spans on (one
provider, a dropping exporter), so the only difference is our hooks. Calls alternate in small blocks
(A B B A ...) so that the machine slowing down hits both alike; each worker process reports the median
round trip of each configuration and the result is the median over fresh worker processes of the
ratio B/A; which configuration is set up first alternates between workers. An A-against-A control
run measures the method's own bias. ``--sides`` adds runs with only the server's or only the
client's hooks (an operator may instrument one side). Bounded: WORKERS x 2 x CALLS calls per run.

    python bench/hooks_overhead.py [--workers 12] [--calls 300] [--modes legacy,default] [--sides both,server,client]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Sequence

_BLOCK = 10


def _worker(mode: str, calls: int, *, b_first: bool, control: bool, side: str) -> tuple[float, float]:
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
    issuer = TokenIssuer()
    token = issuer.mint([BASE_RESOURCE, SEARCH_RESOURCE, FETCH_RESOURCE])
    request = CallToolRequest(params=CallToolRequestParams(name="search", arguments={"query": "q"}))
    options = {"mode": "legacy"} if mode == "legacy" else {}

    async def setup(stack: contextlib.AsyncExitStack, instrumented: bool) -> Client:
        instrumented = instrumented and not control
        policy = incident_policy()
        store = IncidentEventStore(policy)
        server = build_incident_server(issuer, store=store, step_delay=0)
        if instrumented and side in ("both", "server"):
            app = instrument_server(server, policy=policy, event_store=store)
        else:
            app = server.streamable_http_app(event_store=store)
        if instrumented and side in ("both", "client"):
            http = instrument_client(auth=BearerAuth(token), policy=policy)
        else:
            http = httpx2.AsyncClient(auth=BearerAuth(token), timeout=httpx2.Timeout(30.0, read=300.0))
        port = await stack.enter_async_context(serve(app))
        await stack.enter_async_context(http)
        return await stack.enter_async_context(
            Client(streamable_http_client(f"http://127.0.0.1:{port}/mcp", http_client=http), **options))

    async def run() -> tuple[float, float]:
        async with contextlib.AsyncExitStack() as stack:
            clients = {}
            for flag in ((True, False) if b_first else (False, True)):  # which is set up first is balanced
                clients[flag] = await setup(stack, flag)
            timings: dict[bool, list[float]] = {False: [], True: []}
            for client in clients.values():  # warm-up
                for _ in range(20):
                    await client.session.send_request(request, CallToolResult)
            for block in range(2 * calls // _BLOCK):
                instrumented = block % 4 in (1, 2)  # A B B A
                client = clients[instrumented]
                for _ in range(_BLOCK):
                    t = time.perf_counter()
                    await client.session.send_request(request, CallToolResult)
                    timings[instrumented].append(time.perf_counter() - t)
        return statistics.median(timings[False]) * 1000, statistics.median(timings[True]) * 1000

    return asyncio.run(run())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=12)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--modes", default="legacy,default")
    parser.add_argument("--sides", default="both", help="which hooks B has: both, server, client (comma list)")
    parser.add_argument("--side", default="both")
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--mode", default="legacy")
    parser.add_argument("--b-first", action="store_true")
    parser.add_argument("--control", action="store_true", help="A against A: the method's own bias")
    args = parser.parse_args()
    if args.worker:
        print(*_worker(args.mode, args.calls, b_first=args.b_first, control=args.control, side=args.side))
        return
    report = {}
    modes, sides = args.modes.split(","), args.sides.split(",")
    runs = [(mode, side, False) for side in sides for mode in modes] + [(modes[0], "both", True)]
    for mode, side, control in runs:
        name = f"{mode} A/A control" if control else (mode if side == "both" else f"{mode} {side} only")
        a_ms, b_ms, ratios = [], [], []
        for worker in range(args.workers):
            command = [sys.executable, __file__, "--worker", "--mode", mode, "--side", side, "--calls", str(args.calls)]
            command += ["--b-first"] if worker % 2 else []
            command += ["--control"] if control else []
            out = subprocess.run(command, check=True, capture_output=True, text=True, timeout=600)
            a, b = (float(x) for x in out.stdout.strip().splitlines()[-1].split())
            a_ms.append(a)
            b_ms.append(b)
            ratios.append(b / a)
        report[name] = {
            "workers": args.workers, "calls_per_configuration": args.calls,
            "uninstrumented_median_ms": round(statistics.median(a_ms), 3),
            "instrumented_median_ms": round(statistics.median(b_ms), 3),
            "ratio_median": round(statistics.median(ratios), 3),
            "ratio_min": round(min(ratios), 3), "ratio_max": round(max(ratios), 3),
        }
        r = report[name]
        print(f"{name}: instrumented/uninstrumented median ratio {r['ratio_median']} "
              f"(spread {r['ratio_min']}..{r['ratio_max']} over {args.workers} workers; "
              f"{r['uninstrumented_median_ms']} ms vs {r['instrumented_median_ms']} ms)", flush=True)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
