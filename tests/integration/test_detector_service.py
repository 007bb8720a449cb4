"""The detector service over real loopback: OTLP/HTTP from the real OpenTelemetry exporter, OTLP/gRPC,
the limits and their answers, the findings API, /metrics, and the `serve` command itself."""

from __future__ import annotations

import asyncio
import gzip
import ipaddress
import json
import os
import re
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import grpc
import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from google.protobuf import json_format
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from promtool import promtool

from mcp_stream_exporter import semconv as sc
from mcp_stream_exporter.detector import Detector, DetectorConfig, RuleConfig
from mcp_stream_exporter.detector.app import Access, create_app
from mcp_stream_exporter.detector.grpc_receiver import serve_grpc
from mcp_stream_exporter.detector.ingest import IngestLimits, IngestQueue
from mcp_stream_exporter.lab import serve

from harness import Clock, answers, detector, detector_process, incident, logged, wait_for

pytestmark = pytest.mark.anyio
TOKEN = "ingest-token-for-tests"


def _request(*attrs: tuple[str, object]) -> trace_service_pb2.ExportTraceServiceRequest:
    """One span of the model (a resume stream ending clean with a call pending), plus ``attrs``."""
    doc = {"resourceSpans": [{"resource": {"attributes": [{"key": "service.name", "value": {"stringValue": "t"}}]},
                              "scopeSpans": [{"spans": [_span(dict(attrs))]}]}]}
    return json_format.ParseDict(_b64(doc), trace_service_pb2.ExportTraceServiceRequest())


def _span(extra: dict[str, object]) -> dict:
    values = {sc.SPAN: "stream", sc.ROLE: "client", sc.STREAM_KIND: "resume", sc.END_REASON: "clean",
              sc.MCP_SESSION_ID: "s1", sc.RESUME_CURSOR: "6", **extra}
    attrs = []
    for k, v in values.items():
        attrs.append({"key": k, "value": {"arrayValue": {"values": [{"stringValue": x} for x in v]}}
                      if isinstance(v, list) else {"stringValue": v}})
    return {"traceId": "5b8efff798038103d269b633813fc60c", "spanId": "eee19b7ec3c1b174", "name": "MCP stream resume",
            "kind": 3, "startTimeUnixNano": str(time.time_ns()), "endTimeUnixNano": str(time.time_ns() + 1000),
            "attributes": attrs}


