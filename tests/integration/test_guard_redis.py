"""The guard on Redis across server replicas and restarts, on the real SDK (legacy mode).

Each replica is its own uvicorn server with its own SDK session manager (sessions live in one
replica's memory, as in production) and its own ``RedisEventStorage``, on one real redis-server. The
client is the SDK's, instrumented, behind a proxy that cuts its connection and can send the next
request to another replica."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import jwt
import pytest
import redis.asyncio as aioredis
from cryptography.hazmat.primitives.asymmetric import rsa
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from prometheus_client import REGISTRY

from mcp_stream_exporter import instrument_client, instrument_server
from mcp_stream_exporter import semconv as sc
from mcp_stream_exporter.auth import Requirement
from mcp_stream_exporter.guard import GuardedEventStore, resolve_refusals
from mcp_stream_exporter.guard.redis_storage import RedisEventStorage
from mcp_stream_exporter.guard.storage import StorageError
from mcp_stream_exporter.lab import (
    BASE_RESOURCE,
    FETCH_RESOURCE,
    SEARCH_RESOURCE,
    BearerAuth,
    CutProxy,
    Incident,
    TokenIssuer,
    build_incident_server,
    incident_policy,
    serve,
)
from mcp_stream_exporter.resume import Refusal
from mcp_stream_exporter.sse import SSEParser
from mcp_stream_exporter.wire import REFUSED_ERROR_CODE

from harness import TOKENS_USED, ours, span_exporter, spans

pytestmark = pytest.mark.anyio

FETCH = {"url": "u", "steps": 6}
DEAD_PORT = 9  # discard: nothing listens, so the SDK's own reconnects fail and the test resumes explicitly


@dataclass
class Replica:
    """One server process's worth of state: its SDK sessions, its guard, its Redis client."""

    port: int
    storage: RedisEventStorage
    requests: list[tuple[str, int]] = field(default_factory=list)  # (method, status) it answered


@contextlib.asynccontextmanager
async def replica(issuer: TokenIssuer, redis_url: str, prefix: str) -> AsyncIterator[Replica]:
    policy = incident_policy()
    storage = RedisEventStorage.from_url(redis_url, prefix=prefix, heartbeat_s=0.2)
    app = instrument_server(build_incident_server(issuer, step_delay=0.05), policy=policy,
                            event_store=GuardedEventStore(policy, storage=storage), retry_interval=100)
    answered: list[tuple[str, int]] = []

    async def recorded(scope: Any, receive: Any, send: Any) -> None:
        async def record(message: Any) -> None:
            if message["type"] == "http.response.start":
                answered.append((scope["method"], message["status"]))
            await send(message)

        await app(scope, receive, record if scope["type"] == "http" else send)

    try:
        async with serve(recorded) as port:
            yield Replica(port, storage, answered)
    finally:
        await storage.aclose()


@contextlib.asynccontextmanager
async def client(issuer: TokenIssuer, proxy: CutProxy) -> AsyncIterator[Incident]:
    broad = issuer.mint([BASE_RESOURCE, SEARCH_RESOURCE, FETCH_RESOURCE])
    narrow = issuer.mint([SEARCH_RESOURCE])
    TOKENS_USED.extend((broad, narrow))
    auth = BearerAuth(broad)
    http = resolve_refusals(instrument_client(auth=auth, policy=incident_policy()))
    async with http, Client(streamable_http_client(f"http://127.0.0.1:{proxy.port}/mcp", http_client=http),
                            mode="legacy") as sdk:
        yield Incident(sdk, proxy, auth, issuer, broad, narrow)


@contextlib.asynccontextmanager
async def proxy_to(port: int) -> AsyncIterator[CutProxy]:
    proxy = CutProxy(port)
    await proxy.start()
    try:
        yield proxy
    finally:
        await proxy.stop()


def last_event_before_the_drop() -> str:
    """The cursor the client holds: the last event id its dropped POST stream delivered."""
    (dropped,) = [s for s in ours(spans(), sc.SPAN_STREAM, sc.ROLE_CLIENT, mcp_stream__stream__kind=sc.STREAM_KIND_POST)
                  if s.attributes[sc.END_REASON] == sc.END_DROPPED]
    return str(dropped.attributes[sc.EVENT_LAST_ID])


