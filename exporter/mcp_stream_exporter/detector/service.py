"""``mcp-stream-exporter serve``: the standalone detector, configured by flags, environment and a file.

Precedence: a flag beats ``MCP_STREAM_<NAME>`` in the environment, which beats the TOML file
(``--config``), which beats the defaults. Logs are JSON lines on stderr. SIGTERM stops taking
traffic, lets in-flight requests finish, applies every batch already accepted, then exits.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import uvicorn

from mcp_stream_exporter.auth import ToolPolicy
from mcp_stream_exporter.detector.app import Access, create_app
from mcp_stream_exporter.detector.connections import ConnectionLimits, server_config
from mcp_stream_exporter.detector.detector import Detector, DetectorConfig
from mcp_stream_exporter.detector.ingest import IngestLimits, IngestQueue, serve_grpc
from mcp_stream_exporter.detector.ledger import LedgerLimits
from mcp_stream_exporter.detector.rules import RuleConfig
from mcp_stream_exporter.detector.snapshot import SnapshotLocked, Snapshots
from mcp_stream_exporter.detector.ui import RUNBOOK_BASE_URL, UiLinks

ENV_PREFIX = "MCP_STREAM_"
log = logging.getLogger("mcp_stream_exporter.detector")


@dataclass(slots=True)
class ServiceConfig:
    host: str = "127.0.0.1"
    port: int = 9464  # HTTP: OTLP/HTTP /v1/traces, /metrics, /api
    grpc_port: int = 4317  # OTLP/gRPC; 0 picks a free port, -1 disables it
    policy: str | None = None  # a ToolPolicy file: its tools are the tool label values
    ingest_token: str | None = None
    api_token: str | None = None
    metrics_user: str | None = None
    metrics_password: str | None = None
    tls_cert: str | None = None  # PEM files; both set: HTTPS and gRPC over TLS
    tls_key: str | None = None
    clean_end_grace_s: float = 30.0
    reissue_grace_s: float = 30.0
    resume_loop_count: int = 5
    resume_loop_window_s: float = 60.0
    max_sessions: int = 20_000
    max_calls_per_session: int = 1_000
    session_ttl_s: float = 3600.0
    max_findings: int = 10_000
    # the detector's state in MiB: 3/4 ledger, 1/8 findings, 1/8 ingest queue; the default leaves the
    # Helm chart's 512 MiB limit room for the runtime (~100 MiB) and decoding (bodies, 2 slots)
    max_memory_mb: int = 256
    max_body_bytes: int = 4 * 1024 * 1024
    max_decompressed_bytes: int = 16 * 1024 * 1024
    max_spans_per_request: int = 10_000
    max_queued_spans: int = 200_000
    max_span_bytes: int = 256 * 1024  # one encoded span: bounds what decoding it costs
    max_json_values: int = 200_000  # values in one OTLP/JSON body, counted before parsing
    max_decoding: int = 2  # requests decoded at once; the others wait up to decoding_wait_s, then 429
    decoding_wait_s: float = 5.0
    max_buffered_bytes: int = 32 * 1024 * 1024  # request bodies held at once
    body_timeout_s: float = 30.0  # to receive a body; then 408
    max_connections: int = 256  # HTTP connections at once; beyond, 503 and closed
    header_timeout_s: float = 10.0  # to send a request's headers; then the connection is closed
    idle_timeout_s: float = 30.0  # an idle keep-alive connection (HTTP and gRPC) is closed
    snapshot_path: str | None = None  # SQLite file: the ledger survives restarts
    snapshot_interval_s: float = 30.0  # a SIGKILL loses at most this much
    log_level: str = "info"
    trace_url_template: str | None = None  # the findings page's trace links, e.g. https://tempo/trace/{trace_id}
    runbook_base_url: str | None = None  # the findings page's runbook links (default: the project's docs)

    def detector_config(self) -> DetectorConfig:
        tools = tuple(ToolPolicy.from_file(self.policy).tools) if self.policy else ()
        return DetectorConfig(
            rules=RuleConfig(self.clean_end_grace_s, self.reissue_grace_s, self.resume_loop_count,
                             self.resume_loop_window_s),
            ledger=LedgerLimits(self.max_sessions, self.max_calls_per_session, self.session_ttl_s,
                                max_bytes=self._budget_bytes(5 / 8)),
            max_findings=self.max_findings, max_findings_bytes=self._budget_bytes(1 / 8),
            max_timelines_bytes=self._budget_bytes(1 / 8), tools=tools)

    def _budget_bytes(self, share: float) -> int:
        return int(self.max_memory_mb * 1024 * 1024 * share)

    def ingest_limits(self) -> IngestLimits:
        return IngestLimits(self.max_body_bytes, self.max_decompressed_bytes, self.max_spans_per_request,
                            self.max_queued_spans, max_queued_bytes=self._budget_bytes(1 / 8),
                            max_span_bytes=self.max_span_bytes,
                            max_json_values=self.max_json_values, max_decoding=self.max_decoding,
                            decoding_wait_s=self.decoding_wait_s, max_buffered_bytes=self.max_buffered_bytes,
                            body_timeout_s=self.body_timeout_s)

    def connection_limits(self) -> ConnectionLimits:
        return ConnectionLimits(self.max_connections, self.header_timeout_s, self.idle_timeout_s)

    def links(self) -> UiLinks:
        return UiLinks(self.trace_url_template, self.runbook_base_url or RUNBOOK_BASE_URL)

    def access(self) -> Access:
        basic = (self.metrics_user, self.metrics_password) if self.metrics_user and self.metrics_password else None
        return Access(self.ingest_token, self.api_token, basic)


def _coerce(name: str, raw: Any, kind: type) -> Any:
    try:
        return kind(raw)
    except (TypeError, ValueError):
        raise SystemExit(f"configuration: {name} must be {kind.__name__}, got {raw!r}") from None


def load_config(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> ServiceConfig:
    environ = os.environ if environ is None else environ
    parser = argparse.ArgumentParser(prog="mcp-stream-exporter serve", description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="a TOML file with any of the settings below")
    kinds = {"int": int, "float": float}
    types = {f.name: kinds.get(str(f.type), str) for f in fields(ServiceConfig)}
    for f in fields(ServiceConfig):
        parser.add_argument(f"--{f.name.replace('_', '-')}", dest=f.name, default=None,
                            help=f"env {ENV_PREFIX}{f.name.upper()} (default {f.default!r})")
    args = parser.parse_args(argv)
    config = ServiceConfig()
    layers: list[Mapping[str, Any]] = []
    path = args.config or environ.get(f"{ENV_PREFIX}CONFIG")
    if path:
        with Path(path).open("rb") as fh:
            data = tomllib.load(fh)
        unknown = set(data) - set(types)
        if unknown:
            raise SystemExit(f"configuration: unknown settings in {path}: {sorted(unknown)}")
        layers.append(data)
    layers.append({n: environ[f"{ENV_PREFIX}{n.upper()}"] for n in types if f"{ENV_PREFIX}{n.upper()}" in environ})
    layers.append({n: v for n, v in vars(args).items() if n in types and v is not None})
    for layer in layers:
        for name, raw in layer.items():
            setattr(config, name, _coerce(name, raw, types[name]) if raw is not None else None)
    return config


class _JsonLogs(logging.Formatter):
    _STANDARD = frozenset(vars(logging.makeLogRecord({})))

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {"time": self.formatTime(record), "level": record.levelname.lower(),
                                 "logger": record.name, "message": record.getMessage()}
        entry.update({k: v for k, v in vars(record).items() if k not in self._STANDARD and k != "message"})
        if record.exc_info:  # the cause of an error (uvicorn logs every 500's exception this way)
            entry["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry, default=str)


def _configure_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonLogs())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def run(config: ServiceConfig) -> int:
    _configure_logging(config.log_level)
    detector = Detector(config.detector_config())
    snapshots = None
    if config.snapshot_path:
        snapshots = Snapshots(detector, config.snapshot_path, config.snapshot_interval_s)
        try:
            snapshots.restore()
        except SnapshotLocked as exc:
            log.error("snapshot refused", extra={"error": str(exc)})
            return 1
        snapshots.start()
    queue = IngestQueue(detector, config.ingest_limits())
    tls: tuple[bytes, bytes] | None = None
    if config.tls_cert and config.tls_key:
        tls = (Path(config.tls_key).read_bytes(), Path(config.tls_cert).read_bytes())
    grpc_server = None
    if config.grpc_port >= 0:
        grpc_server, grpc_port = serve_grpc(queue, config.host, config.grpc_port, config.ingest_token, tls,
                                            config.connection_limits())
        log.info("otlp grpc listening", extra={"host": config.host, "port": grpc_port})
    app = create_app(detector, queue, config.access(), config.links())
    server = uvicorn.Server(server_config(app, config.host, config.port, config.connection_limits(),
                                          log_config=None, access_log=False, ssl_certfile=config.tls_cert,
                                          ssl_keyfile=config.tls_key, timeout_graceful_shutdown=10))
    listener = server.config.bind_socket()  # bound here so that the log says the port: --port=0 picks one
    log.info("detector starting", extra={"host": config.host, "port": listener.getsockname()[1],
                                         "tools": list(detector.config.tools)})
    # uvicorn handles SIGTERM/SIGINT (stops listening, finishes in-flight requests), then re-raises the
    # signal to the handler it found: make that one a no-op so the drain below still runs.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: None)
    server.run(sockets=[listener])
    if grpc_server is not None:
        grpc_server.stop(grace=5).wait()
    queue.close()  # drain what was accepted before exiting
    if snapshots is not None:
        snapshots.close()  # after the drain: the final snapshot holds every accepted span
    log.info("detector stopped", extra={"findings": len(detector.findings)})
    return 0


def main(argv: Sequence[str]) -> int:
    return run(load_config(argv))
