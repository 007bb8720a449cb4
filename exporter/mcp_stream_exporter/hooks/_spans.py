"""Deferred spans: a call and a stream as either side sees them, made a span of ours only once they deviate.

A call or a stream keeps what its span would say (a few fields, its events and links as tuples) and describes it
only when the tracker (``_tracking``) decides it is worth a span: on the healthy path, which makes none, nothing
of it is ever built (docs/span-model.md, "The healthy path"). Our spans are made whatever the application's
sampler decides (``DeviationTracer``).
"""

from __future__ import annotations

import functools
import re
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.trace import Span as SdkSpan
from opentelemetry.sdk.trace import SpanLimits, TracerProvider
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from opentelemetry.trace import Link, NonRecordingSpan, Span, SpanContext, SpanKind, TraceFlags
from opentelemetry.util.types import Attributes, AttributeValue

from mcp_stream_exporter import semconv as sc
from mcp_stream_exporter.auth import NOTHING_MISSING, AuthView, Requirement
from mcp_stream_exporter.exchange import stream_attributes

if TYPE_CHECKING:
    from mcp_stream_exporter.hooks._tracking import Holder

CallKey = tuple[str | None, str]  # (session id, JSON-RPC request id)

_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(?:-|$)", re.ASCII)
_UNKNOWN_AUDIENCE = frozenset({sc.VERIFICATION_OPAQUE, sc.VERIFICATION_ABSENT})  # no claims: audience unknown
# A deferred span keeps its last events as the SDK's span would (OTEL_SPAN_EVENT_COUNT_LIMIT, oldest
# dropped), so a long stream's frames cost bounded memory before its span exists; 128 if unlimited.
MAX_DEFERRED_EVENTS = SpanLimits().max_events or 128


# the application provider's own-sampled tracer (``DeviationTracer``), shared by every client and server it serves
_OWN_TRACERS: weakref.WeakKeyDictionary[TracerProvider, trace.Tracer] = weakref.WeakKeyDictionary()


class DeviationTracer:
    """Makes this project's spans, recorded and exported whatever the application's sampler decides.

    Our spans are deviations from the healthy path, rare by design, and the detector must see every
    one: a loss whose spans a 10 % sampler dropped is a loss nobody is told about. So they are made by
    a tracer provider of our own with an always-on sampler, sharing the application provider's
    resource, id generator and span processors (its exporters): same destination, our own sampling
    decision. Parents stay as they are (the SDK's request span): when the application sampled that
    trace our spans sit in it; when it did not, they still carry its trace id. A provider that is not
    the OpenTelemetry SDK's (no-op, or a proxy before one is installed) is used as it is."""

    __slots__ = ("_provider", "_tracer")

    def __init__(self, provider: trace.TracerProvider | None = None) -> None:
        self._provider = provider
        self._tracer: trace.Tracer | None = None

    def _resolve(self) -> trace.Tracer:
        if self._tracer is not None:
            return self._tracer
        provider = self._provider or trace.get_tracer_provider()
        if not isinstance(provider, TracerProvider):
            # resolved again next time: an SDK provider may be installed later
            return provider.get_tracer(sc.INSTRUMENTATION_NAME, sc.INSTRUMENTATION_VERSION, schema_url=sc.SCHEMA_URL)
        tracer = _OWN_TRACERS.get(provider)
        if tracer is None:  # one a provider: each registers an at-fork hook the interpreter keeps for good
            own = TracerProvider(sampler=ALWAYS_ON, resource=provider.resource, shutdown_on_exit=False,
                                 active_span_processor=provider._active_span_processor,  # pinned: test_sdk_contract
                                 id_generator=provider.id_generator)
            tracer = _OWN_TRACERS[provider] = own.get_tracer(sc.INSTRUMENTATION_NAME, sc.INSTRUMENTATION_VERSION,
                                                             schema_url=sc.SCHEMA_URL)
        self._tracer = tracer
        return tracer

    def start_span(self, name: str, context: Context | None = None, kind: SpanKind = SpanKind.INTERNAL,
                   attributes: Attributes = None, links: Sequence[Link] | None = None,
                   start_time: int | None = None) -> Span:
        return self._resolve().start_span(name, context=context, kind=kind, attributes=attributes, links=links,
                                          start_time=start_time)


SpanStarter = DeviationTracer | trace.Tracer


def audience_known(view: AuthView) -> bool:
    """An opaque token (or none) says nothing of its audience: unknown, never "empty"."""
    return view.verification not in _UNKNOWN_AUDIENCE


