"""The hooks over the real SDK: every tools/call is linked to the stream and event that ended it."""

from __future__ import annotations

import asyncio

import httpx2
import pytest
from mcp.shared.exceptions import MCPError

from mcp_stream_exporter import semconv as sc
from mcp_stream_exporter.hooks._tracking import HOLD_BYTES
from mcp_stream_exporter.lab import FETCH_RESOURCE, SEARCH_RESOURCE
from mcp_stream_exporter.wire import REFUSED_ERROR_CODE

from harness import incident, ours, play_incident, spans

pytestmark = pytest.mark.anyio


# where each side's call span says its result went: a server call span whose result was stored while no
# stream was open ends at that storage, with no terminal stream (docs/span-model.md, "Span: call")
_DELIVERED_ON = {sc.ROLE_CLIENT: (sc.STREAM_KIND_RESUME,), sc.ROLE_SERVER: (sc.STREAM_KIND_RESUME, None)}


def _attr(span, key):
    return (span.attributes or {}).get(key)


def _terminal_link(call_span):
    links = [lk for lk in call_span.links if (lk.attributes or {}).get(sc.LINK_TYPE) == sc.LINK_TERMINAL_STREAM]
    assert len(links) == 1
    return links[0].context.span_id


def _call(found, role, tool):
    found = ours(found, sc.SPAN_CALL, role, gen_ai__tool__name=tool)
    assert len(found) == 1, found
    return found[0]


@pytest.mark.parametrize(("mode", "era"), [("legacy", sc.ERA_RESUMABLE), (None, sc.ERA_STATELESS)])
async def test_a_clean_call_is_recorded_on_the_sdks_own_span_with_its_terminal_event(mode, era):
    async with incident(mode) as s:
        result = await s.call("search", {"query": "q", "steps": 2})
        store = s.store
    assert "search results" in result.content[0].text
    assert s.progress == ["search step 1", "search step 2"]
    found = spans()
    # the healthy path: no call, POST or resume span of ours on either side, the SDK's spans are the
    # record (the session's standalone GET stream and its DELETE are spans: one each per session)
    assert ours(found, sc.SPAN_CALL) == []
    assert ours(found, sc.SPAN_REPLAY) == []
    assert {_attr(sp, sc.STREAM_KIND) for sp in ours(found, sc.SPAN_STREAM)} <= {sc.STREAM_KIND_GET,
                                                                               sc.STREAM_KIND_DELETE}
    (sdk_client,) = [sp for sp in found if sp.name == "MCP send tools/call search"]
    assert [sp for sp in found if sp.name == "tools/call search"]  # the SDK's server span
    assert _attr(sdk_client, sc.TERMINAL_STREAM_KIND) == sc.STREAM_KIND_POST
    if era == sc.ERA_RESUMABLE:
        event_id = _attr(sdk_client, sc.TERMINAL_EVENT_ID)
        stored = store._index[event_id].message  # the server's store: that event is this call's response
        assert str(stored.id) == _attr(sdk_client, sc.JSONRPC_REQUEST_ID)
        assert stored.result["content"][0]["text"] == "search results for 'q'"
    else:
        assert _attr(sdk_client, sc.TERMINAL_EVENT_ID) is None  # no event ids in 2026-07-28


async def test_a_call_that_deviates_gets_spans_of_ours_on_both_sides_under_the_sdks_span():
    async with incident("legacy") as s:
        await s.call("search", {"query": "q"})  # healthy: nothing of ours
        result = await s.call("poll", {"steps": 2})  # the server closes its stream: a deviation
    assert "poll done" in result.content[0].text
    found = spans()
    calls = {role: _call(found, role, "poll") for role in (sc.ROLE_CLIENT, sc.ROLE_SERVER)}
    assert ours(found, sc.SPAN_CALL, gen_ai__tool__name="search") == []
    for role, call in calls.items():
        assert _attr(call, sc.CALL_OUTCOME) == sc.OUTCOME_RESULT
        assert _attr(call, sc.TERMINAL_STREAM_KIND) in _DELIVERED_ON[role]
    (sdk_client,) = [sp for sp in found if sp.name == "MCP send tools/call poll"]
    assert calls[sc.ROLE_CLIENT].parent.span_id == sdk_client.context.span_id
    (sdk_server,) = [sp for sp in found if sp.name == "tools/call poll"]
    links = {(lk.attributes or {}).get(sc.LINK_TYPE): lk.context.span_id for lk in calls[sc.ROLE_SERVER].links}
    assert links[sc.LINK_SDK_REQUEST] == sdk_server.context.span_id


