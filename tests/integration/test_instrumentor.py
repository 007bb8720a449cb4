"""McpStreamInstrumentor: `opentelemetry-instrument` instruments an SDK server and client that never call the
hooks, the kill switches leave them alone, and instrumenting twice (or over hooks installed by hand) observes
each stream once."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
from importlib.metadata import entry_points, version
from pathlib import Path
from typing import Any

import anyio
import httpx2
import pytest
from mcp import Client, types
from mcp.client.streamable_http import streamable_http_client
from mcp.server.lowlevel import Server
from mcp.server.mcpserver import MCPServer
from mcp.server.streamable_http import EventStore
from starlette.applications import Starlette
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import PlainTextResponse
from starlette.routing import Mount, Route

from mcp_stream_exporter import instrument_client, instrument_server
from mcp_stream_exporter import semconv as sc
from mcp_stream_exporter.auth import ToolPolicy
from mcp_stream_exporter.guard import GuardedEventStore, RefusalResolver, resolve_refusals
from mcp_stream_exporter.hooks import ClientTap, ServerInstrumentation
from mcp_stream_exporter.instrumentation import McpStreamInstrumentor
from mcp_stream_exporter.lab import serve
from mcp_stream_exporter.lab.proxy import CutProxy

from harness import after_grace, detector, ours, span_exporter, spans

APP = Path(__file__).with_name("sdk_app.py")
INSTRUMENT = Path(sys.executable).with_name("opentelemetry-instrument")


def _run_instrumented(**env: str) -> dict[str, Any]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "MCP_STREAM_"))}
    run = subprocess.run([str(INSTRUMENT), sys.executable, str(APP)], env={**clean, **env}, capture_output=True,
                         text=True, timeout=60, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    outcome: dict[str, Any] = json.loads(run.stdout)
    assert outcome["result"] == "hello"
    return outcome


def _ours(outcome: dict[str, Any]) -> list[dict[str, Any]]:
    return [s for s in outcome["spans"] if s["scope"] == sc.INSTRUMENTATION_NAME]


def _echo_server() -> MCPServer:
    """A server of one tool, built (``streamable_http_app``) after the instrumentor is on, as the tests need it."""
    server = MCPServer("probe")

    @server.tool()
    def echo(text: str) -> str:
        return text

    return server


def test_the_entry_point_is_the_instrumentor():
    (entry,) = [e for e in entry_points(group="opentelemetry_instrumentor") if e.name == "mcp_stream_exporter"]
    assert entry.load() is McpStreamInstrumentor
    assert McpStreamInstrumentor().instrumentation_dependencies() == ("mcp >= 2.3, < 3",)


def test_opentelemetry_instrument_instruments_an_sdk_server_and_client_that_never_call_the_hooks():
    mine = _ours(_run_instrumented())
    # the healthy path: each side records the session's standalone GET stream and its DELETE
    kinds = {(s["attributes"][sc.ROLE], s["attributes"][sc.STREAM_KIND]) for s in mine}
    assert kinds == {(role, kind) for role in (sc.ROLE_SERVER, sc.ROLE_CLIENT)
                     for kind in (sc.STREAM_KIND_GET, sc.STREAM_KIND_DELETE)}
    assert len(mine) == len(kinds), "one span per stream and side: nothing observed twice"
    assert {(s["version"], s["schema_url"]) for s in mine} == {(version("mcp-stream-exporter"), sc.SCHEMA_URL)}


def test_a_policy_file_that_does_not_load_leaves_the_hooks_on_without_it_and_says_so(tmp_path):
    """Raised from the instrumentor, the policy's error stopped ``opentelemetry-instrument`` setting up every
    instrumentation, ours and the others: the application ran on with no tracing at all."""
    bad = tmp_path / "tool-policy.toml"
    bad.write_text('[tools.fetch]\nresources = ["https://mcp.example.com/tools/fetch#x"]\n')
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "MCP_STREAM_"))}
    run = subprocess.run([str(INSTRUMENT), sys.executable, str(APP)], env={**clean, "MCP_STREAM_POLICY": str(bad)},
                         capture_output=True, text=True, timeout=60, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    assert _ours(json.loads(run.stdout)), "the hooks still on"
    assert "MCP_STREAM_POLICY" in run.stderr and "is no resource indicator" in run.stderr


@pytest.mark.parametrize("switch", [{"MCP_STREAM_EXPORTER_DISABLED": "true"},
                                    {"OTEL_PYTHON_DISABLED_INSTRUMENTATIONS": "mcp_stream_exporter"}],
                         ids=["MCP_STREAM_EXPORTER_DISABLED", "OTEL_PYTHON_DISABLED_INSTRUMENTATIONS"])
def test_a_kill_switch_leaves_the_sdk_alone(switch):
    outcome = _run_instrumented(**switch)
    assert _ours(outcome) == []
    assert any(s["name"] == "tools/call echo" for s in outcome["spans"]), "the SDK's own spans are still there"


@pytest.mark.anyio
async def test_instrumenting_twice_or_over_hooks_installed_by_hand_observes_each_stream_once():
    span_exporter().clear()
    instrumentor = McpStreamInstrumentor()
    instrumentor.instrument()
    try:
        instrumentor.instrument()  # warns and does nothing: still one wrapper
        assert not hasattr(Server.streamable_http_app.__wrapped__, "__wrapped__")
        server = _echo_server()
        app = instrument_server(server)  # by hand, while the instrumentor is on
        assert sum(isinstance(getattr(m, "__self__", None), ServerInstrumentation) for m in server.middleware) == 1
        http = instrument_client()  # by hand too; the SDK's transport must not tap it again
        async with (serve(app) as port, http,
                    Client(streamable_http_client(f"http://127.0.0.1:{port}/mcp", http_client=http),
                           mode="legacy") as client):
            assert (await client.call_tool("echo", {"text": "hello"})).content[0].text == "hello"
        assert isinstance(http._transport, ClientTap) and not isinstance(http._transport._inner, ClientTap)
    finally:
        instrumentor.uninstrument()
    streams = ours(spans(), sc.SPAN_STREAM)
    for role in (sc.ROLE_SERVER, sc.ROLE_CLIENT):
        kinds = sorted(s.attributes[sc.STREAM_KIND] for s in streams if s.attributes[sc.ROLE] == role)
        assert kinds == [sc.STREAM_KIND_DELETE, sc.STREAM_KIND_GET], role

    assert not hasattr(Server.streamable_http_app, "__wrapped__")  # uninstrumented: the SDK's own again
    plain = MCPServer("plain")
    plain.streamable_http_app()
    assert not any(isinstance(getattr(m, "__self__", None), ServerInstrumentation) for m in plain.middleware)


@pytest.mark.anyio
@pytest.mark.parametrize("how", ["by hand", "instrumentor", "instrumentor, then by hand"])
async def test_an_app_built_again_from_one_server_is_observed_by_its_own_hooks_and_stays_a_starlette_app(how, caplog):
    """An app factory run twice over one server (a test's fixture, an app rebuilt): the app served is observed by
    its own hooks, whatever the other app's left on the server (its middleware), once (``instrument_server`` given
    the app the instrumentor built), and keeps the Starlette API the SDK's app has (a CORS middleware added, its
    state, its routes), with the hooks or under the instrumentor."""
    span_exporter().clear()
    server = _echo_server()
    instrumentor = McpStreamInstrumentor()
    if how != "by hand":
        instrumentor.instrument()
    try:
        build = {"by hand": lambda: instrument_server(server), "instrumentor": server.streamable_http_app,
                 "instrumentor, then by hand": lambda: instrument_server(server.streamable_http_app())}[how]
        build()
        app = build()
        assert isinstance(app, Starlette) and app.routes
        app.add_middleware(CORSMiddleware, allow_origins=["*"])
        app.state.built = how
        with caplog.at_level(logging.WARNING, logger="mcp_stream_exporter"):
            async with (serve(app) as port,
                        Client(streamable_http_client(f"http://127.0.0.1:{port}/mcp"), mode="legacy") as client):
                assert (await client.call_tool("echo", {"text": "hello"})).content[0].text == "hello"
    finally:
        if how != "by hand":
            instrumentor.uninstrument()
    assert not [r for r in caplog.records if r.name.startswith("mcp_stream_exporter.hooks")]
    kinds = sorted(s.attributes[sc.STREAM_KIND] for s in ours(spans(), sc.SPAN_STREAM)
                   if s.attributes[sc.ROLE] == sc.ROLE_SERVER)
    assert kinds == [sc.STREAM_KIND_DELETE, sc.STREAM_KIND_GET]


def test_an_asgi_app_of_any_kind_is_observed_an_unhashable_one_too():
    """Only an app ``instrument_server`` built is returned as it is: any other, a dataclass's instance included
    (unhashable), is wrapped."""

    @dataclasses.dataclass
    class App:
        async def __call__(self, scope: Any, receive: Any, send: Any) -> None: ...

    app = App()
    assert instrument_server(app) is not app


@pytest.mark.anyio
async def test_a_plain_client_the_sdk_sends_with_reads_its_calls_off_the_sdks_messages(monkeypatch):
    """As ``instrument_client`` makes it (``hooks.client.reads_messages``): the tap reads no call's body again."""
    from mcp_stream_exporter.hooks import client as client_hooks

    read_body = client_hooks.read_body

    def unread(body: bytes) -> Any:
        assert b"tools/call" not in body, "the body of a call the SDK built from its message was read again"
        return read_body(body)  # the SDK's other messages (notifications) are read off their bytes

    instrumentor = McpStreamInstrumentor()
    instrumentor.instrument()
    try:
        app = _echo_server().streamable_http_app()
        http = httpx2.AsyncClient()
        async with (serve(app) as port, http,
                    Client(streamable_http_client(f"http://127.0.0.1:{port}/mcp", http_client=http),
                           mode="legacy") as client):
            monkeypatch.setattr(client_hooks, "read_body", unread)
            assert (await client.call_tool("echo", {"text": "hello"})).content[0].text == "hello"
        assert isinstance(http._transport, ClientTap) and type(http) is client_hooks._ReadingClient
    finally:
        instrumentor.uninstrument()


