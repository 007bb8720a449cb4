"""The incident's server (docs/incident.md, "What happened"), on the real SDK.

Two tools, ``search`` and ``fetch``, each requiring its own resource indicator, and the replay store
the incident describes: the SDK example's per-stream store plus a per-event audience check that, at
the first buffered event the resuming token is not authorised for, stops the replay and lets the
stream end cleanly. Nothing in it is wrong on its own; composed with a narrowed refresh it loses a
result with no signal. The guard (guard/) is the fix; this is the reproduction.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from dataclasses import dataclass
from typing import Any

from mcp.server.auth.middleware.auth_context import get_access_token
from mcp.server.auth.settings import AuthSettings
from mcp.server.context import CallNext, HandlerResult, ServerRequestContext
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.streamable_http import EventCallback, EventId, EventMessage, EventStore, StreamId
from mcp_types import JSONRPCMessage
from pydantic import AnyHttpUrl

from mcp_stream_exporter import scope as request_scope
from mcp_stream_exporter.auth import Requirement, ToolPolicy, canonical_resources
from mcp_stream_exporter.lab.tokens import ISSUER, TokenIssuer

BASE_RESOURCE = "https://mcp.example.com"
SEARCH_RESOURCE = f"{BASE_RESOURCE}/tools/search"
FETCH_RESOURCE = f"{BASE_RESOURCE}/tools/fetch"


def incident_policy() -> ToolPolicy:
    return ToolPolicy({"search": Requirement.of([SEARCH_RESOURCE]), "fetch": Requirement.of([FETCH_RESOURCE]),
                       "poll": Requirement.of([SEARCH_RESOURCE])})


@dataclass(slots=True)
class _Entry:
    event_id: str
    stream_id: StreamId
    message: JSONRPCMessage | None
    session_id: str | None = None


_Key = tuple[str | None, StreamId]  # (session, stream): the SDK's stream ids repeat across sessions


def _session() -> str | None:
    """The session of the request this runs for, where the hooks' observer bound one (else None)."""
    current = request_scope.current()
    return current.session_id if current is not None else None


