"""Spans -> lifecycle events: the span model (docs/span-model.md) read back, checked and typed.

A :class:`Span` is what every source (OTLP protobuf or JSON, an in-process ``ReadableSpan``)
becomes; :func:`lifecycle` turns one into the event the ledger understands, or says why it
cannot. Spans that are not part of the model and not the SDK's MCP spans are ignored, not rejected.
"""

from __future__ import annotations

import hashlib
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mcp_stream_exporter import semconv as sc
from mcp_stream_exporter.auth import canonical_resources
from mcp_stream_exporter.redaction import redact, redact_cut, redact_id

KIND_CLIENT = "client"
KIND_SERVER = "server"
KIND_INTERNAL = "internal"

_SDK_CLIENT_PREFIX = sc.SDK_CLIENT_SPAN_PREFIX
_TIMEOUT_CODES = frozenset({"-32001"})  # the SDK's "Request timed out"
_UNKNOWN_AUDIENCE = frozenset({sc.VERIFICATION_OPAQUE, sc.VERIFICATION_ABSENT})

# Bounds on what one span may make the detector keep: a longer list is refused, and a longer string is kept
# as a digest of it, never cut (a cut id would be another call's): a server's ids may be long (a JWT
# session id), and the same id gives the same digest on every span. Trace and span ids are hex of 16
# and 8 bytes, not all zero: OTLP calls any other invalid.
MAX_CHARS = sc.MAX_CHARS
MAX_ITEMS = sc.MAX_ITEMS
_NO_TRACE_ID = "0" * 32
_NO_SPAN_ID = "0" * 16


@dataclass(slots=True)
class Span:
    """One finished span, from any source; ids are lower-case hex."""

    trace_id: str
    span_id: str
    parent_span_id: str | None
    name: str
    kind: str
    start_ns: int
    end_ns: int
    attributes: Mapping[str, Any]
    exception_types: tuple[str, ...] = ()
    error: bool = False
    origin: str = ""  # the emitting process: resource service.instance.id, else service.name


# every attribute the span model's readers look at, by the type they take as it is (``clean``): an OTLP reader
# may skip the others without reading their values
MODEL_KEYS: dict[str, type] = {
    **dict.fromkeys((sc.SPAN, sc.ROLE, sc.ERA, sc.MCP_SESSION_ID, sc.STREAM_KIND, sc.END_REASON, sc.EVENT_FIRST_ID,
                     sc.EVENT_LAST_ID, sc.RESUME_CURSOR, sc.GEN_AI_TOOL_NAME, sc.AUTH_FINGERPRINT, sc.AUTH_VERIFICATION,
                     sc.JSONRPC_REQUEST_ID, sc.CALL_OUTCOME, sc.TERMINAL_EVENT_ID, sc.TERMINAL_STREAM_KIND,
                     sc.CALL_ARGUMENTS_HASH, sc.CALL_REQUEST_SPAN_ID, sc.REPLAY_DECISION, sc.REPLAY_SENT_LAST_ID,
                     sc.REPLAY_OFFENDING_EVENT_ID, sc.GUARD_DECISION, sc.SESSION_OWNER), str),
    **dict.fromkeys((sc.HTTP_RESPONSE_STATUS_CODE, sc.EVENTS_COUNT, sc.ERROR_FRAMES_COUNT, sc.REPLAY_BUFFERED,
                     sc.REPLAY_SENT, sc.REPLAY_SKIPPED), int),
    **dict.fromkeys((sc.STREAM_REQUEST_IDS, sc.PENDING_REQUEST_IDS, sc.RUNNING_REQUEST_IDS, sc.TERMINAL_REQUEST_IDS,
                     sc.REPEATED_REQUEST_IDS, sc.REQUIRED_RESOURCES, sc.REQUIRED_SCOPES, sc.AUTH_AUDIENCE,
                     sc.AUTH_MISSING_RESOURCES, sc.AUTH_MISSING_SCOPES, sc.AUTH_SCOPES, sc.REPLAY_FOREIGN_EVENT_IDS),
                    tuple),
}


