"""The detector service against an attacker: bad input is a 4xx or a per-span rejection, never a 500
or a lost batch; decoding costs are bounded before anything is materialised; slow clients do not
starve others. The real FastAPI app and ingest queue, in-process (TestClient) or over real HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import logging
import os
import select
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import httpx
import pytest
import uvicorn
from attacks import ATTACKS
from fastapi.testclient import TestClient
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span as OtlpSpan
from prometheus_client import CollectorRegistry

from mcp_stream_exporter import semconv as sc
from mcp_stream_exporter.detector import Detector
from mcp_stream_exporter.detector.app import Access, create_app
from mcp_stream_exporter.detector.connections import ConnectionLimits, server_config
from mcp_stream_exporter.detector.grpc_receiver import serve_grpc
from mcp_stream_exporter.detector.ingest import JSON, PROTOBUF, IngestLimits, IngestQueue
from mcp_stream_exporter.detector.service import _JsonLogs

TOKEN = "ingest-secret"
DECODING_BUDGET_MIB = 48  # the 16 MiB decompressed body itself, and what walking it costs
AUTH = {"authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def service():
    detector = Detector()
    queue = IngestQueue(detector, IngestLimits())
    access = Access(ingest_token=TOKEN, api_token=TOKEN, metrics_basic_auth=("prom", "scrape"))
    with TestClient(create_app(detector, queue, access)) as client:
        yield client, detector, queue
    queue.close()


def _stream_span(session: str, **extra: object) -> OtlpSpan:
    """A client resume that ended cleanly with call 7 pending."""
    span = OtlpSpan(trace_id=os.urandom(16), span_id=os.urandom(8), name="MCP stream resume", kind=3,
                    start_time_unix_nano=1_700_000_000_000_000_000, end_time_unix_nano=1_700_000_001_000_000_000)
    attrs: dict[str, object] = {
        sc.SPAN: sc.SPAN_STREAM, sc.ROLE: sc.ROLE_CLIENT, sc.STREAM_KIND: "resume", sc.END_REASON: sc.END_CLEAN,
        sc.MCP_SESSION_ID: session, sc.STREAM_REQUEST_IDS: ["7"], sc.PENDING_REQUEST_IDS: ["7"],
        sc.RESUME_CURSOR: "41", sc.HTTP_RESPONSE_STATUS_CODE: 200, **extra}
    for key, value in attrs.items():
        kv = KeyValue(key=key)
        if isinstance(value, list):
            kv.value.array_value.values.extend(AnyValue(string_value=v) for v in value)
        elif isinstance(value, int):
            kv.value.int_value = value
        else:
            kv.value.string_value = str(value)
        span.attributes.append(kv)
    return span


def _body(*spans: OtlpSpan) -> bytes:
    request = ExportTraceServiceRequest()
    request.resource_spans.add().scope_spans.add().spans.extend(spans)
    return request.SerializeToString()


def test_ingest_takes_post_alone_another_method_is_a_405_that_names_it(service):
    client, _, _ = service
    for method in ("GET", "PUT", "DELETE"):
        answer = client.request(method, "/v1/traces", headers=AUTH)
        assert answer.status_code == 405 and answer.headers["allow"] == "POST" and answer.json()["error"]


@pytest.mark.parametrize("gzipped", [False, True])
def test_a_large_batch_plain_or_compressed_is_taken_whole_with_its_one_bad_span_refused(service, gzipped):
    client, detector, queue = service
    body = _body(*[_stream_span(f"big{i}", **{sc.RESUME_CURSOR: f"{i}" + "c" * 200}) for i in range(1200)],
                 _stream_span("bad", **{sc.EVENTS_COUNT: "-1"}))
    assert len(body) > 256 * 1024
    headers = {"content-type": PROTOBUF, **AUTH}
    if gzipped:
        body, headers["content-encoding"] = gzip.compress(body), "gzip"
    answer = client.post("/v1/traces", content=body, headers=headers)
    assert answer.status_code == 200, answer.text
    assert ExportTraceServiceResponse.FromString(answer.content).partial_success.rejected_spans == 1
    assert queue.wait_idle(10)
    assert detector.ledger.find("big0", "7") is not None and detector.ledger.find("big1199", "7") is not None


def test_a_truncated_gzip_body_is_a_400_and_header_values_are_read_without_their_surrounding_spaces(service):
    client, _, _ = service
    body = gzip.compress(_body(_stream_span("s")))
    for cut in (10, len(body) - 8):  # after the gzip header; before the gzip trailer
        answer = client.post("/v1/traces", content=body[:cut],
                             headers={"content-type": PROTOBUF, "content-encoding": "gzip", **AUTH})
        assert answer.status_code == 400 and "truncated" in answer.json()["error"]
    answer = client.post("/v1/traces", content=body,
                         headers={"content-type": " application/x-protobuf ", "content-encoding": "gzip ", **AUTH})
    assert answer.status_code == 200, answer.text
    answer = client.post("/v1/traces", content=b"{}", headers={"content-type": "APPLICATION/JSON", **AUTH})
    assert answer.status_code == 200 and answer.json() == {}  # answered in the encoding it was sent in


@pytest.mark.parametrize("value", ["\u00b2", "\u0661\u0662", "9" * 5000, "1" * 19, "-1", " 1"])
def test_an_int_attribute_that_is_no_int64_is_one_span_refused_and_the_rest_of_the_batch_kept(service, value):
    client, detector, queue = service
    body = _body(_stream_span("bad", **{sc.EVENTS_COUNT: value}), _stream_span("good"))
    answer = client.post("/v1/traces", content=body, headers={"content-type": PROTOBUF, **AUTH})
    assert answer.status_code == 200, answer.text
    partial = ExportTraceServiceResponse.FromString(answer.content).partial_success
    assert partial.rejected_spans == 1 and sc.EVENTS_COUNT in partial.error_message
    assert queue.wait_idle(10)
    assert detector.ledger.find("good", "7") is not None and detector.ledger.find("bad", "7") is None


@pytest.mark.parametrize("query", ["since=nan", "since=inf", "since=-inf", "since=1e308", "until=1e400", "until=-1",
                                   "since=18446744074"])
def test_a_findings_time_that_is_no_time_in_nanoseconds_is_a_422_not_a_500(service, query):
    client, _, _ = service
    answer = client.get(f"/api/findings?{query}", headers=AUTH)
    assert answer.status_code == 422 and answer.json()["detail"][0]["loc"][1] == query.split("=")[0]
    assert client.get("/api/findings?since=0&until=18446744073", headers=AUTH).status_code == 200


@pytest.mark.parametrize("document", [
    '{"resourceSpans":[{"scopeSpans":"x"}]}', '{"resourceSpans":"x"}', '{"resourceSpans":[1]}',
    '{"resourceSpans":[{"scopeSpans":[{"spans":"x"}]}]}', '{"resourceSpans":[{"scopeSpans":[{"spans":[7]}]}]}',
    '{"resourceSpans":[{"scopeSpans":[{"spans":[{"links":"x"}]}]}]}', '{"resourceSpans":[{"scopeSpans":[null]}]}',
    '{"resourceSpans":[{"scopeSpans":[{"spans":[{"links":[1]}]}]}]}', '{"resourceSpans":{"scopeSpans":[]}}',
    '{"resourceSpans":[{"scopeSpans":[{"spans":[{"spanId":7}]}]}]}', '[]', '"x"'])
def test_json_whose_parts_have_the_wrong_type_is_a_400_with_a_reason(service, document):
    client, _, _ = service
    answer = client.post("/v1/traces", content=document.encode(), headers={"content-type": JSON, **AUTH})
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]


@pytest.mark.parametrize("header", [b"Bearer \xff", b"Bearer ingest-secret\xe9", b"\xff\xfe", b"Basic \xc3\xa9",
                                    b"Bearer", b"Bearer ", b"Bearerx ingest-secret", b"Bearer ingest-secret x"])
def test_a_wrong_authorization_header_of_any_bytes_is_a_401_on_ingest_api_and_metrics(service, header):
    client, _, _ = service
    headers = {"authorization": header}
    assert client.post("/v1/traces", content=_body(), headers={"content-type": PROTOBUF, **headers}).status_code == 401
    assert client.get("/api/rules", headers=headers).status_code == 401
    assert client.get("/metrics", headers=headers).status_code == 401


@pytest.mark.parametrize(("scheme", "basic"), [("Bearer", "Basic"), ("bearer", "basic"), ("BEARER", "BASIC"),
                                               ("bEaReR", "bAsIc")])
def test_the_auth_scheme_is_matched_case_insensitively(service, scheme, basic):
    client, _, _ = service
    headers = {"authorization": f"{scheme}  {TOKEN}"}
    assert client.post("/v1/traces", content=_body(), headers={"content-type": PROTOBUF, **headers}).status_code == 200
    assert client.get("/api/rules", headers=headers).status_code == 200
    assert client.get("/metrics", headers={"authorization": f"{basic} cHJvbTpzY3JhcGU="}).status_code == 200


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_a_small_body_that_would_inflate_to_millions_of_objects_is_refused_before_it_costs_memory(attack):
    run = subprocess.run([sys.executable, str(Path(__file__).with_name("attacks.py")), attack], capture_output=True,
                         text=True, timeout=120, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    print(f"\n{attack}: {result}")
    assert result["status"] == 413 and result["error"]
    assert result["peak_growth_mib"] < DECODING_BUDGET_MIB


def _slots_taken(queue: IngestQueue) -> list:
    held = [queue.decoding() for _ in range(queue.limits.max_decoding)]  # as by slow decodes
    for slot in held:
        slot.__enter__()
    return held


def test_decoding_is_bounded_in_concurrency_and_past_the_wait_a_request_gets_429_with_retry_after():
    detector = Detector()
    queue = IngestQueue(detector, IngestLimits(max_decoding=2, decoding_wait_s=0.05))
    with TestClient(create_app(detector, queue)) as client:
        held = _slots_taken(queue)
        busy = client.post("/v1/traces", content=_body(_stream_span("busy")), headers={"content-type": PROTOBUF})
        assert busy.status_code == 429 and busy.headers["retry-after"] and "decoding" in busy.json()["error"]
        for slot in held:
            slot.__exit__(None, None, None)
        assert client.post("/v1/traces", content=_body(_stream_span("free")),
                           headers={"content-type": PROTOBUF}).status_code == 200
    queue.close()
    assert detector.registry.get_sample_value("mcp_stream_detector_ingest_requests_rejected_total",
                                              {"reason": "busy"}) == 1


def test_a_request_waits_for_a_decoding_slot_to_free_up():
    detector = Detector()
    queue = IngestQueue(detector, IngestLimits(max_decoding=1, decoding_wait_s=60))
    with TestClient(create_app(detector, queue)) as client:
        (held,) = _slots_taken(queue)
        freed = threading.Timer(0.05, held.__exit__, (None, None, None))
        freed.start()
        answer = client.post("/v1/traces", content=_body(_stream_span("turn")), headers={"content-type": PROTOBUF})
        freed.join()
        assert answer.status_code == 200
    queue.close()


def test_health_checks_and_scrapes_answer_while_more_senders_than_worker_threads_wait_for_a_decoding_slot():
    """A request waits for its decoding slot on the event loop, not on one of the worker threads that
    ``/healthz`` and ``/metrics`` run on: waiting there, a burst of senders (80 against 40 threads) held every
    thread for ``decoding_wait_s`` and a liveness probe timed out."""
    senders = 50  # Starlette's thread pool has 40
    detector = Detector()
    queue = IngestQueue(detector, IngestLimits(max_decoding=1, decoding_wait_s=60))
    waiting = threading.Semaphore(0)
    reserve = queue.reserve

    def counted(size: int, hold: object = None) -> bool:  # each sender's body is in: it waits for the slot next
        taken = reserve(size, hold)  # type: ignore[arg-type]
        waiting.release()
        return taken

    queue.reserve = counted  # type: ignore[method-assign]
    with TestClient(create_app(detector, queue)) as client:
        (held,) = _slots_taken(queue)
        posts = [threading.Thread(target=client.post, args=("/v1/traces",), daemon=True, kwargs={
                     "content": _body(_stream_span(f"w{i}")), "headers": {"content-type": PROTOBUF}})
                 for i in range(senders)]
        for post in posts:
            post.start()
        for _ in range(senders):
            assert waiting.acquire(timeout=30)
        answers: list[int] = []
        probe = threading.Thread(target=lambda: answers.extend(
            client.get(path).status_code for path in ("/healthz", "/readyz", "/metrics")), daemon=True)
        probe.start()
        probe.join(30)  # a bound on a hang, not a timing: the slot stays taken until after this
        assert answers == [200, 200, 200]
        held.__exit__(None, None, None)
        for post in posts:
            post.join(60)
    queue.close()
    assert detector.ledger.sessions == senders


def test_request_bodies_held_at_once_are_bounded_in_bytes():
    detector = Detector()
    queue = IngestQueue(detector, IngestLimits(max_buffered_bytes=1024))
    with TestClient(create_app(detector, queue)) as client:
        assert queue.reserve(1000)  # another request's body, held
        answer = client.post("/v1/traces", content=_body(_stream_span("big", **{sc.RESUME_CURSOR: "c" * 200})),
                             headers={"content-type": PROTOBUF})
        assert answer.status_code == 429 and answer.headers["retry-after"]
        queue.release(1000)
        assert client.post("/v1/traces", content=_body(_stream_span("small")),
                           headers={"content-type": PROTOBUF}).status_code == 200
    queue.close()


@pytest.mark.parametrize("grace", [0.0, 60.0])
def test_a_body_still_coming_past_its_grace_makes_way_for_a_prompt_one_when_the_bodies_held_fill_the_buffer(grace):
    """A few slow senders holding the bodies' buffer turned every sender away (429, and gRPC's UNAVAILABLE)
    for their bodies' whole timeout; now the slowest make way, answered 429 with Retry-After once the rest of their
    body is read (a 408 is final to OTLP exporters: the batch was lost). Within its grace a body keeps its room."""
    detector = Detector()
    queue = IngestQueue(detector, IngestLimits(max_buffered_bytes=1024, body_grace_s=grace))
    app = create_app(detector, queue)
    headers = [(b"content-type", PROTOBUF.encode()), (b"content-length", b"1000")]
    body = _body(_stream_span("prompt", **{sc.RESUME_CURSOR: "c" * 200}))
    assert 124 < len(body) < 1024

    async def run() -> tuple[list[dict], list[dict]]:
        rest = asyncio.Event()
        parts = [{"type": "http.request", "body": b"x" * 100, "more_body": False},
                 {"type": "http.request", "body": b"x" * 900, "more_body": True}]

        async def trickle() -> dict:
            if len(parts) == 1:
                await rest.wait()
            return parts.pop()

        async def prompt() -> dict:
            return {"type": "http.request", "body": body, "more_body": False}

        slow_answer: list[dict] = []
        prompt_answer: list[dict] = []

        async def keep(into: list[dict], message: dict) -> None:
            into.append(message)

        slow = asyncio.create_task(app({"type": "http", "method": "POST", "path": "/v1/traces", "headers": headers},
                                       trickle, lambda m: keep(slow_answer, m)))
        for _ in range(100):  # until its 900 bytes are held
            await asyncio.sleep(0)
            if queue.buffered == 900:
                break
        await app({"type": "http", "method": "POST", "path": "/v1/traces",
                   "headers": [(b"content-type", PROTOBUF.encode())]}, prompt, lambda m: keep(prompt_answer, m))
        rest.set()  # the slow sender sends the rest of its body, then reads its answer
        await asyncio.wait_for(slow, 10)
        return slow_answer, prompt_answer

    slow_answer, prompt_answer = asyncio.run(run())
    if grace:
        assert prompt_answer[0]["status"] == 429 and slow_answer[0]["status"] == 200
    else:
        assert prompt_answer[0]["status"] == 200 and slow_answer[0]["status"] == 429
        assert (b"retry-after", b"2") in slow_answer[0]["headers"]
        assert b"made way for another" in slow_answer[1]["body"]
    assert queue.reserve(1024)  # every byte reserved was released
    queue.close()


def test_a_grpc_export_makes_the_slow_http_bodies_that_fill_the_buffer_make_way():
    """Senders behind a Collector's loadbalancing exporter speak gRPC only: slow HTTP bodies held the buffer, and
    every gRPC export was UNAVAILABLE until their timeout."""
    queue = IngestQueue(Detector(), IngestLimits(max_buffered_bytes=1024, body_grace_s=0.0, body_timeout_s=30))
    limits = ConnectionLimits(max_connections=8, header_timeout_s=60, idle_timeout_s=60)
    with _bounded_server(limits, queue=queue) as port:
        grpc_server, grpc_port = serve_grpc(queue, "127.0.0.1", 0)
        slow = socket.create_connection(("127.0.0.1", port), timeout=15)
        try:
            slow.sendall(b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
                         b"Content-Length: 1000\r\n\r\n" + b"x" * 900)
            deadline = time.monotonic() + 10
            while queue.buffered < 900 and time.monotonic() < deadline:  # until its 900 bytes are held
                time.sleep(0.01)
            assert queue.buffered == 900
            with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
                export = channel.unary_unary("/opentelemetry.proto.collector.trace.v1.TraceService/Export")
                body = _body(_stream_span("grpc", **{sc.RESUME_CURSOR: "c" * 200}))
                answer = ExportTraceServiceResponse.FromString(export(body, timeout=10))
            assert answer.partial_success.rejected_spans == 0
            slow.sendall(b"x" * 100)  # the rest of its body: then its answer, retryable, on a connection kept
            assert slow.recv(4096).startswith(b"HTTP/1.1 429 ")
        finally:
            slow.close()
            grpc_server.stop(None)
    assert queue.reserve(1024)
    queue.close()


def test_the_ingest_queue_is_bounded_in_bytes_not_only_in_spans():
    detector = Detector()
    queue = IngestQueue(detector, IngestLimits(max_queued_bytes=64 * 1024))
    big = _body(*[_stream_span(f"q{i}", **{sc.RESUME_CURSOR: f"{i}" + "c" * 250}) for i in range(100)])
    with TestClient(create_app(detector, queue)) as client:
        with detector.lock:  # the worker is stuck applying: the queue fills up
            first = client.post("/v1/traces", content=big, headers={"content-type": PROTOBUF})
            second = client.post("/v1/traces", content=big, headers={"content-type": PROTOBUF})
        assert first.status_code == 200  # an empty queue takes any batch: progress is always possible
        assert second.status_code == 429 and second.headers["retry-after"]
        assert queue.wait_idle(10)
    queue.close()


@contextlib.contextmanager
def _bounded_server(limits: ConnectionLimits, registry: CollectorRegistry | None = None,
                    ingest: IngestLimits | None = None, access: Access | None = None,
                    queue: IngestQueue | None = None):
    detector = queue.detector if queue is not None else Detector()
    queue = queue or IngestQueue(detector, ingest or IngestLimits())
    server = uvicorn.Server(server_config(create_app(detector, queue, access), "127.0.0.1", 0, limits,
                                          registry or detector.registry, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.started
    try:
        yield server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(10)
        queue.close()


def _closed_by_server(sock: socket.socket) -> bool:
    """Whether the server closes it (after an answer, if any) before the socket's own timeout."""
    try:
        while sock.recv(4096):
            pass
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    return True


