"""The detector's HTTP face (FastAPI): OTLP/HTTP in, ``/metrics``, ``/api/findings``, health.

The same app serves the standalone service (with an ingest queue) and embedded mode (without one:
spans arrive through the span processor, so ``/v1/traces`` is not mounted).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import FastAPI, HTTPException, Query, Request, Response
from fastapi.responses import HTMLResponse, JSONResponse
from google.protobuf import json_format
from prometheus_client.exposition import choose_encoder
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Receive, Scope, Send

from mcp_stream_exporter.detector.credentials import basic_matches, bearer_matches
from mcp_stream_exporter.detector.detector import Detector
from mcp_stream_exporter.detector.findings import Query as FindingQuery
from mcp_stream_exporter.detector.ingest import (
    JSON,
    PROTOBUF,
    IngestError,
    IngestQueue,
    decode,
    decompress,
    partial_success,
    receive,
)
from mcp_stream_exporter.detector.rules import RULES
from mcp_stream_exporter.detector.ui import UiLinks, mount_ui

log = logging.getLogger("mcp_stream_exporter.detector")


@dataclass(frozen=True, slots=True)
class Access:
    """Who may use what: a bearer token for ingest and for ``/api``, basic auth for ``/metrics``."""

    ingest_token: str | None = None
    api_token: str | None = None
    metrics_basic_auth: tuple[str, str] | None = None  # (user, password)


class _IngestFirst:
    """``POST /v1/traces`` straight to its handler, past routing and FastAPI's endpoint machinery: about
    a millisecond of the service's CPU a request, a sixth of a 512-span batch's whole cost. Every other
    request, the same path's other methods (405) among them, goes the usual way."""

    def __init__(self, app: ASGIApp, handler: Callable[[Request], Awaitable[Response]]) -> None:
        self._app = app
        self._handler = handler

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] == "/v1/traces":
            response = await self._handler(Request(scope, receive))
            await response(scope, receive, send)
            return
        await self._app(scope, receive, send)


def _bearer_ok(request: Request, token: str | None) -> bool:
    return token is None or bearer_matches(request.headers.get("authorization", ""), token)


def _basic_ok(request: Request, creds: tuple[str, str] | None) -> bool:
    return creds is None or basic_matches(request.headers.get("authorization", ""), *creds)