class IncidentEventStore(EventStore):
    """The incident's replay store: sequential event ids, per-stream buffers, a per-event audience check
    that ends the replay silently at the first event the resuming token may not see.

    ``session_wide_filter=True`` is the other naive store in the wild (as in dunglas/mercure#1321): it
    replays every event stored after the cursor, on any stream, and skips the ones the token may not
    see, so the cursor moves past them and another call's result can arrive on this stream.

    Streams are kept per session where the hooks' observer tells the session (the SDK's stream ids are
    request ids and repeat across sessions), so many sessions can share one store without a replay
    crossing sessions: the fleet (``lab.fleet``) runs hundreds.

    ``replay_latency_s`` is a remote store's: a replay returns that long after it read what it replays; and
    ``priming_latency_s``: the priming event the SDK stores for a resumed stream after its replay returns is stored
    that long after. Whatever the call stores meanwhile the SDK drops (it takes the resume for the call's stream
    only once the replay returned and its priming event went out), as it does in the shorter windows a store in
    memory leaves."""

    def __init__(self, policy: ToolPolicy, *, max_events_per_stream: int = 1000,
                 session_wide_filter: bool = False, replay_latency_s: float = 0.0,
                 priming_latency_s: float = 0.0) -> None:
        self._policy = policy
        self._session_wide_filter = session_wide_filter
        self._replay_latency_s = replay_latency_s
        self._priming_latency_s = priming_latency_s
        self._resumed: set[_Key] = set()  # streams a replay returned, whose next priming event is a resume's
        self._ids = itertools.count(1)
        self._streams: dict[_Key, deque[_Entry]] = {}
        self._index: dict[EventId, _Entry] = {}
        self._tool_of: dict[_Key, str] = {}
        self._max = max_events_per_stream

    async def record_tool(self, ctx: ServerRequestContext[Any, Any], call_next: CallNext) -> HandlerResult:
        """ServerMiddleware: which tool each stream (request id) belongs to."""
        if ctx.method == "tools/call" and ctx.request_id is not None:
            name = (ctx.params or {}).get("name")
            if isinstance(name, str):
                self._tool_of[(_session(), str(ctx.request_id))] = name
        return await call_next(ctx)

    async def store_event(self, stream_id: StreamId, message: JSONRPCMessage | None) -> EventId:
        if message is None and self._resumed:
            resumed = (_session(), stream_id)
            if resumed in self._resumed:
                self._resumed.discard(resumed)
                await asyncio.sleep(self._priming_latency_s)
        entry = _Entry(str(next(self._ids)), stream_id, message, _session())
        buf = self._streams.setdefault((entry.session_id, stream_id), deque(maxlen=self._max))
        if len(buf) == buf.maxlen:
            self._index.pop(buf[0].event_id, None)
        buf.append(entry)
        self._index[entry.event_id] = entry
        return entry.event_id

    async def replay_events_after(self, last_event_id: EventId, send_callback: EventCallback) -> StreamId | None:
        stream_id = await self._replay(last_event_id, send_callback)
        if self._replay_latency_s:
            await asyncio.sleep(self._replay_latency_s)
        if self._priming_latency_s and stream_id is not None:
            self._resumed.add((_session(), stream_id))
        return stream_id

    async def _replay(self, last_event_id: EventId, send_callback: EventCallback) -> StreamId | None:
        cursor = self._index.get(last_event_id)
        if cursor is None or cursor.session_id != _session():
            return None
        token = get_access_token()
        claims = (token.claims or {}) if token is not None else {}
        aud = claims.get("aud", [])
        audience = canonical_resources([aud] if isinstance(aud, str) else aud)
        if self._session_wide_filter:
            await self._replay_filtered(last_event_id, audience, send_callback)
            return cursor.stream_id
        requirement = self._policy.requirement(self._tool_of.get((cursor.session_id, cursor.stream_id)))
        after = False
        # a copy: the call stores on while the replay awaits each send
        for entry in list(self._streams.get((cursor.session_id, cursor.stream_id), ())):
            if entry.event_id == last_event_id:
                after = True
                continue
            if not after or entry.message is None:
                continue
            if not _may_see(requirement, audience):
                return None  # the incident: stop here, send nothing more, end the stream cleanly
            await send_callback(EventMessage(entry.message, entry.event_id))
        if not _may_see(requirement, audience):
            return None
        return cursor.stream_id

    async def _replay_filtered(self, last_event_id: EventId, audience: frozenset[str],
                               send_callback: EventCallback) -> None:
        session = _session()
        later = sorted((e for e in self._index.values()
                        if int(e.event_id) > int(last_event_id) and e.session_id == session),
                       key=lambda e: int(e.event_id))
        for entry in later:
            requirement = self._policy.requirement(self._tool_of.get((entry.session_id, entry.stream_id)))
            if entry.message is None or not _may_see(requirement, audience):
                continue
            await send_callback(EventMessage(entry.message, entry.event_id))


def _may_see(requirement: Requirement | None, audience: frozenset[str]) -> bool:
    """This store's check: the token's ``aud`` covers the resources of the event's tool."""
    return requirement is None or requirement.resources <= audience


def build_incident_server(issuer: TokenIssuer | None = None, *, step_delay: float = 0.05,
                          store: IncidentEventStore | None = None) -> MCPServer:
    """``search`` and ``fetch`` (``steps`` progress notifications, ``step_delay`` apart, then a
    result) and ``poll`` (closes its SSE stream after the first step: a server-initiated end).
    With an ``issuer`` the server requires its tokens."""
    auth: dict[str, Any] = {}
    if issuer is not None:
        auth = {"token_verifier": issuer, "auth": AuthSettings(issuer_url=AnyHttpUrl(ISSUER), resource_server_url=None,
                                                                  required_scopes=["mcp"])}
    mcp = MCPServer("incident", **auth)

    async def work(tool: str, steps: int, ctx: Context) -> None:
        for i in range(steps):
            await asyncio.sleep(step_delay)
            await ctx.report_progress(i + 1, steps, f"{tool} step {i + 1}")

    @mcp.tool()
    async def search(query: str, ctx: Context, steps: int = 0) -> str:
        """Search the index."""
        await work("search", steps, ctx)
        return f"search results for {query!r}"

    @mcp.tool()
    async def fetch(url: str, ctx: Context, steps: int = 0) -> str:
        """Fetch a document."""
        await work("fetch", steps, ctx)
        return f"contents of {url}"

    @mcp.tool()
    async def poll(steps: int, ctx: Context) -> str:
        """A long job that tells the client to poll: it closes its stream after the first step."""
        for i in range(steps):
            await asyncio.sleep(step_delay)
            await ctx.report_progress(i + 1, steps, f"poll step {i + 1}")
            if i == 0:
                await ctx.close_sse_stream()
        return f"poll done after {steps} steps"

    if store is not None:
        mcp.middleware.append(store.record_tool)
    return mcp
