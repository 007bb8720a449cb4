"""The detector fed by the real hooks over the real SDK: the incident, its guarded twin, and the
failure modes the lab's servers can produce for real."""

from __future__ import annotations

import asyncio
import sys

import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from opentelemetry import trace

from mcp_stream_exporter import instrument_client
from mcp_stream_exporter import semconv as sc
from mcp_stream_exporter.detector import Detector
from mcp_stream_exporter.detector.embedded import span_of
from mcp_stream_exporter.lab import (
    BASE_RESOURCE,
    FETCH_RESOURCE,
    SEARCH_RESOURCE,
    BearerAuth,
    Incident,
    incident_policy,
)

from harness import TOKENS_USED, Clock, after_grace, detector, incident, ours, play_incident, span_exporter, spans

pytestmark = pytest.mark.anyio


def _by_rule(findings):
    out = {}
    for f in findings:
        out.setdefault(f.rule, []).append(f)
    return out


async def test_the_incident_gives_one_narrowed_resume_and_one_clean_end_pending_for_fetch_with_the_gap():
    with detector() as (found, clock):
        async with incident("legacy") as lab:
            await play_incident(lab)
        findings = _by_rule(after_grace(found, clock))
    (narrowed,) = findings["narrowed_resume"]
    (lost,) = findings["clean_end_pending"]
    assert narrowed.tool == lost.tool == "fetch"
    assert narrowed.request_id == lost.request_id
    assert narrowed.evidence["missing_resources"] == [FETCH_RESOURCE]
    assert narrowed.evidence["audience_held"] == [SEARCH_RESOURCE]
    assert sorted(narrowed.roles) == sorted(lost.roles) == [sc.ROLE_CLIENT, sc.ROLE_SERVER]
    assert lost.trace_ids and lost.session_id
    (truncated,) = findings["replay_truncated"]
    assert truncated.evidence["offending_event_id"]
    (attributed,) = findings["timeout_attributed"]
    assert attributed.caused_by in {narrowed.id, lost.id, truncated.id, findings["resume_loop"][0].id}
    assert set(findings) == {"narrowed_resume", "clean_end_pending", "replay_truncated", "resume_loop",
                             "timeout_attributed"}
    assert found.registry.get_sample_value("mcp_stream_silent_losses_total",
                                           {"tool": "fetch", "rule": "clean_end_pending"}) == 1.0


async def test_the_guarded_incident_with_reauthorisation_produces_no_finding():
    with detector() as (found, clock):
        async with incident("legacy", guarded=True) as lab:
            _, fetch = await play_incident(lab, fetch_timeout=20)
            assert isinstance(fetch, MCPError)
            recovered = await lab.recover(fetch, "fetch", {"url": "u", "steps": 4})
        assert recovered.content[0].text == "contents of u"
        assert after_grace(found, clock) == []
    assert found.registry.get_sample_value("mcp_stream_resumes_total", {"role": "client", "outcome": "refused"}) == 1


async def test_client_spans_only_server_spans_only_or_both_each_see_the_loss_once():
    async with incident("legacy") as lab:
        await play_incident(lab)
    recorded = [span_of(s) for s in spans()]
    client_side = [s for s in recorded if s.attributes.get(sc.ROLE) != sc.ROLE_SERVER and s.kind != "server"]
    server_side = [s for s in recorded if s.attributes.get(sc.ROLE) != sc.ROLE_CLIENT and s.kind != "client"]
    clock = Clock()
    for subset in (client_side, server_side, recorded):
        alone = Detector(clock=clock)
        alone.consume(subset)
        clock.advance(60)
        alone.tick()
        rules = sorted(f.rule for f in alone.findings)
        assert rules.count("clean_end_pending") == 1
        assert rules.count("narrowed_resume") == 1


async def test_a_session_wide_filtering_replay_is_a_foreign_result_a_skipped_cursor_and_a_cross_stream_replay():
    with detector() as (found, clock):
        async with incident("legacy", session_wide_filter=True) as lab:
            _, fetch = await play_incident(lab)
        findings = _by_rule(after_grace(found, clock))
    assert "search results" in fetch.content[0].text  # the SDK gave fetch's caller search's result
    (foreign,) = findings["foreign_result"]
    assert foreign.tool == "fetch"
    assert foreign.evidence["wire_ids"] != [foreign.request_id]
    assert "cursor_past_undelivered" in findings
    assert "cross_stream_replay" in findings


async def test_a_resume_to_an_unknown_cursor_answered_with_an_empty_stream_is_flagged():
    with detector() as (found, clock):
        async with incident("legacy") as lab:
            with pytest.raises(MCPError):
                await lab.call("fetch", {"url": "u"}, timeout=1.0, resume_from="999999")
        findings = _by_rule(after_grace(found, clock))
    assert "unknown_cursor" in findings


async def test_a_session_that_expires_while_a_call_is_owed_is_flagged():
    with detector() as (found, clock):
        async with incident("legacy") as lab:
            expiry = []
            lab.proxy.arm(b"fetch step 1", on_cut=lambda: expiry.append(asyncio.ensure_future(lab.expire_sessions())))
            with pytest.raises(MCPError):
                await lab.call("fetch", {"url": "u", "steps": 4}, timeout=3)
        findings = _by_rule(after_grace(found, clock))
    (expired,) = findings["session_expired_in_flight"]
    assert expired.tool == "fetch"


