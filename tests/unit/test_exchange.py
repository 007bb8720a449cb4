"""One exchange read the same way by every role: what a body asks for, what a request requires, what a
response carries."""

from __future__ import annotations

import enum
import json

import httpx2
from hypothesis import given
from hypothesis import strategies as st

from mcp_stream_exporter import semconv as sc
from mcp_stream_exporter import wire
from mcp_stream_exporter.auth import NO_REQUIREMENT, Requirement, ToolPolicy
from mcp_stream_exporter.exchange import (
    AUTHORIZATION,
    CONTENT_JSON,
    CONTENT_NONE,
    CONTENT_SSE,
    CONTENT_TYPE,
    LAST_EVENT_ID,
    REQUEST_HEADERS,
    RESPONSE_HEADERS,
    SESSION_ID,
    UNREAD,
    Body,
    EncodedArguments,
    can_ask,
    content_of,
    read_body,
    read_message,
    requirement_of,
    stream_attributes,
)
from mcp_stream_exporter.headers import pick
from mcp_stream_exporter.hooks.client import _picked
from mcp_stream_exporter.wire import MAX_PARSED_BODY, TOOLS_CALL, WireMessage, classify, sdk_call

FETCH = "https://mcp.example.com/tools/fetch"


def test_a_body_gives_its_calls_its_other_requests_the_proposed_version_and_the_calls_it_cancels():
    batch = [
        {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "fetch"}},
        {"jsonrpc": "2.0", "id": "p", "method": "ping"},
        {"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": 0}},
        {"jsonrpc": "2.0", "method": "notifications/progress", "params": {"progressToken": 1}},
    ]
    asked = read_body(json.dumps(batch).encode())
    assert [(m.id, m.tool) for m in asked.calls] == [("1", "fetch")]
    assert [m.id for m in asked.requests] == ["1", "p"]
    assert asked.cancelled == ("0",)
    init = read_body(b'{"jsonrpc":"2.0","id":0,"method":"initialize","params":{"protocolVersion":"2025-11-25"}}')
    assert init.protocol_version == "2025-11-25" and init.calls == ()


def test_an_empty_unparseable_or_oversized_body_is_observed_not_read():
    call = b'{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"fetch"}}'
    assert read_body(call) != UNREAD
    assert read_body(b"") == read_body(b"not json") == UNREAD
    assert read_body(call + b" " * MAX_PARSED_BODY) == UNREAD


def test_a_request_requires_its_tools_policy_and_anything_else_nothing():
    policy = ToolPolicy.from_mapping({"fetch": {"resources": [FETCH]}})
    assert requirement_of(policy, "fetch") == Requirement.of([FETCH], [])
    assert requirement_of(policy, "unnamed") == requirement_of(policy, None) == NO_REQUIREMENT


def test_content_kind_and_the_attributes_every_stream_span_opens_with():
    assert [content_of(t) for t in ("text/event-stream; charset=utf-8", "application/json", "")] == [
        CONTENT_SSE, CONTENT_JSON, CONTENT_NONE]
    assert stream_attributes("GET", CONTENT_SSE, "2025-11-25", "41") == {
        sc.HTTP_REQUEST_METHOD: "GET", sc.STREAM_CONTENT: CONTENT_SSE, sc.ERA: sc.ERA_RESUMABLE,
        sc.MCP_PROTOCOL_VERSION: "2025-11-25", sc.RESUME_CURSOR: "41"}
    assert stream_attributes("POST", CONTENT_JSON, "2026-07-28", None)[sc.ERA] == sc.ERA_STATELESS


def test_the_byte_check_passes_every_body_that_can_ask_for_a_call_a_cancel_or_an_initialize():
    batch = json.dumps([{"jsonrpc": "2.0", "method": "notifications/progress", "params": {}},
                        {"jsonrpc": "2.0", "id": 4, "method": "tools/call", "params": {"name": "fetch"}}]).encode()
    escaped = [b'{"jsonrpc":"2.0","id":1,"method":"tools\\/call","params":{"name":"fetch"}}',
               b'{"jsonrpc":"2.0","id":1,"method":"\\u0074ools/call","params":{"name":"fetch"}}',
               b'{"jsonrpc":"2.0","method":"notifications\\/cancelled","params":{"requestId":3}}',
               b'{"jsonrpc":"2.0","id":0,"method":"initiali\\u007ae","params":{"protocolVersion":"2025-11-25"}}']
    for body in [batch, *escaped]:
        asked = read_body(body)
        assert can_ask(body) and (asked.calls or asked.cancelled or asked.protocol_version), body
    assert [m.id for m in read_body(batch).calls] == ["4"]  # the call in the batch, not lost
    for body in (b'{"jsonrpc":"2.0","id":2,"method":"tools/list"}', b'{"jsonrpc":"2.0","id":2,"result":{}}',
                 b'{"jsonrpc":"2.0","method":"notifications/initialized"}'[:20], b"not json"):
        assert not can_ask(body)


