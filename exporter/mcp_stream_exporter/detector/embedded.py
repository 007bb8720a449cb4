"""Embedded mode: the same detector in-process, fed by an OpenTelemetry span processor.

No collector and no second service: ``embed_detector()`` adds the processor to the tracer provider
(the global one by default, where the SDK's own spans go too), and can serve ``/metrics`` and
``/api`` from this process on a background thread.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace import Span as SdkSpan
from opentelemetry.trace import SpanKind, StatusCode

from mcp_stream_exporter.detector.detector import Detector, DetectorConfig
from mcp_stream_exporter.detector.events import KIND_CLIENT, KIND_INTERNAL, KIND_SERVER, Span, origin_of
from mcp_stream_exporter.detector.ui import UiLinks

_KINDS = {SpanKind.CLIENT: KIND_CLIENT, SpanKind.SERVER: KIND_SERVER}


def span_of(readable: ReadableSpan) -> Span | None:
    """A finished SDK span as the detector reads it; None for one without a context."""
    ctx = readable.context
    if ctx is None:
        return None
    resource = readable.resource.attributes if readable.resource is not None else {}
    origin = origin_of(resource)
    return Span(
        trace_id=format(ctx.trace_id, "032x"),
        span_id=format(ctx.span_id, "016x"),
        parent_span_id=format(readable.parent.span_id, "016x") if readable.parent is not None else None,
        name=readable.name,
        kind=_KINDS.get(readable.kind, KIND_INTERNAL),
        start_ns=readable.start_time or 0,
        end_ns=readable.end_time or readable.start_time or 0,
        attributes=readable.attributes or {},
        exception_types=tuple(str((e.attributes or {}).get("exception.type", "")) for e in readable.events
                              if e.name == "exception"),
        error=readable.status.status_code == StatusCode.ERROR,
        origin=origin,
    )


class DetectorSpanProcessor(SpanProcessor):
    """Hands every finished span the application sampled to the detector, synchronously: a few dict updates per
    span."""

    def __init__(self, detector: Detector) -> None:
        self.detector = detector

    def on_start(self, span: SdkSpan, parent_context: Context | None = None) -> None:
        pass

    def on_end(self, span: ReadableSpan) -> None:
        context = span.context
        if context is not None and not context.trace_flags.sampled:
            return  # recorded, not sampled (``RECORD_ONLY``): no exporter sends it, nor is it given to the detector
        converted = span_of(span)
        if converted is not None:
            self.detector.consume((converted,), transport="embedded")


class EmbeddedDetector:
    """The detector, its span processor, and optionally its HTTP endpoints, in this process."""

    def __init__(self, detector: Detector, processor: DetectorSpanProcessor) -> None:
        self.detector = detector
        self.processor = processor
        self._server: Any = None
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()
        self.port: int | None = None

    def serve(self, host: str = "127.0.0.1", port: int = 0, tick_interval_s: float = 0.5,
              links: UiLinks | None = None) -> int:
        """Serve ``/metrics``, ``/api`` and the findings page ``/ui/`` on a background thread; returns the
        bound port."""
        import uvicorn  # only embedded users who serve pay for the import

        from mcp_stream_exporter.detector.app import create_app

        config = uvicorn.Config(create_app(self.detector, links=links), host=host, port=port, log_level="warning",
                                lifespan="off")
        self._server = server = uvicorn.Server(config)
        thread = threading.Thread(target=server.run, name="mcp-stream-detector-http", daemon=True)
        thread.start()
        self._threads.append(thread)
        deadline = time.monotonic() + 10
        while not server.started and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        if not server.started:
            raise RuntimeError(f"the detector's HTTP server did not start on {host}:{port}")
        self.port = int(server.servers[0].sockets[0].getsockname()[1])
        ticker = threading.Thread(target=self._tick, args=(tick_interval_s,), name="mcp-stream-detector-tick",
                                  daemon=True)
        ticker.start()
        self._threads.append(ticker)
        return self.port

    def _tick(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            self.detector.tick()

    def close(self) -> None:
        self._stop.set()
        if self._server is not None:
            self._server.should_exit = True
        for thread in self._threads:
            thread.join(timeout=5)


def embed_detector(config: DetectorConfig | None = None, *, tracer_provider: trace.TracerProvider | None = None,
                   detector: Detector | None = None) -> EmbeddedDetector:
    """Install a detector on ``tracer_provider`` (default: the global one), the same detector the
    service runs. Call ``.serve()`` on the result to expose ``/metrics`` and ``/api``."""
    provider = tracer_provider or trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        raise TypeError("embedded mode needs the OpenTelemetry SDK's TracerProvider; install one first")
    detector = detector or Detector(config)
    processor = DetectorSpanProcessor(detector)
    provider.add_span_processor(processor)
    return EmbeddedDetector(detector, processor)
