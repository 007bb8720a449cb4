"""An SSE body's end is read as the SDK's client reads it: a frame whose last line a lone CR ended is
dispatched (httpx2 takes that CR for a line end and the blank line after it), so the hooks on both sides
see the call answered, as the client was, rather than a clean end with the call pending; and an answer its app stops
before its end is one the client reads cut short, not ended."""

from __future__ import annotations

import asyncio
import contextlib
import json

import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

from mcp_stream_exporter import semconv as sc
from mcp_stream_exporter.hooks import ServerInstrumentation, instrument_client
from mcp_stream_exporter.lab import serve

from harness import after_grace, detector, ours, span_exporter, spans

pytestmark = pytest.mark.anyio
_HEADERS = [(b"mcp-session-id", b"s1")]
_RESULT = {"content": [{"type": "text", "text": "hello"}]}


async def _lifespan(receive, send) -> None:
    """A hand-written app's lifespan: it starts and stops at once."""
    while (await receive())["type"] != "lifespan.shutdown":
        await send({"type": "lifespan.startup.complete"})
    await send({"type": "lifespan.shutdown.complete"})


def _server(tail: bytes):
    """A hand-written MCP server (legacy era) whose tools/call answer is one SSE frame ended by ``tail``."""
    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        request = json.loads(body) if scope["method"] == "POST" else {}
        if "id" not in request:  # a notification, the GET stream, the DELETE
            await send({"type": "http.response.start", "status": 202 if request else 405, "headers": _HEADERS})
            await send({"type": "http.response.body", "body": b""})
            return
        result = {"initialize": {"protocolVersion": "2025-11-25", "capabilities": {"tools": {}},
                                 "serverInfo": {"name": "hand-written", "version": "1"}},
                  "tools/list": {"tools": [{"name": "echo", "inputSchema": {"type": "object"}}]}}.get(request["method"])
        answer = json.dumps({"jsonrpc": "2.0", "id": request["id"], "result": result or _RESULT}).encode()
        if result is not None:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [*_HEADERS, (b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": answer})
            return
        await send({"type": "http.response.start", "status": 200,
                    "headers": [*_HEADERS, (b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": b"id: e1\r\ndata: " + answer + tail, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
    return app


@pytest.mark.parametrize("tail", [b"\r\n\r\n", b"\r\n\r", b"\r"], ids=["crlf-crlf", "crlf-cr", "cr"])
async def test_a_result_whose_frame_a_last_cr_ends_is_the_healthy_path_on_both_sides(tail):
    span_exporter().clear()
    server = ServerInstrumentation()
    with detector() as (found, clock):
        async with serve(server.asgi(_server(tail))) as port:
            http = instrument_client()
            async with http, Client(streamable_http_client(f"http://127.0.0.1:{port}/mcp", http_client=http),
                                    mode="legacy") as client:
                result = await asyncio.wait_for(client.call_tool("echo", {}), 10)
        assert result.content[0].text == "hello"  # the SDK's client dispatched it
        assert after_grace(found, clock) == []
    assert ours(spans(), sc.SPAN_CALL) == []
    assert [s for s in ours(spans(), sc.SPAN_STREAM) if s.attributes.get(sc.PENDING_REQUEST_IDS)] == []


def _stopping_server():
    """A hand-written 2026-07-28 server whose tools/call answer sends a progress frame, then stops before its body's
    last message: a redeploy cancelling the app, whose client reads the answer cut short."""
    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        progress = {"jsonrpc": "2.0", "method": "notifications/progress", "params": {"progressToken": 1, "progress": 1}}
        await send({"type": "http.response.body", "body": b"data: " + json.dumps(progress).encode() + b"\r\n\r\n",
                    "more_body": True})
        raise asyncio.CancelledError  # the app stops here
    return app


async def test_an_answer_its_app_stops_before_its_end_is_cut_short_and_pages_nothing_on_the_servers_spans():
    span_exporter().clear()
    server = ServerInstrumentation()
    call = {"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": {"name": "slow", "arguments": {}}}
    with detector() as (found, clock):
        async with serve(server.asgi(_stopping_server())) as port, httpx2.AsyncClient() as http:
            with contextlib.suppress(httpx2.HTTPError):
                await http.post(f"http://127.0.0.1:{port}/mcp", json=call,
                                headers={"mcp-protocol-version": "2026-07-28", "accept": "text/event-stream"})
        assert after_grace(found, clock) == []
    (post,) = ours(spans(), sc.SPAN_STREAM, sc.ROLE_SERVER)
    assert post.attributes[sc.END_REASON] == sc.END_DROPPED


async def test_a_resume_answered_with_a_redirect_ends_as_no_stream_on_the_servers_spans():
    """A redirect carries nothing: the client sends its resume again where it points, or is told it failed."""
    async def redirecting(scope, receive, send):
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        await send({"type": "http.response.start", "status": 307, "headers": [(b"location", b"/mcp/")]})
        await send({"type": "http.response.body", "body": b""})

    span_exporter().clear()
    async with serve(ServerInstrumentation().asgi(redirecting)) as port, httpx2.AsyncClient() as http:
        answer = await http.get(f"http://127.0.0.1:{port}/mcp", headers={"mcp-session-id": "s1", "last-event-id": "4"})
    assert answer.status_code == 307
    (resume,) = ours(spans(), sc.SPAN_STREAM, sc.ROLE_SERVER)
    assert resume.attributes[sc.STREAM_KIND] == sc.STREAM_KIND_RESUME
    assert resume.attributes[sc.END_REASON] == sc.END_HTTP_ERROR