def test_during_a_slowloris_other_clients_are_still_served_and_the_slow_ones_make_way():
    limits = ConnectionLimits(max_connections=40, header_timeout_s=60, idle_timeout_s=60)  # no deadline here
    with _bounded_server(limits) as port:
        slow = []
        for _ in range(100):  # more than the limit, headers started and never finished
            sock = socket.create_connection(("127.0.0.1", port), timeout=15)
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            slow.append(sock)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as http:
            for _ in range(5):
                assert http.get("/healthz").status_code == 200
        closed, _, _ = select.select(slow, [], [], 1.0)  # readable: EOF, the server closed it
        assert len(slow) - len(closed) <= limits.max_connections
        for sock in slow:
            sock.close()


def _closed(registry: CollectorRegistry, reason: str) -> float:
    return registry.get_sample_value("mcp_stream_detector_http_connections_closed_total", {"reason": reason}) or 0


def test_connections_that_never_send_their_headers_are_cut_off_at_the_deadline():
    limits = ConnectionLimits(max_connections=100, header_timeout_s=1.0, idle_timeout_s=1.0)
    registry = CollectorRegistry()
    with _bounded_server(limits, registry) as port:
        slow = []
        for _ in range(30):
            sock = socket.create_connection(("127.0.0.1", port), timeout=15)
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            slow.append(sock)
        idle = [socket.create_connection(("127.0.0.1", port), timeout=15) for _ in range(10)]  # nothing sent
        kept_alive = socket.create_connection(("127.0.0.1", port), timeout=15)
        kept_alive.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")  # answered, then idle
        for sock in [*slow, *idle, kept_alive]:  # recv waits for the server to close it, up to 15 s
            assert _closed_by_server(sock)
            sock.close()
        assert _closed(registry, "header_timeout") >= 40  # the idle keep-alive one is uvicorn's own timeout