def clean(value: object, kind: type) -> bool:
    """Whether the readers take ``value`` of a key of ``kind`` (``MODEL_KEYS``) as it is: nothing to coerce,
    cut, redact or refuse. A reader of OTLP checks each encoded value once, and hands a span whose values
    all are to :func:`model_event` unchecked."""
    if value is None:
        return True
    if type(value) is not kind:
        return False
    if type(value) is str:
        return len(value) <= MAX_CHARS and redact(value) == value
    if type(value) is tuple:
        return len(value) <= MAX_ITEMS and all(type(v) is str and clean(v, str) for v in value)
    return isinstance(value, int) and value >= 0  # an int (not a bool: its type is not int): a count or a status


def origin_of(resource: Mapping[str, Any]) -> str:
    """Which process emitted a span, from its resource: ``service.instance.id``, else ``service.name``."""
    return str(resource.get("service.instance.id") or resource.get("service.name") or "")


class Rejected(ValueError):
    """A span that claims to be part of the model but breaks it; the reason goes back to the sender."""


@dataclass(slots=True)
class Token:
    """The ``mcp_stream.auth.*`` view of the token on a request, as the span carries it.

    The gap is the span's ``auth.missing_*`` or, when a producer sent only the audience (and scopes)
    with ``required.*``, computed here. A token whose audience is unknown (opaque, absent, or no
    ``auth.audience`` and no ``auth.missing_*``) has no gap: unknown is never "missing"."""

    audience: tuple[str, ...] = ()
    fingerprint: str | None = None
    missing_resources: tuple[str, ...] = ()
    missing_scopes: tuple[str, ...] = ()

    @property
    def gap(self) -> bool:
        return bool(self.missing_resources or self.missing_scopes)


@dataclass(slots=True)
class Common:
    """What every event of the model has: who saw it, where it sits in a trace, whose session."""

    role: str
    era: str
    scope: str  # the session id, or ``trace:<id>[/<request span id>]`` where there is none (2026-07-28)
    session_id: str | None
    trace_id: str
    span_id: str
    start_ns: int
    end_ns: int
    origin: str


@dataclass(slots=True)
class StreamEnd:
    at: Common
    kind: str
    reason: str
    status: int | None
    request_ids: tuple[str, ...]
    pending_ids: tuple[str, ...]
    terminal_ids: tuple[str, ...]
    events: int
    error_frames: int
    first_event_id: str | None
    last_event_id: str | None
    cursor: str | None
    tool: str | None
    required: tuple[str, ...]
    token: Token
    running_ids: tuple[str, ...] = ()  # (server) pending calls whose tool had not answered yet
    repeated_ids: tuple[str, ...] = ()  # of the terminal ids, calls its side saw answered before, leaving no span
    # (server) a 404 the SDK gave another principal than the session's: no sign the session is gone
    other_owner: bool = False
    fingerprint: str | None = None  # (client, 2026-07-28) its one call's arguments fingerprint, as on the call's span


@dataclass(slots=True)
class CallEnd:
    at: Common
    request_id: str
    tool: str | None
    outcome: str
    required: tuple[str, ...]
    token: Token
    terminal_event_id: str | None
    sdk_span_id: str | None  # client: the SDK's request span, this span's parent
    terminal_stream_kind: str | None = None  # where the terminal event went; server: absent when only stored
    fingerprint: str | None = None  # client: the salted hash of tool and arguments (matches a re-issue)

    @property
    def stored_only(self) -> bool:
        """(server) The span ended when the terminal event was stored, with no stream open to carry it."""
        return (self.at.role == sc.ROLE_SERVER and self.outcome in _TERMINAL
                and self.terminal_stream_kind is None)


@dataclass(slots=True)
class Replay:
    at: Common
    cursor: str
    request_id: str | None
    decision: str
    buffered: int
    sent: int
    sent_last_id: str | None
    offending_event_id: str | None
    skipped: int
    foreign_event_ids: tuple[str, ...]
    guard_decision: str | None
    required: tuple[str, ...]
    token: Token


