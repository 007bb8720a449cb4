"""OTLP/gRPC in: ``Export`` on an asyncio gRPC server of its own, decoded like an HTTP body (bounded, span by span).

A thread-pool gRPC server gives a call a thread as soon as its headers are in, and the thread waits for the
request's message with no bound but the sender's own deadline: two calls that never sent theirs held every
decoding thread, and every sender behind them, for as long as they liked, token or not. Here waiting for a
message holds no thread: the token is checked on the call's headers, a message must come within
``body_timeout_s``, and when as many calls wait for theirs as the bodies' buffer holds messages of the largest size
(gRPC holds what of them has come, outside the buffer), one waiting past ``body_grace_s`` makes way for a new one
(the longest first), as a slow HTTP body does. A message in whole is reserved in that buffer, where slow HTTP
bodies make way for it. Every refusal a retry may get past is
``UNAVAILABLE``, never gRPC's own ``RESOURCE_EXHAUSTED``, which some OTLP exporters take as final.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from concurrent import futures
from dataclasses import dataclass
from typing import Any, NoReturn

import grpc
from grpc import aio

from mcp_stream_exporter.detector.connections import ConnectionLimits
from mcp_stream_exporter.detector.credentials import bearer_matches
from mcp_stream_exporter.detector.ingest import IngestQueue, partial_success, receive
from mcp_stream_exporter.detector.limits import IngestError, IngestLimits
from mcp_stream_exporter.detector.otlp import decode_protobuf

_SERVICE = "opentelemetry.proto.collector.trace.v1.TraceService"
# calls with their message in, waiting for a decoding thread beside those decoding: a sender among them waits its
# turn (or its own deadline). Each holds its message within the bodies' budget (``IngestQueue.reserve``)
_WAITING_RPCS = 16


@dataclass(slots=True, eq=False)
class _Receiving:
    """A call waiting for its message: since when, and its wait's deadline (brought forward to make way)."""

    since: float
    timeout: asyncio.Timeout
    evicted: bool = False


