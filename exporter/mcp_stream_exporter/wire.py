"""What a JSON-RPC payload on the wire is: request, notification, response or error, and its ids.

Both hooks read POST bodies and SSE ``data:`` with this; only the fields the span model needs are
pulled out, and nothing of a payload is kept beyond them.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable
from typing import Any, Final, NamedTuple

from mcp_stream_exporter import semconv as sc

TOOLS_CALL: Final = "tools/call"
CANCELLED: Final = "notifications/cancelled"
INITIALIZE: Final = "initialize"
# JSON-RPC error code (the implementation-defined server range) for a call or a resume refused because
# the token does not grant what it requires: the guard answers with it, the hooks recognise it
REFUSED_ERROR_CODE: Final = -32003


class WireMessage(NamedTuple):
    """A JSON-RPC message, reduced to what the span model needs (a tuple: built once per message)."""

    kind: str  # one of semconv.FRAME_*
    id: str | None = None  # JSON-RPC id as a string (the semconv form), None for notifications
    method: str | None = None
    tool: str | None = None  # params.name of a tools/call
    is_tool_error: bool = False  # a result with isError: true
    traceparent: str | None = None  # params._meta.traceparent of a request
    cancelled_id: str | None = None  # params.requestId of notifications/cancelled
    protocol_version: str | None = None  # params.protocolVersion of initialize / its result
    arguments: Any = None  # params.arguments of a tools/call, as parsed: for a fingerprint, never kept
    error_code: int | None = None  # error.code of an error response

    @property
    def is_terminal(self) -> bool:
        """A response or error: the event that completes its request."""
        return self.kind in (sc.FRAME_RESPONSE, sc.FRAME_ERROR)


UNPARSEABLE = WireMessage(sc.FRAME_OTHER)
# Builds a WireMessage from all its fields in order, in one C call: a NamedTuple's own constructor is a
# Python function, and the hooks build one for every request and every frame.
_wire_message: Callable[[tuple[Any, ...]], WireMessage] = functools.partial(tuple.__new__, WireMessage)
MAX_PARSED_BODY: Final = 4 * 1024 * 1024  # larger bodies pass through unparsed: observed, not read


def _id(value: Any) -> str | None:
    if value is None or isinstance(value, bool):
        return None
    return str(value) if isinstance(value, int | str) else None


def request_message(request_id: Any, method: str, params: Any, encoded: Any = None) -> WireMessage:
    """A request as the wire carries it, from its id, method and params: parsed here from a body, or
    handed over already parsed by the SDK's server middleware (the same fields, read the same way).
    ``encoded``: what stands for a call's arguments, if it has any, instead of ``params``' own."""
    params = params if isinstance(params, dict) else {}
    meta = params.get("_meta")
    tp = meta.get("traceparent") if isinstance(meta, dict) else None
    pv = params.get("protocolVersion")
    call = method == TOOLS_CALL
    name = params.get("name") if call else None
    # an id is an int or a str nearly always: read here, not by a call of ``_id`` (a bool is an int, and no id)
    kind = type(request_id)
    rid = request_id if kind is str else str(request_id) if kind is int else _id(request_id)
    # kind, id, method, tool, is_tool_error, traceparent, cancelled_id, protocol_version, arguments, error_code
    return _wire_message((sc.FRAME_REQUEST, rid, method, name if isinstance(name, str) else None, False,
                          tp if isinstance(tp, str) else None, None, pv if isinstance(pv, str) else None,
                          None if not call or (arguments := params.get("arguments")) is None else encoded or arguments,
                          None))


def _classify(obj: Any) -> WireMessage:
    if not isinstance(obj, dict):
        return UNPARSEABLE
    method = obj.get("method")
    if isinstance(method, str):
        if "id" in obj:
            return request_message(obj.get("id"), method, obj.get("params"))
        params = obj.get("params")
        params = params if isinstance(params, dict) else {}
        return WireMessage(
            sc.FRAME_NOTIFICATION,
            method=method,
            cancelled_id=_id(params.get("requestId")) if method == CANCELLED else None,
        )
    if "error" in obj:
        error = obj["error"]
        code = error.get("code") if isinstance(error, dict) else None
        return WireMessage(sc.FRAME_ERROR, _id(obj.get("id")),
                           error_code=code if isinstance(code, int) and not isinstance(code, bool) else None)
    if "result" in obj:
        result = obj["result"]
        result = result if isinstance(result, dict) else {}
        pv = result.get("protocolVersion")
        return WireMessage(
            sc.FRAME_RESPONSE,
            _id(obj.get("id")),
            is_tool_error=result.get("isError") is True,
            protocol_version=pv if isinstance(pv, str) else None,
        )
    return UNPARSEABLE


_FAST_RESPONSE = re.compile(r'\{"jsonrpc":"2\.0","id":(?:"([^"\\]*)"|(-?\d+)),"(result|error)":')
_FAST_NOTIFICATION = re.compile(r'\{"jsonrpc":"2\.0","method":"([^"\\]+)"')
# a code of up to 18 digits (any int64): a longer one goes to the full parse, which reads up to Python's 4,300 digits
# and past them none (not JSON, as the SDK's parser refuses it); ``int()`` of it here raised into the SDK's read
_FAST_ERROR_CODE = re.compile(r'\{"code":(-?\d{1,18})[,}]')
_TOOL_ERROR = '"isError":true'


def classify_frame(data: str) -> list[WireMessage]:
    """``classify`` for an SSE ``data:`` field, without parsing the whole payload when the SDK's
    serialisation makes that unnecessary: a tool result can be megabytes, and all we need of it is
    its id, whether it is an error (and its code), and ``isError`` (a key, so never inside an escaped string)."""
    m = _FAST_RESPONSE.match(data)
    if m is not None:
        request_id = m.group(1) if m.group(1) is not None else m.group(2)
        if m.group(3) == "error":
            code = _FAST_ERROR_CODE.match(data, m.end())
            return [WireMessage(sc.FRAME_ERROR, request_id, error_code=int(code.group(1)))] if code else classify(data)
        return [_wire_message((sc.FRAME_RESPONSE, request_id, None, None, _TOOL_ERROR in data,
                               None, None, None, None, None))]
    m = _FAST_NOTIFICATION.match(data)
    if m is not None and m.group(1) != CANCELLED:
        return [WireMessage(sc.FRAME_NOTIFICATION, method=m.group(1))]
    return classify(data)


_FAST_RESULT = re.compile(rb'\{"jsonrpc":"2\.0","id":(?:"([^"\\]*)"|(-?[0-9]+)),"result":')
_TOOL_ERROR_BYTES = _TOOL_ERROR.encode()


def classify_body(body: bytes | bytearray) -> list[WireMessage]:
    """``classify_frame`` of a JSON body, as its bytes (UTF-8, undecodable bytes replaced): a result in the
    SDK's form is read off the bytes, so a megabyte result is searched once and never decoded; anything
    else is decoded and read by ``classify_frame``. ``"`` and ``\\`` are never part of a multi-byte
    sequence, so the id's bytes decode to what the decoded body's id would be."""
    request_id = result_id(body)
    if request_id is None:
        return classify_frame(body.decode("utf-8", "replace"))
    return [_wire_message((sc.FRAME_RESPONSE, request_id, None, None, body.find(_TOOL_ERROR_BYTES) >= 0,
                           None, None, None, None, None))]


def result_id(body: bytes | bytearray, at: int = 0) -> str | None:
    """The id of the result a JSON body in the SDK's form is (as ``classify_body`` reads it), off its head
    alone; None for anything else. ``at``: where the body starts (an SSE frame's data, ``sse.message_frame``)."""
    m = _FAST_RESULT.match(body, at)
    if m is None:
        return None
    string_id, int_id = m.group(1, 2)
    return int_id.decode() if string_id is None else string_id.decode("utf-8", "replace")


# json's C scanner: what ``json.loads`` runs, without the Python around it (typeshed does not declare it)
_scan: Callable[[str, int], tuple[Any, int]] = json.JSONDecoder().scan_once  # type: ignore[attr-defined]


def _loads(text: str) -> Any:
    """``json.loads(text)``, in one call of the scanner for a payload with nothing around its value (as
    the SDK writes them); anything else (whitespace, trailing garbage, an error) goes to ``json.loads``."""
    try:
        obj, end = _scan(text, 0)
    except StopIteration:
        return json.loads(text)
    return obj if end == len(text) else json.loads(text)


# A ``tools/call`` request as the SDK writes one: compact; ``jsonrpc``, ``id``, ``method``, ``params``; in
# ``params`` ``name``, ``arguments``, ``_meta``; ``traceparent`` last in ``_meta``. ``sdk_call`` reads it.
_SDK_CALL = re.compile(r'\{"jsonrpc":"2\.0","id":(?:"([^"\\\x00-\x1f]*)"|(0|-?[1-9][0-9]{0,17})),'
                       r'"method":"tools/call","params":\{"name":"([^"\\\x00-\x1f]*)","arguments":')
_META = ',"_meta":{'
_TRACEPARENT = '"traceparent":"'
_SDK_CALL_END = '"}}}'
# The ``_meta`` members before ``traceparent`` found to be valid JSON: a client sends the same ones (its
# protocol version, its name) on every call. Bounded in count and in size, whatever a client sends.
_VALID_MEMBERS: dict[str, None] = {}
_MAX_VALID_MEMBERS = 64
_MAX_MEMBERS_CHARS = 4096


def sdk_call(text: str) -> WireMessage | None:
    """A body holding one ``tools/call`` request in the SDK's own form, read exactly as ``json.loads`` and
    ``request_message`` would read it, without building its ``_meta``: the head and the tail are matched
    as they must be, the arguments parsed, the members of ``_meta`` before ``traceparent`` checked to be
    valid JSON (once for all the calls that repeat them). None for anything else, which is parsed in full:
    another order, whitespace, escapes in what is matched, malformed JSON."""
    head = _SDK_CALL.match(text)
    if head is None or not text.endswith(_SDK_CALL_END):
        return None
    try:
        arguments, at = _scan(text, head.end())
    except (StopIteration, ValueError, RecursionError):
        return None
    if not text.startswith(_META, at):
        return None
    at += len(_META)
    cut = text.rfind(_TRACEPARENT, at)
    value_at, end = cut + len(_TRACEPARENT), len(text) - len(_SDK_CALL_END)
    if cut < 0 or value_at > end:
        return None
    traceparent = text[value_at:end]
    if '"' in traceparent or "\\" in traceparent or not traceparent.isprintable():  # not one JSON string as it is
        return None
    if cut > at and not _valid_members(text[at:cut]):
        return None
    string_id, int_id, tool = head.group(1, 2, 3)
    # kind, id, method, tool, is_tool_error, traceparent, cancelled_id, protocol_version, arguments, error_code
    return _wire_message((sc.FRAME_REQUEST, int_id if string_id is None else string_id, TOOLS_CALL, tool, False,
                          traceparent, None, None, arguments, None))


def _valid_members(members: str) -> bool:
    """Whether ``members`` (each followed by a comma) are the valid members of a JSON object."""
    if members in _VALID_MEMBERS:
        return True
    if len(members) > _MAX_MEMBERS_CHARS or not members.endswith(","):
        return False
    try:
        obj, end = _scan("{" + members[:-1] + "}", 0)
    except (StopIteration, ValueError, RecursionError):
        return False
    if end != len(members) + 1 or type(obj) is not dict:
        return False
    if len(_VALID_MEMBERS) >= _MAX_VALID_MEMBERS:
        _VALID_MEMBERS.clear()
    _VALID_MEMBERS[members] = None
    return True


NOT_JSON: Final = object()  # what ``parse`` gives for a payload that is not JSON


def parse(payload: str | bytes) -> Any:
    """A payload's JSON value, or ``NOT_JSON``."""
    try:  # JSON-RPC on MCP's transports is UTF-8: decoding first spares json its encoding detection
        return _loads(payload.decode() if isinstance(payload, bytes) else payload)
    except (ValueError, UnicodeDecodeError, RecursionError):  # nested too deep for json: not read, as non-JSON
        return NOT_JSON


def classify_parsed(obj: Any) -> list[WireMessage]:
    """Every JSON-RPC message in a payload ``parse`` read; [] for non-JSON."""
    if obj is NOT_JSON:
        return []
    if isinstance(obj, list):
        return [_classify(o) for o in obj]
    return [_classify(obj)]


def classify(payload: str | bytes) -> list[WireMessage]:
    """Every JSON-RPC message in a payload (a 2025-03-26 batch gives several); [] for non-JSON."""
    return classify_parsed(parse(payload))
