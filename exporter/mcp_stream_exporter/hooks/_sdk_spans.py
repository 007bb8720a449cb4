"""The SDK's own client call spans, indexed while they are open: a healthy call's terminal event goes on them.

OTel's MCP semantic conventions add MCP attributes to the existing span rather than start another: a healthy call,
which leaves no span of ours, is recorded on the SDK's ``MCP send tools/call`` span while it is open (``annotate``).
Its end is how a client learns the SDK answered its caller itself (a timeout, its resumes run out), so the SDK's
tracer records those spans whatever the application's sampler decides (``_RecordingCalls``).
"""

from __future__ import annotations

import functools
import logging
import threading
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Final

from mcp.shared import _otel as sdk_otel
from opentelemetry import trace
from opentelemetry.attributes import BoundedAttributes
from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, Tracer, TracerProvider
from opentelemetry.sdk.trace import Span as SdkSpan
from opentelemetry.sdk.trace.sampling import Decision, Sampler, SamplingResult
from opentelemetry.trace import Link, SpanKind, StatusCode
from opentelemetry.trace.span import TraceState
from opentelemetry.util.types import Attributes

from mcp_stream_exporter import semconv as sc
from mcp_stream_exporter.hooks import _defects
from mcp_stream_exporter.hooks._spans import Terminal

if TYPE_CHECKING:
    from mcp_stream_exporter.hooks._spans import Call
    from mcp_stream_exporter.hooks._tracking import Tracker


def annotate(sdk: SdkSpan, terminal: Terminal) -> None:
    """Where a healthy call's terminal event came, on the SDK's own span while it is open.

    Two strings, written into its attributes under the span's lock, as ``set_attribute`` does them
    (``end`` sets ``_end_time`` under that lock; every mutator takes it), without the checks two plain
    strings need none of: the SDK's ``set_attribute`` costs some 10k instructions each (two locks, a
    Python ``__setitem__``, a recursive value check), a tenth of a legacy client's hooks for the two. A
    span with a value length limit, or too full to take both without dropping one, goes through
    ``set_attribute``, which applies the limits (pinned by tests/integration/test_sdk_contract.py)."""
    stream_kind, event_id = terminal
    attributes = sdk._attributes
    if (type(attributes) is BoundedAttributes and attributes.max_value_len is None
            and (attributes.maxlen is None or len(attributes._dict) + 2 <= attributes.maxlen)):
        with sdk._lock:
            if sdk._end_time is None:  # ``is_recording``
                values = attributes._dict
                values[sc.TERMINAL_STREAM_KIND] = stream_kind
                if event_id is not None:
                    values[sc.TERMINAL_EVENT_ID] = event_id
        return
    if sdk.is_recording():
        sdk.set_attribute(sc.TERMINAL_STREAM_KIND, stream_kind)
        if event_id is not None:
            sdk.set_attribute(sc.TERMINAL_EVENT_ID, event_id)


_SPAN_ID: Final = 1  # where a SpanContext, a tuple, keeps its span id (``SpanContext.span_id`` reads it there)