async def dropped_fetch(lab: Incident, steps: int) -> None:
    """fetch, cut after its first progress event with every reconnect sent nowhere: the call fails on
    the client while the server goes on."""
    lab.proxy.arm(b"fetch step 1", on_cut=lambda: setattr(lab.proxy, "upstream_port", DEAD_PORT))
    with pytest.raises(MCPError):
        await lab.call("fetch", {"url": "u", "steps": steps}, timeout=10)


def _store_errors() -> float:
    return sum(REGISTRY.get_sample_value("mcp_stream_guard_store_errors_total", {"operation": op}) or 0.0
               for op in ("get", "after", "requirement", "append", "require", "open", "is_open"))


async def until(condition: Any, what: str, timeout_s: float = 10) -> None:
    for _ in range(int(timeout_s / 0.05)):
        if await condition():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


async def test_a_resume_that_reaches_another_replica_is_answered_from_redis(redis_server):
    span_exporter().clear()
    issuer = TokenIssuer()
    async with (replica(issuer, redis_server.url, "two") as a, replica(issuer, redis_server.url, "two") as b,
                proxy_to(a.port) as proxy, client(issuer, proxy) as lab):
        proxy.arm(b"fetch step 1", on_cut=lambda: setattr(proxy, "upstream_port", b.port))  # the reroute
        result = await lab.call("fetch", FETCH, timeout=15)
    assert result.content[0].text == "contents of u"
    assert ("GET", 200) in b.requests  # the resume went to the replica that never saw the session


async def test_a_narrowed_resume_on_another_replica_is_refused_explicitly(redis_server):
    span_exporter().clear()
    issuer = TokenIssuer()
    async with (replica(issuer, redis_server.url, "narrow") as a, replica(issuer, redis_server.url, "narrow") as b,
                proxy_to(a.port) as proxy, client(issuer, proxy) as lab):
        def reroute_and_narrow() -> None:
            proxy.upstream_port = b.port
            lab.refresh_narrows()

        proxy.arm(b"fetch step 1", on_cut=reroute_and_narrow)
        with pytest.raises(MCPError) as refused:
            await lab.call("fetch", FETCH, timeout=15)
        assert refused.value.code == REFUSED_ERROR_CODE  # the error frame, not a timeout
        refusal = Refusal.from_data(refused.value.data)
        assert refusal.error == "insufficient_audience"
        assert refusal.requirement.resources == {FETCH_RESOURCE}
        lab.widen()
        recovered = await lab.call("fetch", FETCH, timeout=15, resume_from=refusal.cursor)
    assert recovered.content[0].text == "contents of u"
    assert ("GET", 200) in b.requests


async def test_a_result_stored_before_a_restart_is_delivered_after_it(redis_server):
    span_exporter().clear()
    issuer = TokenIssuer()
    async with proxy_to(DEAD_PORT) as proxy, replica(issuer, redis_server.url, "restart") as a:
        proxy.upstream_port = a.port
        async with client(issuer, proxy) as lab:
            await dropped_fetch(lab, steps=3)
            cursor = last_event_before_the_drop()
            session_id = next(s.attributes[sc.MCP_SESSION_ID] for s in spans()
                              if s.attributes and sc.MCP_SESSION_ID in s.attributes)
            stored = a.storage

            async def result_stored() -> bool:
                event = await stored.get(session_id, cursor)
                return event is not None and any(e.message is not None and "result" in e.message.model_fields_set
                                                 for e in await stored.after(session_id, event) or ())

            await until(result_stored, "fetch's result in Redis")
            # the replica restarts: its SDK sessions are gone, Redis keeps the events
            await a.storage.aclose()
            async with replica(issuer, redis_server.url, "restart") as restarted:
                proxy.upstream_port = restarted.port
                result = await lab.call("fetch", FETCH, timeout=15, resume_from=cursor)
    assert result.content[0].text == "contents of u"
    assert ("GET", 200) in restarted.requests


