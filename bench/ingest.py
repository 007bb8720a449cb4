"""Detector throughput, a core, on two span mixes, against decoding baselines; memory per tracked call.

Mixes (OTLP protobuf batches encoded by the OpenTelemetry SDK's own encoder, two processes' resources,
the SDK's scope and ours, as docs/span-model.md describes them):

- realistic: per session the SDK's spans of ``initialize``, ``notifications/initialized`` and
  ``tools/list``, then ``tools/call`` requests with their two SDK spans each (the client's carrying the
  hooks' terminal attributes); 1 % of calls are lost as in the incident, with their spans (the call,
  the dropped POST, three resumes ending clean with the call pending and a narrowed token, the
  truncated replay) and the client's SDK span timing out.
- all-lost: per session one healthy call and one lost call: the hooks' spans dominate.

In-process, each round measures CPU time (``time.process_time``) of, on the same batches and
alternating the order: (A) the bare decode, ``ExportTraceServiceRequest.FromString``; (W) decode and
walk, what a Python consumer of OTLP did before the lean path (every span's ids, name, kind, times,
status, events and every attribute read into Python); (D) the detector as the service runs it:
``decode_protobuf`` (bounded, span by span), ``Detector.read`` and ``Detector.apply`` on a fresh
detector. Reported: medians over rounds with their spread (min..max), D/W and D/A.

End to end: a real ``mcp-stream-exporter serve`` (a subprocess, a fresh one each round, as the detector
in-process is fresh each round) takes the realistic mix over OTLP/HTTP and over OTLP/gRPC from two sender
threads; each round's rate is the spans sent over the CPU time the service spent until the last batch was
in its ledger (``/proc/<pid>/stat``), and over wall time. ``--e2e-sessions`` sizes that mix (the
service's CPU time is counted in 10 ms ticks: a round should take many of them). ``--e2e-against DIR``
runs the same rounds, alternated, on the service of another checkout of this repository (its
``exporter`` first on ``PYTHONPATH``), and reports the ratio of the two rates round by round. CPU time
on a machine others are using moves by tens of percent; ``--e2e-instructions`` counts instead the
instructions the service runs a span, under valgrind's callgrind (``PYTHONHASHSEED=0``): one round
each, repeatable within a fraction of a percent, about 50 times slower.

Memory: tracemalloc's traced bytes after applying N calls' events to a fresh detector whose budgets
hold them all, divided by N: a tracked call (its POST dropped with it pending, owed a result; target
<= 1 KiB) and a lost call with its findings and their evidence (the incident's shape); each with and
without the findings page's timelines (which have their own share of ``--max-memory-mb``).

The generated spans are frozen out of the garbage collector (``gc.freeze``), so that the collector
does not walk the bench's own data. Bounded: ROUNDS x SESSIONS, and the end-to-end rounds.

    python bench/ingest.py [--sessions 1000] [--calls 10] [--rounds 7] [--memory-calls 20000]
                           [--e2e-rounds 5] [--e2e-sessions 3000] [--e2e-against DIR] [--e2e-instructions]
                           [--no-e2e]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, Status, StatusCode, Tracer, set_span_in_context

from mcp_stream_exporter import semconv as sc
from mcp_stream_exporter.detector import Detector, DetectorConfig
from mcp_stream_exporter.detector.ledger import LedgerLimits
from mcp_stream_exporter.detector.limits import IngestLimits
from mcp_stream_exporter.detector.otlp import decode_protobuf

FETCH = "https://mcp.example.com/tools/fetch"
SEARCH = "https://mcp.example.com/tools/search"
BATCH = 512  # the Collector's and the SDK's BatchSpanProcessor default
LOST_EVERY = 100  # realistic mix: one call in 100 lost
SDK_SCOPE = "mcp-python-sdk"
HOOKS_SCOPE = "mcp_stream_exporter"
PROTOCOL = "2025-11-25"


class _Sides:
    """Two processes' tracers (a client and a server), each with the SDK's scope and the hooks'."""

    def __init__(self) -> None:
        self.exporter = InMemorySpanExporter()
        self.tracers: dict[tuple[str, str], Tracer] = {}
        for role in (sc.ROLE_CLIENT, sc.ROLE_SERVER):
            provider = TracerProvider(resource=Resource.create({
                "service.name": f"bench-{role}", "service.instance.id": f"bench-{role}-0"}))
            provider.add_span_processor(SimpleSpanProcessor(self.exporter))
            for scope in (SDK_SCOPE, HOOKS_SCOPE):
                self.tracers[role, scope] = provider.get_tracer(scope)

    def sdk(self, role: str) -> Tracer:
        return self.tracers[role, SDK_SCOPE]

    def hooks(self, role: str) -> Tracer:
        return self.tracers[role, HOOKS_SCOPE]

    def spans(self) -> list[ReadableSpan]:
        return list(self.exporter.get_finished_spans())