class SdkSpans(SpanProcessor):
    """Keeps the SDK's open ``MCP send tools/call`` spans by span id, so a healthy call can be
    recorded on the SDK's span (semconv: add MCP attributes to the existing span rather than start
    another) instead of on a span of ours; and tells the clients' trackers of one that timed out (``watch``)."""

    def __init__(self) -> None:
        self._open: dict[int, SdkSpan] = {}
        self._trackers: weakref.WeakSet[Tracker] = weakref.WeakSet()
        self._calls: dict[int, tuple[Tracker, Call]] = {}  # span id -> the call a client started for it (``bind``)

    def watch(self, tracker: Tracker) -> None:
        """``tracker`` (a client's) learns of each call it left pending whose caller's timeout ran out
        (``Tracker.abandoned_pending``): the SDK sends no cancel then when its request asked to be resumable (its
        resumption hints), so its span is the only sign that the caller is gone."""
        self._trackers.add(tracker)

    def bind(self, sdk: SdkSpan, tracker: Tracker, call: Call) -> None:
        """``call``, started by ``tracker``, is the one the SDK's span ``sdk`` stands for: ``tracker`` is told if
        the span ends with no result of it seen (``Tracker.unanswered``), no walk of its calls needed."""
        context = sdk._context
        if context is not None:
            self._calls[context[_SPAN_ID]] = (tracker, call)

    # Both run on every span the application starts and ends: they read the span's name and context off
    # its fields, and the span id off the context's tuple, not through the properties and the method
    # around them (pinned by tests/integration/test_sdk_contract.py).
    def on_start(self, span: SdkSpan, parent_context: Context | None = None) -> None:
        if span._name.startswith(sc.SDK_CLIENT_CALL_SPAN) and span._context is not None:
            self._open[span._context[_SPAN_ID]] = span

    def on_end(self, span: ReadableSpan) -> None:
        context = span._context
        if context is not None and self._open.pop(context[_SPAN_ID], None) is not None:  # a call's
            bound = self._calls.pop(context[_SPAN_ID], None) if self._calls else None
            attributes = span._attributes
            # a healthy call's span has where its result came (``annotate``): the rest are told apart below
            values = attributes._dict if type(attributes) is BoundedAttributes else attributes  # not Mapping's ``in``
            if values is None or sc.TERMINAL_STREAM_KIND not in values:
                try:
                    self._unanswered(span, context[_SPAN_ID], bound)
                except Exception:  # the hooks' reading never fails the SDK's span
                    _defects.report("a call's end")

    def _unanswered(self, span: ReadableSpan, span_id: int, bound: tuple[Tracker, Call] | None) -> None:
        """The SDK's span of a call ended, and its caller with it, with no word of a result written on it: the call
        a client started for it (``bind``), its terminal event not seen (the tap reads every answer before the SDK
        does), was answered by the SDK itself (``Tracker.unanswered``): none waits for it any more. How, the span
        tells: ``TimeoutError`` recorded, its caller's timeout ran out; an error status without it, the SDK failed
        the call (its resumes ran out, its stream ended without a cursor); neither, its caller was cancelled (OTel
        records no ``CancelledError``) or the SDK closed it as its transport died (``Connection closed``, which
        the SDK leaves off the span). At a timeout, a call left pending too (``Tracker.abandoned_pending``)."""
        timed_out = any(event.name == "exception" and (event.attributes or {}).get("exception.type") == "TimeoutError"
                        for event in span._events)
        if bound is not None:
            bound[0].unanswered(bound[1], timed_out, not timed_out and span._status._status_code is StatusCode.ERROR)
        request_id = (span._attributes or {}).get(sc.JSONRPC_REQUEST_ID)
        if timed_out and request_id is not None:
            for tracker in list(self._trackers):
                tracker.abandoned_pending(str(request_id), span_id)

    def get(self, traceparent: str | None) -> SdkSpan | None:
        if traceparent is None or len(traceparent) < 55:
            return None
        try:
            return self._open.get(int(traceparent[36:52], 16))  # version-traceid-SPANID-flags
        except ValueError:
            return None

    @classmethod
    def of_global_provider(cls, *, told: bool = True) -> SdkSpans | None:
        """The index on the global provider (where the SDK's spans are made), installed once. None without one:
        the SDK then makes no spans, and a call it fails itself (its resumes ran out) goes untold (``told`` once)."""
        provider = trace.get_tracer_provider()
        if not isinstance(provider, TracerProvider):
            if told:
                _no_global_provider()
            return None
        with _INSTALL_LOCK:
            index = _INDEXES.get(provider)
            if index is None:
                index = _INDEXES[provider] = cls()
                provider.add_span_processor(index)
            _record_sdk_calls(provider)
        return index


@functools.cache  # said once a process
def _no_global_provider() -> None:
    logging.getLogger("mcp_stream_exporter.hooks").warning(
        "no OpenTelemetry SDK TracerProvider is set globally (trace.set_tracer_provider) as an instrumented MCP client "
        "sends: the MCP SDK makes no spans of its own, so a call it fails itself (its resumes ran out) stays in flight "
        "for the client's hooks until its client closes (MCPToolCallsStuckInFlight); set one, with or without "
        "exporters, before the client's first request")


class _RecordingCalls(Sampler):
    """The application's sampler, but an ``MCP send tools/call`` span it drops is recorded all the same: with
    ``RECORD_ONLY`` span processors see it and exporters skip it, and its context stays unsampled, so its children
    and the trace its request carries are sampled as the application's sampler said. Without it a sampled-out call
    that the SDK failed itself (its resumes ran out) or gave up on (its caller's timeout) would stay in flight for
    the hooks, and page as stuck, until its HTTP client closed."""

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler

    def should_sample(self, parent_context: Context | None, trace_id: int, name: str, kind: SpanKind | None = None,
                      attributes: Attributes = None, links: Sequence[Link] | None = None,
                      trace_state: TraceState | None = None) -> SamplingResult:
        result = self.sampler.should_sample(parent_context, trace_id, name, kind, attributes, links, trace_state)
        if result.decision is Decision.DROP and name.startswith(sc.SDK_CLIENT_CALL_SPAN):
            return SamplingResult(Decision.RECORD_ONLY, attributes, result.trace_state)  # a dropped span has none
        return result

    def get_description(self) -> str:
        return self.sampler.get_description()


def _record_sdk_calls(provider: TracerProvider) -> None:
    """Have the SDK's tracer (one for the process, on the global ``provider``) record its client call spans whatever
    the application's sampler decides (``_RecordingCalls``); only that tracer's, not the provider's other tracers."""
    tracer = sdk_otel._tracer
    if isinstance(tracer, trace.ProxyTracer):  # the SDK imported before the global provider was set
        tracer = tracer._tracer  # resolved now, on it
    if (isinstance(tracer, Tracer) and tracer.span_processor is provider._active_span_processor
            and not isinstance(tracer.sampler, _RecordingCalls)):
        tracer.sampler = _RecordingCalls(tracer.sampler)


_INDEXES: weakref.WeakKeyDictionary[TracerProvider, SdkSpans] = weakref.WeakKeyDictionary()
_INSTALL_LOCK = threading.Lock()