async def test_the_sdks_404_to_another_principal_naming_a_live_session_is_marked_and_read_as_no_expiry():
    """The SDK refuses another principal's request naming a live session with the 404 of a session that does not
    exist: the server's span says so, and the detector reads no expiry from it; the owner's own 404, once the
    session is gone, is the expiry it is."""
    with detector() as (found, clock):
        async with incident("legacy") as lab:
            assert lab.server is not None
            await lab.call("search", {"query": "q"})
            (session_id,) = lab.server.session_manager._server_instances  # lab only: no public API
            mallory = lab.issuer.mint([BASE_RESOURCE, SEARCH_RESOURCE, FETCH_RESOURCE], subject="mallory")
            url = f"http://127.0.0.1:{lab.proxy.port}/mcp"

            async def resume_as(token: str) -> int:
                headers = {"mcp-session-id": session_id, "last-event-id": "1", "accept": "text/event-stream",
                           "mcp-protocol-version": "2025-11-25", "authorization": f"Bearer {token}"}
                async with httpx2.AsyncClient() as raw:
                    return (await raw.get(url, headers=headers)).status_code

            fetching = asyncio.ensure_future(lab.call("fetch", {"url": "u", "steps": 4}))
            await asyncio.sleep(0.05)  # fetch under way
            assert await resume_as(mallory) == 404
            async with httpx2.AsyncClient() as raw:
                posted = await raw.post(url, json={"jsonrpc": "2.0", "id": 99, "method": "tools/call",
                                                   "params": {"name": "fetch", "arguments": {"url": "m"}}},
                                        headers={"mcp-session-id": session_id, "authorization": f"Bearer {mallory}",
                                                 "accept": "application/json, text/event-stream",
                                                 "mcp-protocol-version": "2025-11-25"})
            assert posted.status_code == 404
            assert (await fetching).content[0].text == "contents of u"  # the session lives
            await lab.expire_sessions()
            assert await resume_as(lab.broad) == 404
        assert after_grace(found, clock) == []
    refused = ours(spans(), "stream", sc.ROLE_SERVER, http__response__status_code=404,
                   mcp_stream__stream__kind=sc.STREAM_KIND_RESUME)
    assert [(s.attributes or {}).get(sc.SESSION_OWNER) for s in refused] == [sc.SESSION_OWNER_OTHER, None]
    (post,) = ours(spans(), "stream", sc.ROLE_SERVER, http__response__status_code=404,
                   mcp_stream__stream__kind=sc.STREAM_KIND_POST)
    assert (post.attributes or {}).get(sc.SESSION_OWNER) == sc.SESSION_OWNER_OTHER


async def test_a_session_gone_is_the_expiry_it_is_whoever_asks_after_it_went():
    """The SDK answers 404 alike to another principal naming a live session and to anyone naming a session it dropped
    (an idle timeout, a restart): the server's hooks ask the SDK which it is, so a session that expired as its
    client's token changed user pages as the expiry on either side's spans, not as a live session's refusal."""
    with detector() as (found, clock):
        async with incident("legacy") as lab:
            mallory = lab.issuer.mint([BASE_RESOURCE, SEARCH_RESOURCE, FETCH_RESOURCE], subject="mallory")
            expiring: list[asyncio.Future[None]] = []

            def expired_as_the_user_changed() -> None:
                lab.auth.token = mallory
                expiring.append(asyncio.ensure_future(lab.expire_sessions()))

            lab.proxy.arm(b"fetch step 1", on_cut=expired_as_the_user_changed)
            with pytest.raises(MCPError):
                await lab.call("fetch", {"url": "u", "steps": 4}, timeout=4)
            await asyncio.gather(*expiring)
        assert "session_expired_in_flight" in [f.rule for f in after_grace(found, clock)]
    refused = ours(spans(), "stream", sc.ROLE_SERVER, http__response__status_code=404)
    assert refused and all(sc.SESSION_OWNER not in (s.attributes or {}) for s in refused)


async def test_a_narrowed_resume_a_naive_server_answered_with_the_result_is_told_by_the_clients_spans_too(
        monkeypatch):
    """No loss: the server handed fetch's result to a token without fetch's resource (a store with no audience
    check). Either side's spans tell it, the client's alone too: its resume span says what the calls it continued
    require and what its token lacks, whether or not it delivered them."""
    monkeypatch.setattr(sys.modules["mcp_stream_exporter.lab.incident"], "_may_see", lambda requirement, audience: True)
    async with incident("legacy") as lab:
        lab.proxy.arm(b"fetch step 4", on_cut=lab.refresh_narrows)  # the resume has only the result to send
        fetched = await lab.call("fetch", {"url": "u", "steps": 4})
    assert fetched.content[0].text == "contents of u"
    recorded = [span_of(s) for s in spans()]
    client_side = [s for s in recorded if s.attributes.get(sc.ROLE) != sc.ROLE_SERVER and s.kind != "server"]
    for subset in (client_side, recorded):
        clock = Clock()
        alone = Detector(clock=clock)
        alone.consume(subset)
        clock.advance(60)
        alone.tick()
        (narrowed,) = alone.findings
        assert (narrowed.rule, narrowed.tool) == ("narrowed_resume", "fetch")
        assert narrowed.evidence["missing_resources"] == [FETCH_RESOURCE]


