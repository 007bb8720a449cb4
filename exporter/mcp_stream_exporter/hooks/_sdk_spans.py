"""The SDK's own client call spans, indexed while they are open: a healthy call's terminal event goes on them.

OTel's MCP semantic conventions add MCP attributes to the existing span rather than start another: a healthy call,
which leaves no span of ours, is recorded on the SDK's ``MCP send tools/call`` span while it is open (``annotate``).
"""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING, Final

from opentelemetry import trace
from opentelemetry.attributes import BoundedAttributes
from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace import Span as SdkSpan
from opentelemetry.trace import StatusCode

from mcp_stream_exporter import semconv as sc
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
                self._unanswered(span, context[_SPAN_ID], bound)

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
    def of_global_provider(cls) -> SdkSpans | None:
        """The index on the global provider (where the SDK's spans are made), installed once."""
        provider = trace.get_tracer_provider()
        if not isinstance(provider, TracerProvider):
            return None
        with _INSTALL_LOCK:
            index = _INDEXES.get(provider)
            if index is None:
                index = _INDEXES[provider] = cls()
                provider.add_span_processor(index)
        return index


_INDEXES: weakref.WeakKeyDictionary[TracerProvider, SdkSpans] = weakref.WeakKeyDictionary()
_INSTALL_LOCK = threading.Lock()
