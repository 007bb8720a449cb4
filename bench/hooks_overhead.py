"""Overhead of the hooks on an MCP tools/call round trip, against the SDK's own tracing and against none.

Three configurations run side by side in one process, each with its own server and client on
127.0.0.1: (A) no tracing, (S) the SDK's own OpenTelemetry spans on, no hooks, (H) the SDK's spans and
our hooks. One tracer provider with a dropping exporter serves the process (a process has one global
provider); A's spans are sampled out by a sampler that reads which configuration is calling, so A
pays the SDK's call into a sampler that says no (a few microseconds) and nothing else. Calls go one
at a time round an order in which every configuration comes once after each pair of configurations
(itself among them), and after its own last call as long ago as each other one does: a call's cost depends on what
ran before it (whose code and data the caches hold), and the earlier cycle A S H H S A, which never
let S follow itself and let H follow itself half the time, read 0.01 to 0.03 apart from a plain A S H.
One at a time, so that the machine slowing down hits all alike: a shared host's slow spells outlast a
round trip, and in blocks of ten calls a spell could fall on one configuration's block (the same code
then read 0.89 to 1.22 against itself over stretches of 100 calls, and 0.92 to 1.03 one call at a
time). Each worker process reports the median round trip of each configuration; the results are the
medians over fresh worker processes of the ratios H/S (the hooks on top of the SDK's tracing), H/A
(everything) and S/A (the SDK's tracing alone), with their spreads and the interval that holds the median
with 95 % confidence (``median_interval``: the workers' ratios vary by more than any change left to measure,
and two runs' medians of the same code differ by as much). Each H/S is held against its target (``TARGETS``):
met when that whole interval is at or under it, missed when it is all over it, undecided otherwise; and
H/S - S/A, a worker's share the hooks add less the share the SDK's tracing adds, is held against 0 (the
hooks never dearer than the SDK's own tracing). The JSON report keeps each worker's medians.
The order in which the configurations are set up rotates between workers. An A-against-A control run
measures the method's own bias. Besides round trips (wall clock, the figures the targets are for), each
worker reports the median process CPU time of each configuration's calls (client and server share the
process): on a machine shared with other work, what the hooks cost in CPU is steadier than what they
cost in wall time, which other processes' scheduling moves. It reports their mean as well (``cpu mean``):
a median leaves out whatever falls on a few calls only (the collector's passes, work done in batches),
which a mean counts where it falls, as an operator's CPU bill does. ``--sides`` adds runs with only
the server's or only the client's hooks in H (an operator may instrument one side). ``--apart`` runs each
worker's three servers in a process of their own, the client on one CPU and the servers on another, as a
deployment has them on two hosts: the round trip then overlaps the two sides' work where it can (the
server's after its answer is sent, the client's before the answer comes), where in one process they take
turns; the CPU figures are then both processes' (the servers' read through ``clock_getcpuclockid``). ``--in-process``
times the round trips through httpx2's ASGI transport, as ``--instructions`` counts them, to set the
time the hooks take against the instructions they run. ``--payload`` makes the call large (its argument
that many characters, echoed in its result): what the hooks' passes over a body cost. Bounded: WORKERS x 3
x CALLS calls per run (rounded up to whole rounds of the order).

``--instructions`` counts instead of timing, for a figure neither a busy machine nor the event loop can
move: each configuration (A, S, H) runs alone in a process under ``valgrind --tool=callgrind``
(PYTHONHASHSEED=0), which dumps its counts when the worker calls ``os.getppid()`` just before and just
after CALLS round trips (after a warm-up). The client reaches the server in process, through
``httpx2.ASGITransport`` (the request body handed over in one message, as uvicorn does): no sockets and
no uvicorn, whose timing-dependent reads moved a socket round trip's count by some 40k instructions from
run to run; this way a configuration's count repeats to within about 0.1 %. The report is the
instructions a round trip, what the hooks add (H-S) against what the SDK's tracing adds (S-A), and H/S
(against the SDK's work alone, without the HTTP server's, so higher than the timed ratio). The
collector's passes fall at different calls from run to run and move a count by up to some 10k:
``--gc-off`` turns it off for the counted calls, leaving 2-4k, for comparing two versions of the hooks
(the figures to report keep it on, as a deployment does).

    python bench/hooks_overhead.py [--workers 12] [--calls 300] [--modes legacy,default] [--sides both,server,client]
                                   [--apart | --in-process] [--payload CHARS]
    python bench/hooks_overhead.py --instructions [--calls 100] [--modes legacy,default] [--sides both,server,client]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import gc
import json
import logging
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

CONFIGURATIONS = ("A", "S", "H")  # no tracing; the SDK's tracing; the SDK's tracing and the hooks
# Going round, every configuration comes once after each pair of configurations, itself among them (a de Bruijn
# sequence of order 3), and the gaps since its own last call are the same for all three (1 1 1 2 2 3 5 6 6
# calls): what ran before a call, whose code and data the caches then hold, falls alike on all three.
# (A S H H S A let S follow itself never and H half the time; A A S S H H A H S balanced the call just
# before but left H's gaps 1 2 6 against the others' 1 3 5.)
_ORDER = tuple("AAASAHSASSSHAHHHSSAAHASHSHH")


def _tracing(untraced: Any) -> None:
    """One tracer provider for the process, its spans dropped; A's sampled out: its client's (``untraced``
    set in the calling task) and its server's (an unsampled parent, in this process or across the wire)."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult
    from opentelemetry.sdk.trace.sampling import Decision, Sampler, SamplingResult

    class Drop(SpanExporter):
        def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    class Configured(Sampler):
        def should_sample(self, parent_context: Any, trace_id: int, name: str, kind: Any = None,
                          attributes: Any = None, links: Any = None, trace_state: Any = None) -> SamplingResult:
            parent = trace.get_current_span(parent_context).get_span_context()
            if untraced.get() or (parent.is_valid and not parent.trace_flags.sampled):
                return SamplingResult(Decision.DROP)
            return SamplingResult(Decision.RECORD_AND_SAMPLE, attributes)

        def get_description(self) -> str:
            return "bench configuration"

    provider = TracerProvider(sampler=Configured())
    provider.add_span_processor(SimpleSpanProcessor(Drop()))
    trace.set_tracer_provider(provider)
    warnings.filterwarnings("ignore")
    logging.disable(logging.INFO)