def lacks(view: AuthView, missing: tuple[frozenset[str], frozenset[str]]) -> bool:
    """Whether a call's token lacks what its tool requires (``missing``, of the policy's gap), known so: the
    deviation a call is given a span for at once, on either side."""
    return bool(missing[0] or missing[1]) and audience_known(view)


def known_missing(view: AuthView, requirement: Requirement) -> tuple[frozenset[str], frozenset[str]]:
    """What ``view`` lacks of ``requirement``, when that can be known; nothing when its audience is unknown."""
    return view.missing(requirement) if audience_known(view) else NOTHING_MISSING


@functools.lru_cache(maxsize=1024)
def auth_attributes(view: AuthView) -> Mapping[str, AttributeValue]:
    """The ``mcp_stream.auth.*`` attributes of a token; cached, tokens repeat on every request."""
    attrs: dict[str, AttributeValue] = {sc.AUTH_VERIFICATION: view.verification}
    if view.fingerprint is not None:
        attrs[sc.AUTH_FINGERPRINT] = view.fingerprint
        if audience_known(view):  # an opaque token's audience is unknown: no attribute, not an empty one
            attrs[sc.AUTH_AUDIENCE] = tuple(sorted(view.audience))
        if view.scopes:
            attrs[sc.AUTH_SCOPES] = tuple(sorted(view.scopes))
    if view.subject_hash is not None:
        attrs[sc.AUTH_SUBJECT_HASH] = view.subject_hash
    return MappingProxyType(attrs)


def sdk_parent(traceparent: str | None) -> Context | None:
    """The SDK's own request span, from the W3C ``traceparent`` it injects into ``params._meta``.

    Parsed here rather than through the propagator API: this runs once per call on the hot path. The
    client writes it, so anything that is not a W3C ``traceparent`` means no parent, never an error."""
    if traceparent is None:
        return None
    parsed = _TRACEPARENT.match(traceparent)
    if parsed is None:
        return None
    version, trace_id, span_id, flags = parsed.groups()
    ctx = SpanContext(int(trace_id, 16), int(span_id, 16), is_remote=True, trace_flags=TraceFlags(int(flags, 16)))
    if version == "ff" or not ctx.is_valid:
        return None
    return trace.set_span_in_context(NonRecordingSpan(ctx))


Description = tuple[str, dict[str, AttributeValue]]  # a span's name and attributes
Identify = Callable[[str | None, Any], str]  # a call's fingerprint, of its tool and its arguments
# What a side saw of an exchange when its response started: HTTP method, content, protocol version,
# resume cursor. A stream keeps this tuple and builds its opening attributes only if it becomes a span.
Opening = tuple[str, str, str | None, str | None]
# A frame event's content, as seen: frame kind, event id, event type, request id, method. A deferred
# stream keeps this tuple per frame and builds the event's attributes only if it becomes a span.
FrameFields = tuple[str, str | None, str | None, str | None, str | None]


def _frame_attributes(fields: FrameFields) -> dict[str, AttributeValue]:
    kind, event_id, event_type, request_id, method = fields
    attrs: dict[str, AttributeValue] = {sc.FRAME_KIND: kind}
    if event_id is not None:
        attrs[sc.EVENT_ID] = event_id
    if event_type is not None:
        attrs[sc.EVENT_TYPE] = event_type
    if request_id is not None:
        attrs[sc.JSONRPC_REQUEST_ID] = request_id
    if method is not None:
        attrs[sc.MCP_METHOD_NAME] = method
    return attrs


def _attributes(attrs: Mapping[str, AttributeValue] | FrameFields) -> Mapping[str, AttributeValue]:
    return _frame_attributes(attrs) if isinstance(attrs, tuple) else attrs