def _reading_a_body(port: int) -> socket.socket:
    """A connection whose POST the server has taken and whose body it waits for (its 100 Continue came)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=15)
    sock.sendall(b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
                 b"Expect: 100-continue\r\nContent-Length: 1000\r\n\r\n")
    assert sock.recv(4096).startswith(b"HTTP/1.1 100 ")
    sock.sendall(b"\x0a")
    return sock


def test_at_the_connection_limit_a_body_still_coming_after_its_grace_makes_way_for_a_new_client():
    registry = CollectorRegistry()
    limits = ConnectionLimits(max_connections=8, header_timeout_s=60, idle_timeout_s=60, body_grace_s=0.0)
    with _bounded_server(limits, registry) as port:
        trickling = []
        for _ in range(limits.max_connections):  # every slot: a head in, a body that never comes
            sock = _reading_a_body(port)
            trickling.append(sock)
        prompt = []
        for _ in range(3):  # new clients, each keeping its connection open once answered
            sock = socket.create_connection(("127.0.0.1", port), timeout=15)
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            assert sock.recv(4096).startswith(b"HTTP/1.1 200 ")
            prompt.append(sock)
        # the first took a trickling body's slot; the next ones the idle slot of the client before them
        select.select(trickling, [], [], 5.0)
        made_way = [sock for sock in trickling if select.select([sock], [], [], 0)[0]]
        assert len(made_way) == 1 and _answer(made_way[0]).startswith(b"HTTP/1.1 408 ")
        assert [_closed(registry, reason) for reason in ("slow_body", "idle", "slow_headers", "busy")] == [1, 2, 0, 0]
        for sock in [*trickling, *prompt]:
            sock.close()


def test_at_the_connection_limit_a_body_within_its_grace_keeps_its_slot_and_the_new_client_gets_503_to_retry():
    registry = CollectorRegistry()
    limits = ConnectionLimits(max_connections=4, header_timeout_s=60, idle_timeout_s=60, body_grace_s=60)
    with _bounded_server(limits, registry) as port:
        coming = []
        for _ in range(limits.max_connections):
            sock = _reading_a_body(port)
            coming.append(sock)
        late = socket.create_connection(("127.0.0.1", port), timeout=15)
        late.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        head, _, reason = _answer(late).partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503 ") and b"\r\nretry-after: 1" in head  # as ingest's overload answers
        assert reason.startswith(b"busy: every connection is serving a request")
        assert _closed(registry, "busy") == 1 and _closed(registry, "slow_body") == 0
        assert select.select(coming, [], [], 0.2)[0] == []  # none of them was closed
        for sock in [*coming, late]:
            sock.close()


def _answer(sock: socket.socket) -> bytes:
    """What the server sends before it closes the connection."""
    received = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(4096):
            received += chunk
    return received


def test_a_body_refused_before_it_is_read_closes_its_connection_so_its_rest_is_no_next_request():
    limits = ConnectionLimits(max_connections=10, header_timeout_s=60, idle_timeout_s=60)
    with _bounded_server(limits) as port:
        sock = socket.create_connection(("127.0.0.1", port), timeout=15)
        sock.sendall(b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
                     b"Expect: 100-continue\r\nContent-Length: 1000000000000\r\n\r\n")
        answer = _answer(sock)  # until the server closes it: a test that hangs here would be the bug
        assert answer.startswith(b"HTTP/1.1 413 ") and b"connection: close" in answer.lower()
        sock.close()


def _response(sock: socket.socket) -> tuple[bytes, bytes]:
    """One response's head and body (by its Content-Length), the connection left open."""
    received = b""
    while b"\r\n\r\n" not in received:
        received += sock.recv(65536)
    head, body = received.split(b"\r\n\r\n", 1)
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length"))
    while len(body) < length:
        body += sock.recv(65536)
    return head, body