def _sdk_request(sides: _Sides, method: str, request_id: str, name: str = "",
                 client_attributes: dict[str, Any] | None = None, timed_out: bool = False) -> Any:
    """The SDK's two spans of one request: the client's ``MCP send ...`` and the server's child."""
    suffix = f" {name}" if name else ""
    client = sides.sdk(sc.ROLE_CLIENT).start_span(f"MCP send {method}{suffix}", kind=SpanKind.CLIENT, attributes={
        sc.MCP_METHOD_NAME: method, sc.JSONRPC_REQUEST_ID: request_id, **(client_attributes or {})})
    server_attributes = {sc.MCP_METHOD_NAME: method, sc.JSONRPC_REQUEST_ID: request_id,
                         sc.MCP_PROTOCOL_VERSION: PROTOCOL}
    if method == "tools/call":
        server_attributes.update({"gen_ai.operation.name": "execute_tool", sc.GEN_AI_TOOL_NAME: name})
    sides.sdk(sc.ROLE_SERVER).start_span(f"{method}{suffix}", kind=SpanKind.SERVER, attributes=server_attributes,
                                         context=set_span_in_context(client)).end()
    if timed_out:
        client.set_attributes({sc.ERROR_TYPE: "-32001", sc.RPC_RESPONSE_STATUS_CODE: "-32001"})
        client.set_status(Status(StatusCode.ERROR, "Request timed out"))
    return client


def _lost_call(sides: _Sides, session: str, request_id: str, parent: Any, resumes: int = 3) -> None:
    """The incident: a dropped POST, resumes ending clean with the call pending and a narrowed token,
    a truncated replay, the call span (cancelled)."""
    common = {sc.ROLE: sc.ROLE_CLIENT, sc.ERA: sc.ERA_RESUMABLE, sc.MCP_SESSION_ID: session,
              sc.MCP_PROTOCOL_VERSION: PROTOCOL}
    stream = {**common, sc.SPAN: sc.SPAN_STREAM, sc.STREAM_REQUEST_IDS: [request_id], sc.GEN_AI_TOOL_NAME: "fetch",
              sc.HTTP_REQUEST_METHOD: "GET", sc.STREAM_CONTENT: "sse", sc.HTTP_RESPONSE_STATUS_CODE: 200}
    client, server = sides.hooks(sc.ROLE_CLIENT), sides.hooks(sc.ROLE_SERVER)
    with client.start_as_current_span("MCP call tools/call fetch", context=set_span_in_context(parent), attributes={
            **common, sc.SPAN: sc.SPAN_CALL, sc.JSONRPC_REQUEST_ID: request_id, sc.GEN_AI_TOOL_NAME: "fetch",
            sc.REQUIRED_RESOURCES: [FETCH], sc.CALL_OUTCOME: sc.OUTCOME_CANCELLED, sc.CALL_STREAMS: 1 + resumes}):
        with client.start_as_current_span("MCP stream post", kind=SpanKind.CLIENT, attributes={
                **stream, sc.HTTP_REQUEST_METHOD: "POST", sc.STREAM_KIND: "post", sc.END_REASON: "dropped",
                sc.PENDING_REQUEST_IDS: [request_id], sc.EVENTS_COUNT: 2, sc.EVENT_FIRST_ID: "4",
                sc.EVENT_LAST_ID: "6"}):
            pass
        for _ in range(resumes):
            with client.start_as_current_span("MCP stream resume", kind=SpanKind.CLIENT, attributes={
                    **stream, sc.STREAM_KIND: "resume", sc.END_REASON: "clean", sc.RESUME_CURSOR: "6",
                    sc.PENDING_REQUEST_IDS: [request_id], sc.EVENTS_COUNT: 0, sc.AUTH_AUDIENCE: [SEARCH],
                    sc.AUTH_FINGERPRINT: "0123456789abcdef", sc.REQUIRED_RESOURCES: [FETCH],
                    sc.AUTH_MISSING_RESOURCES: [FETCH]}):
                pass
            with server.start_as_current_span("MCP replay", attributes={
                    **common, sc.ROLE: sc.ROLE_SERVER, sc.SPAN: sc.SPAN_REPLAY, sc.RESUME_CURSOR: "6",
                    sc.JSONRPC_REQUEST_ID: request_id, sc.REPLAY_DECISION: sc.REPLAY_TRUNCATED,
                    sc.REPLAY_BUFFERED: 4, sc.REPLAY_SENT: 0, sc.REPLAY_OFFENDING_EVENT_ID: "8",
                    sc.AUTH_AUDIENCE: [SEARCH], sc.REQUIRED_RESOURCES: [FETCH],
                    sc.AUTH_MISSING_RESOURCES: [FETCH]}):
                pass


