"""Who a resume answered from Redis is answered to: the session's own principal, never a token naming none.

Two replicas of the real SDK server share one redis-server; the session lives on the first. The SDK's 404 on the
second is also its answer to a credential that is not the session's, so the guard answers from Redis only a
token that names its principal (issuer, subject, client), the one the session's events are bound to. An opaque
token names nobody the guard can read: two users' opaque tokens would look alike."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator

import httpx
import pytest

from mcp_stream_exporter.guard import GuardedEventStore
from mcp_stream_exporter.guard.redis_storage import RedisEventStorage
from mcp_stream_exporter.lab import (
    BASE_RESOURCE,
    FETCH_RESOURCE,
    SEARCH_RESOURCE,
    TokenIssuer,
    build_incident_server,
    incident_policy,
    serve,
)

pytestmark = pytest.mark.anyio

_LEGACY = "2025-11-25"


@contextlib.asynccontextmanager
async def _replica(issuer: TokenIssuer, redis_url: str) -> AsyncIterator[str]:
    storage = RedisEventStorage.from_url(redis_url, prefix="principal")
    store = GuardedEventStore(incident_policy(), storage=storage, opaque="allow")
    try:
        async with serve(store.serve(build_incident_server(issuer, step_delay=0.01), retry_interval=100)) as port:
            yield f"http://127.0.0.1:{port}/mcp"
    finally:
        await storage.aclose()


def _headers(token: str, session_id: str | None = None, **extra: str) -> dict[str, str]:
    headers = {"accept": "application/json, text/event-stream", "content-type": "application/json",
               "mcp-protocol-version": _LEGACY, "authorization": f"Bearer {token}", **extra}
    return {**headers, "mcp-session-id": session_id} if session_id else headers


async def _event_ids(http: httpx.AsyncClient, url: str, token: str) -> tuple[str, list[str]]:
    """A session opened with ``token`` on ``url``, and the event ids of one ``tools/list`` answered in it."""
    init = {"jsonrpc": "2.0", "id": 0, "method": "initialize",
            "params": {"protocolVersion": _LEGACY, "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}}
    session_id = (await http.post(url, headers=_headers(token), content=json.dumps(init))).headers["mcp-session-id"]
    await http.post(url, headers=_headers(token, session_id),
                    content=json.dumps({"jsonrpc": "2.0", "method": "notifications/initialized"}))
    listed = await http.post(url, headers=_headers(token, session_id),
                             content=json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/list"}))
    return session_id, [line[3:].strip() for line in listed.text.splitlines() if line.startswith("id:")]


async def test_a_resume_on_another_replica_with_a_token_naming_no_principal_gets_the_sdks_404(redis_server):
    issuer = TokenIssuer()
    alice = issuer.opaque([BASE_RESOURCE, SEARCH_RESOURCE, FETCH_RESOURCE], subject="alice")
    bob = issuer.opaque([BASE_RESOURCE, SEARCH_RESOURCE, FETCH_RESOURCE], subject="bob")
    alice_jwt = issuer.mint([BASE_RESOURCE, SEARCH_RESOURCE, FETCH_RESOURCE])
    async with (_replica(issuer, redis_server.url) as first, _replica(issuer, redis_server.url) as second,
                httpx.AsyncClient(timeout=10) as http):
        session_id, cursors = await _event_ids(http, first, alice)
        assert cursors
        for token in (bob, alice):  # the guard cannot tell these two apart: neither is answered from Redis
            resumed = await http.get(second, headers=_headers(token, session_id, **{"last-event-id": cursors[0]}))
            assert resumed.status_code == 404
            assert '"tools"' not in resumed.text
        jwt_session, jwt_cursors = await _event_ids(http, first, alice_jwt)
        resumed = await http.get(second, headers=_headers(alice_jwt, jwt_session, **{"last-event-id": jwt_cursors[0]}))
        assert resumed.status_code == 200  # a JWT names its principal: its own session is answered from Redis
        mallory = issuer.mint([BASE_RESOURCE, SEARCH_RESOURCE, FETCH_RESOURCE], subject="mallory")
        resumed = await http.get(second, headers=_headers(mallory, jwt_session, **{"last-event-id": jwt_cursors[0]}))
        assert resumed.status_code == 404  # another principal's session does not exist, as the SDK says: no frame
        assert "principal_mismatch" not in resumed.text  # naming the session's calls and what they require
