"""The hooks in setups around the app that change how its answers travel, not what they say: compressed by a
middleware or a proxy, redirected, a media type in another case, the app instrumented twice, a client behind a
proxy. The app answers exactly as without the hooks, nothing is logged, and a healthy run raises no finding."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable

import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.server.mcpserver import MCPServer
from starlette.applications import Starlette
from starlette.middleware.gzip import GZipMiddleware
from starlette.routing import Mount
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mcp_stream_exporter import instrument_client, instrument_server
from mcp_stream_exporter import semconv as sc
from mcp_stream_exporter.auth import TokenReader
from mcp_stream_exporter.hooks import _defects, _observer, client
from mcp_stream_exporter.lab import serve

from harness import after_grace, detector, ours, span_exporter, spans

pytestmark = pytest.mark.anyio

STATELESS = "2026-07-28"


def _server() -> MCPServer:
    mcp = MCPServer("transparency")

    @mcp.tool()
    def echo(text: str) -> str:
        return text + "x" * 2000  # past GZipMiddleware's 500-byte minimum

    return mcp


async def _results(url: str, http: httpx2.AsyncClient | None, mode: str) -> list[str]:
    options = {"mode": mode} if mode == "legacy" else {}
    async with Client(streamable_http_client(url, http_client=http), **options) as client:
        return [(await asyncio.wait_for(client.call_tool("echo", {"text": f"t{i}"}), 20)).content[0].text
                for i in range(3)]


@contextlib.asynccontextmanager
async def _mounted(mcp: MCPServer, app: ASGIApp) -> AsyncIterator[int]:
    """``app`` mounted at /mcp, with the MCP session manager's lifespan, served on 127.0.0.1."""
    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        async with mcp.session_manager.run():
            yield

    async with serve(Starlette(routes=[Mount("/mcp", app=app)], lifespan=lifespan)) as port:
        yield port