async def _break_fetch(lab: Incident) -> None:
    """fetch's stream cut after its first progress event: the SDK tells its caller, who may re-issue it."""
    lab.proxy.arm(b"fetch step 1")
    with pytest.raises(MCPError):
        await lab.call("fetch", {"url": "u", "steps": 4})


async def test_a_stateless_call_broken_mid_stream_is_flagged_unless_the_client_reissues_it():
    with detector() as (found, clock):
        async with incident(None) as lab:
            await _break_fetch(lab)
        (finding,) = after_grace(found, clock)
    assert (finding.rule, finding.tool, finding.era) == ("not_reissued", "fetch", sc.ERA_STATELESS)

    with detector() as (found, clock):
        async with incident(None) as lab:
            await _break_fetch(lab)
            await lab.call("fetch", {"url": "u", "steps": 4})  # re-issued, as the 2026-07-28 spec requires
        assert after_grace(found, clock) == []
    # the break's fingerprint is on its stream's span too: a lost call span still finds the re-issue
    (broken,) = ours(spans(), "stream", sc.ROLE_CLIENT, mcp_stream__end__reason=sc.END_DROPPED)
    calls = ours(spans(), "call", sc.ROLE_CLIENT)
    assert {(c.attributes or {}).get(sc.CALL_ARGUMENTS_HASH) for c in calls} == {
        (broken.attributes or {}).get(sc.CALL_ARGUMENTS_HASH)} != {None}


async def test_a_stateless_call_reissued_through_another_client_of_the_process_is_reissued():
    with detector() as (found, clock):
        async with incident(None) as lab:
            await _break_fetch(lab)
            http = instrument_client(auth=BearerAuth(lab.broad), policy=incident_policy())  # the caller reconnects
            async with http, Client(streamable_http_client(f"http://127.0.0.1:{lab.proxy.port}/mcp",
                                                           http_client=http)) as again:
                assert (await again.call_tool("fetch", {"url": "u", "steps": 4})).content[0].text == "contents of u"
        assert after_grace(found, clock) == []


async def test_two_clients_in_one_trace_have_their_stateless_calls_judged_each_on_its_own():
    """An agent's turn (one trace) with two connections, whose requests are numbered alike: both streams break,
    the first client re-issues its fetch, the second's caller gives up on its search: that one is lost."""
    with detector() as (found, clock):
        async with incident(None) as lab:
            http = instrument_client(auth=lab.auth, policy=incident_policy())
            url = f"http://127.0.0.1:{lab.proxy.port}/mcp"
            async with http, Client(streamable_http_client(url, http_client=http)) as sdk:
                other = Incident(sdk, lab.proxy, lab.auth, lab.issuer, lab.broad, lab.narrow)
                with trace.get_tracer("agent").start_as_current_span("agent turn"):
                    lab.proxy.arm(b"fetch step 2")  # the reset breaks every live connection
                    broken = await asyncio.gather(lab.call("fetch", {"url": "a", "steps": 4}, timeout=5),
                                                  other.call("search", {"query": "q", "steps": 6}, timeout=5),
                                                  return_exceptions=True)
                    assert all(isinstance(outcome, MCPError) for outcome in broken)
                    await lab.call("fetch", {"url": "a", "steps": 4})  # re-issued; the search is not
        (finding,) = after_grace(found, clock)
    assert (finding.rule, finding.tool) == ("not_reissued", "search")
    recorded = [span_of(s) for s in spans()]
    for reordered in (recorded[::-1], recorded[1::2] + recorded[::2]):  # whatever order the spans arrive in
        again = Detector(clock=(later := Clock()))
        for span in reordered:
            again.consume([span])
        later.advance(60)
        again.tick()
        assert [(f.rule, f.tool) for f in again.findings] == [("not_reissued", "search")]
    calls = [c for c in ours(spans(), sc.SPAN_CALL, sc.ROLE_CLIENT)
             if c.attributes[sc.CALL_OUTCOME] != sc.OUTCOME_REISSUED]  # the re-issue's start, besides its span
    assert len({c.context.trace_id for c in calls}) == 1  # one trace, and ids alike
    assert len({c.attributes[sc.JSONRPC_REQUEST_ID] for c in calls}) < len(calls)
    assert len({c.attributes[sc.CALL_REQUEST_SPAN_ID] for c in calls}) == len(calls)  # what tells them apart


@pytest.mark.parametrize(("step_delay", "steps"), [(0.05, 40), (1.5, 1)], ids=["answer-begun", "nothing-sent-yet"])
async def test_a_stateless_call_the_client_times_out_on_is_cancelled_not_a_call_owed_a_reissue(step_delay, steps):
    with detector() as (found, clock):
        # 2026-07-28: closing the response stream is the client's cancel, before its headers came or after
        async with incident(None, step_delay=step_delay) as lab:
            with pytest.raises(MCPError):
                await lab.call("fetch", {"url": "u", "steps": steps}, timeout=0.5)
        assert after_grace(found, clock) == []
    (client,) = ours(spans(), sc.SPAN_CALL, sc.ROLE_CLIENT)
    assert client.attributes[sc.CALL_OUTCOME] == sc.OUTCOME_CANCELLED