def _untraced_unrecorded(untraced: Any) -> None:
    """A's client calls dropped before the client hooks' sampler sees them. The hooks record an SDK call span the
    application's sampler drops (``RECORD_ONLY``, on the SDK's tracer: one for the process, whichever
    configuration calls); A stands for an application with neither tracing nor hooks, which records nothing (its
    calls paid some 12 us a call for it from ``c02d0af`` on, S/A reading low by about 0.007). Call after every
    client's hooks are installed."""
    from mcp.shared import _otel
    from opentelemetry import trace
    from opentelemetry.sdk.trace import Tracer
    from opentelemetry.sdk.trace.sampling import Decision, Sampler, SamplingResult

    class Untraced(Sampler):
        def __init__(self, sampler: Sampler) -> None:
            self.sampler = sampler

        def should_sample(self, parent_context: Any, trace_id: int, name: str, kind: Any = None,
                          attributes: Any = None, links: Any = None, trace_state: Any = None) -> SamplingResult:
            if untraced.get():
                return SamplingResult(Decision.DROP)
            return self.sampler.should_sample(parent_context, trace_id, name, kind, attributes, links, trace_state)

        def get_description(self) -> str:
            return self.sampler.get_description()

    tracer = _otel._tracer
    if isinstance(tracer, trace.ProxyTracer):
        tracer = tracer._tracer
    if isinstance(tracer, Tracer) and not isinstance(tracer.sampler, Untraced):
        tracer.sampler = Untraced(tracer.sampler)


def _server(configuration: str, issuer: Any, *, control: bool, side: str) -> tuple[Any, Any]:
    """One configuration's MCP server: (the server, its ASGI app), hooked in H when ``side`` hooks the server."""
    from mcp_stream_exporter import instrument_server
    from mcp_stream_exporter.lab import IncidentEventStore, build_incident_server, incident_policy

    policy = incident_policy()
    store = IncidentEventStore(policy)
    server = build_incident_server(issuer, store=store, step_delay=0)
    if configuration == "H" and not control and side in ("both", "server"):
        return server, instrument_server(server, policy=policy, event_store=store)
    return server, server.streamable_http_app(event_store=store)


def _set_up_order(rotate: int) -> tuple[str, ...]:
    """The order the configurations are set up in: which comes first rotates between workers."""
    return CONFIGURATIONS[rotate % 3:] + CONFIGURATIONS[:rotate % 3]