def realistic(sessions: int, calls: int) -> list[ReadableSpan]:
    sides = _Sides()
    n = 0
    for i in range(sessions):
        session = f"session-{i:08d}"
        _sdk_request(sides, "initialize", "0").end()
        sides.sdk(sc.ROLE_SERVER).start_span("notifications/initialized", kind=SpanKind.SERVER, attributes={
            sc.MCP_METHOD_NAME: "notifications/initialized", sc.MCP_PROTOCOL_VERSION: PROTOCOL}).end()
        _sdk_request(sides, "tools/list", "1").end()
        for c in range(calls):
            n += 1
            request_id = str(c + 2)
            if n % LOST_EVERY:
                _sdk_request(sides, "tools/call", request_id, "search", {
                    sc.TERMINAL_STREAM_KIND: "post", sc.TERMINAL_EVENT_ID: f"{request_id}_1"}).end()
                continue
            sdk_span = _sdk_request(sides, "tools/call", request_id, "fetch", timed_out=True)
            _lost_call(sides, session, request_id, sdk_span)
            sdk_span.end()
    return sides.spans()


def all_lost(sessions: int, *, lost: bool = True) -> list[ReadableSpan]:
    """Per session a healthy call and a call whose POST dropped with it pending (lost: and its resumes)."""
    sides = _Sides()
    for i in range(sessions):
        _sdk_request(sides, "tools/call", "2", "search").end()
        sdk_span = _sdk_request(sides, "tools/call", "3", "fetch")
        _lost_call(sides, f"session-{i:08d}", "3", sdk_span, resumes=3 if lost else 0)
        sdk_span.end()
    return sides.spans()


def _batches(spans: list[ReadableSpan]) -> list[bytes]:
    return [encode_spans(spans[i:i + BATCH]).SerializeToString() for i in range(0, len(spans), BATCH)]


# --- in-process: the same batches, three ways ---

def _bare(batches: list[bytes]) -> None:
    for body in batches:
        ExportTraceServiceRequest.FromString(body)


def _any(v: Any) -> Any:
    which = v.WhichOneof("value")
    if which == "array_value":
        return tuple(_any(x) for x in v.array_value.values)
    return getattr(v, which) if which else None


