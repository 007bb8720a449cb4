"""Real servers on 127.0.0.1 for the integration tests, and span look-ups by the span model."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import DEFAULT_ON, Sampler, SamplingResult

from mcp_stream_exporter import lab
from mcp_stream_exporter import semconv as sc
from mcp_stream_exporter.detector import Detector, DetectorConfig, Finding, RuleConfig
from mcp_stream_exporter.detector.embedded import DetectorSpanProcessor
from mcp_stream_exporter.lab import Incident

_EXPORTER: InMemorySpanExporter | None = None
_DETECTORS: list[SpanProcessor] = []  # the current test's detectors, fed from the global provider
TOKENS_USED: list[str] = []  # every bearer a scenario minted; conftest checks none leaked
DETECTORS_USED: list[Detector] = []  # every detector a scenario fed; conftest checks their outputs too


class ApplicationSampler(Sampler):
    """The application's sampler on the global provider (made once per run), which a test may set:
    the SDK's own spans are sampled by it, as in production."""

    def __init__(self) -> None:
        self.current: Sampler = DEFAULT_ON

    def should_sample(self, *args: Any, **kwargs: Any) -> SamplingResult:
        return self.current.should_sample(*args, **kwargs)

    def get_description(self) -> str:
        return self.current.get_description()


SAMPLER = ApplicationSampler()


@contextlib.contextmanager
def sampled_by(sampler: Sampler) -> Iterator[None]:
    """Run the scenarios inside with the application's tracer provider sampling by ``sampler``."""
    span_exporter()
    SAMPLER.current = sampler
    try:
        yield
    finally:
        SAMPLER.current = DEFAULT_ON


def span_exporter() -> InMemorySpanExporter:
    """One global provider for the whole run (OTel allows one), so the SDK's own spans are real too."""
    global _EXPORTER
    if _EXPORTER is None:
        _EXPORTER = InMemorySpanExporter()
        provider = TracerProvider(sampler=SAMPLER)
        provider.add_span_processor(SimpleSpanProcessor(_EXPORTER))
        provider.add_span_processor(_Forward())
        trace.set_tracer_provider(provider)
    return _EXPORTER


class _Forward(SpanProcessor):
    def on_end(self, span: ReadableSpan) -> None:
        for processor in list(_DETECTORS):
            processor.on_end(span)


class Clock:
    """Real time plus an offset a test moves forward: grace periods pass without sleeping."""

    def __init__(self) -> None:
        self.offset_ns = 0

    def __call__(self) -> int:
        return time.time_ns() + self.offset_ns

    def advance(self, seconds: float) -> None:
        self.offset_ns += int(seconds * 1e9)


@contextlib.contextmanager
def detector(grace_s: float = 5.0, processor: SpanProcessor | None = None,
             tools: tuple[str, ...] = ()) -> Iterator[tuple[Detector, Clock]]:
    """A fresh detector fed every span of the scenarios run inside (or ``processor``, e.g. an OTLP exporter);
    ``tools`` is the policy's tools, the tool label's values."""
    span_exporter()
    clock = Clock()
    found = Detector(DetectorConfig(rules=RuleConfig(clean_end_grace_s=grace_s, reissue_grace_s=grace_s),
                                    tools=tools), clock=clock)
    DETECTORS_USED.append(found)
    feed = processor or DetectorSpanProcessor(found)
    _DETECTORS.append(feed)
    try:
        yield found, clock
    finally:
        _DETECTORS.remove(feed)


def after_grace(found: Detector, clock: Clock, grace_s: float = 5.0) -> list[Finding]:
    clock.advance(grace_s + 1)
    found.tick()
    return list(found.findings)


def ours(spans: Sequence[ReadableSpan], kind: str, role: str | None = None, **attrs: Any) -> list[ReadableSpan]:
    """Spans of the span model of one kind (stream, call, replay), filtered by role and attributes."""
    out = []
    for s in spans:
        a = s.attributes or {}
        if a.get(sc.SPAN) != kind or (role is not None and a.get(sc.ROLE) != role):
            continue
        if all(a.get(k.replace("__", ".")) == v for k, v in attrs.items()):
            out.append(s)
    return out


@contextlib.asynccontextmanager
async def incident(mode: str | None = "legacy", **options: Any) -> AsyncIterator[Incident]:
    """The lab incident with spans going to the in-memory exporter, cleared first."""
    span_exporter().clear()
    async with lab.incident(mode, **options) as scenario:
        TOKENS_USED.extend((scenario.broad, scenario.narrow))
        yield scenario