def _token(issuer: Any) -> str:
    """A token for every tool of the incident's server: no call in the bench deviates."""
    from mcp_stream_exporter.lab import BASE_RESOURCE, FETCH_RESOURCE, SEARCH_RESOURCE

    return str(issuer.mint([BASE_RESOURCE, SEARCH_RESOURCE, FETCH_RESOURCE]))


def _pin(cpu: int) -> None:
    """Keeps this process on one CPU (``--apart``: client and server each on their own, as on two hosts)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) >= 2:
        os.sched_setaffinity(0, {cpus[cpu]})


def _cpu_clock(pid: int) -> Callable[[], float]:
    """Another process's CPU time in seconds, read as this process reads its own (``clock_getcpuclockid``)."""
    import ctypes

    clock = ctypes.c_int()
    error = ctypes.CDLL(None, use_errno=True).clock_getcpuclockid(pid, ctypes.byref(clock))
    if error:
        raise OSError(error, os.strerror(error))
    return functools.partial(time.clock_gettime, clock.value)


def _serve_apart(*, rotate: int, control: bool, side: str) -> None:
    """(``--apart``) The three configurations' servers in this process, on their own CPU: prints their ports
    and a token they accept as one JSON line, then serves until stdin closes."""
    import contextvars

    from mcp_stream_exporter.lab import TokenIssuer, serve

    _pin(1)
    _tracing(contextvars.ContextVar("untraced", default=False))
    issuer = TokenIssuer()

    async def run() -> None:
        async with contextlib.AsyncExitStack() as stack:
            order = _set_up_order(rotate)
            ports = {configuration: await stack.enter_async_context(
                         serve(_server(configuration, issuer, control=control, side=side)[1]))
                     for configuration in order}
            token = _token(issuer)
            print(json.dumps({"ports": ports, "token": token}), flush=True)
            await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)

    asyncio.run(run())


