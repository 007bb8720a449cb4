"""The client reads what a request asks for off the message the SDK encodes as its body, not off its bytes again;
a request built otherwise is read off the wire, and either way the same calls are read."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx2
import pytest

from mcp_stream_exporter import instrument_client
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