def _recased(app: ASGIApp) -> ASGIApp:
    """A proxy that spells the content type its own way (media types are case-insensitive)."""
    async def recasing(scope: Scope, receive: Receive, send: Send) -> None:
        async def sent(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [(k, v.title() if k == b"content-type" else v) for k, v in message["headers"]]
            await send(message)
        await app(scope, receive, sent)
    return recasing


def _gzip_outside(mcp: MCPServer, json_response: bool) -> ASGIApp:  # a proxy's gzip, SSE included
    return GZipMiddleware(instrument_server(mcp, json_response=json_response, streamable_http_path="/"),
                          minimum_size=0, exclude_content_types=())


def _gzip_inside(mcp: MCPServer, json_response: bool) -> ASGIApp:  # the observed app compresses its answers
    inner = GZipMiddleware(mcp.streamable_http_app(json_response=json_response, streamable_http_path="/"),
                           minimum_size=0, exclude_content_types=())
    return instrument_server(inner, streamable_http_path="/")


def _recased_outside(mcp: MCPServer, json_response: bool) -> ASGIApp:
    return _recased(instrument_server(mcp, json_response=json_response, streamable_http_path="/"))


def _instrumented_twice(mcp: MCPServer, json_response: bool) -> ASGIApp:  # an app and the MCP app in it, both
    inner = instrument_server(mcp, json_response=json_response, streamable_http_path="/")
    return instrument_server(Starlette(routes=[Mount("/", app=inner)]), streamable_http_path="/")


SETUPS: dict[str, Callable[[MCPServer, bool], ASGIApp]] = {
    "gzip_by_a_proxy": _gzip_outside, "gzip_inside_the_app": _gzip_inside, "content_type_recased": _recased_outside,
    "instrumented_twice": _instrumented_twice}


@pytest.mark.parametrize("mode", ["legacy", STATELESS])
@pytest.mark.parametrize("json_response", [False, True], ids=["sse", "json"])
@pytest.mark.parametrize("setup", list(SETUPS))
async def test_a_healthy_run_answers_as_without_the_hooks_and_raises_no_finding(setup, json_response, mode, caplog):
    results = await _both_ways(setup, json_response, mode, caplog.handler)
    assert results[0] == results[1]
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


async def _both_ways(setup: str, json_response: bool, mode: str, logged: logging.Handler) -> list[list[str]]:
    """The results without the hooks, then with them; each run's detector finds nothing. uvicorn logs an app's
    exception through its own handlers, set when it starts: ``logged`` joins them then."""
    results = []
    for hooked in (False, True):
        with detector() as (found, clock):
            mcp = _server()
            app = SETUPS[setup](mcp, json_response) if hooked else (
                mcp.streamable_http_app(json_response=json_response, streamable_http_path="/"))
            async with _mounted(mcp, app) as port:
                logging.getLogger("uvicorn").addHandler(logged)
                url = f"http://127.0.0.1:{port}/mcp/"
                if hooked:
                    async with instrument_client() as http:
                        results.append(await _results(url, http, mode))
                else:
                    results.append(await _results(url, None, mode))
            assert after_grace(found, clock) == []
    return results


@pytest.mark.parametrize("mode", ["legacy", STATELESS])
async def test_a_redirect_the_sdk_follows_is_no_answer_and_raises_no_finding(mode):
    """A client URL without the mount's trailing slash: each request is redirected (307) and sent again."""
    with detector() as (found, clock):
        mcp = _server()
        async with _mounted(mcp, instrument_server(mcp, streamable_http_path="/")) as port, instrument_client() as http:
            results = await _results(f"http://127.0.0.1:{port}/mcp", http, mode)
        assert after_grace(found, clock) == []
    assert [r[:2] for r in results] == ["t0", "t1", "t2"]


async def test_a_client_behind_a_proxy_from_the_environment_goes_through_it_tapped(monkeypatch):
    """``instrument_client()`` routes as the SDK's own client does: through ``HTTP_PROXY``, its answers tapped."""
    seen: list[bytes] = []

    async def proxy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(await reader.readline())
        writer.write(b"HTTP/1.1 502 Bad Gateway\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
        await writer.drain()
        writer.close()

    stub = await asyncio.start_server(proxy, "127.0.0.1", 0)
    monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{stub.sockets[0].getsockname()[1]}")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    try:
        async with instrument_client() as http:
            response = await http.post("http://mcp.example/mcp", content=b"{}")
            assert type(http._transport_for_url(httpx2.URL("http://mcp.example/mcp"))).__name__ == "ClientTap"
    finally:
        stub.close()
    assert response.status_code == 502
    assert seen == [b"POST http://mcp.example/mcp HTTP/1.1\r\n"]


async def test_a_health_checks_head_and_a_browsers_preflight_are_no_streams():
    span_exporter().clear()
    mcp = _server()
    async with _mounted(mcp, instrument_server(mcp, streamable_http_path="/")) as port, httpx2.AsyncClient() as http:
        url = f"http://127.0.0.1:{port}/mcp/"
        assert (await http.head(url)).status_code == 405
        await http.options(url, headers={"last-event-id": "1", "origin": "http://app.example",
                                         "access-control-request-method": "GET"})
    assert ours(spans(), sc.SPAN_STREAM) == []


@pytest.mark.parametrize("mode", ["legacy", STATELESS])
@pytest.mark.parametrize("json_response", [False, True], ids=["sse", "json"])
async def test_a_defect_in_the_hooks_reading_never_reaches_the_application(json_response, mode, monkeypatch, caplog):
    """Every reader the hooks call on a request, an answer or a call raises (as ``int()`` of a hostile server's
    5,000-digit error code once did, out of the client's tap, killing the SDK's transport): the application's calls
    answer as without the hooks, and the defect is logged once, as a warning."""
    def defect(*args: object, **kwargs: object) -> None:
        raise RuntimeError("a defect of the hooks")

    for module in (_observer, client):
        for reader in ("can_ask", "request_message", "read_body", "result_id", "classify_frame", "classify_body",
                       "message_frame", "empty_frames", "whole_frame", "read_message", "pick", "_picked"):
            if hasattr(module, reader):
                monkeypatch.setattr(module, reader, defect)
    monkeypatch.setattr(TokenReader, "from_authorization", defect)
    monkeypatch.setattr(_defects, "_reported", False)
    caplog.set_level(logging.DEBUG, logger="mcp_stream_exporter.hooks")
    mcp = _server()
    app = instrument_server(mcp, json_response=json_response, streamable_http_path="/")
    async with _mounted(mcp, app) as port, instrument_client() as http:
        results = await _results(f"http://127.0.0.1:{port}/mcp/", http, mode)
    assert [r[:2] for r in results] == ["t0", "t1", "t2"]
    reported = [r for r in caplog.records if r.name == "mcp_stream_exporter.hooks"]
    assert reported and [r.levelno for r in reported if r.levelno >= logging.WARNING] == [logging.WARNING]