async def test_a_post_that_fails_is_a_stream_span_linked_from_its_call():
    async with incident(None) as s:  # 2026-07-28: a broken response stream ends the call
        s.proxy.arm(b"fetch step 1")
        with pytest.raises(MCPError):
            await s.call("fetch", {"url": "u", "steps": 4})
    found = spans()
    call = _call(found, sc.ROLE_CLIENT, "fetch")
    assert _attr(call, sc.CALL_OUTCOME) == sc.OUTCOME_NO_TERMINAL
    (post,) = ours(found, sc.SPAN_STREAM, sc.ROLE_CLIENT, mcp_stream__stream__kind=sc.STREAM_KIND_POST)
    assert _attr(post, sc.END_REASON) == sc.END_DROPPED
    assert _attr(post, sc.PENDING_REQUEST_IDS) == (_attr(call, sc.JSONRPC_REQUEST_ID),)
    assert post.parent.span_id == call.context.span_id
    assert [lk.context.span_id for lk in call.links] == [post.context.span_id]
    kinds = [(e.attributes or {}).get(sc.FRAME_KIND) for e in post.events]
    assert kinds == [sc.FRAME_NOTIFICATION]  # the progress event it saw before the cut, kept
    assert post.events[0].timestamp >= post.start_time


async def test_a_stateless_call_the_server_loses_is_taken_from_the_sdks_middleware_with_what_its_body_says():
    """In 2026-07-28 the server's hooks take a call from the SDK's middleware, which has parsed its body:
    the same id, tool and parent as reading the body gives, and the call still tracked to its end."""
    async with incident(None) as s:
        s.proxy.arm(b"fetch step 1")
        with pytest.raises(MCPError):
            await s.call("fetch", {"url": "u", "steps": 4})
    found = spans()
    client, server = _call(found, sc.ROLE_CLIENT, "fetch"), _call(found, sc.ROLE_SERVER, "fetch")
    assert _attr(server, sc.ERA) == sc.ERA_STATELESS
    assert _attr(server, sc.CALL_OUTCOME) == sc.OUTCOME_NO_TERMINAL
    assert _attr(server, sc.JSONRPC_REQUEST_ID) == _attr(client, sc.JSONRPC_REQUEST_ID)
    assert _attr(server, sc.POLICY_DECISION) == "allowed"
    (sdk_client,) = [sp for sp in found if sp.name == "MCP send tools/call fetch"]
    (sdk_server,) = [sp for sp in found if sp.name == "tools/call fetch"]
    assert server.parent.span_id == sdk_client.context.span_id  # the traceparent in its params._meta
    links = {(lk.attributes or {}).get(sc.LINK_TYPE): lk.context.span_id for lk in server.links}
    assert links[sc.LINK_SDK_REQUEST] == sdk_server.context.span_id
    (post,) = ours(found, sc.SPAN_STREAM, sc.ROLE_SERVER, mcp_stream__stream__kind=sc.STREAM_KIND_POST)
    assert _attr(post, sc.PENDING_REQUEST_IDS) == (_attr(server, sc.JSONRPC_REQUEST_ID),)


async def test_a_stateless_call_refused_before_the_hooks_middleware_is_read_from_its_body():
    """A middleware ahead of the hooks' (here the call guard) can answer a call the hooks' middleware
    never sees: its body is read when the response starts, and the refusal is recorded as in any era."""
    async with incident(None, guard_calls=True) as s:
        s.auth.token = s.narrow
        with pytest.raises(MCPError) as refused:
            await s.call("fetch", {"url": "u"})
    assert refused.value.code == REFUSED_ERROR_CODE
    call = _call(spans(), sc.ROLE_SERVER, "fetch")
    assert _attr(call, sc.ERA) == sc.ERA_STATELESS
    assert _attr(call, sc.POLICY_DECISION) == "refused"
    assert _attr(call, sc.CALL_OUTCOME) == sc.OUTCOME_ERROR
    assert _attr(call, sc.AUTH_MISSING_RESOURCES) == (FETCH_RESOURCE,)


