"""The incident's parts wired together for one test: instrumented server behind a cutting proxy,
an instrumented client with a bearer that can change, and spans collected in memory."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp_types import CallToolRequest, CallToolRequestParams, CallToolResult
from opentelemetry.sdk.trace import ReadableSpan

from mcp_stream_exporter import instrument_client, instrument_server
from mcp_stream_exporter.lab import (
    BASE_RESOURCE,
    FETCH_RESOURCE,
    SEARCH_RESOURCE,
    BearerAuth,
    CutProxy,
    IncidentEventStore,
    TokenIssuer,
    build_incident_server,
    incident_policy,
)

from harness import serve, span_exporter


@dataclass
class Scenario:
    client: Client
    proxy: CutProxy
    auth: BearerAuth
    issuer: TokenIssuer
    broad: str
    narrow: str
    progress: list[str]

    async def call(self, name: str, arguments: dict[str, Any], timeout: float = 10.0) -> CallToolResult:
        async def on_progress(progress: float, total: float | None, message: str | None) -> None:
            self.progress.append(message or "")

        return await self.client.session.send_request(
            CallToolRequest(params=CallToolRequestParams(name=name, arguments=arguments)),
            CallToolResult,
            request_read_timeout_seconds=timeout,
            progress_callback=on_progress,
        )

    @staticmethod
    def spans() -> list[ReadableSpan]:
        return list(span_exporter().get_finished_spans())


@contextlib.asynccontextmanager
async def incident(mode: str | None = "legacy", *, enforce: bool = False,
                   retry_interval: int = 200, step_delay: float = 0.05) -> AsyncIterator[Scenario]:
    exporter = span_exporter()
    exporter.clear()
    issuer = TokenIssuer()
    policy = incident_policy()
    store = IncidentEventStore(policy)
    server = build_incident_server(issuer, store=store, step_delay=step_delay)
    app = instrument_server(server, policy=policy, enforce=enforce, event_store=store,
                            retry_interval=retry_interval)
    broad = issuer.mint([BASE_RESOURCE, SEARCH_RESOURCE, FETCH_RESOURCE])
    narrow = issuer.mint([SEARCH_RESOURCE])
    async with serve(app) as port:
        proxy = CutProxy(port)
        await proxy.start()
        auth = BearerAuth(broad)
        http = instrument_client(auth=auth, policy=policy)
        kwargs = {"mode": mode} if mode else {}
        try:
            async with http, Client(streamable_http_client(f"http://127.0.0.1:{proxy.port}/mcp",
                                                           http_client=http), **kwargs) as client:
                yield Scenario(client, proxy, auth, issuer, broad, narrow, [])
        finally:
            await proxy.stop()