@pytest.mark.anyio
async def test_a_client_with_the_guards_refusal_resolver_is_tapped_once_beneath_it():
    """The tap observes the wire, not the errors the resolver adds: it goes under the resolver, once."""
    instrumentor = McpStreamInstrumentor()
    instrumentor.instrument()
    try:
        server = _echo_server()
        by_hand, bare = resolve_refusals(instrument_client()), resolve_refusals()
        async with serve(server.streamable_http_app()) as port:
            for http in (by_hand, bare):
                async with http, Client(streamable_http_client(f"http://127.0.0.1:{port}/mcp", http_client=http),
                                        mode="legacy") as client:
                    assert (await client.call_tool("echo", {"text": "hi"})).content[0].text == "hi"
                resolver = http._transport
                assert isinstance(resolver, RefusalResolver) and isinstance(resolver.inner, ClientTap)
                assert not isinstance(resolver.inner._inner, ClientTap)
    finally:
        instrumentor.uninstrument()


@pytest.mark.anyio
async def test_a_server_the_guard_serves_is_guarded_once_under_the_instrumentor():
    """``GuardedEventStore.serve`` builds the app with ``streamable_http_app``, which the instrumentor wraps with the
    guard's layer already (``instrument_server`` applies an event store's): one layer acts, the calls go through."""
    instrumentor = McpStreamInstrumentor()
    instrumentor.instrument()
    try:
        server = _echo_server()
        async with (serve(GuardedEventStore(ToolPolicy({})).serve(server)) as port,
                    Client(streamable_http_client(f"http://127.0.0.1:{port}/mcp"), mode="legacy") as client):
            for text in ("one", "two"):
                assert (await client.call_tool("echo", {"text": text})).content[0].text == text
    finally:
        instrumentor.uninstrument()