async def test_dropped_connection_then_resume_links_the_call_to_the_resume_stream():
    async with incident("legacy") as s:
        s.proxy.arm(b"fetch step 1")
        result = await s.call("fetch", {"url": "u", "steps": 4})
    assert "contents of u" in result.content[0].text
    assert s.proxy.cuts == 1
    found = spans()
    received = {}  # role -> the last event id its POST stream span saw before the cut
    for role in (sc.ROLE_CLIENT, sc.ROLE_SERVER):
        call = _call(found, role, "fetch")
        request_id = _attr(call, sc.JSONRPC_REQUEST_ID)
        assert _attr(call, sc.CALL_OUTCOME) == sc.OUTCOME_RESULT
        assert _attr(call, sc.TERMINAL_STREAM_KIND) in _DELIVERED_ON[role]
        (post,) = ours(found, sc.SPAN_STREAM, role, mcp_stream__stream__kind=sc.STREAM_KIND_POST,
                       mcp_stream__stream__request_ids=(request_id,))
        assert _attr(post, sc.END_REASON) == sc.END_DROPPED
        assert _attr(post, sc.PENDING_REQUEST_IDS) == (request_id,)
        resumes = ours(found, sc.SPAN_STREAM, role, mcp_stream__stream__kind=sc.STREAM_KIND_RESUME)
        delivering = [r for r in resumes if request_id in (_attr(r, sc.TERMINAL_REQUEST_IDS) or ())]
        assert len(delivering) == 1
        if _attr(call, sc.TERMINAL_STREAM_KIND) is None:  # the server stored it with no stream open: ended then
            assert _attr(call, sc.TERMINAL_EVENT_ID) is not None
        else:
            assert _terminal_link(call) == delivering[0].context.span_id
        received[role] = _attr(post, sc.EVENT_LAST_ID)
        # both sides record the cursor the client resumed from: the last event the client received
        assert _attr(delivering[0], sc.RESUME_CURSOR) == received[sc.ROLE_CLIENT]
    # the server may have written more than the client received before it saw the cut, never less
    assert int(received[sc.ROLE_CLIENT]) <= int(received[sc.ROLE_SERVER])
    (replay,) = ours(found, sc.SPAN_REPLAY, sc.ROLE_SERVER)
    assert _attr(replay, sc.REPLAY_DECISION) == sc.REPLAY_COMPLETE


async def test_server_closed_stream_ends_clean_with_the_call_pending_then_resumes():
    async with incident("legacy") as s:
        result = await s.call("poll", {"steps": 3})
    assert "poll done" in result.content[0].text
    found = spans()
    call = _call(found, sc.ROLE_CLIENT, "poll")
    request_id = _attr(call, sc.JSONRPC_REQUEST_ID)
    (post,) = ours(found, sc.SPAN_STREAM, sc.ROLE_CLIENT, mcp_stream__stream__kind=sc.STREAM_KIND_POST,
                   mcp_stream__stream__request_ids=(request_id,))
    assert _attr(post, sc.END_REASON) == sc.END_CLEAN
    assert _attr(post, sc.PENDING_REQUEST_IDS) == (request_id,)
    assert _attr(call, sc.TERMINAL_STREAM_KIND) == sc.STREAM_KIND_RESUME
    assert _attr(call, sc.CALL_STREAMS) >= 2


