"""The detector service under attack: peak memory per attack, series after a label flood, slow clients.

Each attack runs against a fresh ``mcp-stream-exporter serve`` on 127.0.0.1 (a real process, OTLP/HTTP
protobuf or JSON). Reported per attack: what was sent, the answers, the process's peak RSS growth
(``VmHWM`` from /proc, less the RSS once ready), and what the detector then holds (its gauges). The
session cap is lifted so that the memory budget is what bounds the ledger.
Bounded: every flood is a fixed number of spans; slow connections are bounded in count and time.

    python bench/hostile.py [--max-memory-mb 64] [--spans 100000] [--only slowloris] [--json]
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import httpx
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span
from prometheus_client.parser import text_string_to_metric_families

from mcp_stream_exporter import semconv as sc

PROTOBUF = {"content-type": "application/x-protobuf"}
BATCH = 5_000
LONG = "x" * 240


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _status(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


@contextmanager
def _service(*flags: str) -> Iterator[tuple[subprocess.Popen[str], str]]:
    port = _free_port()
    with tempfile.TemporaryFile("w+") as logs:
        proc = subprocess.Popen([sys.executable, "-m", "mcp_stream_exporter.cli", "serve", f"--port={port}",
                                 "--grpc-port=-1", "--otlp-http-port=-1", *flags], stdout=subprocess.DEVNULL,
                                stderr=logs, text=True)
        url = f"http://127.0.0.1:{port}"
        try:
            for _ in range(600):
                try:
                    if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(0.05)
            yield proc, url
        finally:
            proc.terminate()
            proc.wait(timeout=30)


def _attrs(span: Span, attrs: dict[str, Any]) -> Span:
    for key, value in attrs.items():
        kv = KeyValue(key=key)
        if isinstance(value, (list, tuple)):
            kv.value.array_value.values.extend(AnyValue(string_value=str(v)) for v in value)
        elif isinstance(value, int):
            kv.value.int_value = value
        else:
            kv.value.string_value = value
        span.attributes.append(kv)
    return span


def _stream(i: int, **attrs: Any) -> Span:
    base = {sc.SPAN: sc.SPAN_STREAM, sc.ROLE: sc.ROLE_CLIENT, sc.STREAM_KIND: "post", sc.END_REASON: sc.END_CLEAN,
            sc.MCP_SESSION_ID: f"s{i}", sc.STREAM_REQUEST_IDS: ["1"], sc.PENDING_REQUEST_IDS: ["1"]}
    span = Span(trace_id=i.to_bytes(16, "big"), span_id=(i + 1).to_bytes(8, "big"), name="MCP stream", kind=3,
                start_time_unix_nano=time.time_ns(), end_time_unix_nano=time.time_ns() + 1000)
    return _attrs(span, {**base, **attrs})


def _send(url: str, spans: Iterator[Span], total: int) -> dict[str, int]:
    answers: dict[str, int] = {}
    with httpx.Client(timeout=60) as http:
        batch: list[Span] = []
        held = 0
        for n, span in enumerate(spans, 1):
            batch.append(span)
            held += span.ByteSize()
            if len(batch) == BATCH or held > 2 * 1024 * 1024 or n == total:
                request = ExportTraceServiceRequest()
                request.resource_spans.add().scope_spans.add().spans.extend(batch)
                for _ in range(50):  # 429: wait as told
                    r = http.post(f"{url}/v1/traces", content=request.SerializeToString(), headers=PROTOBUF)
                    if r.status_code != 429:
                        break
                    time.sleep(float(r.headers.get("retry-after", "1")))
                answers[str(r.status_code)] = answers.get(str(r.status_code), 0) + 1
                batch, held = [], 0
                if n == total:
                    break
    return answers


def _gauges(url: str) -> dict[str, Any]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    out: dict[str, Any] = {"metrics_bytes": len(text), "series": 0}
    for family in text_string_to_metric_families(text):
        out["series"] += len(family.samples)
        for sample in family.samples:
            if sample.name in ("mcp_stream_detector_ledger_sessions", "mcp_stream_detector_ledger_calls",
                               "mcp_stream_detector_findings_retained"):
                out[sample.name.removeprefix("mcp_stream_detector_")] = int(sample.value)
            elif sample.name == "mcp_stream_detector_state_bytes":
                out[f"state_{sample.labels['part']}_mib"] = round(sample.value / 2**20, 1)
            elif sample.name == "mcp_stream_detector_ledger_evictions_total" and sample.value:
                out[f"evicted_{sample.labels['reason']}"] = int(sample.value)
    return out


def _bomb(url: str, body: bytes, media: str, copies: int) -> dict[str, int]:
    headers = {"content-type": media, "content-encoding": "gzip"}
    with ThreadPoolExecutor(copies) as pool:
        codes = list(pool.map(lambda _: httpx.post(f"{url}/v1/traces", content=body, headers=headers,
                                                   timeout=300).status_code, range(copies)))
    return {str(c): codes.count(c) for c in set(codes)}


def _slowloris(url: str, port: int, count: int) -> dict[str, Any]:
    sockets = []
    for _ in range(count):
        try:
            sock = socket.create_connection(("127.0.0.1", port), timeout=5)
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            sockets.append(sock)
        except OSError:
            break
    served = sum(httpx.get(f"{url}/healthz", timeout=10).status_code == 200 for _ in range(10))
    time.sleep(12)  # past the header deadline (10 s): the slow ones are cut off
    closed = sum(_closed(sock) for sock in sockets)
    return {"slow_connections": len(sockets), "healthz_served_of_10": served, "closed_by_server": closed}


def _closed(sock: socket.socket) -> bool:
    sock.settimeout(0.5)
    try:
        while sock.recv(4096):  # a 503 (past the connection limit), then the close
            pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        return False
    finally:
        sock.close()
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-memory-mb", type=int, default=64)
    parser.add_argument("--spans", type=int, default=100_000)
    parser.add_argument("--only", help="run the attacks whose name contains this")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    n = args.spans
    sixteen = 16 * 1024 * 1024

    def empty_spans() -> bytes:
        spans = b"\x12\x00" * ((sixteen - 16) // 2)
        scope = b"\x12" + _varint(len(spans)) + spans
        return gzip.compress(b"\x0a" + _varint(len(scope)) + scope, 9)

    def json_objects() -> bytes:
        return gzip.compress(b'{"resourceSpans":[{"scopeSpans":[{"spans":[' + b"{}," * ((sixteen - 64) // 3)
                             + b"{}]}]}]}", 9)

    attacks: dict[str, Callable[[str, int], dict[str, Any]]] = {
        "protobuf gzip bomb, 4 at once": lambda url, port: _bomb(url, empty_spans(), "application/x-protobuf", 4),
        "json gzip bomb, 4 at once": lambda url, port: _bomb(url, json_objects(), "application/json", 4),
        "label flood (kind, reason, tool)": lambda url, port: _send(url, (_stream(
            i, **{sc.STREAM_KIND: f"k{i}", sc.END_REASON: f"r{i}", sc.GEN_AI_TOOL_NAME: f"t{i}"})
            for i in range(n)), n),
        "ids at the 256-char cap, a session each": lambda url, port: _send(url, (_stream(
            i, **{sc.MCP_SESSION_ID: f"{LONG}{i:016}", sc.STREAM_REQUEST_IDS: [f"{LONG}{i:016}"],
                  sc.PENDING_REQUEST_IDS: [f"{LONG}{i:016}"]}) for i in range(n)), n),
        "ids past the cap (64 KiB each)": lambda url, port: _send(url, (_stream(
            i, **{sc.MCP_SESSION_ID: f"{i}" + "x" * 65536}) for i in range(n // 50)), n // 50),
        "one session, a new resume cursor each": lambda url, port: _send(url, (_stream(
            i, **{sc.MCP_SESSION_ID: "one", sc.STREAM_KIND: "resume", sc.RESUME_CURSOR: f"c{i}"})
            for i in range(n)), n),
        "re-ending the same 100 calls, 1000 times each": lambda url, port: _send(url, (_stream(
            i, **{sc.MCP_SESSION_ID: f"s{i % 100}", sc.STREAM_REQUEST_IDS: [str(i % 10)],
                  sc.PENDING_REQUEST_IDS: [str(i % 10)]}) for i in range(n)), n),
        "findings with the largest evidence": lambda url, port: _send(url, (_stream(
            i, **{sc.STREAM_KIND: "resume", sc.PENDING_REQUEST_IDS: [],
                  sc.TERMINAL_REQUEST_IDS: [f"{LONG}{j:016}" for j in range(256)]}) for i in range(n // 20)), n // 20),
        "slowloris, 1200 connections": lambda url, port: _slowloris(url, port, 1200),
    }
    results = {}
    for name, attack in attacks.items():
        if args.only and args.only not in name:
            continue
        with _service(f"--max-memory-mb={args.max_memory_mb}", "--clean-end-grace-s=1",
                      "--max-sessions=1000000") as (proc, url):  # the memory budget is the bound
            ready = _status(proc.pid, "VmRSS")
            started = time.monotonic()
            answers = attack(url, int(url.rsplit(":", 1)[1]))
            time.sleep(2)  # grace periods run out: findings are made
            result = {"answers": answers, "seconds": round(time.monotonic() - started, 1),
                      "peak_rss_growth_mib": round((_status(proc.pid, "VmHWM") - ready) / 2**20, 1),
                      **_gauges(url)}
            if "evidence" in name:
                result["api_findings_limit_5_bytes"] = len(httpx.get(f"{url}/api/findings?limit=5").content)
            results[name] = result
            if not args.json:
                print(f"{name}: {result}", flush=True)
    if args.json:
        print(json.dumps(results, indent=2))


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
