"""Detection does not depend on the application's sampler: the incident and a re-issue story on the
real SDK, with the SDK's spans sampled at 10 % (parent-based) or not at all, give the findings an
unsampled run gives, and no `not_reissued` for a call that was re-issued."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from mcp.shared.exceptions import MCPError
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased, Sampler, TraceIdRatioBased

from mcp_stream_exporter import semconv as sc

from harness import after_grace, detector, incident, ours, play_incident, sampled_by, spans

pytestmark = pytest.mark.anyio

SAMPLERS = {"parent_based_10pct": ParentBased(TraceIdRatioBased(0.1)), "always_off": ALWAYS_OFF}
INCIDENT_RULES = {"narrowed_resume", "clean_end_pending", "replay_truncated", "resume_loop", "timeout_attributed"}


def _sdk_spans() -> list[str]:
    return [s.name for s in spans() if sc.MCP_METHOD_NAME in (s.attributes or {}) and sc.SPAN not in s.attributes]


@pytest.mark.parametrize("sampler", SAMPLERS.values(), ids=SAMPLERS.keys())
async def test_the_incident_is_found_whatever_the_applications_sampler(sampler: Sampler):
    with sampled_by(sampler), detector() as (found, clock):
        async with incident("legacy") as lab:
            await play_incident(lab)
        findings = after_grace(found, clock)
        sdk_spans = _sdk_spans()
    assert {f.rule for f in findings} == INCIDENT_RULES
    assert [f.request_id for f in findings if f.rule == "clean_end_pending"] == [findings[0].request_id]
    assert found.registry.get_sample_value("mcp_stream_silent_losses_total",
                                           {"tool": "fetch", "rule": "clean_end_pending"}) == 1.0
    if sampler is ALWAYS_OFF:
        assert sdk_spans == []  # the application's sampler did apply: the SDK's spans are gone, ours are not


@pytest.mark.parametrize("sampler", SAMPLERS.values(), ids=SAMPLERS.keys())
async def test_a_reissued_stateless_call_is_no_finding_and_one_not_reissued_is_whatever_the_sampler(sampler: Sampler):
    with sampled_by(sampler), detector() as (found, clock):
        async with incident(None) as lab:
            for _ in range(3):  # several stories: with a 10 % sampler some SDK spans are kept, most are not
                lab.proxy.arm(b"fetch step 1")
                with pytest.raises(MCPError):
                    await lab.call("fetch", {"url": "u", "steps": 4})
                await lab.call("fetch", {"url": "u", "steps": 4})  # the re-issue
        assert after_grace(found, clock) == []
        reissues = ours(spans(), sc.SPAN_CALL, sc.ROLE_CLIENT, mcp_stream__call__outcome=sc.OUTCOME_RESULT)
    assert len(reissues) == 3  # recorded by our own tracer, whatever the sampler did to the SDK's spans

    with sampled_by(sampler), detector() as (found, clock):
        async with incident(None) as lab:
            lab.proxy.arm(b"fetch step 1")
            with pytest.raises(MCPError):
                await lab.call("fetch", {"url": "u", "steps": 4})
        (finding,) = after_grace(found, clock)
    assert (finding.rule, finding.tool) == ("not_reissued", "fetch")


@pytest.mark.parametrize("sampler", SAMPLERS.values(), ids=SAMPLERS.keys())
async def test_a_call_the_sdk_fails_itself_is_over_at_once_whatever_the_sampler(sampler: Sampler):
    """Its stream cut and its resumes refused (a token the server rejects: 401), the SDK fails the call to its
    caller: its call span ends ``no_terminal`` then, and it is no longer in flight, sampled or not. The SDK's span
    of it is how the hooks learn that; sampled out, only the HTTP client's close would tell, which a long-running
    client never does: the call would page as stuck."""
    with sampled_by(sampler), detector() as (found, _):
        async with incident("legacy") as lab:
            lab.proxy.arm(b"fetch step 1", on_cut=lambda: setattr(lab.auth, "token", "not a token"))
            with pytest.raises(MCPError):
                await lab.call("fetch", {"url": "u", "steps": 4}, timeout=6)
            ended = [s.attributes[sc.CALL_OUTCOME] for s in ours(spans(), sc.SPAN_CALL, sc.ROLE_CLIENT)]
            in_flight = found.registry.get_sample_value("mcp_stream_calls_in_flight")
            sdk_spans = _sdk_spans()
            failed = found.registry.get_sample_value("mcp_stream_calls_total",
                                                     {"role": "client", "tool": "fetch", "outcome": "error"})
    assert ended == [sc.OUTCOME_NO_TERMINAL] and in_flight == 0
    if sampler is ALWAYS_OFF:  # recorded for the hooks, neither exported nor counted by the embedded detector
        assert sdk_spans == [] and failed is None


def test_a_client_instrumented_before_the_applications_tracer_provider_is_set_still_learns_of_calls_the_sdk_fails():
    """The hooks learn of a call the SDK fails itself from the SDK's own span, made on the global provider: looked up
    once, as the client was instrumented, a provider set afterwards (tracing configured in ``main``, the client built
    at import) was never seen, and such a call stayed in flight, to page as stuck 15 minutes later. A process of its
    own: a process has one global provider."""
    run = subprocess.run([sys.executable, str(Path(__file__).with_name("late_provider_app.py"))], capture_output=True,
                         text=True, timeout=120, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(run.stdout) == {"told": True, "outcomes": [sc.OUTCOME_NO_TERMINAL], "in_flight": 0}