@pytest.mark.parametrize("mode", ["legacy", None])
async def test_calls_answered_by_a_json_body_with_an_event_store_are_healthy(mode):
    """The SDK stores a JSON answer before its response starts: no stream is open when it is stored, yet the
    POST carries it."""
    with detector() as (found, clock):
        async with incident(mode, json_response=True) as lab:
            for tool, arguments in (("search", {"query": "q", "steps": 2}), ("fetch", {"url": "u", "steps": 2})):
                assert (await lab.call(tool, arguments)).content[0].text
        assert after_grace(found, clock) == []
    assert ours(spans(), sc.SPAN_CALL) == []  # the healthy path: no span of ours


async def test_another_call_of_the_same_tool_right_after_the_break_is_not_the_reissue():
    with detector() as (found, clock):
        async with incident(None) as lab:
            await _break_fetch(lab)
            await lab.call("fetch", {"url": "another", "steps": 0})  # same tool, other arguments: another call
        (finding,) = after_grace(found, clock)
    assert (finding.rule, finding.tool) == ("not_reissued", "fetch")
    calls = ours(spans(), sc.SPAN_CALL, sc.ROLE_CLIENT)
    (broken,) = calls  # the other call was healthy: no span of ours
    assert broken.attributes[sc.CALL_ARGUMENTS_HASH]  # a salted hash: the arguments themselves are nowhere
    assert not any(v in ("u", "another") for s in spans() for v in (s.attributes or {}).values())


async def test_a_result_stored_after_the_post_dropped_and_never_resumed_before_the_timeout_is_a_loss():
    with detector() as (found, clock):
        async with incident("legacy", retry_interval=30_000) as lab:  # the SDK's resume would come after the timeout
            lab.proxy.arm(b"fetch step 1")
            with pytest.raises(MCPError):
                await lab.call("fetch", {"url": "u", "steps": 2}, timeout=1.5)
        findings = _by_rule(after_grace(found, clock))
    (lost,) = findings["stored_not_delivered"]
    assert (lost.tool, lost.severity, lost.evidence["timed_out"]) == ("fetch", "critical", True)
    assert lost.evidence["stored_event_id"]
    assert set(findings) == {"stored_not_delivered", "timeout_attributed"}
    assert found.registry.get_sample_value("mcp_stream_silent_losses_total",
                                           {"tool": "fetch", "rule": "stored_not_delivered"}) == 1.0


async def test_a_result_stored_after_the_post_dropped_and_delivered_by_the_resume_is_no_finding():
    with detector() as (found, clock):
        async with incident("legacy") as lab:
            lab.proxy.arm(b"fetch step 1")
            result = await lab.call("fetch", {"url": "u", "steps": 2})
        assert result.content[0].text == "contents of u"
        assert after_grace(found, clock) == []


async def test_resumes_the_sdk_goes_on_making_after_the_caller_timed_out_stay_on_the_calls_one_resume_loop():
    with detector() as (found, clock):
        async with incident("legacy") as lab:
            await play_incident(lab)

            def orphans() -> list[object]:  # resumes after the cancel: the hooks no longer tie them to the call
                return [s for s in ours(spans(), sc.SPAN_STREAM, sc.ROLE_CLIENT, mcp_stream__stream__kind="resume")
                        if sc.STREAM_REQUEST_IDS not in (s.attributes or {})]

            for _ in range(100):  # bounded: the SDK resumes every 200 ms
                if len(orphans()) >= 5:
                    break
                await asyncio.sleep(0.1)
            assert len(orphans()) >= 5
        findings = _by_rule(after_grace(found, clock))
    (loop,) = findings["resume_loop"]
    assert loop.request_id is not None and loop.tool == "fetch"


async def test_an_opaque_token_on_a_resume_that_delivered_the_result_is_no_narrowed_resume():
    with detector() as (found, clock):
        async with incident("legacy") as lab:
            lab.auth.token = lab.issuer.opaque([SEARCH_RESOURCE, FETCH_RESOURCE])
            TOKENS_USED.append(lab.auth.token)
            lab.proxy.arm(b"fetch step 1")
            result = await lab.call("fetch", {"url": "u", "steps": 2})
        assert result.content[0].text == "contents of u"
        assert after_grace(found, clock) == []
    (resume, *_) = ours(spans(), sc.SPAN_STREAM, sc.ROLE_CLIENT, mcp_stream__stream__kind="resume")
    assert resume.attributes[sc.AUTH_VERIFICATION] == sc.VERIFICATION_OPAQUE
    assert sc.AUTH_AUDIENCE not in resume.attributes  # unknown, not empty
    assert sc.AUTH_MISSING_RESOURCES not in resume.attributes


