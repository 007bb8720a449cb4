"""The replay guard against the incident, over the real SDK client in legacy mode."""

from __future__ import annotations

import asyncio

import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError

from mcp_stream_exporter import instrument_server
from mcp_stream_exporter import semconv as sc
from mcp_stream_exporter.asgi import Message, Receive, Scope, Send
from mcp_stream_exporter.auth import TokenReader
from mcp_stream_exporter.guard import CallGuard, GuardedEventStore
from mcp_stream_exporter.lab import (
    BASE_RESOURCE,
    FETCH_RESOURCE,
    SEARCH_RESOURCE,
    BearerAuth,
    TokenIssuer,
    build_incident_server,
    incident_policy,
    serve,
)
from mcp_stream_exporter.resume import Action, Refusal, decide_resume
from mcp_stream_exporter.wire import REFUSED_ERROR_CODE

from harness import incident, ours, span_exporter, spans

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
        assert fetch.code == REFUSED_ERROR_CODE  # an explicit, immediate error, not a timeout
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


async def test_a_resume_never_replays_another_sessions_result_with_the_same_request_id():
    """The SDK example's store, keyed by stream id only, replays Bob's result into Alice's session. The guard
    scopes every event by session."""
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client

    from mcp_stream_exporter import instrument_client, instrument_server
    from mcp_stream_exporter.guard import GuardedEventStore
    from mcp_stream_exporter.lab import (
        BASE_RESOURCE,
        BearerAuth,
        CutProxy,
        TokenIssuer,
        build_incident_server,
        incident_policy,
        serve,
    )
    from mcp_stream_exporter.lab.scenario import Incident

    span_exporter().clear()
    issuer = TokenIssuer()
    policy = incident_policy()
    audience = [BASE_RESOURCE, SEARCH_RESOURCE, FETCH_RESOURCE]
    app = instrument_server(build_incident_server(issuer), policy=policy, event_store=GuardedEventStore(policy),
                            retry_interval=1200)
    async with serve(app) as port:
        proxy = CutProxy(port)
        await proxy.start()
        alice_http = instrument_client(auth=BearerAuth(issuer.mint(audience, subject="alice")))
        bob_http = instrument_client(auth=BearerAuth(issuer.mint(audience, subject="bob", client_id="bob")))
        async with (
            alice_http, bob_http,
            Client(streamable_http_client(f"http://127.0.0.1:{proxy.port}/mcp", http_client=alice_http),
                   mode="legacy") as alice_client,
            Client(streamable_http_client(f"http://127.0.0.1:{port}/mcp", http_client=bob_http),
                   mode="legacy") as bob_client,
        ):
            alice = Incident(alice_client, proxy, alice_http.auth, issuer, "", "")  # type: ignore[arg-type]
            bob = Incident(bob_client, proxy, bob_http.auth, issuer, "", "")  # type: ignore[arg-type]
            cut = asyncio.Event()

            def hold_alice_after_the_cut() -> None:
                proxy.hold()  # alice's resume waits at the proxy until bob's result is stored
                cut.set()

            proxy.arm(b"fetch step 1", on_cut=hold_alice_after_the_cut)

            async def bob_meanwhile():
                await cut.wait()
                try:
                    return await bob.call("fetch", {"url": "bob-secret"})
                finally:
                    proxy.release()

            alice_result, bob_result = await asyncio.gather(alice.call("fetch", {"url": "alice-doc", "steps": 16}),
                                                            bob_meanwhile())
        await proxy.stop()
    assert proxy.cuts == 1
    assert bob_result.content[0].text == "contents of bob-secret"
    assert alice_result.content[0].text == "contents of alice-doc"
    found = spans()
    replays = ours(found, sc.SPAN_REPLAY, sc.ROLE_SERVER)
    assert replays
    assert all(sc.REPLAY_FOREIGN_EVENT_IDS not in r.attributes for r in replays)


async def test_a_client_whose_call_the_call_guard_refused_still_ends_its_session_with_its_delete():
    """A DELETE ends every call of its session, so the guard refuses one whose token may not see a call the session
    had; a call the call guard refused never ran, and counted all the same: the client's DELETE was refused (403) and
    the session held until its idle timeout, with a warning of calls in flight that were none."""
    policy, issuer = incident_policy(), TokenIssuer()
    server = build_incident_server(issuer, step_delay=0)
    server.middleware.append(CallGuard(policy))
    app = instrument_server(server, policy=policy, event_store=GuardedEventStore(policy))
    deleted: list[int] = []

    async def watched(scope: Scope, receive: Receive, send: Send) -> None:
        async def sent(message: Message) -> None:
            if scope["type"] == "http" and scope["method"] == "DELETE" and message["type"] == "http.response.start":
                deleted.append(message["status"])
            await send(message)

        await app(scope, receive, sent)

    async with serve(watched) as port:
        http = httpx2.AsyncClient(auth=BearerAuth(issuer.mint([BASE_RESOURCE, SEARCH_RESOURCE])))
        async with http, Client(streamable_http_client(f"http://127.0.0.1:{port}/mcp", http_client=http),
                                mode="legacy") as client:
            with pytest.raises(MCPError) as refused:
                await client.call_tool("fetch", {"url": "u"})
            assert refused.value.code == REFUSED_ERROR_CODE
            assert "search results" in (await client.call_tool("search", {"query": "q"})).content[0].text
        assert deleted == [200]
        assert not server.session_manager._server_instances  # ended now, not at the idle timeout
