"""One exchange on the MCP endpoint, an HTTP request and its response, as the hooks and the guard read it.

Which headers matter, what a request body asks for (its ``tools/call`` requests, the protocol version
it negotiates, the calls it cancels), what each request requires under a tool policy, which stream
the SDK's event store files a request's events under, and the attributes a stream span opens with.
Both hooks and the guard read an exchange through this module, so they cannot disagree about it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, Final, NamedTuple

from opentelemetry.util.types import AttributeValue

from mcp_stream_exporter import semconv as sc
from mcp_stream_exporter.auth import NO_REQUIREMENT, Requirement, ToolPolicy
from mcp_stream_exporter.wire import (
    CANCELLED,
    INITIALIZE,
    MAX_PARSED_BODY,
    TOOLS_CALL,
    WireMessage,
    classify_parsed,
    parse,
    request_message,
    sdk_call,
)

SESSION_ID: Final = "mcp-session-id"
AUTHORIZATION: Final = "authorization"
PROTOCOL_VERSION: Final = "mcp-protocol-version"
LAST_EVENT_ID: Final = "last-event-id"
CONTENT_TYPE: Final = "content-type"
CONTENT_ENCODING: Final = "content-encoding"
# the headers the hooks read: their names on the wire (lower-case bytes), to the names the hooks key them by
REQUEST_HEADERS: Final[Mapping[bytes, str]] = {n.encode(): n for n in (SESSION_ID, AUTHORIZATION, PROTOCOL_VERSION,
                                                                        LAST_EVENT_ID)}
RESPONSE_HEADERS: Final[Mapping[bytes, str]] = {n.encode(): n for n in (SESSION_ID, CONTENT_TYPE, CONTENT_ENCODING)}

CONTENT_SSE: Final = "sse"
CONTENT_JSON: Final = "json"
CONTENT_NONE: Final = "none"

# The SDK's event-store stream id of the standalone GET stream (``streamable_http.GET_STREAM_KEY``);
# every other stream's id is its request's JSON-RPC id. Pinned by tests/integration/test_sdk_contract.py.
STANDALONE_STREAM_ID: Final = "_GET_stream"
_STATELESS_FROM: Final = "2026-07-28"


def stream_id_of(request_id: str | None) -> str:
    """The stream the SDK's event store files a message's events under: a POST's SSE stream is its
    request's JSON-RPC id (as a string); a message related to no request goes to the standalone GET's."""
    return STANDALONE_STREAM_ID if request_id is None else request_id


def request_id_of(stream_id: str) -> str | None:
    """The JSON-RPC id of the request whose stream this is; None for the standalone GET stream."""
    return None if stream_id == STANDALONE_STREAM_ID else stream_id


def content_of(content_type: str) -> str:
    """What a response carries: an SSE stream, one JSON body, or neither. A media type is case-insensitive: the
    SDK's client reads it lower-cased (a proxy may send ``Text/Event-Stream``)."""
    if content_type.startswith("text/event-stream"):
        return CONTENT_SSE
    if content_type.startswith("application/json"):
        return CONTENT_JSON
    lowered = content_type.lower()
    return content_of(lowered) if lowered != content_type else CONTENT_NONE


class Body(NamedTuple):
    """What one POST body asks for, as far as streams and calls are concerned (a tuple: read on every
    request, built once)."""

    calls: tuple[WireMessage, ...] = ()  # tools/call requests, each with an id
    requests: tuple[WireMessage, ...] = ()  # every request with an id, tools/call included
    protocol_version: str | None = None  # what an initialize request proposes
    cancelled: tuple[str, ...] = ()  # request ids of notifications/cancelled


UNREAD: Final = Body()
# Builds a Body from all its fields in order, in one C call (a NamedTuple's constructor is a Python function)
_body: Callable[[tuple[Any, ...]], Body] = functools.partial(tuple.__new__, Body)
# A JSON string decodes to one of these methods only if the method's bytes are in the body as they are,
# or the body escapes something (``\/``, ``\u0074``): a body with neither cannot ask for one of them.
_CALL, _CANCEL, _INITIALIZE = (m.encode() for m in (TOOLS_CALL, CANCELLED, INITIALIZE))


def read_body(body: bytes) -> Body:
    """The requests in a POST body; ``UNREAD`` for one too large to parse (observed, not read)."""
    if not body or len(body) > MAX_PARSED_BODY:
        return UNREAD
    try:  # JSON-RPC on MCP's transports is UTF-8 (``parse``)
        text = body.decode()
    except UnicodeDecodeError:
        return UNREAD
    msg = sdk_call(text)  # the usual: one call, as the SDK writes it
    if msg is not None:
        one = (msg,)
        return _body((one, one, None, ()))
    obj = parse(text)
    if type(obj) is dict and obj.get("method") == TOOLS_CALL and "id" in obj:  # the usual: one call, read as
        msg = request_message(obj["id"], TOOLS_CALL, obj.get("params"))        # ``classify`` reads it
        if msg.id is not None:
            one = (msg,)
            return _body((one, one, None, ()))
    messages = classify_parsed(obj)
    calls: list[WireMessage] = []
    requests: list[WireMessage] = []
    cancelled: list[str] = []
    protocol_version = None
    for msg in messages:
        if msg.method is None:
            continue
        if msg.id is not None:
            requests.append(msg)
            if msg.method == TOOLS_CALL:
                calls.append(msg)
            elif msg.method == INITIALIZE and msg.protocol_version is not None:
                protocol_version = msg.protocol_version
        elif msg.method == CANCELLED and msg.cancelled_id is not None:
            cancelled.append(msg.cancelled_id)
    return Body(tuple(calls), tuple(requests), protocol_version, tuple(cancelled))