def create_app(detector: Detector, queue: IngestQueue | None = None, access: Access | None = None,
               links: UiLinks | None = None) -> FastAPI:
    access = access or Access()
    # FastAPI's own telemetry off: the detector tracing its own requests would feed itself (embedded
    # mode) or export spans about its ingest back into its ingest, a loop that never drains.
    app = FastAPI(title="mcp-stream-exporter detector", docs_url=None, redoc_url=None, openapi_url=None,
                  telemetry={"tracing": False, "metrics": False, "logs": False, "operation_spans": False})
    metrics = detector.metrics

    def refuse(status: int, reason: str, metric_reason: str, headers: dict[str, str] | None = None) -> Response:
        metrics.requests_rejected.labels(metric_reason).inc()
        log.warning("ingest refused", extra={"status": status, "reason": reason})
        return JSONResponse({"error": reason}, status_code=status, headers=headers)

    if queue is not None:
        limits = queue.limits

        @app.post("/v1/traces")
        async def ingest(request: Request) -> Response:
            if not _bearer_ok(request, access.ingest_token):
                return refuse(401, "a bearer token is required", "unauthorized", {"WWW-Authenticate": "Bearer"})
            declared = request.headers.get("content-length")
            if declared is not None and declared.isdigit() and int(declared) > limits.max_body_bytes:
                return refuse(413, f"body exceeds {limits.max_body_bytes} bytes", "too_large")
            content_type = request.headers.get("content-type", PROTOBUF)
            encoding = request.headers.get("content-encoding")
            chunks: list[bytes] = []
            size = 0  # held, and reserved in the queue's body buffer
            try:
                try:
                    async with asyncio.timeout(limits.body_timeout_s):
                        async for chunk in request.stream():
                            if size + len(chunk) > limits.max_body_bytes:
                                return refuse(413, f"body exceeds {limits.max_body_bytes} bytes", "too_large")
                            if not queue.reserve(len(chunk)):
                                return refuse(429, "too many request bodies held; retry after the given delay",
                                              "busy", {"Retry-After": str(limits.retry_after_s)})
                            chunks.append(chunk)
                            size += len(chunk)
                except TimeoutError:
                    return refuse(408, f"body not received within {limits.body_timeout_s} s", "timeout")

                def process() -> Any:
                    with queue.decoding():
                        body = decompress(b"".join(chunks), encoding, limits)
                        return receive(queue, decode(body, content_type, limits), "otlp_http")

                outcome = await run_in_threadpool(process)
            except IngestError as exc:
                headers = {"Retry-After": str(limits.retry_after_s)} if exc.status == 429 else None
                return refuse(exc.status, exc.reason, exc.metric_reason, headers)
            finally:
                queue.release(size)
            if outcome is None:
                return refuse(429, "ingest queue full; retry after the given delay", "queue_full",
                              {"Retry-After": str(limits.retry_after_s)})
            if outcome.rejected:
                log.info("spans refused",
                         extra={"rejected": outcome.rejected_count, "reason": outcome.message()[:1000]})
            answer = partial_success(outcome)
            if content_type.startswith(JSON):
                return Response(json_format.MessageToJson(answer), media_type=JSON)
            return Response(answer.SerializeToString(), media_type=PROTOBUF)

        app.add_middleware(_IngestFirst, handler=ingest)

    @app.get("/metrics")
    def scrape(request: Request) -> Response:
        if not _basic_ok(request, access.metrics_basic_auth):
            return Response("authentication required", status_code=401,
                            headers={"WWW-Authenticate": 'Basic realm="metrics"'})
        encoder, content_type = choose_encoder(request.headers.get("accept", ""))
        return Response(encoder(detector.registry), media_type=content_type)

    def api_guard(request: Request) -> None:
        if not _bearer_ok(request, access.api_token):
            raise HTTPException(401, "a bearer token is required", headers={"WWW-Authenticate": "Bearer"})

    @app.get("/api/findings")
    def findings(request: Request, rule: str | None = None, tool: str | None = None, severity: str | None = None,
                 since: Annotated[float | None, Query(description="epoch seconds")] = None,
                 until: Annotated[float | None, Query(description="epoch seconds")] = None,
                 offset: Annotated[int, Query(ge=0)] = 0,
                 limit: Annotated[int, Query(ge=1, le=500)] = 50) -> dict[str, Any]:
        api_guard(request)
        if rule is not None and rule not in RULES:
            raise HTTPException(400, f"unknown rule {rule!r}; see /api/rules")
        q = FindingQuery(rule, tool, severity, int(since * 1e9) if since is not None else None,
                         int(until * 1e9) if until is not None else None, offset, limit)
        with detector.lock:
            page, total = detector.findings.query(q)
            items = [f.to_json() for f in page]
        return {"total": total, "offset": offset, "limit": limit, "findings": items}

    @app.get("/api/findings/{finding_id}")
    def finding(request: Request, finding_id: str) -> dict[str, Any]:
        api_guard(request)
        with detector.lock:
            found = detector.findings.get(finding_id)
            if found is None:
                raise HTTPException(404, "no such finding (it may have aged out of the store)")
            return found.to_json()

    @app.get("/api/rules")
    def rules(request: Request) -> list[dict[str, Any]]:
        api_guard(request)
        return [{"id": r.id, "severity": r.severity, "eras": sorted(r.eras), "silent_loss": r.loss,
                 "summary": r.summary} for r in RULES.values()]

    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    def readyz() -> Response:
        if queue is not None and not queue.accepting:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        return JSONResponse({"status": "ready"})

    @app.get("/", response_class=HTMLResponse)
    def index() -> str:
        return ("<html><head><title>mcp-stream-exporter</title></head><body><h1>mcp-stream-exporter detector</h1>"
                "<ul><li><a href='/ui/'>/ui/</a> (findings)</li><li><a href='/metrics'>/metrics</a></li>"
                "<li><a href='/api/findings'>/api/findings</a></li>"
                "<li><a href='/api/rules'>/api/rules</a></li><li><a href='/readyz'>/readyz</a></li></ul>"
                "</body></html>")

    mount_ui(app, detector, links or UiLinks(), access.api_token,
             lambda request: _bearer_ok(request, access.api_token))
    return app
