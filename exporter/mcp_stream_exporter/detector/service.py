"""``mcp-stream-exporter serve``: the standalone detector, configured by flags, environment and a file.

Precedence: a flag beats ``MCP_STREAM_<NAME>`` in the environment, which beats the TOML file
(``--config``), which beats the defaults (``settings.py``). Logs are JSON lines on stderr. SIGTERM stops
taking traffic, lets in-flight requests finish, applies every batch already accepted, then exits.
"""

from __future__ import annotations

import json
import logging
import re
import signal
import socket
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import uvicorn

from mcp_stream_exporter.asgi import ASGIApp, Receive, Scope, Send
from mcp_stream_exporter.detector.app import create_app
from mcp_stream_exporter.detector.connections import server_config
from mcp_stream_exporter.detector.detector import Detector
from mcp_stream_exporter.detector.grpc_receiver import serve_grpc
from mcp_stream_exporter.detector.ingest import IngestQueue
from mcp_stream_exporter.detector.settings import PROG, ConfigError, ServiceConfig, effective, load
from mcp_stream_exporter.detector.snapshot import SnapshotLocked, Snapshots
from mcp_stream_exporter.semconv import INSTRUMENTATION_VERSION

log = logging.getLogger("mcp_stream_exporter.detector")


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


class _JsonLogs(logging.Formatter):
    """One JSON object a line: ``time`` in ISO 8601 UTC, no terminal colours (uvicorn's ``color_message``)."""

    _STANDARD = frozenset(vars(logging.makeLogRecord({}))) | {"message", "color_message"}

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        stamp = datetime.fromtimestamp(record.created, UTC)
        return stamp.strftime("%Y-%m-%dT%H:%M:%S.") + f"{stamp.microsecond // 1000:03d}Z"

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {"time": self.formatTime(record), "level": record.levelname.lower(),
                                 "logger": record.name, "message": _ANSI.sub("", record.getMessage())}
        entry.update({k: v for k, v in vars(record).items() if k not in self._STANDARD})
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


def _listen(host: str, port: int) -> socket.socket:
    sock = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET,
                                backlog=2048)
    sock.set_inheritable(True)
    return sock


def _otlp_port_serves_traces_only(app: ASGIApp, port: int) -> ASGIApp:
    """The OTLP/HTTP port (4318, where OTLP exporters send by default) answers ``/v1/traces`` alone:
    ``/metrics``, ``/api`` and the findings page stay on ``--port`` behind their own credentials."""

    async def route(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and (scope.get("server") or (None, None))[1] == port \
                and scope["path"] != "/v1/traces":
            await send({"type": "http.response.start", "status": 404,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": b'{"error": "this port serves /v1/traces only"}'})
            return
        await app(scope, receive, send)

    return route


def run(config: ServiceConfig) -> int:
    _configure_logging(config.log_level)
    otlp_http = None  # the same server on a second socket: one set of limits, one shutdown
    if config.otlp_http_port >= 0:
        try:
            otlp_http = _listen(config.host, config.otlp_http_port)
        except OSError as exc:
            log.error("cannot listen for otlp http", extra={"port": config.otlp_http_port, "error": str(exc)})
            return 1
    detector = Detector(config.detector_config())
    snapshots = None
    if config.snapshot_path:
        snapshots = Snapshots(detector, config.snapshot_path, config.snapshot_interval_s, config.senders_retry_s)
        try:
            snapshots.restore()
        except SnapshotLocked as exc:
            log.error("snapshot refused", extra={"error": str(exc)})
            return 1
        snapshots.start()
    queue = IngestQueue(detector, config.ingest_limits())
    access = config.access()
    tls: tuple[bytes, bytes] | None = None
    if config.tls_cert and config.tls_key:
        tls = (config.tls_key.read_bytes(), config.tls_cert.read_bytes())
    grpc_server = None
    if config.grpc_port >= 0:
        grpc_server, grpc_port = serve_grpc(queue, config.host, config.grpc_port, access.ingest_token, tls,
                                            config.connection_limits())
        log.info("otlp grpc listening", extra={"host": config.host, "port": grpc_port})
    app: ASGIApp = create_app(detector, queue, access, config.links())
    if otlp_http is not None:
        app = _otlp_port_serves_traces_only(app, otlp_http.getsockname()[1])
        log.info("otlp http listening", extra={"host": config.host, "port": otlp_http.getsockname()[1]})
    server = uvicorn.Server(server_config(app, config.host, config.port, config.connection_limits(),
                                          detector.registry, log_config=None, access_log=False,
                                          ssl_certfile=config.tls_cert, ssl_keyfile=config.tls_key,
                                          timeout_graceful_shutdown=10))
    listener = server.config.bind_socket()  # bound here so that the log says the port: --port=0 picks one
    log.info("detector starting", extra={"host": config.host, "port": listener.getsockname()[1],
                                         "tools": list(detector.config.tools)})
    # uvicorn handles SIGTERM/SIGINT (stops listening, finishes in-flight requests), then re-raises the
    # signal to the handler it found: make that one a no-op so the drain below still runs.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: None)
    server.run(sockets=[listener] if otlp_http is None else [listener, otlp_http])
    if grpc_server is not None:
        grpc_server.stop(grace=5).wait()
    drained = queue.close()  # apply what was accepted before exiting
    if snapshots is not None:
        snapshots.close(drained)  # after the drain: final if it holds every accepted span
    log.info("detector stopped", extra={"findings": len(detector.findings)})
    return 0


def main(argv: Sequence[str]) -> int:
    """Exit 0 after a clean stop (or ``--version``, or a valid ``--check-config``), 2 on a bad setting."""
    try:
        invocation = load(argv)
    except ConfigError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    if invocation.version:
        print(f"mcp-stream-exporter {INSTRUMENTATION_VERSION}")
        return 0
    if invocation.check_only:
        print(effective(invocation))
        return 0
    return run(invocation.config)
