"""The replay guard against the incident, over the real SDK client in legacy mode."""

from __future__ import annotations

import asyncio

import pytest
from harness import incident, ours, spans
from mcp.shared.exceptions import MCPError

from mcp_stream_exporter import semconv as sc
from mcp_stream_exporter.auth import TokenReader
from mcp_stream_exporter.lab import FETCH_RESOURCE, SEARCH_RESOURCE
from mcp_stream_exporter.resume import RESUME_REFUSED, Action, Refusal, decide_resume

pytestmark = pytest.mark.anyio

REQUEST_TIMEOUT = -32001  # the SDK's "Request ... timed out"


async def _incident_run(s, fetch_timeout):
    s.proxy.arm(b"fetch step 1", on_cut=s.refresh_narrows)  # the drop, then the narrowing refresh
    return await asyncio.gather(
        s.call("search", {"query": "q", "steps": 4}),
        s.call("fetch", {"url": "u", "steps": 4}, timeout=fetch_timeout),
        return_exceptions=True,
    )


async def test_the_naive_store_loses_fetch_and_the_guard_refuses_then_delivers_it_after_reauthorisation():
    async with incident("legacy") as naive:
        search, fetch = await _incident_run(naive, fetch_timeout=2.5)
    assert "search results" in search.content[0].text
    assert isinstance(fetch, MCPError)
    assert fetch.code == REQUEST_TIMEOUT  # lost: only an unrelated timeout ends the call

    async with incident("legacy", guarded=True) as guarded:
        search, fetch = await _incident_run(guarded, fetch_timeout=20)
        assert "search results" in search.content[0].text
        assert isinstance(fetch, MCPError)
        assert fetch.code == RESUME_REFUSED  # an explicit, immediate error, not a timeout
        refusal = Refusal.from_data(fetch.data)
        assert refusal.error == "insufficient_audience"
        assert refusal.requirement.resources == {FETCH_RESOURCE}
        assert refusal.token_audience == {SEARCH_RESOURCE}
        held = TokenReader().read(guarded.auth.token)
        decision = decide_resume([refusal.requirement], held, cursor=refusal.cursor, can_widen=True)
        assert decision.action is Action.REAUTHORIZE
        guarded.widen()
        recovered = await guarded.call("fetch", {"url": "u", "steps": 4}, resume_from=decision.cursor)
    assert recovered.content[0].text == "contents of u"

    found = spans()
    (client_post,) = [sp for sp in ours(found, sc.SPAN_STREAM, sc.ROLE_CLIENT,
                                        mcp_stream__stream__kind=sc.STREAM_KIND_POST)
                      if sp.attributes[sc.END_REASON] == sc.END_DROPPED
                      and refusal.request_id in sp.attributes[sc.STREAM_REQUEST_IDS]]
    assert refusal.cursor == client_post.attributes[sc.EVENT_LAST_ID]  # the cursor never moved
    refused = ours(found, sc.SPAN_REPLAY, sc.ROLE_SERVER, mcp_stream__guard__decision=sc.GUARD_REFUSE)
    assert len(refused) == 1
    assert refused[0].attributes[sc.REPLAY_DECISION] == sc.REPLAY_REFUSED
    assert refused[0].attributes[sc.GUARD_MISSING_RESOURCES] == (FETCH_RESOURCE,)
    error_frames = [sp for sp in ours(found, sc.SPAN_STREAM, sc.ROLE_CLIENT)
                    if sp.attributes.get(sc.ERROR_FRAMES_COUNT)]
    assert len(error_frames) == 1
    assert ours(found, sc.SPAN_REPLAY, sc.ROLE_SERVER, mcp_stream__guard__decision=sc.GUARD_ALLOW)
    assert not ours(found, sc.SPAN_REPLAY, sc.ROLE_SERVER, mcp_stream__replay__decision=sc.REPLAY_TRUNCATED)
