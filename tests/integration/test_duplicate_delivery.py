"""A result delivered twice is told, whichever copy comes first and whether the first left a span or not: a layer in
front of the SDK app copies each ``tools/call`` result onto the session's standalone GET stream, as a broadcast bug
does (mcp_dart #142). The copy's stream names it; a healthy run with the same layer copying nothing raises nothing."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.server.mcpserver import MCPServer
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mcp_stream_exporter import instrument_client
from mcp_stream_exporter.auth import ToolPolicy
from mcp_stream_exporter.hooks import ServerInstrumentation
from mcp_stream_exporter.lab import IncidentEventStore, serve

from harness import after_grace, detector

pytestmark = pytest.mark.anyio


class _Broadcast:
    """Copies every body of a POST's answer that holds a tool's result onto the open standalone GET streams."""

    def __init__(self, app: ASGIApp, copying: str | None) -> None:
        self.app, self.copying = app, copying  # "first", before the POST's own body, or "after" it
        self.gets: list[Send] = []
        self.get_open = asyncio.Event()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        if scope["method"] == "GET" and b"last-event-id" not in headers:
            async def standalone(message: Message) -> None:
                await send(message)
                if message["type"] == "http.response.start":
                    self.gets.append(send)
                    self.get_open.set()
            try:
                await self.app(scope, receive, standalone)
            finally:
                if send in self.gets:
                    self.gets.remove(send)
            return

        async def answer(message: Message) -> None:
            body = message.get("body", b"")
            copy = self.copying is not None and message["type"] == "http.response.body" and b'"content"' in body
            if copy and self.copying == "first":
                await self._copy(body)
            await send(message)
            if copy and self.copying == "after":
                await self._copy(body)

        await self.app(scope, receive, answer if scope["method"] == "POST" else send)

    async def _copy(self, body: bytes) -> None:
        for get in list(self.gets):
            await get({"type": "http.response.body", "body": body, "more_body": True})


def _server() -> MCPServer:
    mcp = MCPServer("duplicates")

    @mcp.tool()
    def echo(text: str) -> str:
        return text

    return mcp


@contextlib.asynccontextmanager
async def _app(copying: str | None, server_hooks: bool) -> AsyncIterator[tuple[int, _Broadcast]]:
    mcp = _server()
    if not server_hooks:
        broadcast = _Broadcast(mcp.streamable_http_app(), copying)
        async with serve(broadcast) as port:
            yield port, broadcast
        return
    instr = ServerInstrumentation()  # the layer inside the hooks: they see what it sends
    mcp.middleware.append(instr.middleware)
    store = instr.event_store(IncidentEventStore(ToolPolicy()))
    broadcast = _Broadcast(mcp.streamable_http_app(event_store=store), copying)
    async with serve(instr.asgi(broadcast)) as port:
        yield port, broadcast


@pytest.mark.parametrize("sides", ["both", "client", "server"])
@pytest.mark.parametrize("copying", ["first", "after", None], ids=["copy_first", "copy_after", "healthy"])
async def test_a_result_copied_onto_the_standalone_stream_is_a_duplicate_delivery(copying, sides):
    with detector() as (found, clock):
        async with _app(copying, sides != "client") as (port, broadcast), instrument_client() as tapped:
            http = tapped if sides != "server" else None
            async with Client(streamable_http_client(f"http://127.0.0.1:{port}/mcp", http_client=http),
                              mode="legacy") as client:
                await asyncio.wait_for(broadcast.get_open.wait(), 10)
                for n in range(3):
                    await asyncio.wait_for(client.call_tool("echo", {"text": f"t{n}"}), 10)
                await client.list_tools()  # a round trip more: the last copy, sent after its result, is read by then
        findings = after_grace(found, clock)
    if copying is None:
        assert findings == []
        return
    assert {f.rule for f in findings} == {"duplicate_terminal"}
    assert len({f.request_id for f in findings}) == 3  # each call's copy, whichever of its two came first
    assert {f.evidence["deliveries"] for f in findings} == {2}
    assert {f.tool for f in findings} == {"echo"}  # named on the copy's span where the first delivery left none


async def test_a_result_read_once_past_the_hold_of_its_answer_is_one_delivery():
    """A result whose frame takes the client's held answer past its bound in the read that brings it: the tap
    follows the answer from its start, reading that frame again, which is no second delivery."""
    mcp = MCPServer("sizes")

    @mcp.tool()
    def pad(n: int) -> str:
        return "x" * n  # twice in its answer (text and structured content): frames around the 64 KiB hold

    with detector() as (found, clock):
        async with serve(mcp.streamable_http_app()) as port, instrument_client() as http, Client(
                streamable_http_client(f"http://127.0.0.1:{port}/mcp", http_client=http), mode="legacy") as client:
            for n in range(32_600, 32_800, 8):
                await asyncio.wait_for(client.call_tool("pad", {"n": n}), 10)
        assert after_grace(found, clock) == []