@pytest.mark.anyio
async def test_every_transport_of_a_client_with_the_resolver_is_tapped_beneath_it():
    """A client routing through a proxy (a mount: here every 127.0.0.1 URL) is resolved and tapped on that route
    too, once, whether tapped by hand or by the instrumentor."""
    instrumentor = McpStreamInstrumentor()
    instrumentor.instrument()
    try:
        server = _echo_server()
        mounted = {"http://127.0.0.1": httpx2.AsyncHTTPTransport()}
        by_hand, bare = resolve_refusals(instrument_client(mounts=mounted)), resolve_refusals(mounts=dict(mounted))
        async with serve(server.streamable_http_app()) as port:
            for http in (by_hand, bare):
                async with http, Client(streamable_http_client(f"http://127.0.0.1:{port}/mcp", http_client=http),
                                        mode="legacy") as client:
                    assert (await client.call_tool("echo", {"text": "hi"})).content[0].text == "hi"
                for transport in (http._transport, *http._mounts.values()):
                    assert isinstance(transport, RefusalResolver) and isinstance(transport.inner, ClientTap)
                    assert not isinstance(transport.inner._inner, ClientTap)
    finally:
        instrumentor.uninstrument()


class _ClaimsAndReplaysNothing(EventStore):
    """An author's store with a bug: a resume's stream is claimed, and none of its events replayed."""

    def __init__(self) -> None:
        self.streams: dict[str, str] = {}

    async def store_event(self, stream_id: str, message: Any) -> str:
        event_id = str(len(self.streams) + 1)
        self.streams[event_id] = stream_id
        return event_id

    async def replay_events_after(self, last_event_id: str, send_callback: Any) -> str | None:
        return self.streams.get(last_event_id)