def _worker(mode: str, calls: int, *, rotate: int, control: bool, side: str, only: str | None = None,
            gc_off: bool = False, in_process: bool = False, payload: int = 1, apart: bool = False) -> dict[str, float]:
    import contextvars

    import httpx2
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client
    from mcp_types import CallToolRequest, CallToolRequestParams, CallToolResult

    from mcp_stream_exporter import instrument_client
    from mcp_stream_exporter.lab import BearerAuth, TokenIssuer, incident_policy, serve

    untraced = contextvars.ContextVar("untraced", default=False)
    _tracing(untraced)
    request = CallToolRequest(params=CallToolRequestParams(name="search", arguments={"query": _payload(payload)}))
    options = {"mode": "legacy"} if mode == "legacy" else {}
    servers: subprocess.Popen[str] | None = None

    def server_cpu() -> float:  # the servers' CPU time, when they run in a process of their own (``apart``)
        return 0.0

    if apart:
        servers = subprocess.Popen([sys.executable, __file__, "--serve-apart", "--side", side,
                                    "--rotate", str(rotate), *(["--control"] if control else [])],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert servers.stdout is not None
        apart_servers = json.loads(servers.stdout.readline())
        token = apart_servers["token"]
        _pin(0)
        server_cpu = _cpu_clock(servers.pid)
    else:
        issuer = TokenIssuer()
        token = _token(issuer)

    async def setup(stack: contextlib.AsyncExitStack, configuration: str, *, in_process: bool = False) -> Client:
        """A client of one configuration and its server: over loopback TCP, in this process or (``apart``)
        another; or ``in_process`` through httpx2's ASGI transport (``--instructions``)."""
        timeout = httpx2.Timeout(30.0, read=300.0)
        if apart:
            http = httpx2.AsyncClient(auth=BearerAuth(token), timeout=timeout)
            url = f"http://127.0.0.1:{apart_servers['ports'][configuration]}/mcp"
        else:
            server, app = _server(configuration, issuer, control=control, side=side)
            if in_process:
                await stack.enter_async_context(server.session_manager.run())  # what the app's lifespan would run
                http = httpx2.AsyncClient(transport=httpx2.ASGITransport(_whole_body(app)), auth=BearerAuth(token),
                                          timeout=timeout)
                url = "http://127.0.0.1:8000/mcp"
            else:
                http = httpx2.AsyncClient(auth=BearerAuth(token), timeout=timeout)
                url = f"http://127.0.0.1:{await stack.enter_async_context(serve(app))}/mcp"
        if configuration == "H" and not control and side in ("both", "client"):
            http = instrument_client(http, policy=incident_policy())  # its own, as in its own process
        await stack.enter_async_context(http)
        return await stack.enter_async_context(Client(streamable_http_client(url, http_client=http), **options))

    async def call(client: Client, configuration: str) -> float:
        token = untraced.set(configuration == "A" or (control and configuration != "S"))
        try:
            started = time.perf_counter()
            await client.session.send_request(request, CallToolResult)
            return time.perf_counter() - started
        finally:
            untraced.reset(token)

    async def counted(configuration: str) -> dict[str, float]:
        """One configuration alone, its calls between two ``os.getppid()``: callgrind dumps at each."""
        async with contextlib.AsyncExitStack() as stack:
            client = await setup(stack, configuration, in_process=True)
            for _ in range(20):
                await call(client, configuration)
            gc.collect()
            if gc_off:
                gc.disable()
            os.getppid()
            for _ in range(calls):
                await call(client, configuration)
            os.getppid()
            gc.enable()
        return {}

    async def run() -> dict[str, float]:
        async with contextlib.AsyncExitStack() as stack:
            order = _set_up_order(rotate)
            clients = {configuration: await setup(stack, configuration, in_process=in_process)
                       for configuration in order}
            _untraced_unrecorded(untraced)
            timings: dict[str, list[float]] = {configuration: [] for configuration in CONFIGURATIONS}
            cpu: dict[str, list[float]] = {configuration: [] for configuration in CONFIGURATIONS}
            for configuration, client in clients.items():  # warm-up
                for _ in range(20):
                    await call(client, configuration)
            rounds = -(-3 * calls // len(_ORDER))  # whole rounds, so that every triple comes equally often
            for i in range(rotate, rotate + rounds * len(_ORDER)):  # where in the order a worker starts rotates too
                configuration = _ORDER[i % len(_ORDER)]
                cpu_started = time.process_time() + server_cpu()
                timings[configuration].append(await call(clients[configuration], configuration))
                cpu[configuration].append(time.process_time() + server_cpu() - cpu_started)
        return {**{configuration: statistics.median(times) * 1000 for configuration, times in timings.items()},
                **{f"{configuration}_cpu": statistics.median(times) * 1000 for configuration, times in cpu.items()},
                **{f"{configuration}_cpu_mean": statistics.fmean(times) * 1000 for configuration, times in cpu.items()}}

    try:
        return asyncio.run(counted(only) if only is not None else run())
    finally:
        if servers is not None:
            servers.communicate("", timeout=60)  # stdin closed: the servers stop


def _payload(chars: int) -> str:
    """The search's query, echoed in its result (twice: its text and its structured content): ``chars``
    characters, non-ASCII past the first, so that reading them takes no ASCII fast path where they travel as
    UTF-8 (the request, a legacy SSE frame); a default-era JSON answer carries them escaped (``\\u00e9``)."""
    return "q" + "é" * (chars - 1)


def _whole_body(app: Any) -> Any:
    """The app, handed each HTTP request's body in one message (httpx2's ASGI transport sends a body and
    then an empty last message; uvicorn sends a small body as one), so the hooks take the path they take
    behind uvicorn."""
    async def whole_body(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        parts = []
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break
            parts.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        first = [{"type": "http.request", "body": b"".join(parts), "more_body": False}]

        async def rest() -> Any:
            return first.pop() if first else await receive()

        await app(scope, rest, send)

    return whole_body


def _instructions(mode: str, side: str, configuration: str, calls: int, gc_off: bool) -> int:
    """Instructions a round trip of one configuration, counted by callgrind between the worker's dumps."""
    with tempfile.TemporaryDirectory() as out:
        command = ["valgrind", "--tool=callgrind", "--dump-before=os_getppid*",
                   f"--callgrind-out-file={out}/cg", sys.executable, __file__, "--worker", "--only", configuration,
                   "--mode", mode, "--side", side, "--calls", str(calls), *(["--gc-off"] if gc_off else [])]
        subprocess.run(command, check=True, capture_output=True, timeout=1800,
                       env={**os.environ, "PYTHONHASHSEED": "0"})
        with open(f"{out}/cg.2", encoding="utf-8") as dump:  # .1: set-up and warm-up; .2: the calls
            total = next(int(line.split()[1]) for line in dump if line.startswith("summary:"))
    return round(total / calls)


def _count(modes: list[str], sides: list[str], calls: int, gc_off: bool) -> None:
    if shutil.which("valgrind") is None:
        raise SystemExit("--instructions needs valgrind")
    report = {}
    for mode in modes:
        bare, sdk = _instructions(mode, "both", "A", calls, gc_off), _instructions(mode, "both", "S", calls, gc_off)
        for side in sides:
            hooked = _instructions(mode, side, "H", calls, gc_off)
            name = mode if side == "both" else f"{mode} {side} only"
            report[name] = {"calls": calls, "A_instructions": bare, "S_instructions": sdk, "H_instructions": hooked,
                            "hooks (H-S)": hooked - sdk, "sdk_tracing (S-A)": sdk - bare,
                            "H/S": round(hooked / sdk, 4)}
            print(f"{name}: instructions a round trip A {bare}, S {sdk}, H {hooked}; the hooks add {hooked - sdk}, "
                  f"the SDK's tracing {sdk - bare}; H/S {hooked / sdk:.4f}", flush=True)
    print(json.dumps(report, indent=2))


def _ratios(num: list[float], den: list[float], target: float | None = None) -> dict[str, Any]:
    """Per worker, the ratio of two configurations' median round trips (``_over_workers``)."""
    return _over_workers([n / d for n, d in zip(num, den, strict=True)], target)


def _dearer(a: list[float], s: list[float], h: list[float]) -> dict[str, Any]:
    """Per worker, what the hooks add to a round trip less what the SDK's tracing adds, each as a share of
    what it adds to (H/S - S/A); held against 0: the hooks never dearer than the SDK's own tracing."""
    return _over_workers([hi / si - si / ai for ai, si, hi in zip(a, s, h, strict=True)], 0.0)


def _over_workers(values: list[float], target: float | None) -> dict[str, Any]:
    """A figure each worker gives: median, spread and the median's interval over workers; held against
    ``target``, if given, its verdict."""
    low, high = median_interval(values)
    figures: dict[str, Any] = {"median": round(statistics.median(values), 3), "min": round(min(values), 3),
                               "max": round(max(values), 3), "low": round(low, 3), "high": round(high, 3)}
    if target is not None:
        figures.update(target=target, verdict=verdict(low, high, target))
    return figures


def median_interval(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float]:
    """Where the median of what the workers sample lies, with at least ``confidence``: the ``k``-th smallest
    and ``k``-th largest value, ``k`` the largest for which a fair coin tossed once a worker comes up heads
    fewer than ``k`` times with a chance of at most (1 - ``confidence``) / 2. It assumes nothing about
    how the ratios spread, only that the workers are drawn alike and independently; what moves every
    worker of a run alike (the host's state that day) it cannot see, which runs repeated can."""
    ordered, n = sorted(values), len(values)
    below, k = math.comb(n, 0) / 2 ** n, 0  # the chance of fewer than k + 1 heads
    while below <= (1 - confidence) / 2:
        k += 1
        below += math.comb(n, k) / 2 ** n
    if k == 0:
        raise ValueError(f"{n} workers are too few for a {confidence:.0%} interval of their median")
    return ordered[k - 1], ordered[n - k]


# The targets of the hooks' cost on top of the SDK's own tracing (H/S), by mode and which side is hooked.
TARGETS = {("legacy", "both"): 1.06, ("default", "both"): 1.05}
SIDE_ALONE_TARGET = 1.03


def verdict(low: float, high: float, target: float) -> str:
    """``met`` when the median's whole interval is at or under the target, ``missed`` when it is all over
    it, otherwise ``undecided``: this run cannot tell the two apart."""
    if high <= target:
        return "met"
    return "missed" if low > target else "undecided"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=12)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--modes", default="legacy,default")
    parser.add_argument("--sides", default="both", help="which hooks H has: both, server, client (comma list)")
    parser.add_argument("--side", default="both")
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--mode", default="legacy")
    parser.add_argument("--rotate", type=int, default=0)
    parser.add_argument("--control", action="store_true", help="A against A: the method's own bias")
    parser.add_argument("--in-process", action="store_true",
                        help="time the round trips through httpx2's ASGI transport, as --instructions counts them")
    parser.add_argument("--instructions", action="store_true", help="count instructions under callgrind instead")
    parser.add_argument("--only", choices=CONFIGURATIONS, help="(worker) one configuration, counted")
    parser.add_argument("--gc-off", action="store_true",
                        help="(--instructions) the garbage collector off while counting: to compare two versions")
    parser.add_argument("--apart", action="store_true",
                        help="each worker's servers in a process of their own, client and server each on a CPU")
    parser.add_argument("--serve-apart", action="store_true", help="(worker) the servers of an --apart worker")
    parser.add_argument("--payload", type=int, default=1,
                        help="characters of the tool's argument, echoed in its result (1: the healthy small call)")
    args = parser.parse_args()
    if args.apart and args.in_process:
        parser.error("--apart and --in-process: the one needs sockets the other does without")
    if not args.worker and not args.instructions and not args.serve_apart:
        try:  # refused before any run, not after them all
            median_interval([1.0] * args.workers)
        except ValueError as too_few:
            parser.error(f"--workers: {too_few}")
    if args.serve_apart:
        _serve_apart(rotate=args.rotate, control=args.control, side=args.side)
        return
    if args.worker:
        print(json.dumps(_worker(args.mode, args.calls, rotate=args.rotate, control=args.control, side=args.side,
                                 only=args.only, gc_off=args.gc_off, in_process=args.in_process,
                                 payload=args.payload, apart=args.apart)))
        return
    if args.instructions:
        _count(args.modes.split(","), args.sides.split(","), args.calls, args.gc_off)
        return
    report = {}
    modes, sides = args.modes.split(","), args.sides.split(",")
    runs = [(mode, side, False) for side in sides for mode in modes] + [(modes[0], "both", True)]
    for mode, side, control in runs:
        name = f"{mode} A/A control" if control else (mode if side == "both" else f"{mode} {side} only")
        medians: dict[str, list[float]] = {f"{c}{figure}": [] for c in CONFIGURATIONS
                                           for figure in ("", "_cpu", "_cpu_mean")}
        for worker in range(args.workers):
            command = [sys.executable, __file__, "--worker", "--mode", mode, "--side", side, "--calls", str(args.calls),
                       "--rotate", str(worker)]
            command += ["--control"] if control else []
            command += ["--in-process"] if args.in_process else []
            command += ["--apart"] if args.apart else []
            command += ["--payload", str(args.payload)]
            out = subprocess.run(command, check=True, capture_output=True, text=True, timeout=600)
            for configuration, ms in json.loads(out.stdout.strip().splitlines()[-1]).items():
                medians[configuration].append(ms)
        a, s, h = (medians[c] for c in CONFIGURATIONS)
        a_cpu, s_cpu, h_cpu = (medians[f"{c}_cpu"] for c in CONFIGURATIONS)
        a_mean, s_mean, h_mean = (medians[f"{c}_cpu_mean"] for c in CONFIGURATIONS)
        report[name] = {
            "workers": args.workers, "calls_per_configuration": args.calls,
            "layout": "apart" if args.apart else "in process" if args.in_process else "one process",
            "per_worker_ms": {figure: [round(ms, 4) for ms in values] for figure, values in medians.items()},
            **{f"{c}_median_ms": round(statistics.median(medians[c]), 3) for c in CONFIGURATIONS},
            **{f"{c}_cpu_median_ms": round(statistics.median(medians[f"{c}_cpu"]), 3) for c in CONFIGURATIONS},
            **{f"{c}_cpu_mean_ms": round(statistics.median(medians[f"{c}_cpu_mean"]), 3) for c in CONFIGURATIONS},
            **({"A/A": _ratios(h, a), "A/A cpu": _ratios(h_cpu, a_cpu), "A/A cpu mean": _ratios(h_mean, a_mean)}
               if control else
               {"H/S": _ratios(h, s, TARGETS.get((mode, side), SIDE_ALONE_TARGET)), "H/A": _ratios(h, a),
                "S/A": _ratios(s, a), "H/S-S/A": _dearer(a, s, h),
                "H/S cpu": _ratios(h_cpu, s_cpu), "H/A cpu": _ratios(h_cpu, a_cpu), "S/A cpu": _ratios(s_cpu, a_cpu),
                "H/S cpu mean": _ratios(h_mean, s_mean), "S/A cpu mean": _ratios(s_mean, a_mean)}),
        }
        r = report[name]
        print(f"{name}: " + ", ".join(f"{k} {v['median']} (spread {v['min']}..{v['max']}, "
                                       f"95% interval {v['low']}..{v['high']})"
                                       for k, v in r.items() if "/" in k)
              + "".join(f"; {k} <= {v['target']}: {v['verdict']}"
                        for k, v in r.items() if isinstance(v, dict) and "verdict" in v)
              + f" over {args.workers} workers; medians A {r['A_median_ms']} ms, S {r['S_median_ms']} ms, "
              f"H {r['H_median_ms']} ms; CPU a call A {r['A_cpu_median_ms']} ms, S {r['S_cpu_median_ms']} ms, "
              f"H {r['H_cpu_median_ms']} ms", flush=True)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
