"""The detector's HTTP face: OTLP/HTTP in (plain ASGI), ``/metrics``, ``/api/findings``, health (FastAPI).

The same app serves the standalone service (with an ingest queue) and embedded mode (without one:
spans arrive through the span processor, so ``/v1/traces`` is not mounted).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Annotated, Any

from anyio import CapacityLimiter, move_on_after, to_thread
from fastapi import FastAPI, HTTPException, Query, Request, Response
from fastapi.responses import HTMLResponse, JSONResponse
from google.protobuf import json_format
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder
from starlette.types import ASGIApp, Receive, Scope, Send

from mcp_stream_exporter.detector.credentials import basic_matches, bearer_matches
from mcp_stream_exporter.detector.detector import Detector, Outcome
from mcp_stream_exporter.detector.findings import Query as FindingQuery
from mcp_stream_exporter.detector.ingest import (
    JSON,
    PROTOBUF,
    BodyHold,
    IngestError,
    IngestLimits,
    IngestQueue,
    busy,
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


_ACCEPTED = {PROTOBUF: b"", JSON: b"{}"}  # the answer to a batch taken whole, as each encoding writes it
# on a refusal before the whole body is in: what is left of it must not be read as the next request
_CLOSE = (b"connection", b"close")
_DISCARDED_BODIES = 4  # the rest of a refused body read and dropped, in --max-body-bytes (``_OtlpHttp._unread``)


@dataclass(frozen=True, slots=True)
class _Answer:
    status: int
    body: bytes
    content_type: str = JSON
    headers: tuple[tuple[bytes, bytes], ...] = ()


def _expire(timeout: asyncio.Timeout, loop: asyncio.AbstractEventLoop) -> None:
    """Bring a body's deadline to now (on its loop): it made way for another, and its receiver, waiting on its
    sender, is to refuse it. Nothing if the body is past that wait already."""
    with contextlib.suppress(RuntimeError):  # the deadline's scope exited, or it expires already
        timeout.reschedule(loop.time())


def _closing(answer: _Answer) -> _Answer:
    return replace(answer, headers=(*answer.headers, _CLOSE))


def _retry_after(limits: IngestLimits) -> tuple[tuple[bytes, bytes], ...]:
    return ((b"retry-after", str(limits.retry_after_s).encode()),)


class _OtlpHttp:
    """``/v1/traces`` as plain ASGI in front of the FastAPI app: OTLP/HTTP requests are the service's
    traffic, and Starlette's request, response and middleware machinery cost about as much as reading a
    small batch. A body is read on a worker thread, never on the event loop: a 256 KiB JSON batch takes
    100 ms and more to decode, and health checks and scrapes would wait for it. Nor on the threads they run
    on: a request waits for one of the few decoding slots on the event loop, then takes a thread of its own
    pool; waiting on a thread of the shared pool, a burst of senders would hold them all and ``/healthz`` would
    time out. Every other request goes to ``app``."""

    def __init__(self, app: ASGIApp, queue: IngestQueue, token: str | None) -> None:
        self._app = app
        self._queue = queue
        self._limits = queue.limits
        self._token = token
        self._rejected = queue.detector.metrics.requests_rejected
        self._slots = CapacityLimiter(queue.limits.max_decoding)  # requests decoding at once, waited for here
        self._threads = CapacityLimiter(queue.limits.max_decoding)  # the threads they decode on: never waited for

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != "/v1/traces":
            await self._app(scope, receive, send)
            return
        if scope["method"] == "POST":
            answer = await self._export(scope["headers"], receive)
            if answer is None:  # the client went away before its body was in
                return
        else:
            answer = _Answer(405, b'{"error": "use POST"}', headers=((b"allow", b"POST"),))
        await send({"type": "http.response.start", "status": answer.status, "headers": [
            (b"content-type", answer.content_type.encode()), (b"content-length", str(len(answer.body)).encode()),
            *answer.headers]})
        await send({"type": "http.response.body", "body": answer.body})

    def _refuse(self, status: int, reason: str, metric_reason: str,
                headers: tuple[tuple[bytes, bytes], ...] = ()) -> _Answer:
        self._rejected.labels(metric_reason).inc()
        log.warning("ingest refused", extra={"status": status, "reason": reason})
        return _Answer(status, json.dumps({"error": reason}).encode(), headers=headers)

    async def _export(self, raw_headers: list[tuple[bytes, bytes]], messages: Receive) -> _Answer | None:
        limits = self._limits
        deadline = asyncio.get_running_loop().time() + limits.body_timeout_s  # for the whole body, read or not
        authorization = declared = content_type = encoding = expect = None
        for name, value in raw_headers:  # the first of each, as Starlette reads them
            if name == b"authorization" and authorization is None:
                authorization = value.decode("latin-1")
            elif name == b"content-length" and declared is None:
                declared = value
            elif name == b"content-type" and content_type is None:
                content_type = value.decode("latin-1").strip()
            elif name == b"content-encoding" and encoding is None:
                encoding = value.decode("latin-1").strip()
            elif name == b"expect" and expect is None:
                expect = value
        length = int(declared) if declared is not None and declared.isdigit() else None  # None: not said
        refusal = None
        if self._token is not None and not bearer_matches(authorization or "", self._token):
            refusal = self._refuse(401, "a bearer token is required", "unauthorized",
                                   ((b"www-authenticate", b"Bearer"),))
        elif length is not None and length > limits.max_body_bytes:
            refusal = self._refuse(413, f"body exceeds {limits.max_body_bytes} bytes", "too_large")
        if refusal is not None:
            if expect is not None and expect.strip().lower() == b"100-continue":
                return _closing(refusal)  # its body comes only after a 100 Continue: none is asked for
            return await self._unread(refusal, messages, length, deadline)
        body = await self._body(messages, length, deadline)
        if not isinstance(body, bytes):
            return body
        if content_type is None:
            content_type = PROTOBUF
        try:
            waited = True
            with move_on_after(limits.decoding_wait_s):
                await self._slots.acquire()
                waited = False
            if waited:
                raise busy()
            try:
                outcome = await to_thread.run_sync(self._read, body, content_type, encoding, limiter=self._threads)
            finally:
                self._slots.release()
        except IngestError as exc:
            return self._refuse(exc.status, exc.reason, exc.metric_reason,
                                _retry_after(limits) if exc.status == 429 else ())
        finally:
            self._queue.release(len(body))
        if outcome is None:
            return self._refuse(429, "ingest queue full; retry after the given delay", "queue_full",
                                _retry_after(limits))
        media = JSON if content_type.lower().startswith(JSON) else PROTOBUF
        if not outcome.rejected:
            return _Answer(200, _ACCEPTED[media], media)
        log.info("spans refused", extra={"rejected": outcome.rejected_count, "reason": outcome.message()[:1000]})
        answer = partial_success(outcome)
        return _Answer(200, json_format.MessageToJson(answer).encode() if media == JSON
                       else answer.SerializeToString(), media)

    async def _body(self, messages: Receive, length: int | None, deadline: float) -> bytes | _Answer | None:
        """The request's body, reserved in the queue's body buffer (the caller releases it); or the answer
        to one refused while it comes; None if the client went away."""
        limits = self._limits
        queue = self._queue
        loop = asyncio.get_running_loop()
        chunks: list[bytes] = []
        size = 0
        hold: BodyHold | None = None
        refusal: _Answer | None = None
        more = True
        try:
            async with asyncio.timeout_at(deadline) as timeout:

                def wake() -> None:  # from whichever thread's reservation made room (gRPC's)
                    loop.call_soon_threadsafe(_expire, timeout, loop)

                hold = queue.hold(wake)
                while True:
                    message = await messages()
                    if message["type"] != "http.request":
                        return None
                    chunk, more = message.get("body", b""), message.get("more_body", False)
                    if hold.evicted:
                        break
                    if size + len(chunk) > limits.max_body_bytes:
                        refusal = self._refuse(413, f"body exceeds {limits.max_body_bytes} bytes", "too_large")
                        break
                    if not queue.reserve(len(chunk), hold):
                        refusal = self._refuse(429, "too many request bodies held; retry after the given delay",
                                               "busy", _retry_after(limits))
                        break
                    chunks.append(chunk)
                    size += len(chunk)
                    if not more:
                        if not queue.keep(hold):  # made way as its last chunk came
                            break
                        hold = None  # the caller's to release
                        return chunks[0] if len(chunks) == 1 else b"".join(chunks)
        except TimeoutError:
            if hold is None or not hold.evicted:
                return self._refuse(408, f"body not received within {limits.body_timeout_s} s", "timeout",
                                    (_CLOSE,))
            chunk = b""  # woken waiting for its next chunk
        finally:
            if hold is not None:
                queue.let_go(hold)
        if refusal is None:  # made way: retryable, as any refusal of a full buffer (a 408 would drop the batch)
            refusal = self._refuse(429, f"the buffer for request bodies filled while this body was still coming after "
                                   f"{limits.body_grace_s} s: it made way for another; retry after the given delay",
                                   "busy", _retry_after(limits))
        if not more:
            return refusal
        chunks.clear()  # not held while the rest is read
        return await self._unread(refusal, messages, None if length is None else length - size - len(chunk),
                                  deadline)

    async def _unread(self, answer: _Answer, messages: Receive, rest: int | None, deadline: float) -> _Answer | None:
        """``answer`` to a request whose body is refused before it is all in, once the ``rest`` of it (None:
        not known) is read and dropped: a sender that writes its whole body before it reads (most OTLP
        exporters) then reads the answer, where a connection closed on unread bytes would reset and lose it.
        At most ``_DISCARDED_BODIES`` times ``max_body_bytes`` is read, by the body's deadline; past either, the
        answer closes the connection. None if the client went away."""
        allowance = _DISCARDED_BODIES * self._limits.max_body_bytes
        if rest is not None and rest > allowance:
            return _closing(answer)
        try:
            async with asyncio.timeout_at(deadline):
                while allowance >= 0:
                    message = await messages()
                    if message["type"] != "http.request":
                        return None
                    if not message.get("more_body", False):
                        return answer
                    allowance -= len(message.get("body", b""))
        except TimeoutError:
            pass
        return _closing(answer)

    def _read(self, body: bytes, content_type: str, encoding: str | None) -> Outcome | None:
        with self._queue.decoding():
            body = decompress(body, encoding, self._limits)
            return receive(self._queue, decode(body, content_type, self._limits), "otlp_http")


# a time as the API takes it, in epoch seconds within OTLP's times (unsigned 64-bit nanoseconds): any other
# (NaN, infinite, negative, too late) is a 422, not a 500 where it would not become an int
_EPOCH_SECONDS = Query(description="epoch seconds", allow_inf_nan=False, ge=0, le=2**64 / 1e9)


def _bearer_ok(request: Request, token: str | None) -> bool:
    return token is None or bearer_matches(request.headers.get("authorization", ""), token)


def _basic_ok(request: Request, creds: tuple[str, str] | None) -> bool:
    return creds is None or basic_matches(request.headers.get("authorization", ""), *creds)


class _Scrapes:
    """``/metrics`` encoded one scrape at a time, on a worker thread, and shared by the scrapes that waited for
    it: a registry near its bounds takes some 0.6 s of CPU to encode, and concurrent scrapes each encoding it
    held every thread of the pool and starved the event loop. A scrape that waited takes the encoding that
    began after it came (as fresh as its own would be), else makes one; waiting holds no thread."""

    def __init__(self, detector: Detector) -> None:
        self._detector = detector
        self._lock: tuple[asyncio.AbstractEventLoop, asyncio.Lock] | None = None  # the running loop's
        self._arrivals = 0
        self._latest: dict[str, tuple[int, bytes]] = {}  # by content type: when its encoding began, the body

    async def encoded(self, encoder: Callable[[CollectorRegistry], bytes], content_type: str) -> bytes:
        self._arrivals += 1
        came = self._arrivals
        async with self._lock_of(asyncio.get_running_loop()):
            latest = self._latest.get(content_type)
            if latest is not None and latest[0] > came:
                return latest[1]
            self._arrivals += 1
            began = self._arrivals
            body = await to_thread.run_sync(self._encode, encoder)
            self._latest = {content_type: (began, body)}  # one kept: a body can be megabytes
            return body

    def _lock_of(self, loop: asyncio.AbstractEventLoop) -> asyncio.Lock:
        if self._lock is None or self._lock[0] is not loop:  # an app served by one loop, then another (tests)
            self._lock = (loop, asyncio.Lock())
        return self._lock[1]

    def _encode(self, encoder: Callable[[CollectorRegistry], bytes]) -> bytes:
        detector = self._detector
        with detector.lock:  # between batches: a finding of a batch before this is counted, one after is not yet
            scraped_ns = detector.clock()
        body = encoder(detector.registry)
        detector.scraped_ns = scraped_ns
        return body


def create_app(detector: Detector, queue: IngestQueue | None = None, access: Access | None = None,
               links: UiLinks | None = None) -> ASGIApp:
    """The detector's app; with a queue, ``/v1/traces`` in front of it (:class:`_OtlpHttp`)."""
    access = access or Access()
    # FastAPI's own telemetry off: the detector tracing its own requests would feed itself (embedded
    # mode) or export spans about its ingest back into its ingest, a loop that never drains.
    app = FastAPI(title="mcp-stream-exporter detector", docs_url=None, redoc_url=None, openapi_url=None,
                  telemetry={"tracing": False, "metrics": False, "logs": False, "operation_spans": False})

    scrapes = _Scrapes(detector)

    @app.get("/metrics")
    async def scrape(request: Request) -> Response:
        if not _basic_ok(request, access.metrics_basic_auth):
            return Response("authentication required", status_code=401,
                            headers={"WWW-Authenticate": 'Basic realm="metrics"'})
        encoder, content_type = choose_encoder(request.headers.get("accept", ""))
        return Response(await scrapes.encoded(encoder, content_type), media_type=content_type)

    def api_guard(request: Request) -> None:
        if not _bearer_ok(request, access.api_token):
            raise HTTPException(401, "a bearer token is required", headers={"WWW-Authenticate": "Bearer"})

    @app.get("/api/findings")
    def findings(request: Request, rule: str | None = None, tool: str | None = None, severity: str | None = None,
                 since: Annotated[float | None, _EPOCH_SECONDS] = None,
                 until: Annotated[float | None, _EPOCH_SECONDS] = None,
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

    @app.get("/api/calls/stuck")
    def stuck_calls(request: Request, limit: Annotated[int, Query(ge=1, le=500)] = 50) -> dict[str, Any]:
        api_guard(request)
        calls, total = detector.stuck_calls(limit)
        return {"total": total, "limit": limit, "calls": calls}

    @app.get("/api/rules")
    def rules(request: Request) -> list[dict[str, Any]]:
        api_guard(request)
        return [{"id": r.id, "severity": r.severity, "eras": sorted(r.eras), "silent_loss": r.loss,
                 "summary": r.summary} for r in RULES.values()]

    # on the event loop, never behind the thread pool the other handlers queue for: a liveness probe must not
    # time out (and restart the pod, its state with it) because scrapes or API reads are slow
    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz() -> Response:
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
    return app if queue is None else _OtlpHttp(app, queue, access.ingest_token)