@pytest.mark.parametrize("tool", ["fetch", "poll"])  # its POST still open; closed, the client polling on a resume
async def test_a_client_that_deletes_its_session_while_a_call_runs_pages_nothing_and_leaves_nothing_in_flight(tool):
    """The SDK closes a session's streams as it accepts its DELETE, before it answers it: the streams of a call
    the client leaves behind as it exits end ``terminated`` on the server, not clean with the call pending."""
    arguments = {"url": "u", "steps": 10_000} if tool == "fetch" else {"steps": 10_000}
    with detector() as (found, clock):
        async with incident("legacy") as lab:
            running = asyncio.create_task(lab.call(tool, arguments, timeout=60))
            for _ in range(200):  # bounded: 10 s
                if len(lab.progress) >= 3:
                    break
                await asyncio.sleep(0.05)
            assert len(lab.progress) >= 3, "the call must be running when its client leaves"
        running.cancel()
        (left,) = await asyncio.gather(running, return_exceptions=True)
        assert isinstance(left, BaseException)  # cancelled, or failed by its client's exit
        assert after_grace(found, clock) == []
    assert found.ledger.in_flight == 0
    ended = ours(spans(), sc.SPAN_STREAM, sc.ROLE_SERVER, mcp_stream__end__reason=sc.END_TERMINATED)
    carried = [sp for sp in ended if sp.attributes.get(sc.STREAM_REQUEST_IDS)]  # not the standalone GET
    assert all(sp.attributes.get(sc.PENDING_REQUEST_IDS) for sp in carried)
    # fetch's POST is open as its client leaves; poll's resume may be between two polls then (a loaded machine)
    assert carried or tool == "poll"


async def _lose_a_result_on_a_half_open_connection(guarded: bool = False, narrowed: bool = False) -> None:
    """fetch's connection is lost on the client's side after its first progress event while the server's stays
    open (a load balancer or NAT): the server writes the result into it and sees nothing wrong. The SDK client would
    resume after the SSE retry (30 s), past its caller's timeout, whose cancel then reaches the server: 2.5 s after the
    call started, some 2 s after the result went out, past the 1 s in which a cancel may cross it on the wire."""
    span_exporter().clear()
    async with incident("legacy", retry_interval=30_000, guarded=guarded) as lab:
        lab.proxy.arm(b"fetch step 1", on_cut=lab.refresh_narrows if narrowed else None, half_open=True)
        with pytest.raises(MCPError):
            await lab.call("fetch", {"url": "u", "steps": 2}, timeout=2.5)
        for _ in range(100):  # bounded: 5 s for the cancel to reach the server
            if ours(spans(), sc.SPAN_CALL, sc.ROLE_SERVER, mcp_stream__call__outcome=sc.OUTCOME_CANCELLED_LATE):
                break
            await asyncio.sleep(0.05)


@pytest.mark.parametrize(("guarded", "narrowed"), [(False, False), (True, False), (True, True)],
                         ids=["naive", "guarded", "guarded-token-narrowed"])
async def test_a_result_sent_into_a_connection_the_client_lost_is_one_loss_and_the_timeout_is_attributed_to_it(
        guarded, narrowed):
    """Guarded too: the guard lets the late cancel of a call no longer in flight reach the SDK (it refused it once,
    and then nothing told of the loss), with the client's token narrowed at the cut too: the cancel goes with it."""
    with detector() as (found, clock):
        await _lose_a_result_on_a_half_open_connection(guarded, narrowed)
        findings = _by_rule(after_grace(found, clock))
    assert set(findings) == {"sent_not_received", "timeout_attributed"}
    (lost,) = findings["sent_not_received"]
    assert (lost.tool, lost.severity, sorted(lost.roles)) == ("fetch", "critical", [sc.ROLE_CLIENT, sc.ROLE_SERVER])
    assert lost.evidence["sent_event_id"]
    assert findings["timeout_attributed"][0].caused_by == lost.id
    assert found.registry.get_sample_value("mcp_stream_silent_losses_total",
                                           {"tool": "fetch", "rule": "sent_not_received"}) == 1.0


async def test_a_result_sent_into_a_lost_connection_is_found_with_the_servers_spans_alone_not_the_clients():
    """Only the server knows the result went out: the client's spans alone show a stream that dropped and a caller
    that gave up before resuming, which a slow tool shows too."""
    await _lose_a_result_on_a_half_open_connection()
    recorded = [span_of(s) for s in spans()]
    client_side = [s for s in recorded if s.attributes.get(sc.ROLE) != sc.ROLE_SERVER and s.kind != "server"]
    server_side = [s for s in recorded if s.attributes.get(sc.ROLE) != sc.ROLE_CLIENT and s.kind != "client"]
    clock = Clock()
    for subset, expected in ((server_side, ["sent_not_received"]), (client_side, [])):
        alone = Detector(clock=clock)
        alone.consume(subset)
        clock.advance(60)
        alone.tick()
        assert sorted(f.rule for f in alone.findings) == expected