async def test_incident_narrowed_resume_ends_clean_with_fetch_pending_and_the_gap_recorded():
    async with incident("legacy") as s:
        s.proxy.arm(b"fetch step 1", on_cut=s.refresh_narrows)  # least privilege: aud = search only
        search, fetch = await asyncio.gather(
            s.call("search", {"query": "q", "steps": 4}, timeout=10.0),
            s.call("fetch", {"url": "u", "steps": 4}, timeout=2.5),
            return_exceptions=True,
        )
    assert not isinstance(search, BaseException) and "search results" in search.content[0].text
    assert isinstance(fetch, MCPError)  # only an unrelated timeout ends it: the incident
    found = spans()

    client_fetch = _call(found, sc.ROLE_CLIENT, "fetch")
    assert _attr(client_fetch, sc.CALL_OUTCOME) == sc.OUTCOME_CANCELLED  # the SDK gave up at its timeout
    assert _attr(client_fetch, sc.TERMINAL_EVENT_ID) is None
    assert _attr(client_fetch, sc.CALL_STREAMS) > 2  # the POST, then resume after resume
    clean_pending = [sp for sp in ours(found, sc.SPAN_STREAM, sc.ROLE_CLIENT,
                                       mcp_stream__stream__kind=sc.STREAM_KIND_RESUME)
                     if _attr(sp, sc.END_REASON) == sc.END_CLEAN and _attr(sp, sc.PENDING_REQUEST_IDS)]
    assert clean_pending, "the client's resume of fetch must end clean with the call pending"
    assert all(_attr(sp, sc.AUTH_AUDIENCE) == (SEARCH_RESOURCE,) for sp in clean_pending)

    truncated = ours(found, sc.SPAN_REPLAY, sc.ROLE_SERVER, mcp_stream__replay__decision=sc.REPLAY_TRUNCATED)
    assert truncated
    gap = truncated[0]
    assert _attr(gap, sc.AUTH_AUDIENCE) == (SEARCH_RESOURCE,)
    assert _attr(gap, sc.REQUIRED_RESOURCES) == (FETCH_RESOURCE,)
    assert _attr(gap, sc.AUTH_MISSING_RESOURCES) == (FETCH_RESOURCE,)
    assert _attr(gap, sc.REPLAY_OFFENDING_EVENT_ID) is not None
    assert _attr(gap, sc.REPLAY_SENT) == 0
    assert _attr(clean_pending[0], sc.PENDING_REQUEST_IDS) == (_attr(gap, sc.JSONRPC_REQUEST_ID),)
    # the search resume was authorised and completed
    assert ours(found, sc.SPAN_REPLAY, sc.ROLE_SERVER, mcp_stream__replay__decision=sc.REPLAY_COMPLETE)


async def test_the_call_guard_refuses_a_call_whose_token_lacks_the_tools_resource_and_the_hooks_record_it():
    async with incident("legacy", guard_calls=True) as s:
        s.auth.token = s.narrow
        with pytest.raises(MCPError) as refused:
            await s.call("fetch", {"url": "u"})
        ok = await s.call("search", {"query": "q"})
    assert FETCH_RESOURCE in refused.value.message
    assert "search results" in ok.content[0].text
    (call,) = ours(spans(), sc.SPAN_CALL, sc.ROLE_SERVER, gen_ai__tool__name="fetch")
    assert _attr(call, sc.POLICY_DECISION) == "refused"
    assert _attr(call, sc.CALL_OUTCOME) == sc.OUTCOME_ERROR
    assert _attr(call, sc.AUTH_MISSING_RESOURCES) == (FETCH_RESOURCE,)


async def test_the_client_tap_records_a_refusal_and_changes_nothing_without_the_guards_resolver():
    """The hooks observe: the guard's error frame is on the client's stream span, and the call is left
    to the SDK (which drops the frame and waits for its timeout) unless the guard's resolver answers it."""
    async with incident("legacy", guarded=True, resolve=False) as s:
        _, fetch = await play_incident(s, fetch_timeout=2.5)
    assert isinstance(fetch, MCPError) and fetch.code != REFUSED_ERROR_CODE  # the SDK's own give-up
    found = spans()
    gave_up = _call(found, sc.ROLE_CLIENT, "fetch").end_time
    refused = [sp for sp in ours(found, sc.SPAN_STREAM, sc.ROLE_CLIENT) if _attr(sp, sc.ERROR_FRAMES_COUNT)]
    # each refused resume of fetch that ends before its caller gave up leaves it pending
    assert refused and all(_attr(sp, sc.PENDING_REQUEST_IDS) for sp in refused if sp.end_time < gave_up)
    assert any(_attr(sp, sc.PENDING_REQUEST_IDS) for sp in refused)