def test_a_refused_body_is_read_and_dropped_within_bounds_so_a_sender_that_sends_it_whole_reads_the_answer():
    """Most OTLP exporters write the whole body, then read: a connection closed on bytes not read resets,
    and the refusal is lost (the exporter retries a batch that can never be taken). The rest of a refused
    body is read and dropped, up to 4 times --max-body-bytes and within the body timeout; past either, the
    answer closes the connection."""
    ingest = IngestLimits(max_body_bytes=64 * 1024, body_timeout_s=1.0)
    limits = ConnectionLimits(max_connections=10, header_timeout_s=60, idle_timeout_s=60)
    post = b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
    with _bounded_server(limits, ingest=ingest, access=Access(ingest_token=TOKEN)) as port:
        sock = socket.create_connection(("127.0.0.1", port), timeout=15)
        auth = f"Authorization: Bearer {TOKEN}\r\n".encode()
        for head, body in [
            (auth + b"Content-Length: 200000\r\n", b"\x00" * 200_000),  # declared too large
            (auth + b"Transfer-Encoding: chunked\r\n", b"".join(b"8000\r\n" + b"\x00" * 0x8000 + b"\r\n"
                                                                for _ in range(6)) + b"0\r\n\r\n"),  # found so
            (b"Content-Length: 200000\r\n", b"\x00" * 200_000),  # no token
        ]:
            sock.sendall(post + head + b"\r\n" + body)
            answer, _ = _response(sock)
            assert answer.split(b" ")[1] in (b"413", b"401") and b"connection: close" not in answer.lower()
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")  # the same connection, past each rest
        assert _response(sock)[0].startswith(b"HTTP/1.1 200 ")
        sock.close()
        for head, sent in [(b"Content-Length: 300000\r\n", 0),  # more than 4 times the limit: not read
                           (b"Content-Length: 200000\r\n", 10_000)]:  # a rest that stops coming
            sock = socket.create_connection(("127.0.0.1", port), timeout=15)
            started = time.monotonic()
            sock.sendall(post + auth + head + b"\r\n" + b"\x00" * sent)
            answer = _answer(sock)  # until the server closes it
            assert answer.startswith(b"HTTP/1.1 413 ") and b"connection: close" in answer.lower()
            assert time.monotonic() - started < ingest.body_timeout_s + 5
            sock.close()