@dataclass(slots=True)
class Operation:
    """The SDK's own span of an MCP request (semconv ``mcp.*``): counts, durations, timeouts."""

    role: str
    method: str
    tool: str | None
    trace_id: str
    span_id: str
    start_ns: int
    duration_s: float
    error_type: str | None
    timed_out: bool
    origin: str
    transport: str | None  # semconv network.transport; the SDK (2.3) sets none
    protocol_version: str | None  # mcp.protocol.version; the SDK (2.3) sets it on its server spans only


Lifecycle = StreamEnd | CallEnd | Replay | Operation


def read_by_rules(e: Operation) -> bool:
    """A client's give-up or failure of a ``tools/call``: the one kind of SDK request span that rules and
    timelines read. Every other one only counts toward the metrics."""
    return e.role == KIND_CLIENT and e.method == "tools/call" and (e.timed_out or e.error_type is not None)

_TERMINAL = frozenset({sc.OUTCOME_RESULT, sc.OUTCOME_TOOL_ERROR, sc.OUTCOME_ERROR})


def lifecycle(span: Span) -> Lifecycle | None:
    """The lifecycle event a span stands for; None for a span outside the model.

    Raises :class:`Rejected` for a span that claims a place in the model but cannot hold it."""
    a = span.attributes
    if a.get(sc.SPAN) is None:
        return _operation(span) if sc.MCP_METHOD_NAME in a and span.kind != KIND_INTERNAL else None
    return model_event(a, (span.trace_id, span.span_id, span.parent_span_id, span.start_ns, span.end_ns,
                           cut_origin(span.origin)))


# where a model span sits: its trace, span and parent span ids (hex), start, end, and origin (cut and redacted)
Where = tuple[str, str, str | None, int, int, str]


def model_event(a: Mapping[str, Any], where: Where, checked: bool = True) -> StreamEnd | CallEnd | Replay:
    """The event of a model span (``mcp_stream.span`` set). ``checked=False`` is for a caller that found every
    value of ``MODEL_KEYS`` in ``a`` ``clean``: the values are then taken as they are, with the same event
    (or refusal) as checking each one, at a fraction of the cost.

    Raises :class:`Rejected` for a span that cannot hold its place in the model."""
    text, number, texts = _CHECKED if checked else _AS_THEY_ARE
    model = a.get(sc.SPAN)
    if model == sc.SPAN_STREAM:
        return _stream(a, where, text, number, texts)
    if model == sc.SPAN_CALL:
        return _call(a, where, text, texts)
    if model == sc.SPAN_REPLAY:
        return _replay(a, where, text, number, texts)
    raise Rejected(f"unknown {sc.SPAN} {redact(str(model)[:MAX_CHARS])[:40]!r}")


def _present(value: str | None, key: str) -> str:
    if value is None:
        raise Rejected(f"missing {key}")
    return value


# the values the span model names for its enumerated attributes: any other is refused with its reason, not read as
# nothing in particular (a "CLEAN" end or a "canceled" call would otherwise miss a loss without a word)
_STREAM_KINDS = frozenset(sc.STREAM_KINDS)
_END_REASONS = frozenset((*sc.END_REASONS, sc.END_OPEN))
_OUTCOMES = frozenset({sc.OUTCOME_RESULT, sc.OUTCOME_TOOL_ERROR, sc.OUTCOME_ERROR, sc.OUTCOME_CANCELLED,
                       sc.OUTCOME_NO_TERMINAL, sc.OUTCOME_EVICTED, sc.OUTCOME_STORE_FAILED, sc.OUTCOME_CANCELLED_LATE,
                       sc.OUTCOME_REISSUED})
_DECISIONS = frozenset({sc.REPLAY_COMPLETE, sc.REPLAY_TRUNCATED, sc.REPLAY_REFUSED, sc.REPLAY_UNKNOWN_CURSOR,
                        sc.REPLAY_INTERRUPTED})


def _one_of(value: str | None, key: str, values: frozenset[str]) -> str:
    if value not in values:
        if value is None:
            raise Rejected(f"missing {key}")
        raise Rejected(f"{key} must be one of {', '.join(sorted(values))}")
    return value