async def test_a_late_cancel_of_a_delivered_call_by_another_principal_is_refused_and_pages_nothing():
    """The guard lets a late cancel reach the SDK (the sign of a half-open connection's loss), but only for a token
    of the call's principal: another's, cancelling ids it guesses, would otherwise page sent_not_received for a call
    its caller got. Another principal's POST into the session is answered as the SDK answers a credential not the
    session's (404), before the SDK sees it."""
    with detector() as (found, clock):
        async with incident("legacy", guarded=True) as lab:
            assert lab.server is not None
            assert (await lab.call("fetch", {"url": "u", "steps": 1})).content  # delivered to its caller
            (session_id,) = lab.server.session_manager._server_instances  # lab only: no public API
            mallory = lab.issuer.mint([BASE_RESOURCE, SEARCH_RESOURCE, FETCH_RESOURCE], subject="mallory")
            await asyncio.sleep(1.2)  # past cancel_race_s after the result went out
            statuses = []
            async with httpx2.AsyncClient() as raw:
                for request_id in range(4):
                    cancelled = await raw.post(f"http://127.0.0.1:{lab.proxy.port}/mcp",
                                               json={"jsonrpc": "2.0", "method": "notifications/cancelled",
                                                     "params": {"requestId": request_id}},
                                               headers={"mcp-session-id": session_id,
                                                        "authorization": f"Bearer {mallory}",
                                                        "accept": "application/json, text/event-stream",
                                                        "mcp-protocol-version": "2025-11-25"})
                    statuses.append(cancelled.status_code)
        assert statuses == [404] * 4  # fetch's id among them
        assert after_grace(found, clock) == []


async def test_a_late_cancel_the_sdk_answers_404_as_the_session_is_gone_tells_the_loss_if_its_opener_sent_it():
    """The result went into a connection whose packets were dropped (the client's read just stalls: no resume), then
    the session ended on the server (idle timeout, admin) before the caller's timeout: its cancel gets 404 and cancels
    nothing, but tells the client never got the result, which nothing else does. Another principal's cancel of a
    delivered call in that gone session, 404 too, tells nothing."""
    with detector() as (found, clock):
        async with incident("legacy", retry_interval=30_000) as lab:
            assert lab.server is not None
            assert (await lab.call("search", {"query": "q"})).content  # delivered: request 1
            (session_id,) = lab.server.session_manager._server_instances  # lab only: no public API
            lab.proxy.arm(b"fetch step 1", stall=True)
            fetching = asyncio.ensure_future(lab.call("fetch", {"url": "u", "steps": 2}, timeout=2.5))
            await asyncio.sleep(0.6)  # fetch's result went out into the half-open connection
            await lab.expire_sessions()
            with pytest.raises(MCPError):
                await fetching
            mallory = lab.issuer.mint([BASE_RESOURCE, SEARCH_RESOURCE, FETCH_RESOURCE], subject="mallory")
            async with httpx2.AsyncClient() as raw:
                cancelled = await raw.post(f"http://127.0.0.1:{lab.proxy.port}/mcp",
                                           json={"jsonrpc": "2.0", "method": "notifications/cancelled",
                                                 "params": {"requestId": 1}},
                                           headers={"mcp-session-id": session_id, "authorization": f"Bearer {mallory}",
                                                    "accept": "application/json, text/event-stream",
                                                    "mcp-protocol-version": "2025-11-25"})
            assert cancelled.status_code == 404
            for _ in range(100):  # bounded: 5 s for the client's cancel to reach the server
                if ours(spans(), sc.SPAN_CALL, sc.ROLE_SERVER, mcp_stream__call__outcome=sc.OUTCOME_CANCELLED_LATE):
                    break
                await asyncio.sleep(0.05)
        findings = _by_rule(after_grace(found, clock))
    (lost,) = findings["sent_not_received"]
    assert (lost.tool, set(findings)) == ("fetch", {"sent_not_received", "timeout_attributed"})


@pytest.mark.parametrize("half_open", [False, True], ids=["reset", "half_open"])
async def test_a_result_the_sdk_resumes_for_after_its_caller_gave_up_reaches_no_caller_and_is_a_loss(half_open):
    """The SSE retry (3 s) is longer than the caller's timeout (1.5 s): the SDK client resumes on after its caller
    gave up and gets the stored result from the replay, then drops it. That delivery reached no caller."""
    span_exporter().clear()
    with detector() as (found, clock):
        async with incident("legacy", retry_interval=3_000) as lab:
            lab.proxy.arm(b"fetch step 1", half_open=half_open)
            with pytest.raises(MCPError):
                await lab.call("fetch", {"url": "u", "steps": 2}, timeout=1.5)

            def resumed_on() -> list[object]:  # the SDK's resume after the timeout, tied to no call by the hooks
                return [s for s in ours(spans(), sc.SPAN_STREAM, sc.ROLE_CLIENT, mcp_stream__stream__kind="resume")
                        if s.attributes.get(sc.TERMINAL_REQUEST_IDS)]

            for _ in range(100):  # bounded: 10 s
                if resumed_on():
                    break
                await asyncio.sleep(0.1)
            assert resumed_on(), "the SDK resumes after the retry interval and gets the result"
        findings = _by_rule(after_grace(found, clock))
    (lost,) = findings["sent_not_received" if half_open else "stored_not_delivered"]
    assert (lost.tool, lost.severity) == ("fetch", "critical")
    assert set(findings) == {lost.rule, "timeout_attributed"}


