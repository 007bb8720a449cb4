"""Many sessions at once on the real SDK, a known few of them losing a result: detection at scale.

One instrumented incident server (``lab.incident``) and ``sessions`` instrumented SDK clients, at most
``concurrent`` open at a time, each making ``calls_per_session`` ``tools/call``: ``fetch`` answered on
its own POST (the healthy path), and one ``poll``, whose server closes the stream after its first
step, so the client resumes and gets the result from the replay (a healthy deviation). A *lossy*
session holds a token without poll's resource: the incident's store ends its replay silently, the SDK
resumes until the caller's timeout, and that result is lost. Which sessions are lossy is known, so a
detector fed these spans can be checked for every loss found and nothing else.

``tests/integration/test_scale.py`` runs a small fleet in the suite; ``bench/scale.py`` the full size.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import httpx2
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from mcp_types import CallToolRequest, CallToolRequestParams, CallToolResult

from mcp_stream_exporter.hooks import instrument_client, instrument_server
from mcp_stream_exporter.lab.incident import (
    BASE_RESOURCE,
    FETCH_RESOURCE,
    SEARCH_RESOURCE,
    IncidentEventStore,
    build_incident_server,
    incident_policy,
)
from mcp_stream_exporter.lab.scenario import serve
from mcp_stream_exporter.lab.tokens import BearerAuth, TokenIssuer


@dataclass(frozen=True, slots=True)
class FleetPlan:
    sessions: int = 500
    calls_per_session: int = 20
    lossy_sessions: int = 100  # each loses its one poll call: 1 % of 10,000 calls by default
    concurrent: int = 100  # sessions open at once
    call_timeout_s: float = 15.0  # the caller's timeout on a poll call (a lost one waits it out)
    retry_ms: int = 300  # the server's SSE retry: how soon the SDK resumes
    step_delay_s: float = 0.005


@dataclass(slots=True)
class FleetOutcome:
    calls: int = 0
    results: int = 0
    # session ids whose poll call timed out: the lossy ones, and any healthy one an overloaded machine made
    # late (if its result never reached the client before the caller gave up, that result was lost too)
    lost: set[str] = field(default_factory=set)
    lossy: set[str] = field(default_factory=set)  # session ids that held a token without poll's resource
    elapsed_s: float = 0.0
    peak_open: int = 0
    tokens: tuple[str, ...] = ()  # the bearer tokens used: for checks that none leaked


async def run_fleet(plan: FleetPlan) -> FleetOutcome:
    """Run the fleet; every client and the server are on 127.0.0.1, every call is real."""
    issuer = TokenIssuer()
    policy = incident_policy()
    store = IncidentEventStore(policy)
    server = build_incident_server(issuer, store=store, step_delay=plan.step_delay_s)
    app = instrument_server(server, policy=policy, event_store=store, retry_interval=plan.retry_ms)
    broad = issuer.mint([BASE_RESOURCE, SEARCH_RESOURCE, FETCH_RESOURCE])
    narrow = issuer.mint([FETCH_RESOURCE])  # may call fetch; may not see poll's events on a replay
    every = max(1, plan.sessions // max(1, plan.lossy_sessions))
    outcome = FleetOutcome(tokens=(broad, narrow))
    gate = asyncio.Semaphore(plan.concurrent)
    open_now = 0
    started = time.monotonic()

    async def session(index: int, url: str) -> None:
        nonlocal open_now
        lossy = index % every == 0 and index // every < plan.lossy_sessions
        session_ids: list[str] = []

        async def note_session(response: httpx2.Response) -> None:
            sid = response.headers.get("mcp-session-id")
            if sid and not session_ids:
                session_ids.append(sid)

        async with gate:
            open_now += 1
            outcome.peak_open = max(outcome.peak_open, open_now)
            try:
                http = instrument_client(auth=BearerAuth(narrow if lossy else broad), policy=policy,
                                         event_hooks={"response": [note_session]})
                async with http, Client(streamable_http_client(url, http_client=http), mode="legacy") as client:
                    poll_at = index % plan.calls_per_session
                    for k in range(plan.calls_per_session):
                        outcome.calls += 1
                        if k == poll_at:
                            try:
                                await _call(client, "poll", {"steps": 2}, plan.call_timeout_s)
                            except MCPError:
                                outcome.lost.add(session_ids[0])
                                continue
                        else:
                            await _call(client, "fetch", {"url": f"u{index}-{k}"}, 30.0)
                        outcome.results += 1
                if lossy:
                    outcome.lossy.add(session_ids[0])
            finally:
                open_now -= 1

    async with serve(app) as port:
        url = f"http://127.0.0.1:{port}/mcp"
        await asyncio.gather(*(session(i, url) for i in range(plan.sessions)))
    outcome.elapsed_s = time.monotonic() - started
    return outcome


async def _call(client: Client, name: str, arguments: dict[str, Any], timeout: float) -> CallToolResult:
    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        pass  # asking for progress makes the server stream: the poll tool's close needs a stream

    return await client.session.send_request(
        CallToolRequest(params=CallToolRequestParams(name=name, arguments=arguments)), CallToolResult,
        request_read_timeout_seconds=timeout, progress_callback=on_progress)