async def test_a_call_whose_replica_died_ends_with_an_error_frame_not_a_silent_end(redis_server):
    span_exporter().clear()
    issuer = TokenIssuer()
    async with contextlib.AsyncExitStack() as stack:
        proxy = await stack.enter_async_context(proxy_to(DEAD_PORT))
        dying = contextlib.AsyncExitStack()
        a = await dying.enter_async_context(replica(issuer, redis_server.url, "died"))
        proxy.upstream_port = a.port
        lab = await stack.enter_async_context(client(issuer, proxy))
        await dropped_fetch(lab, steps=200)  # still running when its replica goes away
        cursor = last_event_before_the_drop()
        await dying.aclose()  # the replica stops: its sessions, its call and its heartbeat are gone
        other = await stack.enter_async_context(replica(issuer, redis_server.url, "died"))
        proxy.upstream_port = other.port
        with pytest.raises(MCPError) as refused:
            await lab.call("fetch", FETCH, timeout=15, resume_from=cursor)
    assert refused.value.code == REFUSED_ERROR_CODE  # explicit and at once, not the caller's timeout
    assert Refusal.from_data(refused.value.data).error == "session_owner_gone"
    assert "is gone and the call did not finish: re-issue it" in refused.value.message  # not "re-authorise"
    assert ("GET", 200) in other.requests


async def test_an_unreachable_redis_refuses_resumes_explicitly_and_new_calls_still_work(redis_server):
    span_exporter().clear()
    issuer = TokenIssuer()
    async with (proxy_to(DEAD_PORT) as proxy, replica(issuer, redis_server.url, "down") as a,
                replica(issuer, redis_server.url, "down") as b):
        proxy.upstream_port = a.port
        async with client(issuer, proxy) as lab:
            await dropped_fetch(lab, steps=3)
            cursor = last_event_before_the_drop()
            errors_before = _store_errors()
            redis_server.stop()
            for owner_or_not in (a, b):  # the session's own replica, and one that cannot tell (never the SDK's 404)
                proxy.upstream_port = owner_or_not.port
                with pytest.raises(MCPError) as refused:
                    await lab.call("fetch", FETCH, timeout=15, resume_from=cursor)
                assert refused.value.code == REFUSED_ERROR_CODE
                assert Refusal.from_data(refused.value.data).error == "store_unavailable"
            assert _store_errors() > errors_before  # what MCPGuardStoreErrors pages on
            proxy.upstream_port = a.port
            async with client(issuer, proxy) as fresh:  # a new session while Redis is down
                searched = await fresh.call("search", {"query": "q", "steps": 2}, timeout=15)
            assert "search results" in searched.content[0].text
            redis_server.start()  # back, empty (no persistence): the cursor is unknown, and said so
            with pytest.raises(MCPError) as unknown:
                await lab.call("fetch", FETCH, timeout=15, resume_from=cursor)
            assert Refusal.from_data(unknown.value.data).error == "unknown_cursor"


async def test_a_post_into_a_session_on_another_replica_is_the_sdks_404_and_a_deleted_session_is_resumed_nowhere(
        redis_server):
    span_exporter().clear()
    issuer = TokenIssuer()
    async with (replica(issuer, redis_server.url, "ended") as a, replica(issuer, redis_server.url, "ended") as b,
                proxy_to(a.port) as proxy):
        async with client(issuer, proxy) as lab:
            proxy.arm(b"search step 1")  # a cut, then the SDK resumes on the same replica: a span with its ids
            await lab.call("search", {"query": "q", "steps": 3}, timeout=15)
            (post,) = ours(spans(), sc.SPAN_STREAM, sc.ROLE_CLIENT, mcp_stream__stream__kind=sc.STREAM_KIND_POST)
            session_id, cursor = str(post.attributes[sc.MCP_SESSION_ID]), str(post.attributes[sc.EVENT_LAST_ID])
            request_id = post.attributes[sc.STREAM_REQUEST_IDS][0]
            headers = {"authorization": f"Bearer {lab.broad}", "mcp-session-id": session_id,
                       "mcp-protocol-version": "2025-11-25", "accept": "application/json, text/event-stream"}
            reuse = {"jsonrpc": "2.0", "id": int(request_id), "method": "tools/call",
                     "params": {"name": "search", "arguments": {"query": "again"}}}
            async with httpx.AsyncClient(timeout=10) as http:
                elsewhere = await http.post(f"http://127.0.0.1:{b.port}/mcp", headers=headers,
                                            content=json.dumps(reuse))
                assert elsewhere.status_code == 404  # only the replica running a session runs its requests
                resumed = await http.get(f"http://127.0.0.1:{b.port}/mcp", headers={**headers, "last-event-id": cursor})
                assert resumed.status_code == 200 and "search results" in resumed.text  # the session's own resume
        assert ("DELETE", 200) in a.requests  # the client ended its session
        async with httpx.AsyncClient(timeout=10) as http:
            after = await http.get(f"http://127.0.0.1:{b.port}/mcp", headers={**headers, "last-event-id": cursor})
    assert after.status_code == 404 and "search results" not in after.text  # dropped from Redis: the SDK's 404