async def play_incident(lab: Incident, fetch_timeout: float = 2.5) -> list[Any]:
    """search and fetch at once; the drop after fetch's first progress event, the narrowing refresh, the
    resume. Returns both outcomes, exceptions included."""
    lab.proxy.arm(b"fetch step 1", on_cut=lab.refresh_narrows)
    return await asyncio.gather(lab.call("search", {"query": "q", "steps": 4}),
                                lab.call("fetch", {"url": "u", "steps": 4}, timeout=fetch_timeout),
                                return_exceptions=True)


def wait_for(condition: Callable[[], Any], timeout_s: float, what: str, every_s: float = 0.25) -> Any:
    """Poll ``condition`` until it returns something truthy; bounded in time."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(every_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def answers(url: str, client: httpx.Client | None = None) -> bool:
    """True when ``url`` answers 200: a server's readiness, polled with :func:`wait_for`."""
    try:
        return (client or httpx).get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def logged(path: Path, message: str) -> dict[str, Any] | None:
    """The first JSON log line of the service with ``message`` in the log file at ``path``, if written yet.
    The service appends to the file; this reads it through its own handle, so no offset is shared."""
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):  # a line still being written
            entry = json.loads(line)
            if isinstance(entry, dict) and entry.get("message") == message:
                return entry
    return None


def spans() -> list[ReadableSpan]:
    return list(span_exporter().get_finished_spans())


class DetectorProcess:
    """``mcp-stream-exporter serve`` in a subprocess on 127.0.0.1: the real service, as deployed."""

    def __init__(self, proc: subprocess.Popen[str], port: int, grpc_port: int | None, ca: str | None = None,
                 otlp_http_port: int | None = None) -> None:
        self.proc = proc
        self.port = port
        self.grpc_port = grpc_port
        self.otlp_http_port = otlp_http_port
        self.url = f"{'https' if ca else 'http'}://127.0.0.1:{port}"
        self.http = httpx.Client(base_url=self.url, timeout=30,
                                 verify=ssl.create_default_context(cafile=ca) if ca else True)

    def post(self, body: bytes, token: str | None = None) -> httpx.Response:
        headers = {"content-type": "application/x-protobuf"} | ({"authorization": f"Bearer {token}"} if token else {})
        return self.http.post("/v1/traces", content=body, headers=headers)

    def findings(self) -> list[dict[str, Any]]:
        return list(self.http.get("/api/findings", params={"limit": 500}).json()["findings"])

    def metrics(self) -> str:
        return self.http.get("/metrics").text


@contextlib.contextmanager
def detector_process(*flags: str, env: dict[str, str] | None = None) -> Iterator[DetectorProcess]:
    """Start the service with ``flags`` (gRPC and the OTLP/HTTP port off unless a flag says otherwise) on
    ports it picks itself (port 0), read the ports back from its log, and wait until ready. Its logs go to
    a file (a pipe nobody reads would fill and block the service)."""
    ca = next((f.split("=", 1)[1] for f in flags if f.startswith("--tls-cert=")), None)
    with tempfile.TemporaryDirectory() as workdir:
        logs = Path(workdir) / "detector.log"
        with logs.open("a") as sink:
            proc = subprocess.Popen([sys.executable, "-m", "mcp_stream_exporter.cli", "serve", "--port=0",
                                     "--grpc-port=-1", "--otlp-http-port=-1", *flags],
                                    env={**os.environ, **(env or {})}, stdout=subprocess.DEVNULL, stderr=sink,
                                    text=True)
        service = None
        try:
            started = wait_for(lambda: proc.poll() is not None or logged(logs, "detector starting"), 30,
                               "the detector to bind its port", every_s=0.05)
            if proc.poll() is not None:
                raise RuntimeError(f"the detector did not start: {logs.read_text()[-2000:]}")
            grpc, otlp_http = logged(logs, "otlp grpc listening"), logged(logs, "otlp http listening")
            service = DetectorProcess(proc, int(started["port"]), int(grpc["port"]) if grpc else None, ca,
                                      int(otlp_http["port"]) if otlp_http else None)
            wait_for(lambda: proc.poll() is not None or answers(f"{service.url}/readyz", service.http), 30,
                     "the detector to be ready", every_s=0.05)
            if proc.poll() is not None:
                raise RuntimeError(f"the detector stopped: {logs.read_text()[-2000:]}")
            yield service
        finally:
            if service is not None:
                service.http.close()
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