async def test_a_call_whose_body_and_result_come_in_many_pieces_is_tracked_to_its_end_on_both_sides():
    """A body the server receives in several ASGI messages is still read, and a result split over many
    reads still ends the call: with a token lacking fetch's resource the call is a span on each side."""
    url = "u" * 300_000
    async with incident("legacy") as s:
        s.auth.token = s.narrow
        result = await s.call("fetch", {"url": url})
    assert result.content[0].text == f"contents of {url}"
    found = spans()
    for role in (sc.ROLE_CLIENT, sc.ROLE_SERVER):
        call = _call(found, role, "fetch")
        assert _attr(call, sc.AUTH_MISSING_RESOURCES) == (FETCH_RESOURCE,)
        assert _attr(call, sc.CALL_OUTCOME) == sc.OUTCOME_RESULT


async def test_a_clean_call_whose_result_is_past_what_the_hooks_hold_is_followed_and_still_healthy():
    """A POST's SSE stream is held and read at its end; a result larger than the hooks hold is followed
    frame by frame from there on both sides, and the call is still the healthy path: no span of ours."""
    url = "u" * (2 * HOLD_BYTES)
    async with incident("legacy") as s:
        result = await s.call("fetch", {"url": url})
    assert result.content[0].text == f"contents of {url}"
    found = spans()
    assert ours(found, sc.SPAN_CALL) == []
    assert {_attr(sp, sc.STREAM_KIND) for sp in ours(found, sc.SPAN_STREAM)} <= {sc.STREAM_KIND_GET,
                                                                               sc.STREAM_KIND_DELETE}
    (sdk_client,) = [sp for sp in found if sp.name == "MCP send tools/call fetch"]
    assert _attr(sdk_client, sc.TERMINAL_STREAM_KIND) == sc.STREAM_KIND_POST
    assert _attr(sdk_client, sc.TERMINAL_EVENT_ID) is not None


async def _fetch_cut_after_the_answers_first_read() -> None:
    async with incident(None) as s:
        s.proxy.arm(b"HTTP/1.1 200")
        await s.call("fetch", {"url": "u" * 300_000})  # a result in many reads: the cut comes after the first


async def test_a_stateless_json_answer_cut_before_its_end_is_a_dropped_stream_that_owes_its_call():
    """A POST's JSON answer to its one call is read once, at its end, rather than followed as a stream
    (the healthy path). Cut before its end, the client's stream is opened then and says what it owed."""
    with pytest.raises(BaseExceptionGroup) as crashed:  # the SDK's client: its task group ends on the cut
        await _fetch_cut_after_the_answers_first_read()
    assert crashed.group_contains(httpx2.RemoteProtocolError)
    found = spans()
    call = _call(found, sc.ROLE_CLIENT, "fetch")
    assert _attr(call, sc.CALL_OUTCOME) == sc.OUTCOME_NO_TERMINAL
    (post,) = ours(found, sc.SPAN_STREAM, sc.ROLE_CLIENT, mcp_stream__stream__kind=sc.STREAM_KIND_POST)
    assert _attr(post, sc.END_REASON) == sc.END_DROPPED
    assert _attr(post, sc.STREAM_CONTENT) == "json"
    assert _attr(post, sc.PENDING_REQUEST_IDS) == (_attr(call, sc.JSONRPC_REQUEST_ID),)
    assert [lk.context.span_id for lk in call.links] == [post.context.span_id]


@pytest.mark.parametrize("mode", ["legacy", None])
async def test_a_call_answered_with_a_tool_error_and_the_next_one_are_the_healthy_path_in_either_era(mode):
    """A call of a tool the server does not have is answered with a tool error: its result, so the healthy
    path (in 2026-07-28 the call is never started as a call of ours on either side), and the SDK's span
    says where it came; so is the next call of the same client."""
    async with incident(mode) as s:
        unknown = await s.call("no_such_tool", {})
        await s.call("search", {"query": "q"})
    assert unknown.is_error
    found = spans()
    assert ours(found, sc.SPAN_CALL) == []
    assert {_attr(sp, sc.STREAM_KIND) for sp in ours(found, sc.SPAN_STREAM)} <= {sc.STREAM_KIND_GET,
                                                                               sc.STREAM_KIND_DELETE}
    for name in ("MCP send tools/call no_such_tool", "MCP send tools/call search"):
        (sdk_client,) = [sp for sp in found if sp.name == name]
        assert _attr(sdk_client, sc.TERMINAL_STREAM_KIND) == sc.STREAM_KIND_POST