class _TraceService:
    """``Export``, taking the request's bytes."""

    def __init__(self, queue: IngestQueue, token: str | None, executor: futures.Executor) -> None:
        self._queue = queue
        self._token = token
        self._executor = executor
        self._rejected = queue.detector.metrics.requests_rejected
        self._receiving: set[_Receiving] = set()
        # calls waiting for their message at once: what of it has come gRPC holds, up to the largest message each
        self._max_receiving = max(4, queue.limits.max_buffered_bytes // _largest_message(queue.limits))
        self._admitted = 0  # calls with their message in, decoding or waiting to

    async def export(self, requests: AsyncIterator[bytes], context: aio.ServicerContext[bytes, Any]) -> Any:
        if self._token is not None:
            sent = dict(context.invocation_metadata() or ()).get("authorization", "")
            if not bearer_matches(str(sent), self._token):
                await self._refuse(context, "unauthorized", grpc.StatusCode.UNAUTHENTICATED,
                                   "a bearer token is required")
        body = await self._message(requests, context)
        if self._admitted >= self._queue.limits.max_decoding + _WAITING_RPCS:
            await self._refuse(context, "busy", grpc.StatusCode.UNAVAILABLE,
                               "every decoding slot is taken and as many senders wait; retry with backoff")
        if not self._queue.reserve(len(body)):  # the request bodies held at once, HTTP's and gRPC's together
            await self._refuse(context, "busy", grpc.StatusCode.UNAVAILABLE,
                               "the detector holds as many request bodies as it may; retry with backoff")
        self._admitted += 1
        try:
            outcome = await asyncio.get_running_loop().run_in_executor(self._executor, self._read, body)
        except IngestError as exc:
            await self._refuse(context, exc.metric_reason, grpc.StatusCode.UNAVAILABLE if exc.status == 429
                               else grpc.StatusCode.INVALID_ARGUMENT, exc.reason)
        finally:
            self._admitted -= 1
            self._queue.release(len(body))
        if outcome is None:  # OTLP/gRPC: UNAVAILABLE is retryable with backoff
            await self._refuse(context, "queue_full", grpc.StatusCode.UNAVAILABLE,
                               "ingest queue full; retry with backoff")
        return partial_success(outcome)

    async def _message(self, requests: AsyncIterator[bytes], context: aio.ServicerContext[bytes, Any]) -> bytes:
        """The call's one message, within the body's timeout; or a refusal."""
        limits = self._queue.limits
        loop = asyncio.get_running_loop()
        now = loop.time()
        if len(self._receiving) >= self._max_receiving and not self._make_way(now):
            await self._refuse(context, "busy", grpc.StatusCode.UNAVAILABLE,
                               "as many senders are sending their batches as the detector takes at once; retry "
                               "with backoff")
        receiving: _Receiving | None = None
        try:
            async with asyncio.timeout(limits.body_timeout_s) as timeout:
                receiving = _Receiving(now, timeout)
                self._receiving.add(receiving)
                body = await anext(requests, None)
        except TimeoutError:
            if receiving is not None and receiving.evicted:
                await self._refuse(context, "busy", grpc.StatusCode.UNAVAILABLE,
                                   f"message still coming after {limits.body_grace_s} s with as many senders "
                                   "sending: it made way for another; retry")
            await self._refuse(context, "timeout", grpc.StatusCode.DEADLINE_EXCEEDED,
                               f"message not received within {limits.body_timeout_s} s")
        finally:
            if receiving is not None:
                self._receiving.discard(receiving)
        if body is None:
            await self._refuse(context, "malformed", grpc.StatusCode.INVALID_ARGUMENT, "no request message")
        return body

    def _make_way(self, now: float) -> bool:
        """The call waiting longest for its message past ``body_grace_s``, if any, ended to make way."""
        slow = now - self._queue.limits.body_grace_s
        waiting = [r for r in self._receiving if not r.evicted and r.since <= slow]
        if not waiting:
            return False
        oldest = min(waiting, key=lambda r: r.since)
        oldest.evicted = True
        oldest.timeout.reschedule(now)  # wakes it, waiting on its sender, to be refused
        return True

    def _read(self, body: bytes) -> Any:
        with self._queue.decoding():
            return receive(self._queue, decode_protobuf(body, self._queue.limits), "otlp_grpc")

    async def _refuse(self, context: aio.ServicerContext[bytes, Any], metric_reason: str, code: grpc.StatusCode,
                      details: str) -> NoReturn:
        self._rejected.labels(metric_reason).inc()
        await context.abort(code, details)


def _largest_message(limits: IngestLimits) -> int:
    return min(limits.max_body_bytes, limits.max_decompressed_bytes)


class GrpcReceiver:
    """The OTLP/gRPC receiver, served on an event loop of its own thread."""

    def __init__(self, queue: IngestQueue, host: str, port: int, token: str | None,
                 tls: tuple[bytes, bytes] | None, connection: ConnectionLimits) -> None:
        limits = queue.limits
        self._executor = futures.ThreadPoolExecutor(max_workers=limits.max_decoding,
                                                    thread_name_prefix="mcp-stream-otlp-grpc")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="mcp-stream-otlp-grpc-loop", daemon=True)
        self._thread.start()
        service = _TraceService(queue, token, self._executor)

        async def start() -> tuple[aio.Server, int]:
            server = aio.server(options=[
                ("grpc.max_receive_message_length", _largest_message(limits)),
                ("grpc.max_connection_idle_ms", int(connection.idle_timeout_s * 1000)),
                ("grpc.max_concurrent_streams", 16)])
            # raw bytes in; a stream of requests, of which one message is read, within a deadline
            handler: grpc.RpcMethodHandler[bytes, Any] = grpc.stream_unary_rpc_method_handler(
                service.export, request_deserializer=None,
                response_serializer=lambda response: response.SerializeToString())
            server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(_SERVICE, {"Export": handler}),))
            address = f"{host}:{port}"
            bound = (server.add_secure_port(address, grpc.ssl_server_credentials([tls])) if tls
                     else server.add_insecure_port(address))
            await server.start()
            return server, bound

        self._server, self.port = asyncio.run_coroutine_threadsafe(start(), self._loop).result(30)

    def stop(self, grace: float | None) -> threading.Event:
        """Stop taking calls, give those in progress ``grace`` seconds (None: none), and stop; the event is set
        once stopped (as a thread-pool gRPC server's ``stop`` answers)."""
        async def stop() -> None:
            await self._server.stop(grace)
            # the calls it cancelled, awaited: a loop closed under them logs tracebacks past the JSON logs
            tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self._loop.shutdown_asyncgens()

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)
        self._loop.close()
        self._executor.shutdown(wait=True)
        stopped = threading.Event()
        stopped.set()
        return stopped


def serve_grpc(queue: IngestQueue, host: str, port: int, token: str | None = None,
               tls: tuple[bytes, bytes] | None = None,
               connection: ConnectionLimits | None = None) -> tuple[GrpcReceiver, int]:
    """The OTLP/gRPC receiver (what the Collector's loadbalancing exporter speaks), started; it and its port."""
    receiver = GrpcReceiver(queue, host, port, token, tls, connection or ConnectionLimits())
    return receiver, receiver.port