def _walk(batches: list[bytes]) -> None:
    """Decode and read every span into Python: what the detector did before its lean path."""
    for body in batches:
        for rs in ExportTraceServiceRequest.FromString(body).resource_spans:
            resource = {kv.key: _any(kv.value) for kv in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    (s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(), s.name, s.kind,
                     s.start_time_unix_nano, s.end_time_unix_nano, s.status.code, resource,
                     {kv.key: _any(kv.value) for kv in s.attributes},
                     [{kv.key: _any(kv.value) for kv in e.attributes} for e in s.events if e.name == "exception"])


def _detector(batches: list[bytes]) -> None:
    detector = Detector(DetectorConfig())
    limits = IngestLimits()
    for body in batches:
        events, _ = detector.read(decode_protobuf(body, limits).spans, "otlp_http")
        detector.apply(events)


def _cpu(run: Callable[[list[bytes]], None], batches: list[bytes]) -> float:
    gc.collect()
    started = time.process_time()
    run(batches)
    return time.process_time() - started


def _summary(values: list[float], digits: int = 0) -> dict[str, Any]:
    return {"median": round(statistics.median(values), digits or None),
            "spread": [round(min(values), digits or None), round(max(values), digits or None)]}


def _ratios(baseline: list[float], detector: list[float]) -> list[float]:
    """Per round, the detector's rate over the baseline's (CPU time of the baseline over the detector's)."""
    return [b / d for b, d in zip(baseline, detector, strict=True)]


def in_process(spans: int, batches: list[bytes], rounds: int) -> dict[str, Any]:
    runs: list[Callable[[list[bytes]], None]] = [_bare, _walk, _detector]
    took: dict[str, list[float]] = {run.__name__: [] for run in runs}
    for r in range(rounds):
        for run in (runs if r % 2 == 0 else runs[::-1]):
            took[run.__name__].append(_cpu(run, batches))
    rate = {name: [spans / t for t in times] for name, times in took.items()}
    return {
        "spans": spans, "batches": len(batches), "rounds": rounds,
        "detector_spans_per_cpu_s": _summary(rate["_detector"]),
        "decode_and_walk_spans_per_cpu_s": _summary(rate["_walk"]),
        "bare_decode_spans_per_cpu_s": _summary(rate["_bare"]),
        "detector_to_decode_and_walk": _summary(_ratios(took["_walk"], took["_detector"]), 3),
        "detector_to_bare_decode": _summary(_ratios(took["_bare"], took["_detector"]), 3),
    }


def memory_per_call(calls: int, *, lost: bool, timelines: bool = True) -> float:
    """Traced bytes a call adds to a detector whose budgets all hold it (no eviction blurs the figure),
    its spans read and applied inside the measure (so what the detector keeps of what it read counts);
    without ``timelines``, the findings page's timelines are given no room (what the ledger and the
    findings alone hold)."""
    batches = _batches(all_lost(calls, lost=lost))
    room = 1 << 40
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    detector = Detector(DetectorConfig(ledger=LedgerLimits(max_sessions=calls, max_bytes=room),
                                       max_findings=3 * calls, max_findings_bytes=room,
                                       max_timelines_bytes=room if timelines else 0))
    for body in batches:
        detector.apply(detector.read(decode_protobuf(body, IngestLimits()).spans, "bench")[0])
    gc.collect()
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    assert detector.ledger.calls == calls, detector.ledger.calls
    assert not timelines or len(detector.timelines) >= calls, len(detector.timelines)
    return (after - before) / calls


# --- end to end: the real service, over OTLP/HTTP and OTLP/gRPC ---

def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _logged(path: Path, message: str) -> dict[str, Any] | None:
    for line in path.read_text().splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(entry, dict) and entry.get("message") == message:
            return entry
    return None


@contextmanager
def _service(source: Path | None = None, callgrind: Path | None = None) -> Iterator[tuple[int, str, int]]:
    """A fresh ``serve`` on ports of its choosing, from this checkout or ``source``'s, under callgrind
    (instrumentation off until asked, its counts written into ``callgrind``) if given: (pid, HTTP base
    URL, gRPC port)."""
    import httpx

    env = dict(os.environ, PYTHONHASHSEED="0")
    if source is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(source / "exporter"), env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "mcp_stream_exporter.cli", "serve", "--port=0", "--grpc-port=0",
               "--otlp-http-port=-1"]
    if callgrind is not None:
        command = ["valgrind", "--tool=callgrind", "--instr-atstart=no",
                   f"--callgrind-out-file={callgrind}/callgrind.%p", *command]
    with tempfile.TemporaryDirectory() as workdir:
        logs = Path(workdir) / "detector.log"
        with logs.open("a") as sink:
            proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=sink, env=env)
        try:
            deadline = time.monotonic() + (30 if callgrind is None else 600)
            while (proc.poll() is None and time.monotonic() < deadline
                   and not (_logged(logs, "detector starting") and _logged(logs, "otlp grpc listening"))):
                time.sleep(0.05)
            http, grpc_ = _logged(logs, "detector starting"), _logged(logs, "otlp grpc listening")
            if http is None or grpc_ is None:
                raise RuntimeError(f"the detector did not start: {logs.read_text()[-2000:]}")
            url = f"http://127.0.0.1:{http['port']}"
            while time.monotonic() < deadline:
                try:
                    if httpx.get(f"{url}/readyz").status_code == 200:
                        break
                except httpx.TransportError:  # bound, not yet listening
                    pass
                time.sleep(0.05)
            yield proc.pid, url, int(grpc_["port"])
        finally:
            proc.terminate()
            proc.wait(timeout=30)


