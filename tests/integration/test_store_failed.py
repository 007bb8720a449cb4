"""A server whose ``EventStore.store_event`` raises, over the real SDK and real HTTP on 127.0.0.1, its spans fed to
the embedded detector: the SDK's message router dies at the failure, the session's calls hang until their
client's timeout, and each lost call is one ``store_failed`` finding."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.server.streamable_http import EventId, StreamId
from mcp.shared.exceptions import MCPError
from mcp.shared.message import ClientMessageMetadata
from mcp_types import (
    CallToolRequest,
    CallToolRequestParams,
    CallToolResult,
    JSONRPCError,
    JSONRPCMessage,
    JSONRPCResponse,
)

from mcp_stream_exporter import instrument_server
from mcp_stream_exporter import semconv as sc
from mcp_stream_exporter.lab import serve
from mcp_stream_exporter.lab.incident import IncidentEventStore, build_incident_server, incident_policy

from harness import after_grace, detector, incident, ours, span_exporter, spans

pytestmark = pytest.mark.anyio
SECRET = "redis://:hunter2@cache:6379"
TIMEOUT_S = 1.5  # the caller's: the result never comes


class StoreDown(ConnectionError):
    """What a Redis store raises when its server is down; its message names the server, password included."""


Fails = Callable[[StreamId, JSONRPCMessage | None], bool]


def failing(store: IncidentEventStore, fails: Fails) -> list[StreamId]:
    """Make the author's store raise for the messages ``fails`` picks (as a Redis store does once its server is
    down); returns the streams it raised for."""
    stores, raised = store.store_event, []

    async def store_event(stream_id: StreamId, message: JSONRPCMessage | None) -> EventId:
        if fails(stream_id, message):
            raised.append(stream_id)
            raise StoreDown(f"{SECRET} unreachable")
        return await stores(stream_id, message)

    store.store_event = store_event  # type: ignore[method-assign]
    return raised


def results(stream_id: StreamId, message: JSONRPCMessage | None) -> bool:
    return isinstance(message, JSONRPCResponse | JSONRPCError)


@contextlib.asynccontextmanager
async def hooked_server_only() -> AsyncIterator[tuple[Client, IncidentEventStore]]:
    """The incident's tools (no auth) with the server hooks, and a client on the SDK alone (no hooks)."""
    span_exporter().clear()  # the spans of this scenario only
    store = IncidentEventStore(incident_policy())
    server = build_incident_server(store=store, step_delay=0.05)
    app = instrument_server(server, policy=incident_policy(), event_store=store, retry_interval=200)
    async with (serve(app) as port,
                Client(streamable_http_client(f"http://127.0.0.1:{port}/mcp"), mode="legacy") as client):
        yield client, store


def _by_rule(findings: list[Any]) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {}
    for f in findings:
        out.setdefault(f.rule, []).append(f)
    return out


async def _server_call_spans(count: int) -> list[Any]:
    """The server's call spans, once there are ``count`` (a call's ends when the server sees its client's
    cancel; bounded: 5 s)."""
    for _ in range(100):
        found = ours(spans(), sc.SPAN_CALL, sc.ROLE_SERVER)
        if len(found) >= count:
            return found
        await asyncio.sleep(0.05)
    raise AssertionError(f"fewer than {count} server call spans")


async def test_a_store_that_fails_on_a_calls_result_is_one_store_failed_finding_with_hooks_on_the_server_only():
    with detector() as (found, clock):
        async with hooked_server_only() as (client, store):
            raised = failing(store, results)
            with pytest.raises(MCPError, match="timed out"):
                await client.call_tool("fetch", {"url": "u", "steps": 1}, read_timeout_seconds=TIMEOUT_S)
        findings = _by_rule(after_grace(found, clock))
    assert raised  # the SDK's router stored the result, and the store raised
    (lost,) = findings.pop("store_failed")
    assert (lost.tool, lost.severity, lost.roles) == ("fetch", "critical", [sc.ROLE_SERVER])
    assert findings == {}
    assert found.registry.get_sample_value("mcp_stream_silent_losses_total",
                                           {"tool": "fetch", "rule": "store_failed"}) == 1.0
    (server_call,) = ours(spans(), sc.SPAN_CALL, sc.ROLE_SERVER)
    assert server_call.attributes[sc.CALL_OUTCOME] == sc.OUTCOME_STORE_FAILED
    assert server_call.attributes[sc.ERROR_TYPE] == f"{__name__}.StoreDown"
    assert SECRET not in "".join(s.to_json() for s in spans())  # the exception's class, never its message


