"""The incident's parts wired together: the instrumented incident server behind a cutting proxy,
and an instrumented SDK client whose bearer token can change (a refresh), all on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.server.mcpserver import MCPServer
from mcp.server.streamable_http import EventStore
from mcp.shared.exceptions import MCPError
from mcp.shared.message import ClientMessageMetadata
from mcp_types import CallToolRequest, CallToolRequestParams, CallToolResult
from opentelemetry import trace

from mcp_stream_exporter.auth import TokenReader
from mcp_stream_exporter.guard import CallGuard, GuardedEventStore, resolve_refusals
from mcp_stream_exporter.hooks import instrument_client, instrument_server
from mcp_stream_exporter.lab.incident import (
    BASE_RESOURCE,
    FETCH_RESOURCE,
    SEARCH_RESOURCE,
    IncidentEventStore,
    build_incident_server,
    incident_policy,
)
from mcp_stream_exporter.lab.proxy import CutProxy
from mcp_stream_exporter.lab.tokens import BearerAuth, TokenIssuer
from mcp_stream_exporter.resume import Action, Refusal, decide_resume


@contextlib.asynccontextmanager
async def serve(app: Any, *, host: str = "127.0.0.1", port: int = 0) -> AsyncIterator[int]:
    """Serve an ASGI app with uvicorn (which sets TCP_NODELAY itself); yields the bound port."""
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on"))
    task = asyncio.create_task(server.serve())
    for _ in range(1000):
        if server.started or task.done():
            break
        await asyncio.sleep(0.01)
    if not server.started:
        await task
        raise RuntimeError(f"uvicorn did not start on {host}:{port}")
    try:
        yield server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        await task


@dataclass
class Incident:
    client: Client
    proxy: CutProxy
    auth: BearerAuth
    issuer: TokenIssuer
    broad: str  # aud: the aggregate resource and both tools
    narrow: str  # aud: search only, as a least-privilege refresh mints it
    store: EventStore | None = None  # the server's replay store
    server: MCPServer | None = None
    progress: list[str] = field(default_factory=list)

    def refresh_narrows(self) -> None:
        self.auth.token = self.narrow

    async def expire_sessions(self) -> None:
        """End every session on the server, as an idle timeout or a restart would: the next request
        with the old session id gets 404."""
        assert self.server is not None
        for transport in list(self.server.session_manager._server_instances.values()):  # lab only: no public API
            await transport.terminate()

    def widen(self) -> None:
        """Re-authorise with a superset audience (the broad token again)."""
        self.auth.token = self.broad

    async def recover(self, refused: MCPError, name: str, arguments: dict[str, Any],
                      timeout: float = 10.0) -> CallToolResult:
        """Leg 3 done right: read the guard's refusal, re-authorise with a superset token and
        resume from the cursor it names (or re-issue when the cursor is gone)."""
        refusal = Refusal.from_data(refused.data)
        held = TokenReader().read(self.auth.token)
        decision = decide_resume([refusal.requirement], held, cursor=refusal.cursor, can_widen=True)
        if decision.action is Action.REAUTHORIZE:
            self.widen()
        resume_from = decision.cursor if decision.action is not Action.REISSUE else None
        return await self.call(name, arguments, timeout=timeout, resume_from=resume_from)

    async def call(self, name: str, arguments: dict[str, Any], timeout: float = 10.0,
                   resume_from: str | None = None) -> CallToolResult:
        """A ``tools/call`` with a progress callback, so the server streams progress events.
        ``resume_from``: don't send it again, resume its stream from this event id (the SDK's
        explicit resumption: a GET with ``Last-Event-ID``)."""

        async def on_progress(progress: float, total: float | None, message: str | None) -> None:
            self.progress.append(message or "")

        return await self.client.session.send_request(
            CallToolRequest(params=CallToolRequestParams(name=name, arguments=arguments)),
            CallToolResult,
            request_read_timeout_seconds=timeout,
            progress_callback=on_progress,
            metadata=ClientMessageMetadata(resumption_token=resume_from) if resume_from else None,
        )


@contextlib.asynccontextmanager
async def incident(mode: str | None = "legacy", *, guarded: bool = False, guard_calls: bool = False,
                   resolve: bool = True, session_wide_filter: bool = False,
                   retry_interval: int = 200, step_delay: float = 0.05, json_response: bool = False,
                   replay_latency_s: float = 0.0, priming_latency_s: float = 0.0,
                   tracer_provider: trace.TracerProvider | None = None) -> AsyncIterator[Incident]:
    """``mode="legacy"`` negotiates the resumable era; ``None`` lets the SDK pick (2026-07-28).
    ``guarded`` serves with the replay guard instead of the incident's naive replay store;
    ``guard_calls`` installs the call guard, which refuses a call whose token lacks the tool's resource;
    ``resolve`` wraps the client with the guard's resolver, so a refused resume fails its call at once;
    ``session_wide_filter`` makes the naive store skip what the token may not see and replay the rest
    of the session (``IncidentEventStore``), and ``replay_latency_s`` makes its replays return that much later, as
    a remote store's do, ``priming_latency_s`` a resumed stream's priming event stored that much later;
    ``json_response`` answers each POST with one JSON body."""
    issuer = TokenIssuer()
    policy = incident_policy()
    store: EventStore
    if guarded:
        store = GuardedEventStore(policy)
        server = build_incident_server(issuer, step_delay=step_delay)
    else:
        store = naive = IncidentEventStore(policy, session_wide_filter=session_wide_filter,
                                           replay_latency_s=replay_latency_s, priming_latency_s=priming_latency_s)
        server = build_incident_server(issuer, store=naive, step_delay=step_delay)
    if guard_calls:
        server.middleware.append(CallGuard(policy))
    app = instrument_server(server, policy=policy, event_store=store,
                            retry_interval=retry_interval, json_response=json_response,
                            tracer_provider=tracer_provider)
    broad = issuer.mint([BASE_RESOURCE, SEARCH_RESOURCE, FETCH_RESOURCE])
    narrow = issuer.mint([SEARCH_RESOURCE])
    async with serve(app) as port:
        proxy = CutProxy(port)
        await proxy.start()
        auth = BearerAuth(broad)
        http = instrument_client(auth=auth, policy=policy, tracer_provider=tracer_provider)
        if resolve:  # last, around the tap: the tap sees only the wire
            http = resolve_refusals(http)
        options: dict[str, Any] = {"mode": mode} if mode else {}
        try:
            async with http, Client(streamable_http_client(f"http://127.0.0.1:{proxy.port}/mcp", http_client=http),
                                    **options) as client:
                yield Incident(client, proxy, auth, issuer, broad, narrow, store=store, server=server)
        finally:
            await proxy.stop()
