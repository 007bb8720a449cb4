"""A resume's live tail on the real SDK server (legacy mode), sent by the guard from its storage.

The SDK resumes a stream by replaying it, then sending a priming event, and only then taking the call's
live events: what the call stores in between went nowhere (a client missed progress, or its result and
waited forever). Here a storage holds the replay in exactly that window, between reading the buffer and
sending it, until the call has stored its result: no timing, the window every time. The client is raw
HTTP over loopback, so the test sees each frame the server sends."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from mcp.server.auth.settings import AuthSettings
from mcp.server.mcpserver import Context, MCPServer
from mcp_types import JSONRPCResponse
from pydantic import AnyHttpUrl

from mcp_stream_exporter.auth import Requirement
from mcp_stream_exporter.guard import GuardedEventStore, InMemoryEventStorage
from mcp_stream_exporter.guard.redis_storage import RedisEventStorage
from mcp_stream_exporter.guard.storage import StoredEvent
from mcp_stream_exporter.lab import BASE_RESOURCE, FETCH_RESOURCE, TokenIssuer, incident_policy, serve
from mcp_stream_exporter.lab.incident import ISSUER
from mcp_stream_exporter.sse import SSEFrame, SSEParser

from harness import TOKENS_USED

pytestmark = pytest.mark.anyio

PROTOCOL = "2025-11-25"
STEPS = 8  # fetch's progress events: the first before the drop, the rest while the replay is held
BOUND_S = 10  # a resume that never ends is a failure, not a hang


class HeldReplay:
    """Holds a resume's replay after it read the buffer, until the resumed call has stored its result (and lets
    the call go on, ``go``, only then): everything the call stores falls between the replay's read and its
    sending, the window the SDK's hand-over to its live tail loses."""

    def __init__(self, *args: Any, **options: Any) -> None:
        super().__init__(*args, **options)
        self.go = asyncio.Event()
        self.answered = asyncio.Event()

    async def after(self, session_id: str, event: StoredEvent) -> list[StoredEvent] | None:
        read = await super().after(session_id, event)  # type: ignore[misc]
        self.go.set()
        await self.answered.wait()
        return read

    async def append(self, session_id: str | None, stream_id: str, message: Any, subject: str | None,
                     requirement: Requirement | None = None) -> str | None:
        event_id = await super().append(session_id, stream_id, message, subject, requirement)  # type: ignore[misc]
        if isinstance(message, JSONRPCResponse) and stream_id == "1":
            self.answered.set()
        return event_id


class HeldInMemory(HeldReplay, InMemoryEventStorage):
    pass


class Tailed(InMemoryEventStorage):
    """Says when a resume's live tail waits on it for the call's next event; the call never goes on."""

    def __init__(self) -> None:
        super().__init__()
        self.go = asyncio.Event()
        self.waiting = asyncio.Event()

    async def wait_after(self, session_id: str, event_id: str, timeout_s: float) -> list[StoredEvent]:
        self.waiting.set()
        return await super().wait_after(session_id, event_id, timeout_s)


class HeldOnRedis(HeldReplay, RedisEventStorage):
    pass


def held_server(issuer: TokenIssuer, go: asyncio.Event) -> MCPServer:
    """``fetch``: one progress event, then (once ``go`` is set) the rest of them and its result."""
    mcp = MCPServer("held", token_verifier=issuer,
                    auth=AuthSettings(issuer_url=AnyHttpUrl(ISSUER), resource_server_url=None, required_scopes=["mcp"]))

    @mcp.tool()
    async def fetch(url: str, ctx: Context) -> str:
        """Fetch a document."""
        await ctx.report_progress(1, STEPS, "fetch step 1")
        await go.wait()
        for step in range(2, STEPS + 1):
            await ctx.report_progress(step, STEPS, f"fetch step {step}")
        return f"contents of {url}"

    return mcp


@contextlib.asynccontextmanager
async def guarded(issuer: TokenIssuer, storage: Any) -> AsyncIterator[tuple[str, asyncio.Queue[str]]]:
    """The guarded server's URL, and each request's method as the server finishes with it."""
    app = GuardedEventStore(incident_policy(), storage=storage).serve(held_server(issuer, storage.go),
                                                                       retry_interval=100)
    finished: asyncio.Queue[str] = asyncio.Queue()

    async def observed(scope: Any, receive: Any, send: Any) -> None:
        await app(scope, receive, send)
        if scope["type"] == "http":
            finished.put_nowait(scope["method"])

    async with serve(observed) as port:
        yield f"http://127.0.0.1:{port}/mcp", finished


def headers(token: str, session_id: str | None = None, **extra: str) -> dict[str, str]:
    out = {"accept": "application/json, text/event-stream", "content-type": "application/json",
           "mcp-protocol-version": PROTOCOL, "authorization": f"Bearer {token}", **extra}
    if session_id is not None:
        out["mcp-session-id"] = session_id
    return out


async def frames(response: httpx.Response, until: str | None = None) -> list[SSEFrame]:
    """The SSE frames of a response, to its end (or to the first whose data holds ``until``)."""
    parser, out = SSEParser(), []
    async for chunk in response.aiter_bytes():
        out += parser.feed(chunk)
        if until is not None and any(until in frame.data for frame in out):
            break
    return out