_APPLIED = re.compile(r"^mcp_stream_detector_ingest_duration_seconds_count (\S+)$", re.M)


def _applied(http: Any, url: str) -> int:
    """Batches the service has put in its ledger so far."""
    match = _APPLIED.search(http.get(f"{url}/metrics").text)
    return int(float(match.group(1))) if match else 0


def _sender(transport: str, url: str, http: Any, channel: Any) -> Callable[[bytes], None]:
    """Send one batch, retrying while the service is busy (429 / UNAVAILABLE), as an OTLP exporter does."""
    import grpc

    export = channel.unary_unary("/opentelemetry.proto.collector.trace.v1.TraceService/Export",
                                 request_serializer=None, response_deserializer=None)

    def send(body: bytes) -> None:
        for _ in range(100):
            if transport == "otlp_http":
                answer = http.post(f"{url}/v1/traces", content=body, headers={"content-type": "application/x-protobuf"})
                if answer.status_code == 200:
                    return
            else:
                try:
                    export(body, timeout=60)
                    return
                except grpc.RpcError:
                    pass
            time.sleep(0.01)
        raise RuntimeError("the service kept refusing a batch")

    return send


_EMPTY = ExportTraceServiceRequest().SerializeToString()


def _round(transport: str, source: Path | None, spans: int, batches: list[bytes],
           senders: int) -> tuple[float, float]:
    """One round on a fresh service: (spans per second of its CPU time, spans per wall second)."""
    import grpc
    import httpx

    with _service(source) as (pid, url, grpc_port), httpx.Client(timeout=60) as http, \
            grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        send = _sender(transport, url, http, channel)
        for _ in range(senders):  # each sender's connection made, the path warm: what is left is the batches
            send(_EMPTY)
        done = _applied(http, url) + len(batches)
        cpu, wall = _cpu_s(pid), time.perf_counter()
        with ThreadPoolExecutor(senders) as pool:
            list(pool.map(send, batches))
        deadline = time.monotonic() + 120
        while _applied(http, url) < done and time.monotonic() < deadline:
            time.sleep(0.05)  # each look is a scrape the service pays for: few of them
        return spans / (_cpu_s(pid) - cpu), spans / (time.perf_counter() - wall)


def _callgrind(pid: int, *option: str) -> None:
    subprocess.run(["callgrind_control", *option, str(pid)], check=True, capture_output=True, timeout=120)


def _instructions(transport: str, source: Path | None, spans: int, batches: list[bytes], senders: int) -> float:
    """Instructions the service runs (all its threads, callgrind) a span it takes, from the first batch
    sent until the last is in its ledger: a count the other work on a shared machine does not move."""
    import grpc
    import httpx

    with tempfile.TemporaryDirectory() as out, _service(source, Path(out)) as (pid, url, grpc_port), \
            httpx.Client(timeout=600) as http, grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        send = _sender(transport, url, http, channel)
        for _ in range(senders):
            send(_EMPTY)
        done = _applied(http, url) + len(batches)
        _callgrind(pid, "--instr=on")
        with ThreadPoolExecutor(senders) as pool:
            list(pool.map(send, batches))
        deadline = time.monotonic() + 600
        while True:  # each look is a scrape: not counted
            time.sleep(0.5)
            _callgrind(pid, "--instr=off")
            if _applied(http, url) >= done or time.monotonic() > deadline:
                break
            _callgrind(pid, "--instr=on")
        _callgrind(pid, "--dump")
        counted = sum(int(line.split()[1]) for dump in Path(out).glob("callgrind.*")
                      for line in dump.read_text().splitlines() if line.startswith("totals:"))
    return counted / spans