async def test_a_caller_with_resumption_hints_that_times_out_before_its_result_ends_its_call_and_pages_nothing():
    """With resumption hints (``on_resumption_token_update``) the SDK sends no cancel at its caller's timeout and
    resumes on for no caller. The client's hooks end the call as the SDK's span ends in the timeout; the result the
    server produces later reaches no caller, but came after its caller gave up: a slow tool, no loss."""
    from mcp.shared.message import ClientMessageMetadata
    from mcp_types import CallToolRequest, CallToolRequestParams, CallToolResult

    async def keep(token: str) -> None:
        pass

    async def progressed(progress: float, total: float | None, message: str | None) -> None:
        pass  # asked for: the server then sends progress events, the first of which the proxy cuts after

    span_exporter().clear()
    with detector() as (found, clock):
        async with incident("legacy", retry_interval=3_000) as lab:
            lab.proxy.arm(b"fetch step 1")
            with pytest.raises(MCPError):
                await lab.client.session.send_request(
                    CallToolRequest(params=CallToolRequestParams(name="fetch", arguments={"url": "u", "steps": 6})),
                    CallToolResult, request_read_timeout_seconds=0.15, progress_callback=progressed,
                    metadata=ClientMessageMetadata(on_resumption_token_update=keep))
            for _ in range(100):  # bounded: 10 s for the SDK's resume after the retry interval
                if ours(spans(), sc.SPAN_STREAM, sc.ROLE_SERVER, mcp_stream__stream__kind="resume"):
                    break
                await asyncio.sleep(0.1)
        assert after_grace(found, clock) == []
    (gave_up,) = ours(spans(), sc.SPAN_CALL, sc.ROLE_CLIENT)
    assert gave_up.attributes[sc.CALL_OUTCOME] == sc.OUTCOME_CANCELLED
    assert ours(spans(), sc.SPAN_CALL, sc.ROLE_SERVER, mcp_stream__call__outcome=sc.OUTCOME_RESULT)  # stored later


async def test_a_user_cancel_between_a_polling_servers_stream_end_and_the_resume_pages_nothing():
    """``poll`` closes its POST after its first step (SEP-1699); the user cancels before the SDK resumes. The server
    answers the cancel (no result yet), and the SDK, resuming for no caller, gets that answer: the call's end."""
    span_exporter().clear()
    with detector() as (found, clock):
        async with incident("legacy") as lab:
            running = asyncio.create_task(lab.call("poll", {"steps": 40}))
            for _ in range(200):  # bounded: 10 s, until the POST ended and before the resume (200 ms later)
                if ours(spans(), sc.SPAN_STREAM, sc.ROLE_CLIENT, mcp_stream__stream__kind="post"):
                    break
                await asyncio.sleep(0.01)
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)
            for _ in range(100):  # bounded: 5 s for the SDK's resume after the cancel
                if ours(spans(), sc.SPAN_STREAM, sc.ROLE_CLIENT, mcp_stream__stream__kind="resume"):
                    break
                await asyncio.sleep(0.05)
        assert after_grace(found, clock) == []


@pytest.mark.parametrize("window", ["replay", "priming"])
@pytest.mark.parametrize("hints", [False, True], ids=["cancel", "resumption_hints"])
async def test_a_result_stored_while_a_resume_replays_which_the_sdk_drops_is_a_loss(hints, window):
    """``poll`` closes its POST after its first step; the SDK resumes. The store's replay returns a second after it
    read what it replays (a remote store), or the priming event the SDK stores for the resumed stream after it is
    stored a second later, and the tool stores its result meanwhile: the SDK, which takes the resume for the call's
    stream only once the replay returned and that priming event went out, drops it. The resume stays open without
    it past its caller's timeout (with resumption hints no cancel goes out, and it stays open while the client
    lives): the server stored a result that no stream carried, and says so as it stores it. (The priming window
    was missed: the hooks took the resume for the stream as its replay returned.)"""
    from mcp.shared.message import ClientMessageMetadata
    from mcp_types import CallToolRequest, CallToolRequestParams, CallToolResult

    async def keep(token: str) -> None:
        pass

    async def progressed(progress: float, total: float | None, message: str | None) -> None:
        pass  # asked for: the server then stores progress events, which the resume replays

    span_exporter().clear()
    with detector() as (found, clock):
        async with incident("legacy", step_delay=0.1, **{f"{window}_latency_s": 1.0}) as lab:
            with pytest.raises(MCPError):
                await lab.client.session.send_request(
                    CallToolRequest(params=CallToolRequestParams(name="poll", arguments={"steps": 5})),
                    CallToolResult, request_read_timeout_seconds=3, progress_callback=progressed,
                    metadata=ClientMessageMetadata(on_resumption_token_update=keep) if hints else None)
            findings = _by_rule(after_grace(found, clock))  # the client still lives, its resume still open
    (stored,) = ours(spans(), sc.SPAN_CALL, sc.ROLE_SERVER, mcp_stream__call__outcome=sc.OUTCOME_RESULT)
    assert sc.TERMINAL_STREAM_KIND not in stored.attributes  # no stream carried it
    (lost,) = findings["stored_not_delivered"]
    assert (lost.tool, lost.severity) == ("poll", "critical")
    assert lost.evidence["stored_event_id"] == stored.attributes[sc.TERMINAL_EVENT_ID]
    assert set(findings) == {"stored_not_delivered", "timeout_attributed"}
    assert findings["timeout_attributed"][0].caused_by == lost.id