def test_a_request_head_past_16_kib_is_refused_even_when_it_comes_in_one_read():
    limits = ConnectionLimits(max_connections=10, header_timeout_s=60, idle_timeout_s=60)
    registry = CollectorRegistry()
    with _bounded_server(limits, registry) as port:
        sock = socket.create_connection(("127.0.0.1", port), timeout=15)
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"p" * 20_000 + b"\r\n\r\n")  # one segment
        assert _answer(sock).startswith(b"HTTP/1.1 400 ")
        sock.close()
        assert _closed(registry, "bad_request") == 1


def test_a_request_head_or_trailer_that_never_ends_is_refused_past_16_kib_and_its_connection_closes():
    limits = ConnectionLimits(max_connections=10, header_timeout_s=60, idle_timeout_s=60)  # no deadline here
    registry = CollectorRegistry()
    with _bounded_server(limits, registry) as port:
        endless = socket.create_connection(("127.0.0.1", port), timeout=15)
        endless.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Endless: ")
        with contextlib.suppress(ConnectionResetError, BrokenPipeError):
            for _ in range(64):  # one header value that never ends, 1 KiB at a time: 64 KiB at most
                endless.sendall(b"v" * 1024)
                time.sleep(0.001)
        assert _answer(endless).startswith(b"HTTP/1.1 400 ")
        trailer = socket.create_connection(("127.0.0.1", port), timeout=15)  # a chunked body's endless trailer
        trailer.sendall(b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n0\r\nX-Trailer: ")
        with contextlib.suppress(ConnectionResetError, BrokenPipeError):
            for _ in range(64):
                trailer.sendall(b"v" * 1024)
                time.sleep(0.001)
        assert _answer(trailer).startswith(b"HTTP/1.1 400 ")
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as http:
            assert http.get("/healthz", headers={"x-pad": "p" * 8000}).status_code == 200
        for sock in (endless, trailer):
            sock.close()
        assert _closed(registry, "bad_request") == 2


def test_the_json_log_line_of_an_error_carries_its_cause():
    try:
        raise RuntimeError("the cause")
    except RuntimeError:
        record = logging.LogRecord("uvicorn.error", logging.ERROR, __file__, 1, "Exception in ASGI application", (),
                                   sys.exc_info())
    line = json.loads(_JsonLogs().format(record))
    assert line["message"] == "Exception in ASGI application"
    assert "RuntimeError: the cause" in line["exception"] and "Traceback" in line["exception"]


def test_otlp_grpc_senders_past_the_decoding_slots_are_answered_retryable_never_resource_exhausted():
    """gRPC's own limit of RPCs at once refuses RESOURCE_EXHAUSTED with no RetryInfo, which OTLP exporters take as
    final and drop the batch: ten senders at once (the Collector's default consumers) lost a quarter of theirs. Past
    the decoding slots, 16 senders wait their turn or are told UNAVAILABLE (retry with backoff), and any more are told
    so at once; one whose body does not fit beside the bodies held is too."""
    queue = IngestQueue(Detector(), IngestLimits(max_decoding=1, decoding_wait_s=0.2, max_buffered_bytes=64 * 1024,
                                                 max_body_bytes=64 * 1024))
    server, port = serve_grpc(queue, "127.0.0.1", 0)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            export = channel.unary_unary("/opentelemetry.proto.collector.trace.v1.TraceService/Export")
            held = _slots_taken(queue)
            sent = [export.future(_body(_stream_span(f"s{n}")), timeout=30) for n in range(24)]
            codes = [future.exception().code() for future in sent]  # type: ignore[union-attr]
            assert set(codes) == {grpc.StatusCode.UNAVAILABLE}
            for slot in held:
                slot.__exit__(None, None, None)
            assert ExportTraceServiceResponse.FromString(export(_body(_stream_span("after")))).partial_success \
                .rejected_spans == 0
            assert queue.reserve(40 * 1024)  # another request's body, held
            with pytest.raises(grpc.RpcError) as refused:
                export(_body(*[_stream_span(f"big{n}") for n in range(100)]))  # some 38 KiB: fits alone, not beside it
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            queue.release(40 * 1024)
    finally:
        server.stop(None)
        queue.close()


def _stalled(channel: grpc.Channel, never: threading.Event, metadata: list | None = None) -> grpc.Future:
    """A call that sends its headers and never its message (its request iterator waits for ever)."""

    def nothing():
        never.wait(60)
        return
        yield  # a generator that yields nothing

    path = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
    return channel.stream_unary(path).future(nothing(), timeout=60, metadata=metadata)


def test_otlp_grpc_calls_that_never_send_their_message_hold_no_decoding_thread_and_make_way_past_their_grace():
    """A thread-pool gRPC server gave each call a thread as its headers came, held until its message came: two that
    never sent theirs stopped all gRPC ingest, token or not. Now a call without the token is refused on its headers,
    one waiting for its message holds no thread, times out after the body's timeout, and at the limit of calls
    waiting makes way past its grace (UNAVAILABLE: retry)."""
    detector = Detector()
    queue = IngestQueue(detector, IngestLimits(max_decoding=1, body_timeout_s=30, body_grace_s=0.0))
    waiting = IngestLimits().max_buffered_bytes // IngestLimits().max_body_bytes  # 8: what gRPC may hold of them
    server, port = serve_grpc(queue, "127.0.0.1", 0, TOKEN)
    never = threading.Event()
    auth = [("authorization", f"Bearer {TOKEN}")]
    # a connection each (channels to one target share one unless told not to): 16 streams at most a connection
    channels = [grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)])
                for _ in range(6)]
    try:
        assert _stalled(channels[0], never).exception(10).code() == grpc.StatusCode.UNAUTHENTICATED
        stalled = [_stalled(channels[n % 5], never, auth) for n in range(waiting)]
        one_ended = threading.Event()
        for future in stalled:
            future.add_done_callback(lambda _: one_ended.set())
        export = channels[5].unary_unary("/opentelemetry.proto.collector.trace.v1.TraceService/Export")
        for n in range(3):  # the first takes the place of a stalled call; the next ones that place in turn
            answer = ExportTraceServiceResponse.FromString(export(_body(_stream_span(f"g{n}")), timeout=10,
                                                                  metadata=auth))
            assert answer.partial_success.rejected_spans == 0
        assert one_ended.wait(10)
        (made_way,) = [f for f in stalled if f.done()]
        assert made_way.exception().code() == grpc.StatusCode.UNAVAILABLE
        assert "made way" in made_way.exception().details()
    finally:
        never.set()
        for channel in channels:
            channel.close()
        server.stop(None)
        queue.close()
    assert detector.ledger.find("g2", "7") is not None