def end_to_end(spans: int, batches: list[bytes], rounds: int, senders: int = 2,
               against: Path | None = None) -> dict[str, Any]:
    report: dict[str, Any] = {"spans": spans, "batches": len(batches), "rounds": rounds, "senders": senders}
    if against is not None:
        report["against"] = str(against)
    for transport in ("otlp_http", "otlp_grpc"):
        rates: dict[Path | None, tuple[list[float], list[float]]] = {None: ([], []), against: ([], [])}
        for r in range(rounds):
            for source in ((None, against) if r % 2 == 0 else (against, None)) if against else (None,):
                cpu, wall = _round(transport, source, spans, batches, senders)
                rates[source][0].append(cpu)
                rates[source][1].append(wall)
        report[transport] = {"spans_per_service_cpu_s": _summary(rates[None][0]),
                             "spans_per_wall_s": _summary(rates[None][1])}
        if against is not None:
            report[transport]["against"] = {"spans_per_service_cpu_s": _summary(rates[against][0]),
                                             "spans_per_wall_s": _summary(rates[against][1])}
            report[transport]["to_against"] = _summary(_ratios(rates[None][0], rates[against][0]), 3)
    return report


def end_to_end_instructions(spans: int, batches: list[bytes], senders: int = 2,
                            against: Path | None = None) -> dict[str, Any]:
    """One round a transport (and a checkout): an instruction count repeats within a fraction of a percent."""
    report: dict[str, Any] = {"spans": spans, "batches": len(batches), "senders": senders}
    for transport in ("otlp_http", "otlp_grpc"):
        ours = _instructions(transport, None, spans, batches, senders)
        report[transport] = {"instructions_per_span": round(ours)}
        if against is not None:
            theirs = _instructions(transport, against, spans, batches, senders)
            report[transport].update(against=round(theirs), against_to_this=round(theirs / ours, 3))
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=1000, help="realistic mix; the all-lost mix has twice as many")
    parser.add_argument("--calls", type=int, default=10, help="tools/call requests per session (realistic mix)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--memory-calls", type=int, default=20000)
    parser.add_argument("--e2e-rounds", type=int, default=5)
    parser.add_argument("--e2e-sessions", type=int, default=3000, help="the realistic mix sent end to end")
    parser.add_argument("--e2e-against", type=Path, help="another checkout whose service runs the same rounds")
    parser.add_argument("--e2e-instructions", action="store_true",
                        help="end to end, count the service's instructions under valgrind (callgrind) instead of "
                             "its CPU time (about 50 times slower: use a smaller --e2e-sessions)")
    parser.add_argument("--no-e2e", action="store_true", help="in-process only")
    args = parser.parse_args()
    mixes = {"realistic": realistic(args.sessions, args.calls), "all_lost": all_lost(2 * args.sessions)}
    if args.e2e_instructions or not args.no_e2e:
        mixes["end_to_end"] = realistic(args.e2e_sessions, args.calls)
    encoded = {name: (len(spans), _batches(spans)) for name, spans in mixes.items()}
    del mixes
    gc.collect()
    gc.freeze()  # the bench's own data is not the detector's garbage
    report: dict[str, Any] = {"cpus": os.cpu_count(), "python": sys.version.split()[0],
                              "load_average_before": os.getloadavg()}
    for name in ("realistic", "all_lost"):
        count, batches = encoded[name]
        report[f"in_process_{name}"] = in_process(count, batches, args.rounds)
        print(json.dumps({name: report[f"in_process_{name}"]}), file=sys.stderr, flush=True)
    for name, lost in (("tracked_call", False), ("lost_call_with_its_findings", True)):
        report[f"bytes_per_{name}"] = round(memory_per_call(args.memory_calls, lost=lost))
        report[f"bytes_per_{name}_without_timelines"] = round(
            memory_per_call(args.memory_calls, lost=lost, timelines=False))
    if args.e2e_instructions:
        report["end_to_end_realistic_instructions"] = end_to_end_instructions(*encoded["end_to_end"],
                                                                              against=args.e2e_against)
    elif not args.no_e2e:
        report["end_to_end_realistic"] = end_to_end(*encoded["end_to_end"], args.e2e_rounds,
                                                    against=args.e2e_against)
    report["load_average_after"] = os.getloadavg()
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