class _Deferred:
    """A span's content, kept until the span is worth creating; then the span, backdated.

    Calls and streams are deferred spans. Their name and attributes are only described (``describe``)
    when the span is created: on the healthy path, which creates none, they are never built."""

    __slots__ = ("_events", "_links", "closed", "parent", "span", "span_kind", "start_time", "traceparent")

    def __init__(self, span_kind: SpanKind, start_time: int | None, traceparent: str | None) -> None:
        self.span_kind = span_kind
        self.start_time = start_time or time.time_ns()
        self.traceparent = traceparent  # the parent, as the SDK sent it: parsed only if a span is made
        self.parent: Context | None = None
        self._events: list[tuple[str, Mapping[str, AttributeValue] | FrameFields, int]] | None = None
        self._links: list[tuple[SpanContext, Mapping[str, AttributeValue]]] | None = None
        self.span: Span | None = None
        self.closed = False  # the span has ended: nothing more goes on it

    def describe(self) -> Description:
        raise NotImplementedError

    def event(self, name: str, attrs: Mapping[str, AttributeValue] | FrameFields, timestamp: int | None = None) -> None:
        """An event now, or at ``timestamp`` (when what it records was seen, for a held stream read later)."""
        if self.closed:
            return
        if self.span is not None:
            self.span.add_event(name, _attributes(attrs), timestamp)
        elif self._events is None:  # a list, not a deque: most calls get one event, which no span ever reads
            self._events = [(name, attrs, timestamp or time.time_ns())]
        else:
            events = self._events
            if len(events) >= MAX_DEFERRED_EVENTS:
                del events[0]  # the oldest goes, as the span's own limit would drop it
            events.append((name, attrs, timestamp or time.time_ns()))

    def link(self, ctx: SpanContext, attrs: Mapping[str, AttributeValue]) -> None:
        if self.closed:
            return
        if self.span is not None:
            self.span.add_link(ctx, attrs)
        elif self._links is None:
            self._links = [(ctx, attrs)]
        else:
            self._links.append((ctx, attrs))

    def close(self, attributes: Mapping[str, AttributeValue], end_time: int | None = None) -> None:
        """End the span (it must exist) with its last attributes, now or at ``end_time``."""
        if self.span is not None and not self.closed:
            self.closed = True
            self.span.set_attributes(attributes)
            self.span.end(end_time)

    def create(self, tracer: SpanStarter, context: Context | None = None) -> Span:
        if self.span is None:
            if self.parent is None and self.traceparent is not None:
                self.parent = sdk_parent(self.traceparent)
            name, attributes = self.describe()
            self.span = tracer.start_span(name, context=self.parent if self.parent is not None else context,
                                          kind=self.span_kind, attributes=attributes,
                                          links=[Link(c, a) for c, a in self._links or ()],
                                          start_time=self.start_time)
            for event, attrs, timestamp in self._events or ():
                self.span.add_event(event, _attributes(attrs), timestamp)
            self._events = None
        return self.span


_SDK_REQUEST_LINK = MappingProxyType({sc.LINK_TYPE: sc.LINK_SDK_REQUEST})