def _str(a: Mapping[str, Any], key: str) -> str | None:
    value = a.get(key)
    if value is None:
        return None
    if type(value) is not str:
        value = _coerced(key, value)
    return redact_id(value) if len(value) <= MAX_CHARS else _digest(value)  # ids told apart: one may be a JWT


def _digest(value: str) -> str:
    """A string longer than the bound, as a digest of it: the same on every span, and never the value."""
    return f"[sha256:{hashlib.sha256(value.encode('utf-8', 'surrogatepass')).hexdigest()[:32]}]"


def _plain(a: Mapping[str, Any], key: str) -> str | None:
    """A bounded string, not redacted: only for values that are compared, or become a label from a closed set."""
    value = a.get(key)
    if value is None:
        return None
    if type(value) is not str:
        value = _coerced(key, value)
    if len(value) > MAX_CHARS:
        raise Rejected(f"{key} longer than {MAX_CHARS} characters")
    return value


def _coerced(key: str, value: object) -> str:
    """A string, or an int (request ids may arrive as ints from other SDKs), as a plain ``str``: a subclass (a
    ``(str, Enum)``, an ``IntEnum`` such as ``HTTPStatus``, which a span processor in process may be handed) by its
    value, not its ``__str__``, and never kept as it is (a timeline writes its steps with ``marshal``)."""
    if isinstance(value, str):
        return str.__str__(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise Rejected(f"{key} must be a string")
    return str(int.__index__(value))


def _int(a: Mapping[str, Any], key: str) -> int | None:
    value = a.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):  # a string of digits too: the span model says int
        raise Rejected(f"{key} must be an integer")
    if value < 0:  # every int of the model is a count or a status
        raise Rejected(f"{key} must not be negative")
    return value if type(value) is int else int.__index__(value)  # an IntEnum (``HTTPStatus``) by its value


def _strs(a: Mapping[str, Any], key: str) -> tuple[str, ...]:
    value = a.get(key)
    if value is None:
        return ()
    if type(value) is str:
        value = (value,)
    elif type(value) not in (tuple, list) and (
            not isinstance(value, Sequence) or isinstance(value, (str, bytes, bytearray))):
        raise Rejected(f"{key} must be a list of strings")
    if len(value) > MAX_ITEMS:
        raise Rejected(f"{key} has more than {MAX_ITEMS} items")
    items = []
    for v in value:
        if type(v) is not str:
            if isinstance(v, bool) or not isinstance(v, (str, int)):
                raise Rejected(f"{key} must be a list of strings")
            v = _coerced(key, v)
        items.append(redact_id(v) if len(v) <= MAX_CHARS else _digest(v))
    # a tuple of clean strings is kept as it came (an OTLP reader shares it from its memo of values)
    return value if type(value) is tuple and all(map(operator.is_, items, value)) else tuple(items)


# a reader of one attribute, (attributes, key) -> value: checked (``_str``, ``_int``, ``_strs``), or as it is
_Get = Callable[[Any, str], Any]
_CHECKED: tuple[_Get, _Get, _Get] = (_str, _int, _strs)
_AS_THEY_ARE: tuple[_Get, _Get, _Get] = (dict.get, dict.get, dict.get)


def _common(a: Mapping[str, Any], where: Where, text: _Get) -> Common:
    role = _present(text(a, sc.ROLE), sc.ROLE)
    if role not in (sc.ROLE_CLIENT, sc.ROLE_SERVER):
        raise Rejected(f"{sc.ROLE} must be client or server")
    era = text(a, sc.ERA) or sc.ERA_RESUMABLE
    if era not in (sc.ERA_RESUMABLE, sc.ERA_STATELESS):
        raise Rejected(f"{sc.ERA} must be resumable or stateless")
    session_id = text(a, sc.MCP_SESSION_ID)
    trace_id, span_id, parent_span_id, start_ns, end_ns, origin = where
    if end_ns < start_ns:
        raise Rejected("span ends before it starts")
    if (len(trace_id) != len(_NO_TRACE_ID) or len(span_id) != len(_NO_SPAN_ID) or trace_id == _NO_TRACE_ID
            or span_id == _NO_SPAN_ID or (parent_span_id is not None and len(parent_span_id) != len(_NO_SPAN_ID))):
        raise Rejected("trace or span id not of 16 or 8 bytes, or all zero")
    return Common(role, era, session_id or _sessionless(trace_id, text(a, sc.CALL_REQUEST_SPAN_ID)), session_id,
                  trace_id, span_id, start_ns, end_ns, origin)