def read_message(message: dict[str, Any], body: bytes) -> Body | None:
    """What ``body``, the encoding of ``message`` (a client's ``json=``), asks for, read off ``message`` when that
    is one ``tools/call`` whose every member the hooks read has JSON's own type (not a subclass, whose encoding and
    ``str`` may differ), as the SDK's calls have: as ``read_body`` reads ``body``, without decoding and parsing it
    again. Its arguments are ``body``'s, parsed only if something needs them (``EncodedArguments``). None for
    anything else, which is for ``read_body``."""
    if len(body) > MAX_PARSED_BODY:
        return UNREAD
    request_id, method, params = message.get("id"), message.get("method"), message.get("params")
    if (type(method) is not str or method != TOOLS_CALL or (type(request_id) is not str and type(request_id) is not int)
            or (type(params) is not dict and isinstance(params, dict)) or not _str_keys(message)):
        return None
    if type(params) is dict:
        meta = params.get("_meta")
        if (type(meta) is not dict and isinstance(meta, dict)) or not _str_keys(params) or (
                type(meta) is dict and not _str_keys(meta)):
            return None
        for value in (params.get("name"), params.get("protocolVersion"),
                      meta.get("traceparent") if type(meta) is dict else None):
            if type(value) is not str and isinstance(value, str):
                return None
    one = (request_message(request_id, TOOLS_CALL, params, EncodedArguments(body)),)
    return _body((one, one, None, ()))


def _str_keys(members: dict[Any, Any]) -> bool:
    """Whether every key is a ``str`` itself: a subclass's may hash and compare as another key than it is written."""
    return _STR.issuperset(map(type, members))  # in C: a generator's frame costs more than these few keys


_STR: Final = frozenset({str})


class EncodedArguments:
    """A call's arguments as the body that carried them (``read_message``): what went on the wire, parsed only if
    something needs them (a re-issue's fingerprint), and never the object its client encoded, which it may change
    after or which may hold what JSON writes otherwise (keys that are not strings)."""

    __slots__ = ("_body",)

    def __init__(self, body: bytes) -> None:
        self._body = body

    def value(self) -> Any:
        """The arguments; ``ValueError`` if the body no longer reads as its call (nested too deep to parse here)."""
        calls = read_body(self._body).calls
        if not calls:
            raise ValueError("the call's body does not parse")
        return calls[0].arguments


def can_ask(body: bytes) -> bool:
    """Whether ``body`` may hold a ``tools/call``, a ``notifications/cancelled`` or an ``initialize``,
    by a byte search: False only when no parse of it could find one (``read_body`` would give no calls,
    no cancels and no protocol version), so the hooks parse only the bodies that can matter to them."""
    # ``find``, not ``in``: ``bytes in bytes`` first tries its operand as an int, and raises and clears a
    # TypeError (with its message formatted) before it searches, on every request
    return (body.find(_CALL) >= 0 or body.find(_CANCEL) >= 0 or body.find(_INITIALIZE) >= 0
            or body.find(b"\\") >= 0)


def calls_only(body: bytes) -> bool:
    """Whether ``body``, one ``can_ask`` let through, can hold nothing the hooks read but ``tools/call``
    requests (no cancel, no initialize, nothing escaped): its calls are the ones the SDK's server
    middleware hands over, already parsed, and it needs reading only for calls the middleware never sees."""
    # ``can_ask``: ``find``, not ``in``; the backslash first: a byte's search is the fastest, and a body of
    # text arguments often has one (an escaped newline or quote), which spares the other two searches
    return body.find(b"\\") < 0 and body.find(_CANCEL) < 0 and body.find(_INITIALIZE) < 0


def most_calls(body: bytes) -> int:
    """At most how many ``tools/call`` requests ``body`` holds (one ``calls_only`` accepts): each has the
    method's bytes as they are, so counting them bounds it."""
    return body.count(_CALL)


def requirement_of(policy: ToolPolicy, tool: str | None) -> Requirement:
    """What a request's stream requires: the policy's requirement for a ``tools/call`` of ``tool``;
    nothing for a tool the policy does not name, or for any other request (``tool`` None)."""
    return policy.requirement(tool) or NO_REQUIREMENT


def era_of(protocol_version: str | None) -> str:
    """2026-07-28 and later have no sessions and no resumption; earlier versions do."""
    if protocol_version is not None and protocol_version >= _STATELESS_FROM:
        return sc.ERA_STATELESS
    return sc.ERA_RESUMABLE


def stream_kind(http_method: str, cursor: str | None) -> str:
    """A POST answers requests; a GET with ``Last-Event-ID`` resumes, without it opens the standalone stream."""
    if http_method == "POST":
        return sc.STREAM_KIND_POST
    if http_method == "DELETE":
        return sc.STREAM_KIND_DELETE
    return sc.STREAM_KIND_RESUME if cursor else sc.STREAM_KIND_GET


def stream_attributes(http_method: str, content: str, protocol_version: str | None,
                      cursor: str | None) -> dict[str, AttributeValue]:
    """The attributes a stream span opens with, on either side."""
    attrs: dict[str, AttributeValue] = {sc.HTTP_REQUEST_METHOD: http_method, sc.STREAM_CONTENT: content,
                                        sc.ERA: era_of(protocol_version)}
    if protocol_version is not None:
        attrs[sc.MCP_PROTOCOL_VERSION] = protocol_version
    if cursor:
        attrs[sc.RESUME_CURSOR] = cursor
    return attrs