class Call(_Deferred):
    """A ``tools/call`` as one side saw its request, until its terminal event."""

    __slots__ = ("_arguments", "_fingerprint", "_identify", "_sdk_request", "auth", "decision", "done", "ended_by",
                 "held_on", "key", "last_event", "method", "missing", "on_exchange", "open_streams", "protocol_version",
                 "ran", "replaying", "requirement", "role", "sdk_span", "stateless", "stored_result", "streams", "tool")

    def __init__(self, key: CallKey, tool: str | None, method: str, role: str, auth: AuthView,
                 protocol_version: str | None, stateless: bool, start_time: int, traceparent: str | None,
                 identify: Identify | None, arguments: Any) -> None:
        # _Deferred's fields set here, not by its ``__init__``: one call fewer, with every call a side sees
        self.span_kind = SpanKind.INTERNAL
        self.start_time = start_time
        self.traceparent = traceparent
        self.parent = self._events = self._links = self.span = None
        self.closed = False
        self.key = key
        self.tool = tool
        self.method = method
        self.role = role
        self.auth = auth  # the token the request presented
        self.protocol_version = protocol_version
        self.stateless = stateless
        self.requirement: Requirement | None = None
        self.missing = NOTHING_MISSING  # of the requirement: resources, scopes
        self.decision: str | None = None  # the server's policy decision
        self.streams = 0
        self.open_streams = 0  # streams carrying it that have not ended
        self.done = False
        self.ended_by: Terminal | None = None  # where the terminal event that ended it came (``Tracker.deliver``)
        self._identify = identify  # client, stateless: computes the fingerprint, only if it is ever needed
        self._arguments = arguments  # what it computes it of, with the tool: kept until then, never exported
        self._fingerprint: str | None = None
        self.sdk_span: SdkSpan | None = None  # the SDK's own span for this request, while it is open
        self.held_on: Holder | None = None  # who holds a stream carrying it: read before anything else judges it
        self._sdk_request: Context | None = None  # (server) where the SDK's own span is current (``in_sdk_request``)
        self.on_exchange = False  # (server) the exchange that carried its request still lasts
        self.ran = False  # (server) the SDK ran its request (``in_sdk_request``)
        self.last_event: str | None = None  # where the latest stream of it to end stopped: its client resumes there
        # (server) its terminal event's store: event id, outcome, when. Sent on a stream, it ends the call; until
        # then a stream open, or its exchange, may still carry it: ``Tracker.unsent`` once none is left to
        self.stored_result: tuple[str, str, int] | None = None
        # (server) resumes of its stream whose replay is under way: the SDK takes one for the call's stream only once
        # its replay returns, and drops what the call stores meanwhile, unless the store sends it itself (the guard's
        # live tail): ``Tracker.replayed``
        self.replaying = 0

    @property
    def fingerprint(self) -> str | None:
        """Salted hash of the tool and its canonical arguments: which call this is, for matching a re-issue."""
        if self._fingerprint is None and self._identify is not None:
            self._fingerprint = self._identify(self.tool, self._arguments)
            self._identify = self._arguments = None
        return self._fingerprint

    def in_sdk_request(self, context: Context) -> None:
        """(server) The SDK's own ``tools/call`` span is current in ``context``: the call's span links to it
        (``sdk_request``). A call not yet a span keeps the context, and reads the span off it only if it
        gets a span while its exchange lasts, or is still pending when the exchange ends
        (``exchange_over``): the healthy path never reads it (some 6k instructions a call)."""
        self._sdk_request = context
        self.ran = True
        if self.span is not None:
            self._link_sdk_request()

    def exchange_over(self) -> None:
        """(server) The exchange that carried the call is over: a call still pending may yet get a span (a
        resume, an eviction), so it links the SDK's request span now and lets go of the context."""
        self.on_exchange = False
        if self.done:
            self._sdk_request = None
        else:
            self._link_sdk_request()

    def _link_sdk_request(self) -> None:
        """Link the SDK's request span off the kept context, if any, and let go of the context."""
        context, self._sdk_request = self._sdk_request, None
        if context is not None:
            sdk = trace.get_current_span(context).get_span_context()
            if sdk.is_valid:
                self.link(sdk, _SDK_REQUEST_LINK)

    def create(self, tracer: SpanStarter, context: Context | None = None) -> Span:
        self._link_sdk_request()
        return _Deferred.create(self, tracer, context)

    def require(self, requirement: Requirement | None, missing: tuple[frozenset[str], frozenset[str]],
                decision: str | None = None) -> None:
        """What the policy says of this call: recorded on its span, now or when it is created."""
        self.requirement, self.missing, self.decision = requirement, missing, decision
        if self.span is not None and not self.closed:
            self.span.set_attributes(self._policy_attributes())

    def describe(self) -> Description:
        session_id, request_id = self.key
        attrs: dict[str, AttributeValue] = {
            **auth_attributes(self.auth),
            sc.SPAN: sc.SPAN_CALL,
            sc.ROLE: self.role,
            sc.MCP_METHOD_NAME: self.method,
            sc.JSONRPC_REQUEST_ID: request_id,
            sc.ERA: sc.ERA_STATELESS if self.stateless else sc.ERA_RESUMABLE,
        }
        if self.tool is not None:
            attrs[sc.GEN_AI_TOOL_NAME] = self.tool
        if session_id is not None:
            attrs[sc.MCP_SESSION_ID] = session_id
        if self.protocol_version is not None:
            attrs[sc.MCP_PROTOCOL_VERSION] = self.protocol_version
        fingerprint = self.fingerprint
        if fingerprint is not None:
            attrs[sc.CALL_ARGUMENTS_HASH] = fingerprint
        if self.stateless:
            _request_span(attrs, self.traceparent)
        attrs.update(self._policy_attributes())
        name = f"{sc.SPAN_NAME_CALL} {self.method}" + (f" {self.tool}" if self.tool else "")
        return name, attrs

    def _policy_attributes(self) -> dict[str, AttributeValue]:
        attrs = requirement_attributes(self.requirement, self.missing if audience_known(self.auth) else NOTHING_MISSING)
        if self.decision is not None:
            attrs[sc.POLICY_DECISION] = self.decision
        return attrs


def requirement_attributes(requirement: Requirement | None,
                           missing: tuple[frozenset[str], frozenset[str]]) -> dict[str, AttributeValue]:
    """``mcp_stream.required.*`` of a requirement and ``mcp_stream.auth.missing_*``: what a token lacks of it."""
    attrs: dict[str, AttributeValue] = {}
    if requirement is not None:
        attrs[sc.REQUIRED_RESOURCES] = sorted(requirement.resources)
        if requirement.scopes:
            attrs[sc.REQUIRED_SCOPES] = sorted(requirement.scopes)
    missing_resources, missing_scopes = missing
    if missing_resources:
        attrs[sc.AUTH_MISSING_RESOURCES] = sorted(missing_resources)
    if missing_scopes:
        attrs[sc.AUTH_MISSING_SCOPES] = sorted(missing_scopes)
    return attrs


