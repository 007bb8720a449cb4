"""The client reads what a request asks for off the message the SDK encodes as its body, not off its bytes again;
a request built otherwise is read off the wire, and either way the same calls are read."""

from __future__ import annotations

import copy
import enum
import json
import sys
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx2
import pytest

from mcp_stream_exporter import instrument_client
from mcp_stream_exporter.exchange import EncodedArguments, read_message
from mcp_stream_exporter.hooks import client as client_hooks
from mcp_stream_exporter.wire import MAX_PARSED_BODY

pytestmark = pytest.mark.anyio

_CALL = {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "fetch", "arguments": {"url": "x"}}}
_HEADERS = {"mcp-session-id": "s1", "mcp-protocol-version": "2025-06-18"}


def _answer(request: httpx2.Request) -> httpx2.Response:
    return httpx2.Response(200, headers={"mcp-session-id": "s1", "content-type": "text/event-stream"},
                           content=b"id: e0\r\ndata: \r\n\r\n")


async def _call_seen(answer: Callable[[httpx2.Request], httpx2.Response] = _answer, **body: Any) -> str | None:
    """The tool of call 1 of session s1 as the tap knows it while its answer is open (a look-up starts it)."""
    http = instrument_client(httpx2.AsyncClient(transport=httpx2.MockTransport(answer), follow_redirects=True))
    tap = http._transport
    assert isinstance(tap, client_hooks.ClientTap)
    async with http, http.stream("POST", "http://mcp.test/mcp", headers=_HEADERS, **body) as response:
        call = tap.instrumentation.tracker.call(("s1", "1"))
        await response.aread()
    return None if call is None else call.tool


async def test_a_call_the_sdk_encodes_as_json_is_read_off_its_message_not_its_bytes(monkeypatch):
    def unread(body: bytes) -> None:
        raise AssertionError("the body of a request built from a JSON object was read again")

    monkeypatch.setattr(client_hooks, "read_body", unread)
    assert await _call_seen(json=_CALL) == "fetch"


async def test_a_call_given_as_bytes_is_read_off_the_wire():
    assert await _call_seen(content=json.dumps(_CALL).encode()) == "fetch"


async def test_a_json_call_too_large_to_parse_is_observed_not_read_as_its_bytes_would_be():
    large = {**_CALL, "params": {"name": "fetch", "arguments": {"url": "x" * MAX_PARSED_BODY}}}
    assert await _call_seen(json=large) is None
    assert await _call_seen(content=httpx2.Request("POST", "http://mcp.test", json=large).content) is None


@pytest.mark.parametrize(("status", "tool"), [(307, "fetch"), (303, None)])
async def test_a_redirected_call_is_read_on_the_request_that_carries_its_body_on(status, tool):
    """A 307 sends the same body again (``httpx2`` hands the next request the same stream and extensions): the call
    is the next request's. A 303 turns it into a GET with no body: that carries no call."""
    def answer(request: httpx2.Request) -> httpx2.Response:
        assert request.method == ("POST" if status == 307 or request.url.path == "/mcp" else "GET")
        if request.url.path == "/mcp":
            return httpx2.Response(status, headers={"location": "/mcp/"})
        return _answer(request)

    assert await _call_seen(answer, json=_CALL) == tool


async def _chunks() -> AsyncIterator[bytes]:
    yield json.dumps(_CALL).encode()


@pytest.mark.parametrize("body", [{"content": json.dumps({**_CALL, "id": 7}).encode()}, {"data": {"a": "b"}},
                                  {"content": _chunks()}], ids=["bytes", "form", "stream"])
async def test_a_json_object_httpx2_does_not_send_is_not_read_and_breaks_nothing(body):
    """``json=`` beside a body ``httpx2`` sends instead (it ignores ``json=`` then): the body sent is what is read
    (call 7 here, never call 1 of the object), and a stream, whose bytes are not known yet, is not read at all."""
    sent = await _call_seen(json=_CALL, **body)
    assert sent is None


class _Named(str, enum.Enum):  # noqa: UP042 (a StrEnum's str() is its value: this one's is not)
    A = "abc"


async def test_a_call_whose_id_json_writes_otherwise_than_str_is_read_off_the_wire():
    http = instrument_client(httpx2.AsyncClient(transport=httpx2.MockTransport(_answer)))
    tap = http._transport
    assert isinstance(tap, client_hooks.ClientTap)
    async with http, http.stream("POST", "http://mcp.test/mcp", headers=_HEADERS, json={**_CALL, "id": _Named.A}):
        assert tap.instrumentation.tracker.call(("s1", "abc")) is not None  # as sent, not "_Named.A"


def test_a_calls_fingerprint_is_of_the_arguments_sent_whatever_their_object_becomes():
    """Its arguments are the body's (``EncodedArguments``): keys that are not strings are sent as strings, which a
    canonical form can sort, and a change to the object after it was sent changes nothing."""
    arguments: dict[Any, Any] = {1: "x", "b": 2}
    message = {**_CALL, "params": {"name": "fetch", "arguments": arguments}}
    asked = read_message(message, httpx2.Request("POST", "http://mcp.test/mcp", json=message).content)
    assert asked is not None
    (call,) = asked.calls
    arguments["b"] = 3
    assert (client_hooks._fingerprint(b"salt", "fetch", call.arguments)
            == client_hooks._fingerprint(b"salt", "fetch", {"1": "x", "b": 2}))


async def test_a_copy_of_an_instrumented_client_builds_with_its_own_settings():
    http = instrument_client(httpx2.AsyncClient(base_url="http://a.test"))
    other = copy.copy(http)
    other.base_url = httpx2.URL("http://b.test")
    assert str(other.build_request("POST", "/mcp", json=_CALL).url) == "http://b.test/mcp"
    assert type(instrument_client(http)) is type(http)  # instrumented twice: as once
    await http.aclose()


class _Gateway(httpx2.AsyncClient):
    """A client of the application's own that rewrites each message it builds (namespaces its tools, its ids)."""

    def build_request(self, *args: Any, **kwargs: Any) -> httpx2.Request:
        message = kwargs.get("json")
        if isinstance(message, dict) and "params" in message:
            kwargs["json"] = {**message, "id": f"gw-{message['id']}",
                              "params": {**message["params"], "name": "ns__" + message["params"]["name"]}}
        return super().build_request(*args, **kwargs)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        raise TypeError("no subclasses")


async def test_a_client_subclass_is_tapped_as_it_is_and_what_it_sends_is_read_off_the_wire():
    http = instrument_client(_Gateway(transport=httpx2.MockTransport(_answer)))
    tap = http._transport
    assert type(http) is _Gateway and isinstance(tap, client_hooks.ClientTap)
    async with http, http.stream("POST", "http://mcp.test/mcp", headers=_HEADERS, json=_CALL) as response:
        call = tap.instrumentation.tracker.call(("s1", "gw-1"))
        await response.aread()
    assert call is not None and call.tool == "ns__fetch"


def test_arguments_nested_deeper_than_json_reads_here_are_known_by_their_tool_alone():
    deep: Any = "x"
    for _ in range(sys.getrecursionlimit()):
        deep = [deep]
    unreadable = EncodedArguments(b'{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"f","arguments":'
                                  + b"[" * 5000 + b"]" * 5000 + b"}}")
    assert (client_hooks._fingerprint(b"salt", "f", deep) == client_hooks._fingerprint(b"salt", "f", unreadable)
            != client_hooks._fingerprint(b"salt", "f", {"a": 1}))