async def dropped_call(http: httpx.AsyncClient, url: str, token: str, finished: asyncio.Queue[str]) -> tuple[str, str]:
    """A session with fetch in flight whose POST the client dropped after its first progress event, and the
    server saw go: (session id, the client's cursor)."""
    init = {"jsonrpc": "2.0", "id": 0, "method": "initialize",
            "params": {"protocolVersion": PROTOCOL, "capabilities": {}, "clientInfo": {"name": "raw", "version": "1"}}}
    session_id = (await http.post(url, headers=headers(token), content=json.dumps(init))).headers["mcp-session-id"]
    await http.post(url, headers=headers(token, session_id),
                    content=json.dumps({"jsonrpc": "2.0", "method": "notifications/initialized"}))
    call = {"jsonrpc": "2.0", "id": 1, "method": "tools/call",
            "params": {"name": "fetch", "arguments": {"url": "u"}, "_meta": {"progressToken": 1}}}
    async with http.stream("POST", url, headers=headers(token, session_id), content=json.dumps(call)) as posted:
        cursor = [f.id for f in await frames(posted, until="fetch step 1") if f.id is not None][-1]
    for _ in range(3):  # initialize, initialized, and the dropped POST: the server has let it go
        assert await finished.get() == "POST"
    return session_id, cursor


@pytest.fixture(params=["memory", "redis"])
def held_storage(request: pytest.FixtureRequest) -> HeldReplay:
    if request.param == "memory":
        return HeldInMemory()
    redis = request.getfixturevalue("redis_server")
    return HeldOnRedis.from_url(redis.url, prefix="live-tail")


async def test_a_resume_gets_all_its_call_stores_while_the_replay_is_sent_then_the_result_and_the_end(
        held_storage: HeldReplay):
    issuer = TokenIssuer()
    token = issuer.mint([BASE_RESOURCE, FETCH_RESOURCE])
    TOKENS_USED.append(token)
    try:
        async with guarded(issuer, held_storage) as (url, finished), httpx.AsyncClient(timeout=BOUND_S) as http:
            session_id, cursor = await dropped_call(http, url, token, finished)
            async with asyncio.timeout(BOUND_S), http.stream(
                    "GET", url, headers=headers(token, session_id, **{"last-event-id": cursor})) as resumed:
                assert resumed.status_code == 200
                got = await frames(resumed)  # to the stream's end: a resume that never ends times out
    finally:
        if isinstance(held_storage, RedisEventStorage):
            await held_storage.aclose()
    assert all(frame.event == "message" and frame.id is not None for frame in got)  # no error frame
    messages = [json.loads(frame.data) for frame in got]
    steps = [m["params"]["message"] for m in messages if m.get("method") == "notifications/progress"]
    assert steps == [f"fetch step {n}" for n in range(2, STEPS + 1)]  # each once, in order, none lost
    assert messages[-1]["id"] == 1 and messages[-1]["result"]["content"][0]["text"] == "contents of u"


async def test_a_session_deleted_while_a_resume_waits_for_its_call_ends_the_resume_with_an_error_frame():
    """The SDK ended the live tail it held silently when the session ended; the guard's tail says why."""
    storage = Tailed()
    issuer = TokenIssuer()
    token = issuer.mint([BASE_RESOURCE, FETCH_RESOURCE])
    TOKENS_USED.append(token)
    async with guarded(issuer, storage) as (url, finished), httpx.AsyncClient(timeout=BOUND_S) as http:
        session_id, cursor = await dropped_call(http, url, token, finished)
        async with asyncio.timeout(BOUND_S), http.stream(
                "GET", url, headers=headers(token, session_id, **{"last-event-id": cursor})) as resumed:
            await storage.waiting.wait()  # the resume waits for fetch's next event
            deleted = await http.delete(url, headers=headers(token, session_id))
            assert deleted.status_code == 200
            got = await frames(resumed)
    (ended,) = got
    assert ended.event == "error" and ended.id is None  # the cursor stays where it was
    assert json.loads(ended.data)["error"] == "session_ended"
    assert json.loads(ended.data)["cursor"] == cursor


async def test_a_client_leaving_a_resume_the_guard_tails_ends_it_on_the_server():
    """The tail runs in the SDK's replay task, which sse-starlette cancels when the client goes: nothing waits on,
    holding the call's id, for a client that is gone."""
    storage = Tailed()
    issuer = TokenIssuer()
    token = issuer.mint([BASE_RESOURCE, FETCH_RESOURCE])
    TOKENS_USED.append(token)
    async with guarded(issuer, storage) as (url, finished), httpx.AsyncClient(timeout=BOUND_S) as http:
        session_id, cursor = await dropped_call(http, url, token, finished)
        async with asyncio.timeout(BOUND_S):
            async with http.stream("GET", url, headers=headers(token, session_id, **{"last-event-id": cursor})):
                await storage.waiting.wait()  # the resume waits for fetch's next event
            assert await finished.get() == "GET"  # the client closed it: the server is done with it