def _sessionless(trace_id: str, request_span_id: str | None) -> str:
    """Where a call without a session (2026-07-28) is kept: its trace and, where its spans name it, the request
    span it went out in (two clients in one trace number their requests alike)."""
    return f"trace:{trace_id}" if request_span_id is None else f"trace:{trace_id}/{request_span_id}"


def cut_origin(origin: str) -> str:
    """The emitting process, cut (not refused: it is the resource's, shared by every span of a batch)."""
    return redact(origin[:MAX_CHARS])


_TOKEN_KEYS = (sc.AUTH_AUDIENCE, sc.AUTH_FINGERPRINT, sc.AUTH_VERIFICATION, sc.AUTH_MISSING_RESOURCES,
               sc.AUTH_MISSING_SCOPES, sc.AUTH_SCOPES)
_NO_TOKEN = Token()  # shared by every event whose span says nothing of a token (no reader changes a Token)


def _token(a: Mapping[str, Any], text: _Get, texts: _Get) -> Token:
    if a.keys().isdisjoint(_TOKEN_KEYS):
        return _NO_TOKEN  # most spans (a POST, a call's end): nothing to read, and no Token a timeline keeps each
    audience = texts(a, sc.AUTH_AUDIENCE) or ()
    fingerprint = text(a, sc.AUTH_FINGERPRINT)
    if text(a, sc.AUTH_VERIFICATION) in _UNKNOWN_AUDIENCE:
        return Token(audience, fingerprint)
    missing_resources = texts(a, sc.AUTH_MISSING_RESOURCES) or ()
    missing_scopes = texts(a, sc.AUTH_MISSING_SCOPES) or ()
    if sc.AUTH_AUDIENCE in a and sc.AUTH_MISSING_RESOURCES not in a:
        held = canonical_resources(audience)
        missing_resources = tuple(sorted(canonical_resources(texts(a, sc.REQUIRED_RESOURCES) or ()) - held))
    if sc.AUTH_SCOPES in a and sc.AUTH_MISSING_SCOPES not in a:
        missing_scopes = tuple(sorted(set(texts(a, sc.REQUIRED_SCOPES) or ()) - set(texts(a, sc.AUTH_SCOPES) or ())))
    return Token(audience, fingerprint, missing_resources, missing_scopes)


def _stream(a: Mapping[str, Any], where: Where, text: _Get, number: _Get, texts: _Get) -> StreamEnd:
    kind = _one_of(text(a, sc.STREAM_KIND), sc.STREAM_KIND, _STREAM_KINDS)
    reason = _one_of(text(a, sc.END_REASON), sc.END_REASON, _END_REASONS)
    return StreamEnd(
        _common(a, where, text), kind, reason, number(a, sc.HTTP_RESPONSE_STATUS_CODE),
        texts(a, sc.STREAM_REQUEST_IDS) or (), texts(a, sc.PENDING_REQUEST_IDS) or (),
        texts(a, sc.TERMINAL_REQUEST_IDS) or (), number(a, sc.EVENTS_COUNT) or 0, number(a, sc.ERROR_FRAMES_COUNT) or 0,
        text(a, sc.EVENT_FIRST_ID), text(a, sc.EVENT_LAST_ID), text(a, sc.RESUME_CURSOR),
        text(a, sc.GEN_AI_TOOL_NAME), texts(a, sc.REQUIRED_RESOURCES) or (), _token(a, text, texts),
        texts(a, sc.RUNNING_REQUEST_IDS) or (), texts(a, sc.REPEATED_REQUEST_IDS) or (),
        text(a, sc.SESSION_OWNER) == sc.SESSION_OWNER_OTHER, text(a, sc.CALL_ARGUMENTS_HASH),
    )