async def test_a_half_open_post_of_a_tool_silent_past_the_grace_is_no_loss_while_the_server_runs_it():
    """fetch's POST is lost on the client's side after its first progress event while the server's side stays open
    (a load balancer or NAT). The SDK server, which still has the POST's stream, answers each resume with what is
    stored and ends it; the client resumes every ``retry``. The tool then works silently for longer than the grace:
    the server's resume spans say it had not answered (``running.request_ids``), so the clean ends page nothing,
    and its result, written into the dead POST and stored, reaches the caller on the next resume."""
    span_exporter().clear()
    with detector() as (found, clock):
        async with incident("legacy", step_delay=1.5) as lab:
            lab.proxy.arm(b"fetch step 1", half_open=True)
            call = asyncio.create_task(lab.call("fetch", {"url": "u", "steps": 2}, timeout=15))

            def resumed() -> list[object]:
                return [s for s in ours(spans(), sc.SPAN_STREAM, sc.ROLE_SERVER, mcp_stream__stream__kind="resume")
                        if s.attributes.get(sc.RUNNING_REQUEST_IDS)]

            for _ in range(100):  # bounded: 5 s for resumes that ended while the tool worked on
                if len(resumed()) >= 2:
                    break
                await asyncio.sleep(0.05)
            assert len(resumed()) >= 2
            clock.advance(6)  # the grace runs out while the tool is silent still
            found.tick()
            paged_while_running = [f.rule for f in found.findings if f.rule != "resume_loop"]
            result = await call
        findings = after_grace(found, clock)
    assert result.content[0].text == "contents of u"
    assert paged_while_running == []
    assert [f.rule for f in findings if f.rule != "resume_loop"] == []


async def _kill_the_clients_transport(calls: list[asyncio.Future[object]]) -> None:
    """search runs, and has a cursor; fetch's POST is reset before it reaches the server."""
    async with incident("legacy") as lab:
        calls.append(asyncio.ensure_future(lab.call("search", {"query": "q", "steps": 20})))
        for _ in range(100):  # bounded: 5 s for search's first progress event, a cursor with it
            if lab.progress:
                break
            await asyncio.sleep(0.05)
        assert lab.progress
        lab.proxy.arm_request(b'"name":"fetch"')
        calls.append(asyncio.ensure_future(lab.call("fetch", {"url": "u", "steps": 1})))
        await asyncio.wait(calls, timeout=10)  # bounded; leaves the callers' own tasks be as it is cancelled
    assert lab.proxy.cuts == 1


async def test_calls_the_sdk_fails_as_its_transport_dies_are_not_left_in_flight_for_good():
    """A POST reset before its response began takes the SDK client's transport down: the SDK fails every call of the
    client with ``Connection closed``, search's too, whose stream had given it a cursor to resume from. Only the end of
    the SDK's span tells (the SDK leaves that error off it): search stayed in flight for good, and counted stuck."""
    with detector() as (found, clock):
        calls: list[asyncio.Future[object]] = []
        with pytest.raises(BaseExceptionGroup):  # the SDK client's task group, which cancels what runs in it
            await _kill_the_clients_transport(calls)
        outcomes = await asyncio.gather(*calls, return_exceptions=True)
        assert [str(outcome) for outcome in outcomes] == ["Connection closed"] * 2
        after_grace(found, clock)
        assert found.ledger.in_flight == 0


async def test_a_stateless_call_answered_with_a_json_rpc_error_at_an_http_error_status_is_answered_not_broken():
    """The 2026-07-28 SDK server answers some JSON-RPC errors at 400 or 404 (a tool's INVALID_PARAMS; a tool asking
    for sampling, which the era has no back-channel for), and the SDK hands the error to its caller: the client's
    spans alone must read it as the call's answer (``error``), not a broken stream owed a re-issue."""
    from mcp.server.mcpserver import MCPServer
    from mcp_types import INVALID_PARAMS
    from opentelemetry.sdk.trace import TracerProvider

    from mcp_stream_exporter.detector import DetectorConfig, RuleConfig
    from mcp_stream_exporter.detector.embedded import DetectorSpanProcessor
    from mcp_stream_exporter.lab import serve

    server = MCPServer("strict")

    @server.tool()
    async def strict(x: str) -> str:
        raise MCPError(INVALID_PARAMS, f"x must be a date, got {x!r}")

    clock = Clock()
    found = Detector(DetectorConfig(rules=RuleConfig(clean_end_grace_s=5, reissue_grace_s=5)), clock=clock)
    client_side = TracerProvider()  # the client's spans only: the server is not instrumented
    client_side.add_span_processor(DetectorSpanProcessor(found))
    async with serve(server.streamable_http_app()) as port:
        http = instrument_client(tracer_provider=client_side)
        async with http, Client(streamable_http_client(f"http://127.0.0.1:{port}/mcp", http_client=http)) as client:
            with pytest.raises(MCPError) as answered:
                await client.call_tool("strict", {"x": "tomorrow"})
    assert answered.value.error.code == INVALID_PARAMS
    clock.advance(60)
    found.tick()
    assert list(found.findings) == [] and found.ledger.in_flight == 0
