"""The replay guard fails closed against hostile clients, on the real SDK server (legacy mode).

Each scenario has an honest SDK client calling ``fetch`` (whose events require the fetch resource)
and an adversary speaking raw HTTP: a token narrowed to ``search`` in the same session, another
session, a forged token, a server without the guard's ASGI layer. The adversary resumes from every
event id the server has handed out; not one of fetch's events may reach it."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import httpx2
import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric import rsa
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.server.elicitation import AcceptedElicitation
from mcp.server.mcpserver import Context, MCPServer
from mcp_types import CreateMessageResult, ElicitResult, ListRootsResult, Root, SamplingMessage, TextContent
from pydantic import BaseModel, FileUrl
from starlette.middleware.gzip import GZipMiddleware

from mcp_stream_exporter.auth import Requirement, TokenReader
from mcp_stream_exporter.guard import GuardedEventStore
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
from mcp_stream_exporter.lab.incident import ISSUER

from harness import TOKENS_USED

pytestmark = pytest.mark.anyio

PROTOCOL = "2025-11-25"
SECRET = "contents of victim-doc"  # fetch's result
PROGRESS = "fetch step"  # fetch's progress events


@dataclass
class Server:
    port: int
    mcp: MCPServer

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/mcp"

    def session_ids(self) -> set[str]:
        return set(self.mcp.session_manager._server_instances)  # no public API for the live sessions


@contextlib.asynccontextmanager
async def guarded_server(issuer: TokenIssuer | None, store: GuardedEventStore, *,
                         asgi_layer: bool = True) -> AsyncIterator[Server]:
    mcp = build_incident_server(issuer, step_delay=0.05)
    app = store.serve(mcp, retry_interval=200) if asgi_layer else mcp.streamable_http_app(event_store=store,
                                                                                         retry_interval=200)
    async with serve(app) as port:
        yield Server(port, mcp)


@contextlib.asynccontextmanager
async def honest_client(server: Server, token: str | None) -> AsyncIterator[tuple[Client, list[str]]]:
    """An SDK client in legacy mode (resumable), and the progress messages it has seen."""
    progress: list[str] = []
    async with (httpx2.AsyncClient(auth=BearerAuth(token) if token else None, timeout=30) as http,
                Client(streamable_http_client(server.url, http_client=http), mode="legacy") as client):
        yield client, progress


def _broad_and_narrow() -> tuple[TokenIssuer, str, str]:
    """An issuer and two tokens of one principal (the incident's client): every resource, and search's alone."""
    issuer = TokenIssuer()
    broad = issuer.mint([BASE_RESOURCE, SEARCH_RESOURCE, FETCH_RESOURCE])
    narrow = issuer.mint([SEARCH_RESOURCE])
    TOKENS_USED.extend((broad, narrow))
    return issuer, broad, narrow


async def fetch_in_flight(client: Client, progress: list[str], steps: int = 30) -> asyncio.Task[Any]:
    """Start a slow ``fetch`` and return once its first progress event has arrived."""
    async def on_progress(p: float, total: float | None, message: str | None) -> None:
        progress.append(message or "")

    task = asyncio.create_task(client.call_tool("fetch", {"url": "victim-doc", "steps": steps},
                                                progress_callback=on_progress))
    for _ in range(500):
        if progress or task.done():
            break
        await asyncio.sleep(0.01)
    assert progress, "fetch never reported progress"
    return task


def headers(session_id: str | None, token: str | None) -> dict[str, str]:
    out = {"accept": "application/json, text/event-stream", "content-type": "application/json",
           "mcp-protocol-version": PROTOCOL}
    if session_id:
        out["mcp-session-id"] = session_id
    if token:
        out["authorization"] = f"Bearer {token}"
    return out


async def resume(http: httpx.AsyncClient, url: str, session_id: str, token: str | None, cursor: int,
                 read_s: float = 0.6) -> str:
    """A resume GET with ``Last-Event-ID: cursor``; what the stream carried within ``read_s``."""
    body: list[str] = []
    with contextlib.suppress(httpx.HTTPError, TimeoutError):
        async with asyncio.timeout(read_s):
            async with http.stream("GET", url, headers={**headers(session_id, token),
                                                        "last-event-id": str(cursor)}) as response:
                async for line in response.aiter_lines():
                    body.append(line)
                    if line.startswith("data:") and body[-2:-1] == ["event: error"]:
                        break  # a refusal is the end of the stream
    return "\n".join(body)


async def resume_everywhere(url: str, session_id: str, token: str | None, upto: int = 50) -> list[str]:
    """The adversary resumes from every event id the store may have handed out (a few dozen here),
    eight at a time."""
    gate = asyncio.Semaphore(8)

    async def one(http: httpx.AsyncClient, cursor: int) -> str:
        async with gate:
            return await resume(http, url, session_id, token, cursor)

    async with httpx.AsyncClient(timeout=5) as http:
        return list(await asyncio.gather(*(one(http, cursor) for cursor in range(1, upto))))


async def open_session(http: httpx.AsyncClient, url: str, token: str) -> str:
    """A session opened over raw HTTP (initialize, then initialized) with ``token``: its id."""
    init = await http.post(url, headers=headers(None, token), content=json.dumps({
        "jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
            "protocolVersion": PROTOCOL, "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}}))
    session_id = init.headers["mcp-session-id"]
    await http.post(url, headers=headers(session_id, token), content=json.dumps(
        {"jsonrpc": "2.0", "method": "notifications/initialized"}))
    return session_id


def leaked(bodies: list[str]) -> list[str]:
    return [b for b in bodies if SECRET in b or PROGRESS in b]


async def test_a_narrow_token_reusing_a_pending_fetchs_request_id_never_gets_fetchs_events():
    issuer = TokenIssuer()
    policy = incident_policy()
    broad = issuer.mint([BASE_RESOURCE, SEARCH_RESOURCE, FETCH_RESOURCE])
    narrow = issuer.mint([SEARCH_RESOURCE])
    TOKENS_USED.extend((broad, narrow))
    store = GuardedEventStore(policy)
    async with guarded_server(issuer, store) as server, honest_client(server, broad) as (c, p):
        fetch = await fetch_in_flight(c, p)
        (session_id,) = server.session_ids()
        (fetch_id,) = [n for n in range(10)  # the SDK's ids are small integers
                       if await store.storage.requirement(session_id, str(n)) == Requirement.of([FETCH_RESOURCE])]
        answers = []
        async with httpx.AsyncClient(timeout=5) as http:
            for request_id in (fetch_id, str(fetch_id)):  # the SDK takes either for the same stream
                call = {"jsonrpc": "2.0", "id": request_id, "method": "tools/call",
                        "params": {"name": "search", "arguments": {"query": "x"}}}
                answers.append(await http.post(server.url, headers=headers(session_id, narrow),
                                               content=json.dumps(call)))
        bodies = await resume_everywhere(server.url, session_id, narrow)
        result = await asyncio.wait_for(fetch, 20)  # the honest caller still gets its own result
    assert [a.status_code for a in answers] == [409, 409]  # fetch's id, in flight
    assert not leaked([a.text for a in answers]), "a POST reusing fetch's id was handed fetch's stream"
    assert not leaked(bodies), "a narrow token read fetch's events"
    assert any('"error": "insufficient_audience"' in b for b in bodies)  # refused, explicitly
    assert SECRET in str(result)


async def test_other_sessions_filling_the_guards_tables_never_let_a_narrow_resume_through():
    issuer = TokenIssuer()
    policy = incident_policy()
    broad = issuer.mint([BASE_RESOURCE, SEARCH_RESOURCE, FETCH_RESOURCE])
    narrow = issuer.mint([SEARCH_RESOURCE])
    TOKENS_USED.extend((broad, narrow))
    async with guarded_server(issuer, GuardedEventStore(policy)) as server, honest_client(server, broad) as (c, p):
        fetch = await fetch_in_flight(c, p, steps=60)
        (victim,) = server.session_ids()
        async with honest_client(server, narrow) as (attacker, _):  # its own session
            (other,) = server.session_ids() - {victim}
            async with httpx.AsyncClient(timeout=30) as http:
                # three batches of tools/call, 40,000 ids each, none its own client's (a reused id is refused)
                for start in range(1_000_000, 1_120_000, 40_000):
                    batch = [{"jsonrpc": "2.0", "id": n, "method": "tools/call", "params": {"name": "search"}}
                             for n in range(start, start + 40_000)]
                    await http.post(server.url, headers=headers(other, narrow), content=json.dumps(batch))
            await attacker.list_tools()  # the flooding session still works
        bodies = await resume_everywhere(server.url, victim, narrow)
        fetch.cancel()
    assert not leaked(bodies), "a narrow resume read fetch's events after the tables were flooded"
    assert any('"error": "insufficient_audience"' in b for b in bodies)


async def test_a_forged_token_is_not_read_by_its_claims_when_the_guard_verifies():
    issuer = TokenIssuer()
    policy = incident_policy()
    broad = issuer.mint([BASE_RESOURCE, SEARCH_RESOURCE, FETCH_RESOURCE])
    forger = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    forged = jwt.encode({"iss": ISSUER, "sub": "alice", "aud": [FETCH_RESOURCE, SEARCH_RESOURCE], "scope": "mcp"},
                        forger, algorithm="RS256")
    TOKENS_USED.extend((broad, forged))
    store = GuardedEventStore(policy, token_reader=TokenReader(key=issuer.public_key))
    async with guarded_server(None, store) as server, honest_client(server, broad) as (c, p):  # auth upstream
        fetch = await fetch_in_flight(c, p)
        (session_id,) = server.session_ids()
        bodies = await resume_everywhere(server.url, session_id, forged)
        fetch.cancel()
    assert not leaked(bodies), "a forged token's claimed audience was trusted"
    assert any('"error": "token_unverified"' in b for b in bodies)


async def test_without_the_guards_asgi_layer_no_resume_replays_another_sessions_events():
    policy = incident_policy()
    store = GuardedEventStore(policy)
    async with guarded_server(None, store, asgi_layer=False) as server, honest_client(server, None) as (c, p):
        fetch = await fetch_in_flight(c, p)
        (victim,) = server.session_ids()
        async with honest_client(server, None) as (other_client, _):
            (other,) = server.session_ids() - {victim}
            bodies = await resume_everywhere(server.url, other, None)  # another session, no token at all
            await other_client.list_tools()
        fetch.cancel()
    assert not leaked(bodies), "a resume in another session replayed the victim's events"
    assert any("no_request_context" in b for b in bodies)  # refused, and said why


async def fetch_id_of(store: GuardedEventStore, session_id: str) -> int:
    (fetch_id,) = [n for n in range(10)  # the SDK's ids are small integers
                   if await store.storage.requirement(session_id, str(n)) == Requirement.of([FETCH_RESOURCE])]
    return fetch_id


async def test_a_narrow_token_of_the_same_principal_cannot_cancel_a_pending_fetch_nor_end_its_session():
    issuer, broad, narrow = _broad_and_narrow()
    store = GuardedEventStore(incident_policy())
    async with guarded_server(issuer, store) as server, honest_client(server, broad) as (c, p):
        fetch = await fetch_in_flight(c, p)
        (session_id,) = server.session_ids()
        fetch_id = await fetch_id_of(store, session_id)
        refused = []
        async with httpx.AsyncClient(timeout=5) as http:
            for spelling in (fetch_id, f"0{fetch_id}", f" {fetch_id}"):  # the SDK cancels fetch by int() of any
                cancel = {"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": spelling}}
                refused.append(await http.post(server.url, headers=headers(session_id, narrow),
                                               content=json.dumps(cancel)))
            refused.append(await http.delete(server.url, headers=headers(session_id, narrow)))
        result = await asyncio.wait_for(fetch, 20)
    assert [r.status_code for r in refused] == [403, 403, 403, 403]
    assert "insufficient_audience" in refused[0].json()["error"]["message"]
    assert SECRET in str(result)  # the call ran to its end


async def test_a_narrow_token_cannot_answer_what_the_server_asked_on_a_broader_calls_stream():
    """An elicitation sent on fetch's stream is fetch's: a narrow token that answers it first (the SDK's
    request ids are small integers, easy to guess) would decide what fetch does."""
    _, broad, narrow = _broad_and_narrow()
    store = GuardedEventStore(incident_policy())
    mcp = MCPServer("elicits")

    class Confirm(BaseModel):
        send_to: str

    @mcp.tool()
    async def fetch(url: str, ctx: Context) -> str:
        """Fetch a document, sent where the user says."""
        answer = await ctx.elicit("Where should the document go?", Confirm)
        return f"{url} sent to {answer.data.send_to}" if isinstance(answer, AcceptedElicitation) else "not sent"

    attacked = asyncio.Event()

    async def user_answers(context: Any, params: Any) -> ElicitResult:
        await asyncio.wait_for(attacked.wait(), 10)
        return ElicitResult(action="accept", content={"send_to": "alice"})

    statuses: list[int] = []
    async with serve(store.serve(mcp, retry_interval=200)) as port:
        url = f"http://127.0.0.1:{port}/mcp"
        async with (httpx2.AsyncClient(auth=BearerAuth(broad), timeout=30) as http,
                    Client(streamable_http_client(url, http_client=http), mode="legacy",
                           elicitation_callback=user_answers) as client):
            call = asyncio.create_task(client.call_tool("fetch", {"url": "victim-doc"}))
            (session_id,) = set(mcp.session_manager._server_instances)
            async with httpx.AsyncClient(timeout=5) as attacker:
                for _ in range(200):  # until the elicitation is out; the first answer the SDK takes decides
                    statuses = [(await attacker.post(url, headers=headers(session_id, narrow), content=json.dumps(
                        {"jsonrpc": "2.0", "id": n, "result": {"action": "accept",
                                                               "content": {"send_to": "mallory"}}}))).status_code
                                for n in range(3)]
                    if 403 in statuses:
                        break
                    await asyncio.sleep(0.01)
            attacked.set()
            result = await asyncio.wait_for(call, 20)
    assert 403 in statuses  # refused, not taken
    assert "sent to alice" in str(result) and "mallory" not in str(result)


@pytest.mark.filterwarnings("ignore:The (sampling|roots) capability is deprecated")
async def test_a_sampling_request_a_tool_sends_on_the_standalone_stream_is_its_calls_to_see_and_to_answer():
    """The SDK sends a tool's ``create_message`` (sampling) and ``list_roots`` on the session's standalone stream,
    tied to no call: what they carry (here the document fetch read) is still fetch's. A narrow token resuming
    that stream is refused at it, and its answer to it is refused; the user's answer decides."""
    _, broad, narrow = _broad_and_narrow()
    store = GuardedEventStore(incident_policy())
    mcp = MCPServer("samples")

    @mcp.tool()
    async def fetch(url: str, ctx: Context) -> str:
        """Fetch a document and have the client's model summarise it."""
        await ctx.session.list_roots()  # on the standalone stream too: a cursor there to resume from
        summary = await ctx.session.create_message(
            messages=[SamplingMessage(role="user", content=TextContent(type="text", text=f"Summarise {SECRET}"))],
            max_tokens=20)
        assert isinstance(summary.content, TextContent)
        return f"summary: {summary.content.text}"

    asked, attacked = asyncio.Event(), asyncio.Event()

    async def roots(context: Any) -> ListRootsResult:
        return ListRootsResult(roots=[Root(uri=FileUrl("file:///home/alice"))])

    async def model(context: Any, params: Any) -> CreateMessageResult:
        asked.set()
        await asyncio.wait_for(attacked.wait(), 10)
        return CreateMessageResult(role="assistant", content=TextContent(type="text", text="alice's"), model="m")

    async with serve(store.serve(mcp, retry_interval=200)) as port:
        url = f"http://127.0.0.1:{port}/mcp"
        async with (httpx2.AsyncClient(auth=BearerAuth(broad), timeout=30) as http,
                    Client(streamable_http_client(url, http_client=http), mode="legacy",
                           sampling_callback=model, list_roots_callback=roots) as client):
            call = asyncio.create_task(client.call_tool("fetch", {"url": "victim-doc"}))
            (session_id,) = set(mcp.session_manager._server_instances)
            await asyncio.wait_for(asked.wait(), 10)  # the sampling request is out, the user yet to answer
            async with httpx.AsyncClient(timeout=5) as attacker:
                answers = [(await attacker.post(url, headers=headers(session_id, narrow), content=json.dumps(
                    {"jsonrpc": "2.0", "id": n, "result": {"role": "assistant", "model": "m", "content": {
                        "type": "text", "text": "mallory's"}}}))).status_code for n in range(3)]
                bodies = [await resume(attacker, url, session_id, narrow, cursor) for cursor in range(1, 12)]
            attacked.set()
            result = await asyncio.wait_for(call, 20)
    assert not [body for body in bodies if SECRET in body]
    assert any("insufficient_audience" in body for body in bodies)  # refused at it, explicitly
    assert set(answers) == {403}
    assert "summary: alice's" in str(result)


@pytest.mark.filterwarnings("ignore:The logging capability is deprecated")
async def test_what_a_tool_sends_on_the_standalone_stream_after_its_call_is_its_principals_alone_to_read_live():
    """A tool's task that outlives its call sends on the session's standalone stream with no call in flight: a fresh
    GET of that stream by another principal or by no token (the SDK's 404), or by a token that claims her and does not
    verify (an error frame), gets none of it, as its replay would not; the session's own principal reads it live."""
    issuer, alice, _ = _broad_and_narrow()
    bob = issuer.mint([BASE_RESOURCE, SEARCH_RESOURCE, FETCH_RESOURCE], subject="bob")
    forged = jwt.encode({**jwt.decode(alice, options={"verify_signature": False})},
                        rsa.generate_private_key(public_exponent=65537, key_size=2048), algorithm="RS256")
    TOKENS_USED.extend((bob, forged))
    store = GuardedEventStore(incident_policy(), token_reader=TokenReader(key=issuer.public_key))
    mcp = build_incident_server(None, step_delay=0.01)  # authentication by a gateway: the guard verifies
    background: list[asyncio.Task[None]] = []

    @mcp.tool()
    async def kick(ctx: Context) -> str:
        """Start a job that reports on the session after the call returned."""
        session = ctx.session

        async def later() -> None:
            await asyncio.sleep(0.3)
            await session.send_log_message(level="info", data=f"{SECRET} (background)", logger="job")

        background.append(asyncio.create_task(later()))
        return "started"

    async def read(http: httpx.AsyncClient, session_id: str, token: str | None) -> str:
        lines: list[str] = []
        with contextlib.suppress(httpx.HTTPError, TimeoutError):
            async with asyncio.timeout(1.5), http.stream("GET", url, headers=headers(session_id, token)) as response:
                async for line in response.aiter_lines():
                    lines.append(line)
        return "\n".join(lines)

    async with serve(store.serve(mcp, retry_interval=200)) as port, httpx.AsyncClient(timeout=10) as http:
        url = f"http://127.0.0.1:{port}/mcp"
        session_id = await open_session(http, url, alice)
        await http.post(url, headers=headers(session_id, alice), content=json.dumps(
            {"jsonrpc": "2.0", "id": 1, "method": "logging/setLevel", "params": {"level": "info"}}))
        read_by = {}
        for n, (who, token) in enumerate((("bob", bob), ("forged", forged), ("nobody", None), ("alice", alice))):
            reader = asyncio.create_task(read(http, session_id, token))  # the fresh standalone stream
            await asyncio.sleep(0.2)
            kicked = await http.post(url, headers=headers(session_id, alice), content=json.dumps(
                {"jsonrpc": "2.0", "id": 10 + n, "method": "tools/call", "params": {"name": "kick", "arguments": {}}}))
            assert "started" in kicked.text
            read_by[who] = await reader
        await asyncio.gather(*background)
    assert [who for who, body in read_by.items() if SECRET in body] == ["alice"]
    # another principal's fresh GET is the SDK's 404 (the session's one standalone stream is its opener's); a token that
    # claims her and does not verify reaches the stream, and gets nothing of it
    assert "Session not found" in read_by["bob"] and "token_unverified" in read_by["forged"]


async def test_another_user_can_neither_post_into_nor_end_a_session_the_sdk_binds_to_no_user():
    """Behind a gateway that authenticates for the SDK (which then binds a session to no user; with a verifier that
    names no subject it binds one to a client app), Bob could post a call into Alice's session: the SDK stores the
    call's events in the context of her initialize, and her resume from his progress was replayed his result. The
    guard answers his POST as the SDK answers a credential not the session's, and refuses his DELETE."""
    issuer = TokenIssuer()
    everything = [BASE_RESOURCE, SEARCH_RESOURCE, FETCH_RESOURCE]
    alice, bob = issuer.mint(everything), issuer.mint(everything, subject="bob")
    TOKENS_USED.extend((alice, bob))
    store = GuardedEventStore(incident_policy(), token_reader=TokenReader(key=issuer.public_key))
    async with serve(store.serve(build_incident_server(None, step_delay=0.01), retry_interval=200)) as port, \
            httpx.AsyncClient(timeout=10) as http:
        url = f"http://127.0.0.1:{port}/mcp"
        session_id = await open_session(http, url, alice)
        posted = await http.post(url, headers=headers(session_id, bob), content=json.dumps({
            "jsonrpc": "2.0", "id": 100, "method": "tools/call", "params": {
                "name": "fetch", "arguments": {"url": "victim-doc", "steps": 3}, "_meta": {"progressToken": "p"}}}))
        refused_end = await http.delete(url, headers=headers(session_id, bob))
        hers = await http.post(url, headers=headers(session_id, alice), content=json.dumps({
            "jsonrpc": "2.0", "id": 100, "method": "tools/call", "params": {
                "name": "fetch", "arguments": {"url": "victim-doc", "steps": 1}}}))
    assert (posted.status_code, posted.json()["error"]["message"]) == (404, "Session not found")
    assert refused_end.status_code == 403
    assert hers.status_code == 200 and SECRET in hers.text  # her session, and her id 100, untouched by his POST


async def test_a_session_header_sent_twice_gets_no_stream_and_deletes_nothing_whatever_the_method():
    """Which session would the SDK take? Its first: a GET or DELETE naming the victim's session twice was read by
    the guard as naming none, and so was neither checked against its calls in flight nor refused."""
    issuer, broad, narrow = _broad_and_narrow()
    store = GuardedEventStore(incident_policy())
    async with guarded_server(issuer, store) as server, honest_client(server, broad) as (c, p):
        fetch = await fetch_in_flight(c, p)
        (session_id,) = server.session_ids()
        twice = httpx.Headers([*headers(session_id, narrow).items(), ("mcp-session-id", session_id)])
        async with httpx.AsyncClient(timeout=5) as http:
            answers = [await http.request(method, server.url, headers=twice) for method in ("GET", "DELETE")]
        result = await asyncio.wait_for(fetch, 20)
    assert [r.status_code for r in answers] == [400, 400]
    assert SECRET in str(result)  # the call ran to its end in its session


async def test_requests_the_sdk_refuses_open_no_session_in_the_guards_storage():
    """The SDK names, in a refusal of a request with no session, the session it made for it and dropped: taken for
    a session born, each such request filled the storage (evicting other users' sessions past its cap)."""
    issuer = TokenIssuer()
    token = issuer.mint([BASE_RESOURCE, SEARCH_RESOURCE])
    TOKENS_USED.append(token)
    store = GuardedEventStore(incident_policy())
    async with guarded_server(issuer, store) as server, httpx.AsyncClient(timeout=5) as http:
        refused = [await http.get(server.url, headers=headers(None, token)) for _ in range(5)]
    assert {r.status_code for r in refused} == {400}
    for answer in refused:
        assert not await store.storage.is_open(answer.headers["mcp-session-id"])


async def test_a_request_whose_id_is_the_standalone_streams_key_is_refused():
    """The SDK keys a request's stream by its id: a narrow token's call with id ``_GET_stream`` became the session's
    standalone stream, and read (and answered) the sampling request a broad call sent there."""
    issuer, broad, narrow = _broad_and_narrow()
    store = GuardedEventStore(incident_policy())
    async with guarded_server(issuer, store) as server, honest_client(server, broad):
        (session_id,) = server.session_ids()
        call = {"jsonrpc": "2.0", "id": "_GET_stream", "method": "tools/call",
                "params": {"name": "search", "arguments": {"query": "q"}}}
        async with httpx.AsyncClient(timeout=5) as http:
            refused = await http.post(server.url, headers=headers(session_id, narrow), content=json.dumps(call))
    assert refused.status_code == 400
    assert "_GET_stream" in refused.json()["error"]["message"]


async def test_an_initialize_inside_a_live_session_is_refused_and_changes_no_running_call():
    """The SDK takes an ``initialize`` that names its session: a narrow token's turned the session's sampling
    capability off under a broad call running in it (the same effect as the cancel it may not send)."""
    issuer, broad, narrow = _broad_and_narrow()
    store = GuardedEventStore(incident_policy())
    async with guarded_server(issuer, store) as server, honest_client(server, broad) as (c, p):
        fetch = await fetch_in_flight(c, p, steps=10)
        (session_id,) = server.session_ids()
        again = {"jsonrpc": "2.0", "id": 9, "method": "initialize", "params": {
            "protocolVersion": PROTOCOL, "capabilities": {}, "clientInfo": {"name": "x", "version": "1"}}}
        async with httpx.AsyncClient(timeout=5) as http:
            refused = await http.post(server.url, headers=headers(session_id, narrow), content=json.dumps(again))
        result = await asyncio.wait_for(fetch, 20)
    assert refused.status_code == 400 and "initialize" in refused.json()["error"]["message"]
    assert SECRET in str(result)


async def test_a_stream_compressed_inside_the_guards_layer_is_refused_never_sent_unread():
    """A compressor between the guard's ASGI layer and the SDK: the guard can read neither the events of a GET
    stream nor write its refusal into them, so it refuses every such stream explicitly (fails closed)."""
    issuer, broad, narrow = _broad_and_narrow()
    store = GuardedEventStore(incident_policy())
    mcp = build_incident_server(issuer, step_delay=0.05)
    inner = GZipMiddleware(mcp.streamable_http_app(event_store=store, retry_interval=200), minimum_size=0,
                           exclude_content_types=())
    async with serve(store.asgi(inner, "/mcp")) as port:
        server = Server(port, mcp)
        async with honest_client(server, broad) as (client, progress):
            fetch = await fetch_in_flight(client, progress)
            (session_id,) = server.session_ids()
            bodies = await resume_everywhere(server.url, session_id, narrow, upto=12)
            fetch.cancel()
    assert not leaked(bodies), "a narrow token read fetch's events through a compressed stream"
    assert all('"error": "stream_encoded"' in b for b in bodies), bodies[:2]