class Stream(_Deferred):
    """One HTTP response on the MCP endpoint, and the calls it carries."""

    __slots__ = ("again", "auth", "calls", "ended", "error_frames", "events", "first_event_id", "holder", "kind",
                 "last_event_id", "moved", "opened", "repeated_ids", "request_ids", "role", "session_id", "status",
                 "terminal_ids")

    def __init__(self, session_id: str | None, kind: str, role: str, auth: AuthView,
                 opened: Mapping[str, AttributeValue] | Opening, status: int | None, calls: list[Call], *,
                 span_kind: SpanKind, start_time: int | None = None) -> None:
        super().__init__(span_kind, start_time, None)
        self.session_id = session_id
        self.kind = kind
        self.role = role
        self.auth = auth  # the token this request presented
        self.opened = opened  # what the side saw of the exchange when the response started
        self.status = status
        self.calls = calls
        # what a resume from any of its events continues (one call, the usual: no comprehension's call)
        self.request_ids = (calls[0].key[1],) if len(calls) == 1 else tuple([c.key[1] for c in calls])
        self.terminal_ids: tuple[str, ...] = ()
        # it brought the result of a call delivered before (a duplicate: its span tells); of those, the calls whose
        # first delivery left no span, which its span names (``Tracker.deliver``)
        self.again = False
        self.repeated_ids: tuple[str, ...] = ()
        self.events = 0
        self.error_frames = 0
        self.first_event_id: str | None = None
        self.last_event_id: str | None = None
        self.ended = False
        self.moved = 0  # a resume: when it last told that it moves its calls on (``Tracker._moving``)
        self.holder: Holder | None = None  # its side holds its frames, unread (``Tracker.hold``)

    def pending(self) -> list[Call]:
        return [c for c in self.calls if not c.done]

    def _opened(self) -> Mapping[str, AttributeValue]:
        return stream_attributes(*self.opened) if isinstance(self.opened, tuple) else self.opened

    def also(self, attrs: Mapping[str, AttributeValue]) -> None:
        """More of what its side saw as the response started (why the SDK refused it)."""
        if self.span is not None:  # made as it opened (a resume)
            self.span.set_attributes(attrs)
            return
        self.opened = {**self._opened(), **attrs}

    def describe(self) -> Description:
        """The token goes on the call spans of a POST, and on the stream span of every other kind."""
        opened = self._opened()
        attrs: dict[str, AttributeValue] = {sc.SPAN: sc.SPAN_STREAM, sc.ROLE: self.role,
                                            sc.STREAM_KIND: self.kind, **opened}
        if self.kind != sc.STREAM_KIND_POST:
            attrs.update(auth_attributes(self.auth))
        if self.status is not None:
            attrs[sc.HTTP_RESPONSE_STATUS_CODE] = self.status
        if self.session_id is not None:
            attrs[sc.MCP_SESSION_ID] = self.session_id
        if self.calls:
            attrs[sc.STREAM_REQUEST_IDS] = list(self.request_ids[:sc.MAX_ITEMS])
            if len(self.calls) == 1:
                call = self.calls[0]
                if call.tool is not None:
                    attrs[sc.GEN_AI_TOOL_NAME] = call.tool
                if call.stateless:
                    _request_span(attrs, call.traceparent)
                    fingerprint = call.fingerprint  # (client) as on its call span: either span tells the break's
                    if fingerprint is not None:
                        attrs[sc.CALL_ARGUMENTS_HASH] = fingerprint
        return f"{sc.SPAN_NAME_STREAM} {self.kind}", attrs


def _request_span(attrs: dict[str, AttributeValue], traceparent: str | None) -> None:
    """A stateless call's request span id, from the traceparent its request carried (W3C: version, trace id,
    parent id, flags), when it is one: both sides read the same request, so both name the same span."""
    parsed = _TRACEPARENT.match(traceparent) if traceparent is not None else None  # as ``sdk_parent`` reads it
    if parsed is not None and parsed.group(3) != "0" * 16:
        attrs[sc.CALL_REQUEST_SPAN_ID] = parsed.group(3)


Terminal = tuple[str, str | None]  # where a call's terminal event came: the stream's kind, the event's id