def _low_level_server() -> Server:
    """A server on the SDK's low-level ``Server`` (handlers, no decorators), as an author writes one."""
    async def list_tools(ctx: Any, params: Any) -> types.ListToolsResult:
        return types.ListToolsResult(tools=[types.Tool(name="work", input_schema={"type": "object"})])

    async def call_tool(ctx: Any, params: Any) -> types.CallToolResult:
        meta = ctx.meta or {}
        token = meta.get("progress_token", meta.get("progressToken")) if isinstance(meta, dict) else getattr(
            meta, "progress_token", None)
        for step in (1, 2):
            await ctx.session.send_progress_notification(token, step, 2, f"step {step}",
                                                         related_request_id=ctx.request_id)
        return types.CallToolResult(content=[types.TextContent(type="text", text="done")])

    return Server("low-level", on_list_tools=list_tools, on_call_tool=call_tool)


@pytest.mark.anyio
@pytest.mark.parametrize("how", ["by hand", "instrumentor"])
async def test_a_low_level_servers_result_lost_behind_its_stores_replay_is_found_by_hand_and_under_the_instrumentor(
        how: str) -> None:
    """The SDK's low-level ``Server`` builds its app with the same ``streamable_http_app`` as ``MCPServer``, which
    builds its own with it: ``instrument_server`` refused it, and the instrumentor left its app unobserved, so a
    result its store never replayed was lost with no finding."""
    server = _low_level_server()
    instrumentor = McpStreamInstrumentor()
    with detector() as (found, clock):
        if how == "by hand":
            app = instrument_server(server, event_store=_ClaimsAndReplaysNothing(), retry_interval=100)
        else:
            instrumentor.instrument()
            try:
                app = server.streamable_http_app(event_store=_ClaimsAndReplaysNothing(), retry_interval=100)
            finally:
                instrumentor.uninstrument()
        async with serve(app) as port:
            proxy = CutProxy(port)
            await proxy.start()
            try:
                async with (instrument_client() as http,
                            Client(streamable_http_client(f"http://127.0.0.1:{proxy.port}/mcp", http_client=http),
                                   mode="legacy") as client):
                    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
                        pass

                    proxy.arm(b"step 1")
                    with anyio.move_on_after(2):  # the caller's timeout: the result never comes
                        await client.call_tool("work", {}, progress_callback=on_progress)
            finally:
                await proxy.stop()
        rules = {finding.rule for finding in after_grace(found, clock)}
    # the server's own record of what its store replayed (replay_truncated), and the loss: stored while the POST was
    # gone, or sent onto it before the server saw it go
    assert proxy.cuts and "replay_truncated" in rules and rules & {"stored_not_delivered", "sent_not_received"}, rules


def _hooks_on(server: MCPServer | Server) -> int:
    return sum(isinstance(getattr(m, "__self__", None), ServerInstrumentation) for m in server.middleware)


def test_a_servers_app_built_while_instrument_server_builds_another_is_instrumented_once_and_an_override_runs_once():
    """Under the instrumentor, ``instrument_server`` building one server's app left any other built meanwhile (a
    gateway that mounts another team's server) unobserved; and a low-level server whose ``streamable_http_app``
    override calls the SDK's ran it twice, nested (a route it adds, added twice)."""
    inner = MCPServer("inner")
    built: list[str] = []

    class Gateway(MCPServer):
        def streamable_http_app(self, **options: Any) -> Starlette:
            app = super().streamable_http_app(**options)
            app.router.routes.append(Mount("/inner", app=inner.streamable_http_app()))
            return app

    class Health(Server):
        def streamable_http_app(self, **options: Any) -> Starlette:
            built.append("app")
            app = super().streamable_http_app(**options)
            app.router.routes.append(Route("/health", lambda request: PlainTextResponse("ok")))
            return app

    instrumentor = McpStreamInstrumentor()
    instrumentor.instrument()
    try:
        outer = Gateway("outer")
        instrument_server(outer)  # by hand, the instrumentor on
        health = Health("health").streamable_http_app()
    finally:
        instrumentor.uninstrument()
    assert (_hooks_on(outer), _hooks_on(inner)) == (1, 1)
    assert built == ["app"] and sum(getattr(r, "path", None) == "/health" for r in health.router.routes) == 1