def _call(a: Mapping[str, Any], where: Where, text: _Get, texts: _Get) -> CallEnd:
    request_id = _present(text(a, sc.JSONRPC_REQUEST_ID), sc.JSONRPC_REQUEST_ID)
    outcome = _one_of(text(a, sc.CALL_OUTCOME), sc.CALL_OUTCOME, _OUTCOMES)
    return CallEnd(_common(a, where, text), request_id, text(a, sc.GEN_AI_TOOL_NAME), outcome,
                   texts(a, sc.REQUIRED_RESOURCES) or (), _token(a, text, texts), text(a, sc.TERMINAL_EVENT_ID),
                   where[2], text(a, sc.TERMINAL_STREAM_KIND), text(a, sc.CALL_ARGUMENTS_HASH))


def _replay(a: Mapping[str, Any], where: Where, text: _Get, number: _Get, texts: _Get) -> Replay:
    cursor = _present(text(a, sc.RESUME_CURSOR), sc.RESUME_CURSOR)
    decision = _one_of(text(a, sc.REPLAY_DECISION), sc.REPLAY_DECISION, _DECISIONS)
    return Replay(
        _common(a, where, text), cursor, text(a, sc.JSONRPC_REQUEST_ID), decision,
        number(a, sc.REPLAY_BUFFERED) or 0, number(a, sc.REPLAY_SENT) or 0, text(a, sc.REPLAY_SENT_LAST_ID),
        text(a, sc.REPLAY_OFFENDING_EVENT_ID), number(a, sc.REPLAY_SKIPPED) or 0,
        texts(a, sc.REPLAY_FOREIGN_EVENT_IDS) or (), text(a, sc.GUARD_DECISION), texts(a, sc.REQUIRED_RESOURCES) or (),
        _token(a, text, texts),
    )


def _operation(span: Span) -> Operation:
    return operation(span.kind, span.name, span.attributes, span.exception_types, span.error, span.trace_id,
                     span.span_id, span.start_ns, span.end_ns, cut_origin(span.origin))


def operation(kind: str, name: str, a: Mapping[str, Any], exception_types: tuple[str, ...], error: bool,
              trace_id: str, span_id: str, start_ns: int, end_ns: int, origin: str) -> Operation:
    """The SDK's request span (``mcp.method.name`` set, kind CLIENT or SERVER) read from its parts, so that
    a reader of OTLP needs no :class:`Span` for it; ``origin`` already cut and redacted."""
    # the method, the tool, the transport and the protocol version only become labels from closed sets
    # (metrics.py), where a token-shaped value cannot go: they are not redacted
    method = _plain(a, sc.MCP_METHOD_NAME) or ""
    tool = _plain(a, sc.GEN_AI_TOOL_NAME)
    if tool is None and method == "tools/call" and name.startswith(_SDK_CLIENT_PREFIX):
        tool = name[len(_SDK_CLIENT_PREFIX) + len(method) + 1:] or None  # the SDK names it only here
        tool = tool if tool is not None and len(tool) <= MAX_CHARS else None
    error_type = _str(a, sc.ERROR_TYPE)
    code = _plain(a, sc.RPC_RESPONSE_STATUS_CODE)
    timed_out = (code in _TIMEOUT_CODES or error_type in ("timeout", "TimeoutError")
                 or "TimeoutError" in exception_types)
    if error_type is None and (error or exception_types):
        # an exception type is as long as its sender made it (up to a span's bytes), and says what it likes (a token
        # too): cut and redacted like any string the timeline shows
        error_type = ("timeout" if timed_out else redact_cut(exception_types[0], MAX_CHARS) if exception_types
                      else "error")
    role = KIND_CLIENT if kind == KIND_CLIENT else KIND_SERVER
    transport, version = a.get(sc.NETWORK_TRANSPORT), a.get(sc.MCP_PROTOCOL_VERSION)  # often absent: read once
    return Operation(role, method, tool, trace_id, span_id, start_ns, max(0, end_ns - start_ns) / 1e9, error_type,
                     timed_out, origin, transport if transport is None else _plain(a, sc.NETWORK_TRANSPORT),
                     version if version is None else _plain(a, sc.MCP_PROTOCOL_VERSION))