_METHODS = st.sampled_from(["tools/call", "tools\\/call", "\\u0074ools/call", "notifications/cancelled",
                            "notifications\\/cancelled", "initialize", "initiali\\u007ae", "tools/list", "ping",
                            "notifications/progress", "notifications/initialized"])
_MESSAGE = st.builds(
    lambda method, rid, params: '{"jsonrpc":"2.0",' + (f'"id":{rid},' if rid is not None else "")
    + f'"method":"{method}","params":{params}}}',
    _METHODS, st.one_of(st.none(), st.integers(0, 99)),
    st.sampled_from(['{"name":"fetch"}', '{"requestId":3}', '{"protocolVersion":"2025-11-25"}', "{}"]))


@given(st.lists(_MESSAGE, min_size=1, max_size=4), st.booleans(), st.integers(0, 40))
def test_a_body_the_byte_check_rules_out_has_nothing_the_hooks_read(messages, batch, cut):
    text = ("[" + ",".join(messages) + "]") if batch else messages[0]
    for body in (text.encode(), text.encode()[:-cut or None]):  # whole, or cut short (malformed)
        if not can_ask(body):
            asked = read_body(body)
            assert not asked.calls and not asked.cancelled and asked.protocol_version is None


_IDS = st.one_of(st.integers(-(2**70), 2**70), st.text(max_size=5), st.booleans(), st.none(),
                 st.floats(allow_nan=False))
_PARAMS = st.one_of(
    st.fixed_dictionaries({"name": st.one_of(st.text(max_size=5), st.integers())},
                          optional={"arguments": st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
                                    "_meta": st.one_of(st.fixed_dictionaries({"traceparent": st.one_of(
                                        st.text(max_size=5), st.integers())}), st.integers())}),
    st.integers(), st.none())


@given(_IDS, _PARAMS, st.booleans(), st.booleans())
def test_a_body_of_one_call_reads_as_its_message_classifies(rid, params, with_id, with_params):
    message: dict[str, object] = {"jsonrpc": "2.0", "method": TOOLS_CALL}
    if with_id:
        message["id"] = rid
    if with_params:
        message["params"] = params
    body = json.dumps(message).encode()
    (msg,) = classify(body)
    # JSON-RPC's id as semconv writes it: an integer's or a string's text; no id for anything else
    assert msg.id == (str(rid) if with_id and isinstance(rid, int | str) and not isinstance(rid, bool) else None)
    is_call = msg.method == TOOLS_CALL and msg.id is not None
    assert read_body(body) == ((msg,) if is_call else (), (msg,) if is_call else (), None, ())


# Bodies as the SDK writes them: a default-era call (client info in ``_meta``) and a 2025-11-25 one.
_SDK_BODIES = [
    '{"jsonrpc":"2.0","id":5,"method":"tools/call","params":{"name":"search","arguments":{"query":"q"},"_meta":'
    '{"io.modelcontextprotocol/protocolVersion":"2026-07-28","io.modelcontextprotocol/clientInfo":{"name":"mcp",'
    '"version":"0.1.0"},"io.modelcontextprotocol/clientCapabilities":{},'
    '"traceparent":"00-3153cfd231911e9a4f63487742599663-d1f898b49d683e55-03"}}}',
    '{"jsonrpc":"2.0","id":"a-3","method":"tools/call","params":{"name":"fetch","arguments":{"url":"x","n":[1,2.5]},'
    '"_meta":{"traceparent":"00-3df2b53aa01e834c447dbd1252e6ee77-200d09763faefb9c-03"}}}',
]


def test_a_call_as_the_sdk_writes_it_is_read_without_the_full_parse_and_reads_the_same():
    for text in _SDK_BODIES:
        fast = sdk_call(text)
        assert fast is not None and [fast] == classify(text), text
        assert read_body(text.encode()).calls == (fast,)