async def test_a_cursor_redis_could_not_hold_is_an_unknown_cursor_never_a_store_error(redis_server):
    """Each part of a Redis stream id is an unsigned 64-bit integer: a Last-Event-ID past that made Redis fail,
    so any client could get ``store_unavailable`` and page on-call (MCPGuardStoreErrors) at will."""
    span_exporter().clear()
    issuer = TokenIssuer()
    token = issuer.mint([BASE_RESOURCE, SEARCH_RESOURCE, FETCH_RESOURCE])
    TOKENS_USED.append(token)
    headers = {"authorization": f"Bearer {token}", "mcp-protocol-version": "2025-11-25",
               "accept": "application/json, text/event-stream", "content-type": "application/json"}
    init = {"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "raw", "version": "1"}}}
    async with (replica(issuer, redis_server.url, "bogus") as a, replica(issuer, redis_server.url, "bogus") as b,
                httpx.AsyncClient(timeout=10) as http):
        opened = await http.post(f"http://127.0.0.1:{a.port}/mcp", headers=headers, content=json.dumps(init))
        session_id = opened.headers["mcp-session-id"]
        errors_before = _store_errors()
        for port in (a.port, b.port):  # the replica that holds the session, and one answering from Redis
            for cursor in ("99999999999999999999-0", "18446744073709551616-0", "0-18446744073709551616",
                           "18446744073709551615-18446744073709551615"):  # the last one Redis holds, never handed out
                resumed = await http.get(f"http://127.0.0.1:{port}/mcp",
                                         headers={**headers, "mcp-session-id": session_id, "last-event-id": cursor})
                assert resumed.status_code == 200
                (frame,) = SSEParser().feed(resumed.content)
                assert (frame.event, json.loads(frame.data)["error"]) == ("error", "unknown_cursor")
        assert await a.storage.get(session_id, "\u0661-0") is None  # an Arabic-Indic one: a digit to \d and int()
        assert _store_errors() == errors_before


async def test_an_event_is_stored_with_its_calls_requirement_whatever_redis_recorded_for_its_stream(redis_server):
    """The call's requirement goes with each event in the one script that stores it: a request id used again, whose
    new requirement Redis failed to record, still has the earlier call's, narrower, which the event would be
    stored with; it is widened there instead, within the session's cap of streams."""
    storage = RedisEventStorage.from_url(redis_server.url, prefix="widen", max_calls_per_session=2)
    search, fetch = Requirement.of(["https://mcp.example.com/search"]), Requirement.of(["https://mcp.example.com/fetch"])
    try:
        await storage.open("s")
        await storage.require("s", "1", search)
        stored = [await storage.get("s", event_id or "") for event_id in (
            await storage.append("s", "1", None, None),  # no call known: the stream's as recorded
            await storage.append("s", "1", None, None, fetch),
            await storage.append("s", "2", None, None, fetch),  # a stream recorded by its first event
            await storage.append("s", "3", None, None, fetch))]  # past the cap of streams: recorded nowhere
        assert [event.requirement if event else None for event in stored] == [search, search | fetch, fetch, None]
        assert [await storage.requirement("s", stream) for stream in "123"] == [search | fetch, fetch, None]
    finally:
        await storage.aclose()


async def test_hundreds_of_live_tails_at_once_hold_a_bounded_number_of_connections_and_fail_nothing(redis_server):
    """Each live tail waits in Redis on a connection of its own, and redis-py's pool has no bound: one client
    resuming its own stream hundreds of times at once took Redis's every connection, paging on-call and leaving
    other users' events unstored. Past ``max_blocking_reads`` a tail polls, and the pool waits at its bound."""
    storage = RedisEventStorage.from_url(redis_server.url, prefix="bounded", max_connections=6)
    watcher = aioredis.Redis.from_url(redis_server.url)
    try:
        await storage.open("s")
        await storage.require("s", "1", Requirement())
        cursor = await storage.append("s", "1", None, None)
        assert cursor is not None
        errors_before = _store_errors()
        tails = [asyncio.create_task(storage.wait_after("s", cursor, 0.3)) for _ in range(200)]
        await asyncio.sleep(0.1)
        other = await storage.append("s", "1", None, None)  # another user's event meanwhile
        clients = len(await watcher.client_list())
        found = await asyncio.gather(*tails)
        assert other is not None
        assert {tuple(e.event_id for e in events) for events in found} <= {(), (other,)}
        assert clients <= 6 + 1  # the watcher's own
        assert _store_errors() == errors_before
    finally:
        await storage.aclose()
        await watcher.aclose()


async def test_a_replica_is_gone_once_its_beat_is_three_periods_old_and_not_when_eviction_took_its_beat(
        redis_server, monkeypatch):
    """The heartbeat had a TTL of three periods, the shortest in Redis: ``volatile-ttl`` evicted it first, and the
    other replicas told clients of calls still running that their replica was gone (re-issue: run twice)."""
    owner = RedisEventStorage.from_url(redis_server.url, prefix="beat", heartbeat_s=0.1)
    other = RedisEventStorage.from_url(redis_server.url, prefix="beat", heartbeat_s=0.1)
    try:
        await owner.open("s")
        assert await other.owner_alive("s")
        beat = owner._owner_key(owner._instance)
        assert await owner._redis.pttl(beat) > 3_000_000  # as long as a session's keys (an hour)
        await owner._redis.delete(beat)  # what an eviction does
        assert await other.owner_alive("s")  # unknown is no death
        assert owner._beating is not None
        owner._beating.cancel()  # the process dies: no beat from now on
        await owner._beat()


        async def gone() -> bool:
            return not await other.owner_alive("s")

        await until(gone, "the dead replica's beat three periods old", 5.0)
        # an owner that beats less often than its reader, and one of before this beat (its key "1", 15 s): alive
        slow = RedisEventStorage.from_url(redis_server.url, prefix="beat", heartbeat_s=60.0)
        await slow.open("slow")
        await other._redis.set("beat:{old}:open", "before", px=60_000)
        await other._redis.set("beat:owner:before", "1", px=15_000)
        await asyncio.sleep(0.5)  # past the reader's three periods, within the slow owner's
        assert await other.owner_alive("slow") and await other.owner_alive("old")
        await slow.aclose()
        parent = slow._me()
        monkeypatch.setattr(os, "getpid", lambda: -1)  # a worker forked after the storage was built
        assert slow._me() != parent  # its own beat, which a sibling's stop does not end

        async def read_only(*_: object, **__: object) -> None:  # a demoted primary, or out of memory: no write is taken
            raise aioredis.ReadOnlyError("You can't write against a read only replica.")

        other._redis.set = read_only  # type: ignore[method-assign,assignment]
        with pytest.raises(StorageError):  # then no beat is written anywhere: the storage fails, no owner is gone
            await other.owner_alive("s")
    finally:
        await owner._redis.aclose()
        await other.aclose()


async def test_a_sessions_events_in_redis_are_bounded_in_bytes_oldest_first(redis_server):
    """A count of events bounded nothing when a tool echoes the megabyte a client sent: one session filled Redis
    (with ``noeviction``, every replica's writes then fail) and each resume read all of it into the guard."""
    from mcp_types import JSONRPCResponse

    storage = RedisEventStorage.from_url(redis_server.url, prefix="bytes", max_bytes_per_session=10_000)
    try:
        await storage.open("s")
        await storage.require("s", "1", Requirement())
        ids = [await storage.append("s", "1", JSONRPCResponse(jsonrpc="2.0", id=i, result={"t": "x" * 3000}), None)
               for i in range(6)]
        kept = [await storage.get("s", event_id) is not None for event_id in ids if event_id is not None]
        assert kept == [False, False, False, True, True, True]  # ~3 KB each: three fit
        assert storage.evictions == 3
        alone = await storage.append("s", "1", JSONRPCResponse(jsonrpc="2.0", id=9, result={"t": "y" * 20_000}), None)
        assert alone is not None and await storage.get("s", alone) is not None  # past the bound alone: kept alone
        assert [await storage.get("s", e) is not None for e in ids[3:] if e is not None] == [False, False, False]
        await storage._redis.delete(storage._keys("s")[2])  # a maxmemory policy that evicts keys took its events
        again = [await storage.append("s", "1", JSONRPCResponse(jsonrpc="2.0", id=i, result={"t": "z" * 3000}), None)
                 for i in range(3)]
        assert [await storage.get("s", e) is not None for e in again if e is not None] == [True, True, True]
    finally:
        await storage.aclose()


async def test_a_cursor_trimmed_between_its_look_up_and_the_read_after_it_is_no_cursor_not_a_replay_from_later(
        redis_server):
    """Another call of the session stores while a resume is between finding its cursor and reading what follows: at
    the session's cap that trims the cursor and what came right after it, and a read from past the cursor would
    start at the oldest event left, skipping those without a word."""
    from mcp_types import JSONRPCResponse

    storage = RedisEventStorage.from_url(redis_server.url, prefix="trim", max_events_per_session=3)
    try:
        await storage.open("s")
        await storage.require("s", "1", Requirement())
        ids = [await storage.append("s", "1", JSONRPCResponse(jsonrpc="2.0", id=i, result={}), None) for i in range(3)]
        assert ids[0] is not None
        cursor = await storage.get("s", ids[0])
        assert cursor is not None and [e.event_id for e in await storage.after("s", cursor) or ()] == ids[1:]
        for i in range(2):  # the other call, meanwhile: the cursor and the event after it go
            await storage.append("s", "1", JSONRPCResponse(jsonrpc="2.0", id=10 + i, result={}), None)
        assert await storage.after("s", cursor) is None
    finally:
        await storage.aclose()


async def test_a_resume_sent_to_a_path_the_router_does_not_know_is_its_404_never_a_replay_from_redis(redis_server):
    """The router's 404 for an unknown path is no "session held by another replica": it comes before the SDK
    checks the token, so a replay from the storage there would answer whatever token the request carries."""
    issuer = TokenIssuer()
    owner = issuer.mint([BASE_RESOURCE, SEARCH_RESOURCE, FETCH_RESOURCE])
    forged = jwt.encode({**jwt.decode(owner, options={"verify_signature": False}), "kid": "lab-1"},
                        rsa.generate_private_key(public_exponent=65537, key_size=2048), algorithm="RS256")
    TOKENS_USED.extend((owner, forged))
    async with replica(issuer, redis_server.url, "paths") as a, httpx.AsyncClient(timeout=10) as http:
        base = f"http://127.0.0.1:{a.port}"

        def headers(session_id: str | None, token: str, **extra: str) -> dict[str, str]:
            out = {"accept": "application/json, text/event-stream", "content-type": "application/json",
                   "mcp-protocol-version": "2025-11-25", "authorization": f"Bearer {token}", **extra}
            return {**out, "mcp-session-id": session_id} if session_id else out

        init = await http.post(f"{base}/mcp", headers=headers(None, owner), json={
            "jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
                "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}})
        session_id = init.headers["mcp-session-id"]
        await http.post(f"{base}/mcp", headers=headers(session_id, owner),
                        json={"jsonrpc": "2.0", "method": "notifications/initialized"})
        answer = await http.post(f"{base}/mcp", headers=headers(session_id, owner), json={
            "jsonrpc": "2.0", "id": 1, "method": "tools/call",
            "params": {"name": "fetch", "arguments": {"url": "victim-doc", "steps": 1}}})
        assert "contents of victim-doc" in answer.text
        cursor = next(line[3:].strip() for line in answer.text.splitlines() if line.startswith("id:"))
        for path in ("/nope", "/mcp/x", "/.well-known/anything"):
            for token in (forged, owner):
                response = await http.get(f"{base}{path}", headers=headers(session_id, token, **{
                    "last-event-id": cursor}))
                assert response.status_code == 404 and "victim-doc" not in response.text, (path, response.text)