def test_otlp_grpc_call_whose_message_never_comes_ends_at_the_bodys_timeout():
    queue = IngestQueue(Detector(), IngestLimits(body_timeout_s=0.3))
    server, port = serve_grpc(queue, "127.0.0.1", 0)
    never = threading.Event()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            refused = _stalled(channel, never).exception(10)
            assert refused.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "not received within" in refused.details()
    finally:
        never.set()
        server.stop(None)
        queue.close()


def test_otlp_grpc_decodes_as_http_does_bounded_and_span_by_span():
    detector = Detector()
    queue = IngestQueue(detector, IngestLimits(max_spans_per_request=10, max_decoding=1, decoding_wait_s=0.05))
    server, port = serve_grpc(queue, "127.0.0.1", 0, TOKEN)
    auth = [("authorization", f"bEaReR {TOKEN}")]
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            export = channel.unary_unary("/opentelemetry.proto.collector.trace.v1.TraceService/Export")
            with pytest.raises(grpc.RpcError) as refused:
                export(b"\x0a\x02\x12\x00" + b"\x12\x00" * 5, metadata=[("authorization", "Bearer wrong")])
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as refused:  # 11 empty spans: refused before any is decoded
                export(ExportTraceServiceRequest.FromString(_body(*[OtlpSpan()] * 11)).SerializeToString(),
                       metadata=auth)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "more than 10 spans" in refused.value.details()
            (held,) = _slots_taken(queue)
            with pytest.raises(grpc.RpcError) as refused:
                export(_body(_stream_span("busy")), metadata=auth)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE  # retryable
            held.__exit__(None, None, None)
            answer = ExportTraceServiceResponse.FromString(export(_body(_stream_span("grpc")), metadata=auth))
            assert answer.partial_success.rejected_spans == 0
        assert queue.wait_idle(10)
    finally:
        server.stop(None)
        queue.close()
    assert detector.ledger.find("grpc", "7") is not None