def _b64(doc: dict) -> dict:
    import base64
    span = doc["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    for key in ("traceId", "spanId"):
        span[key] = base64.b64encode(bytes.fromhex(span[key])).decode()
    return doc


class Service:
    def __init__(self, limits: IngestLimits | None = None, access: Access | None = None) -> None:
        self.clock = Clock()
        self.detector = Detector(DetectorConfig(rules=RuleConfig(clean_end_grace_s=5)), clock=self.clock)
        self.queue = IngestQueue(self.detector, limits or IngestLimits())
        self.app = create_app(self.detector, self.queue, access)

    def drain(self) -> None:
        for _ in range(500):
            if self.queue.queued == 0:
                return
            time.sleep(0.01)
        raise AssertionError("the ingest queue did not drain")


async def test_the_incident_over_otlp_http_from_the_real_exporter_reaches_the_findings_api():
    svc = Service()
    async with serve(svc.app) as port:
        exporter = BatchSpanProcessor(OTLPSpanExporter(endpoint=f"http://127.0.0.1:{port}/v1/traces"),
                                      schedule_delay_millis=100)
        with detector(processor=exporter):
            async with incident("legacy") as lab:
                lab.proxy.arm(b"fetch step 1", on_cut=lab.refresh_narrows)
                await asyncio.gather(lab.call("search", {"query": "q", "steps": 4}),
                                     lab.call("fetch", {"url": "u", "steps": 4}, timeout=2.5),
                                     return_exceptions=True)
            await asyncio.to_thread(exporter.force_flush)
        await asyncio.to_thread(svc.drain)
        svc.clock.advance(6)
        svc.detector.tick()
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
            page = (await http.get("/api/findings", params={"rule": "clean_end_pending", "tool": "fetch"})).json()
            assert page["total"] == 1
            one = (await http.get(f"/api/findings/{page['findings'][0]['id']}")).json()
            assert one["rule"] == "clean_end_pending" and one["session_id"] and one["trace_ids"]
            narrowed = (await http.get("/api/findings", params={"rule": "narrowed_resume"})).json()["findings"]
            assert narrowed[0]["evidence"]["missing_resources"] == ["https://mcp.example.com/tools/fetch"]
            assert (await http.get("/api/findings", params={"rule": "nonsense"})).status_code == 400
            assert (await http.get("/api/findings/nope")).status_code == 404
            paged = (await http.get("/api/findings", params={"limit": 2, "offset": 1})).json()
            assert len(paged["findings"]) == 2 and paged["total"] >= 4
            metrics = (await http.get("/metrics", headers={"Accept": "application/openmetrics-text"})).text
    assert 'mcp_stream_silent_losses_total{rule="clean_end_pending",tool="fetch"} 1.0 # {trace_id="' in metrics


async def test_otlp_http_takes_protobuf_json_and_gzip_and_answers_partial_success_for_broken_spans():
    svc = Service()
    good = _request((sc.PENDING_REQUEST_IDS, ["3"]))
    broken = _request((sc.ROLE, "martian"))
    async with serve(svc.app) as port, httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
        r = await http.post("/v1/traces", content=good.SerializeToString(),
                            headers={"Content-Type": "application/x-protobuf"})
        assert r.status_code == 200
        assert not trace_service_pb2.ExportTraceServiceResponse.FromString(r.content).HasField("partial_success")
        body = json_format.MessageToJson(broken)
        doc = json.loads(body)
        span = doc["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
        span["traceId"], span["spanId"] = "5b8efff798038103d269b633813fc60c", "eee19b7ec3c1b174"  # OTLP/JSON: hex
        r = await http.post("/v1/traces", content=gzip.compress(json.dumps(doc).encode()),
                            headers={"Content-Type": "application/json", "Content-Encoding": "gzip"})
        assert r.status_code == 200
        assert r.json()["partialSuccess"]["rejectedSpans"] == "1"
        assert "mcp_stream.role must be client or server" in r.json()["partialSuccess"]["errorMessage"]
        # ids in base64 (protobuf's generic JSON mapping), not hex: that span alone is refused, not its batch
        doc = json.loads(json_format.MessageToJson(_request((sc.PENDING_REQUEST_IDS, ["4"]))))
        spans = doc["resourceSpans"][0]["scopeSpans"][0]["spans"]
        spans.append({**spans[0], "traceId": "5b8efff798038103d269b633813fc60d", "spanId": "eee19b7ec3c1b175"})
        r = await http.post("/v1/traces", json=doc)
        assert r.status_code == 200
        assert r.json()["partialSuccess"]["rejectedSpans"] == "1"
        assert "trace or span id not of 16 or 8 bytes" in r.json()["partialSuccess"]["errorMessage"]
        await asyncio.to_thread(svc.drain)
    assert svc.detector.ledger.calls == 2  # "3", and "4" beside the span of base64 ids


async def test_otlp_http_limits_answer_clearly_and_the_service_keeps_serving():
    limits = IngestLimits(max_body_bytes=64 * 1024, max_decompressed_bytes=256 * 1024, max_spans_per_request=2,
                          max_queued_spans=1)
    svc = Service(limits, Access(ingest_token=TOKEN))
    auth = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/x-protobuf"}
    body = _request((sc.PENDING_REQUEST_IDS, ["3"])).SerializeToString()
    async with serve(svc.app) as port, httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
        assert (await http.post("/v1/traces", content=body)).status_code == 401
        assert (await http.post("/v1/traces", content=b"\x00" * 70_000, headers=auth)).status_code == 413
        bomb = gzip.compress(b"\x00" * 10_000_000)
        r = await http.post("/v1/traces", content=bomb, headers={**auth, "Content-Encoding": "gzip"})
        assert r.status_code == 413 and "decompressed" in r.json()["error"]
        assert (await http.post("/v1/traces", content=b"\xff\xfe garbage", headers=auth)).status_code == 400
        r = await http.post("/v1/traces", content=body, headers={**auth, "Content-Type": "text/plain"})
        assert r.status_code == 415
        many = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
        spans = many.resource_spans[0].scope_spans[0].spans
        spans.extend([spans[0], spans[0]])
        assert (await http.post("/v1/traces", content=many.SerializeToString(), headers=auth)).status_code == 413
        with svc.detector.lock:  # the worker is stuck applying: the queue fills up
            assert (await http.post("/v1/traces", content=body, headers=auth)).status_code == 200
            r = await http.post("/v1/traces", content=body, headers=auth)
            assert r.status_code == 429 and r.headers["Retry-After"] == "2"
        await asyncio.to_thread(svc.drain)
        assert (await http.post("/v1/traces", content=body, headers=auth)).status_code == 200
        assert (await http.get("/healthz")).status_code == 200
        assert (await http.get("/readyz")).status_code == 200
    rejected = {r: svc.detector.registry.get_sample_value("mcp_stream_detector_ingest_requests_rejected_total",
                                                           {"reason": r})
                for r in ("unauthorized", "too_large", "malformed", "bad_encoding", "too_many_spans", "queue_full")}
    assert rejected == {"unauthorized": 1, "too_large": 2, "malformed": 1, "bad_encoding": 1, "too_many_spans": 1,
                        "queue_full": 1}


def test_otlp_grpc_takes_spans_and_refuses_without_the_token():
    svc = Service(access=Access(ingest_token=TOKEN))
    server, port = serve_grpc(svc.queue, "127.0.0.1", 0, TOKEN)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = trace_service_pb2_grpc.TraceServiceStub(channel)
            request = _request((sc.PENDING_REQUEST_IDS, ["3"]))
            request.resource_spans[0].scope_spans[0].spans.append(_request((sc.ROLE, "martian"))
                                                                   .resource_spans[0].scope_spans[0].spans[0])
            with pytest.raises(grpc.RpcError) as refused:
                stub.Export(request)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            answer = stub.Export(request, metadata=[("authorization", f"Bearer {TOKEN}")])
            assert answer.partial_success.rejected_spans == 1
        svc.drain()
    finally:
        server.stop(None)
    assert svc.detector.ledger.calls == 1
    assert svc.detector.registry.get_sample_value("mcp_stream_detector_spans_received_total",
                                                  {"transport": "otlp_grpc"}) == 2


async def test_metrics_pass_promtool_and_can_require_basic_auth():
    svc = Service(access=Access(metrics_basic_auth=("prom", "secret")))
    svc.detector.consume([])
    async with serve(svc.app) as port, httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
        assert (await http.get("/metrics")).status_code == 401
        text = (await http.get("/metrics", auth=("prom", "secret"))).text
    check = promtool("check", "metrics", stdin=text)
    assert check.returncode == 0, check.stdout + check.stderr


def test_serve_reads_flags_env_and_file_and_shuts_down_gracefully(tmp_path):
    config = tmp_path / "detector.toml"
    config.write_text('port = 0\ngrpc_port = -1\notlp_http_port = -1\nclean_end_grace_s = 2.5\n')  # 0: picks a port
    env = {**os.environ, "MCP_STREAM_API_TOKEN": "api-secret"}
    logs = tmp_path / "serve.log"
    with logs.open("a") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "mcp_stream_exporter.cli", "serve", "--config", str(config),
                                 "--log-level", "info"], env=env, stderr=sink, text=True)
    try:
        started = wait_for(lambda: logged(logs, "detector starting"), 10, "the service to bind its port",
                           every_s=0.05)
        url = f"http://127.0.0.1:{started['port']}"
        wait_for(lambda: answers(f"{url}/readyz"), 10, "the service to be ready", every_s=0.05)
        for api in ("/api/findings", "/api/calls/stuck"):
            assert httpx.get(f"{url}{api}").status_code == 401
            ok = httpx.get(f"{url}{api}", headers={"Authorization": "Bearer api-secret"})
            assert ok.status_code == 200
        assert ok.json() == {"total": 0, "limit": 50, "calls": []}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        proc.kill()
    assert logged(logs, "otlp grpc listening") is None  # the file's grpc_port = -1 over the default 4317
    entries = [json.loads(line) for line in logs.read_text().splitlines() if line.startswith("{")]
    assert any(entry["message"] == "detector stopped" for entry in entries)
    assert all("api-secret" not in json.dumps(entry) for entry in entries)
    # every line machine-readable: ISO 8601 UTC times, no terminal colours (uvicorn's lines included)
    assert any(entry["logger"].startswith("uvicorn") for entry in entries)
    assert all(re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", entry["time"]) for entry in entries)
    assert all("\x1b" not in json.dumps(entry, ensure_ascii=False) for entry in entries)


def test_otlp_http_is_also_served_on_the_otlp_port_with_nothing_else_there():
    body = _request().SerializeToString()
    with detector_process("--otlp-http-port=0", env={"MCP_STREAM_INGEST_TOKEN": TOKEN}) as service:
        assert service.otlp_http_port not in (None, service.port)
        otlp = httpx.Client(base_url=f"http://127.0.0.1:{service.otlp_http_port}", timeout=30)
        with otlp:
            sent = {"content-type": "application/x-protobuf"}
            assert otlp.post("/v1/traces", content=body, headers=sent).status_code == 401
            ok = otlp.post("/v1/traces", content=body, headers=sent | {"authorization": f"Bearer {TOKEN}"})
            assert ok.status_code == 200
            for path in ("/metrics", "/api/findings", "/ui/", "/healthz"):  # those stay on --port
                assert otlp.get(path).status_code == 404, path
        assert 'mcp_stream_detector_spans_received_total{transport="otlp_http"} 1.0' in service.metrics()


def _self_signed(tmp_path):
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.now(UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - timedelta(minutes=1))
            .not_valid_after(now + timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    (tmp_path / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tmp_path / "key.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                         serialization.PrivateFormat.PKCS8,
                                                         serialization.NoEncryption()))
    return str(tmp_path / "cert.pem"), str(tmp_path / "key.pem")


def test_tls_on_http_and_grpc_with_the_ingest_token(tmp_path):
    cert, key = _self_signed(tmp_path)
    request = trace_service_pb2.ExportTraceServiceRequest()
    with detector_process(f"--tls-cert={cert}", f"--tls-key={key}", "--grpc-port=0",
                          env={"MCP_STREAM_INGEST_TOKEN": "ingest-secret"}) as service:
        assert service.url.startswith("https://")
        assert service.post(request.SerializeToString()).status_code == 401
        assert service.post(request.SerializeToString(), token="ingest-secret").status_code == 200
        with pytest.raises(httpx.TransportError):  # no plain HTTP beside TLS
            httpx.get(f"http://127.0.0.1:{service.port}/healthz", timeout=5)
        credentials = grpc.ssl_channel_credentials(root_certificates=Path(cert).read_bytes())
        with grpc.secure_channel(f"127.0.0.1:{service.grpc_port}", credentials) as channel:
            export = trace_service_pb2_grpc.TraceServiceStub(channel).Export
            export(request, metadata=[("authorization", "Bearer ingest-secret")], timeout=10)
            with pytest.raises(grpc.RpcError) as refused:
                export(request, timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