def test_a_call_almost_in_the_sdks_form_is_parsed_in_full():
    head = '{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"f","arguments":{},"_meta":'
    for text in (head + '{"a":,"traceparent":"t"}}}',  # malformed members before traceparent
                 head + '{"a":1,"traceparent":"t"}}}x',  # something after the body
                 head + '{"traceparent":"t","a":1}}}',  # traceparent not last: parsed, not matched
                 head + '{"traceparent":"}}}',  # the value's quote is the end's
                 head + '{"traceparent":"t\\u0041"}}}',  # an escape in the value
                 head.replace('"id":1', '"id":01') + '{"traceparent":"t"}}}'):  # not JSON's number
        assert sdk_call(text) is None, text
        assert read_body(text.encode()).calls == tuple(m for m in classify(text) if m.id is not None), text


def test_the_meta_members_the_fast_read_remembers_are_bounded_in_count_and_size():
    head = '{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"f","arguments":{},"_meta":'
    for i in range(200):
        assert sdk_call(head + f'{{"k{i}":{i},"traceparent":"t"}}}}}}') is not None
    assert len(wire._VALID_MEMBERS) <= 64
    huge = head + '{"k":"' + "x" * 5000 + '","traceparent":"t"}}}'
    assert sdk_call(huge) is None and [m.traceparent for m in read_body(huge.encode()).calls] == ["t"]


_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=4),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                                 max_size=3), max_leaves=8)


@given(st.one_of(st.integers(-(2**70), 2**70), st.text(max_size=5), st.floats(allow_nan=False)), st.text(max_size=5),
       _JSON, st.dictionaries(st.text(max_size=4), _JSON, max_size=3), st.text(max_size=6), st.integers(0, 400),
       st.sampled_from(["", '"', "\\", ",", "}", "{", "]", "x", "\x01", " "]), st.booleans())
def test_a_body_in_the_sdks_form_or_one_edit_from_it_reads_as_its_full_parse(rid, name, arguments, members, traceparent,
                                                                             at, char, drop):
    message = {"jsonrpc": "2.0", "id": rid, "method": "tools/call",
               "params": {"name": name, "arguments": arguments, "_meta": {**members, "traceparent": traceparent}}}
    text = json.dumps(message, separators=(",", ":"), ensure_ascii=False)
    for body in (text, text[:at] + char + text[at + drop:]):
        fast = sdk_call(body)
        assert fast is None or [fast] == classify(body), body


class _Named(str, enum.Enum):  # noqa: UP042 (a StrEnum's str() is its value: this one's is not)
    A = "abc"


class _Shown(int):  # encoded as the number, ``str()`` otherwise
    def __str__(self) -> str:
        return "shown"


class _Dict(dict):  # a subclass whose ``get`` the encoder never calls
    def get(self, key, default=None):
        return "not what is sent"


_ODD = st.sampled_from([_Named.A, _Shown(7), True, 1.0, None])
_PLAIN_OR_ODD_TEXT = st.one_of(st.text(max_size=4), st.integers(), st.just(_Named.A))
_REQUESTS = st.fixed_dictionaries(
    {"jsonrpc": st.just("2.0"), "method": st.sampled_from([TOOLS_CALL, "notifications/cancelled", "initialize",
                                                            "tools/list", _Named.A])},
    optional={"id": st.one_of(st.integers(-(2**70), 2**70), st.text(max_size=4), _ODD),
              "params": st.one_of(st.builds(lambda members, odd: _Dict(members) if odd else members,
                                            st.fixed_dictionaries({}, optional={
                  "name": _PLAIN_OR_ODD_TEXT, "protocolVersion": _PLAIN_OR_ODD_TEXT,
                  "arguments": st.one_of(_JSON, st.dictionaries(st.integers(0, 3) | st.text(max_size=1), _JSON,
                                                                max_size=3)),
                  "_meta": st.one_of(st.dictionaries(st.sampled_from(["traceparent", "k"]), _PLAIN_OR_ODD_TEXT,
                                                     max_size=2), st.builds(_Dict, st.just({"traceparent": "t"})))}),
                                            st.booleans()), _JSON)})