async def test_a_store_that_fails_on_a_calls_result_with_hooks_on_both_sides_is_one_finding_its_timeout_attributed():
    with detector() as (found, clock):
        async with incident("legacy") as lab:
            failing(lab.store, results)  # type: ignore[arg-type]
            with pytest.raises(MCPError, match="timed out"):
                await lab.call("fetch", {"url": "u", "steps": 2}, timeout=TIMEOUT_S)
            assert lab.progress == ["fetch step 1", "fetch step 2"]  # the router stored and sent those
        findings = _by_rule(after_grace(found, clock))
    (lost,) = findings["store_failed"]
    assert (lost.tool, lost.evidence["timed_out"]) == ("fetch", True)
    assert sorted(findings) == ["store_failed", "timeout_attributed"]
    assert findings["timeout_attributed"][0].caused_by == lost.id
    assert found.ledger.in_flight == 0


async def test_the_sessions_other_call_in_flight_and_a_later_call_are_each_lost_and_each_one_finding():
    """The router dies with the session: a call it had in flight never gets its result either, nor does one the
    session sends once the store answers again (each hangs until its caller's timeout)."""
    with detector() as (found, clock):
        async with incident("legacy") as lab:
            store_down = True
            failing(lab.store, lambda stream_id, message: store_down and results(stream_id, message))  # type: ignore[arg-type]
            outcomes = await asyncio.gather(lab.call("search", {"query": "q", "steps": 20}, timeout=TIMEOUT_S),
                                            lab.call("fetch", {"url": "u", "steps": 1}, timeout=TIMEOUT_S),
                                            return_exceptions=True)
            assert all(isinstance(o, MCPError) for o in outcomes), outcomes
            store_down = False
            with pytest.raises(MCPError, match="timed out"):
                await lab.call("fetch", {"url": "later", "steps": 0}, timeout=TIMEOUT_S)
            ended = await _server_call_spans(3)  # the later call's ends as the server starts it
            assert [s.attributes[sc.CALL_OUTCOME] for s in ended] == [sc.OUTCOME_STORE_FAILED] * 3
        findings = _by_rule(after_grace(found, clock))
    lost = findings["store_failed"]
    assert sorted(f.tool for f in lost) == ["fetch", "fetch", "search"]
    assert len({f.request_id for f in lost}) == 3 and len({f.session_id for f in lost}) == 1
    assert sorted(findings) == ["store_failed", "timeout_attributed"]
    assert found.registry.get_sample_value("mcp_stream_silent_losses_total",
                                           {"tool": "fetch", "rule": "store_failed"}) == 2.0


async def test_a_later_call_whose_client_sends_no_cancel_is_still_one_finding():
    """A request with a resumption-token callback: the SDK client sends no ``notifications/cancelled`` at its
    timeout (as a client that only drops its stream): the call ends ``store_failed`` as the server starts it."""
    with detector() as (found, clock):
        async with hooked_server_only() as (client, store):
            store_down = True
            failing(store, lambda stream_id, message: store_down and results(stream_id, message))
            with pytest.raises(MCPError, match="timed out"):
                await client.call_tool("fetch", {"url": "u", "steps": 0}, read_timeout_seconds=TIMEOUT_S)
            store_down = False

            async def resumption_token(token: str) -> None:
                pass

            with pytest.raises(MCPError, match="timed out"):
                await client.session.send_request(
                    CallToolRequest(params=CallToolRequestParams(name="fetch", arguments={"url": "later"})),
                    CallToolResult, request_read_timeout_seconds=TIMEOUT_S,
                    metadata=ClientMessageMetadata(on_resumption_token_update=resumption_token))
            ended = await _server_call_spans(2)
            assert [s.attributes[sc.CALL_OUTCOME] for s in ended] == [sc.OUTCOME_STORE_FAILED] * 2
        findings = _by_rule(after_grace(found, clock))
    assert [f.tool for f in findings.pop("store_failed")] == ["fetch", "fetch"]
    assert findings == {}


async def test_a_priming_event_that_fails_to_store_is_answered_500_at_once_and_pages_nothing():
    with detector() as (found, clock):
        async with incident("legacy") as lab:
            store_down = True
            failing(lab.store, lambda stream_id, message: store_down and message is None)  # type: ignore[arg-type]
            with pytest.raises(MCPError, match="Error handling POST request"):
                await lab.call("fetch", {"url": "u", "steps": 0}, timeout=TIMEOUT_S)
            store_down = False
            result = await lab.call("fetch", {"url": "u", "steps": 0}, timeout=10)  # the session lives on
            assert result.content[0].text == "contents of u"  # type: ignore[union-attr]
        assert after_grace(found, clock) == []
