"""Setting the hooks and the guard up: what is no server, app, event store or policy is refused where it is given,
not at the first request; hooks given the endpoint's path as another app routes it say so; the guard's ``serve``
returns the app itself, guarded around whatever middleware is added to it."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from mcp.server.lowlevel import Server
from mcp.server.mcpserver import MCPServer
from starlette.applications import Starlette
from starlette.types import Receive, Scope, Send

from mcp_stream_exporter import ToolPolicy, instrument_client, instrument_server
from mcp_stream_exporter.guard import CallGuard, GuardedEventStore
from mcp_stream_exporter.hooks import ServerInstrumentation
from mcp_stream_exporter.instrumentation import McpStreamInstrumentor

_POLICY = ToolPolicy({})


async def _ok(scope: Scope, receive: Receive, send: Send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b""})


def _request(app: Any, path: str, headers: tuple[tuple[bytes, bytes], ...] = (), method: str = "POST"
             ) -> list[dict[str, Any]]:
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(app({"type": "http", "method": method, "path": path, "headers": list(headers)}, receive, send))
    return sent


@pytest.mark.parametrize("target", ["app.main:app", MCPServer("x").streamable_http_app,
                                    Server("x").streamable_http_app],
                         ids=["a string", "the server's method", "a low-level server's method"])
def test_instrument_server_refuses_what_is_no_server_or_app(target: Any) -> None:
    with pytest.raises(TypeError, match="instrument_server takes"):
        instrument_server(target)


@pytest.mark.parametrize("store", [GuardedEventStore, {}], ids=["a class", "a mapping"])
def test_instrument_server_refuses_what_is_no_event_store(store: Any) -> None:
    with pytest.raises(TypeError, match="event_store must be an EventStore instance"):
        instrument_server(MCPServer("x"), event_store=store)


@pytest.mark.parametrize("policy", ["tool-policy.toml", {"tools": {}}], ids=["a path", "a mapping"])
def test_every_policy_taker_refuses_what_is_no_policy(policy: Any) -> None:
    for take in (lambda: instrument_server(MCPServer("x"), policy=policy),
                 lambda: instrument_client(policy=policy),
                 lambda: McpStreamInstrumentor().instrument(policy=policy),
                 lambda: GuardedEventStore(policy),
                 lambda: CallGuard(policy)):
        with pytest.raises(TypeError, match="policy must be a ToolPolicy"):
            take()


def test_hooks_say_once_that_mcp_requests_come_to_a_path_they_do_not_observe(caplog: pytest.LogCaptureFixture) -> None:
    """``instrument_server(outer_app)`` with the SDK's app mounted at ``/api``: its endpoint is ``/api/mcp`` there."""
    app = ServerInstrumentation(path="/mcp").asgi(_ok)
    with caplog.at_level(logging.WARNING, logger="mcp_stream_exporter.hooks"):
        _request(app, "/health")
        assert not caplog.records  # no MCP header: any other route of the app
        _request(app, "/api/mcp", ((b"mcp-protocol-version", b"2025-11-25"),))  # an initialize carries no session
        _request(app, "/.well-known/oauth-protected-resource/mcp", ((b"mcp-session-id", b"s1"),), "GET")  # discovery
        assert not caplog.records
        _request(app, "/api/mcp", ((b"mcp-session-id", b"s1"),))
        _request(app, "/api/mcp", ((b"mcp-session-id", b"s1"),))
    assert [r.getMessage() for r in caplog.records] == [
        "MCP requests come to '/api/mcp', which these hooks do not observe: they observe '/mcp'. If that is the "
        "endpoint they are for, give instrument_server its path as the app it observes routes it "
        "(streamable_http_path=...)"]


def test_hooks_that_observe_their_endpoint_say_nothing_of_mcp_requests_elsewhere(
        caplog: pytest.LogCaptureFixture) -> None:
    """Two servers' hooks around one app: each sees the other's requests go by."""
    app = ServerInstrumentation(path="/a/mcp").asgi(_ok)
    with caplog.at_level(logging.WARNING, logger="mcp_stream_exporter.hooks"):
        _request(app, "/a/mcp", ((b"mcp-session-id", b"s1"),))
        _request(app, "/b/mcp", ((b"mcp-session-id", b"s2"),))
    assert not caplog.records


def test_guard_serve_returns_the_app_guarded_around_the_middleware_added_to_it() -> None:
    reached: list[str] = []

    class Recording:
        def __init__(self, app: Any) -> None:
            self.app = app

        async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
            reached.append(scope["path"])
            await self.app(scope, receive, send)

    app = GuardedEventStore(_POLICY).serve(MCPServer("x"))
    assert isinstance(app, Starlette)
    app.add_middleware(Recording)
    # the guard answers a request naming two tokens before anything inside it sees the request
    sent = _request(app, "/mcp", ((b"authorization", b"Bearer a"), (b"authorization", b"Bearer b")))
    assert sent[0]["status"] == 400
    assert reached == []