def _of_json_types(value: object) -> bool:
    """Whether ``value`` holds JSON's own types only (an enum or a subclass of ``str`` compares equal to the string
    JSON writes of it, and is left to the body all the same)."""
    if type(value) is dict:
        return all(type(k) is str and _of_json_types(v) for k, v in value.items())
    if type(value) is list:
        return all(map(_of_json_types, value))
    return type(value) in (str, int, float, bool, type(None))


def _resolved(asked: Body) -> Body:
    """``asked`` with each call's arguments as the body carried them (``EncodedArguments``, parsed now)."""
    def resolved(msg: WireMessage) -> WireMessage:
        arguments = msg.arguments
        return msg._replace(arguments=arguments.value()) if isinstance(arguments, EncodedArguments) else msg

    return asked._replace(calls=tuple(map(resolved, asked.calls)), requests=tuple(map(resolved, asked.requests)))


@given(st.one_of(_REQUESTS, _JSON))
def test_a_call_read_off_the_object_a_client_encodes_reads_as_its_body_or_is_left_to_the_body(value):
    """``read_message`` of the object a client hands ``httpx2`` as ``json=`` (the SDK's every message), which the
    client's tap reads instead of the body: the call ``read_body`` reads in that body, or None (the body is read),
    whatever the object holds that JSON writes otherwise than ``str`` does (an enum, an ``int`` or ``dict``
    subclass, keys that are not strings)."""
    if not isinstance(value, dict):
        return
    try:
        body = httpx2.Request("POST", "http://mcp.test", json=value).content
    except (ValueError, TypeError, UnicodeEncodeError):  # no body to send: the request is never built
        return
    asked = read_message(value, body)
    assert asked is None or _resolved(asked) == read_body(body), body
    plain = (value.get("method") == TOOLS_CALL and type(value.get("id")) in (int, str)
             and type(value.get("params", {})) is dict and _of_json_types(value) and json.loads(body) == value)
    assert asked is not None or not plain or len(body) > MAX_PARSED_BODY, body  # the SDK's own: read off the object


class _Key(str):  # hashes and compares as no "method": json writes it as one
    def __hash__(self) -> int:
        return 0

    def __eq__(self, other: object) -> bool:
        return other is self


def test_a_message_with_a_key_that_is_not_a_str_itself_is_left_to_its_body():
    call = {"jsonrpc": "2.0", "id": 1, "method": TOOLS_CALL, "params": {"name": "f", "_meta": {"traceparent": "t"}}}
    for odd in ({**call, _Key("method"): "tools/list"}, {**call, "params": {**call["params"], _Key("name"): "g"}},
                {**call, "params": {"name": "f", "_meta": {"traceparent": "t", _Key("traceparent"): "u"}}}):
        assert read_message(odd, httpx2.Request("POST", "http://mcp.test", json=odd).content) is None
    assert read_message(call, json.dumps(call).encode()) is not None


def test_a_call_too_large_to_parse_is_observed_not_read_off_its_object_as_off_its_body():
    message = {"jsonrpc": "2.0", "id": 1, "method": TOOLS_CALL, "params": {"name": "f", "arguments": {"a": "x"}}}
    body = json.dumps(message).encode()
    assert read_message(message, body + b" " * MAX_PARSED_BODY) == UNREAD


def test_the_headers_an_exchange_is_read_by_are_picked_by_name_whatever_their_case_a_repeat_keeping_its_first():
    """The first, as Starlette reads it, so the SDK acts on it: the last made a DELETE naming two sessions end one
    in the SDK and the other in the hooks (whose every clean end then read ``terminated``)."""
    raw = [(b"Host", b"h"), (b"MCP-Session-Id", b"s1"), (b"Authorization", b"Bearer a"),
           (b"authorization", b"Bearer b"), (b"last-event-id", b"\xe9"), (b"mcp-session-id", b"s2")]
    assert pick(raw, REQUEST_HEADERS) == {SESSION_ID: "s1", AUTHORIZATION: "Bearer a", LAST_EVENT_ID: "\xe9"}
    lowered = [(k.lower(), v) for k, v in raw]  # as an ASGI server hands them over
    assert pick(lowered, REQUEST_HEADERS, lowered=True) == pick(raw, REQUEST_HEADERS)
    assert _picked(httpx2.Headers(raw), REQUEST_HEADERS) == pick(raw, REQUEST_HEADERS)  # the client's tap alike
    assert pick([(b"content-type", b"text/event-stream")], RESPONSE_HEADERS, lowered=True) == {
        CONTENT_TYPE: "text/event-stream"}
