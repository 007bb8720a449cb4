"""Detection at scale on the real SDK: many sessions open at once, a known few losing a result. Every
loss is found exactly once and nothing else is (``bench/scale.py`` runs 10,000 calls over 500 sessions)."""

from __future__ import annotations

import pytest

from mcp_stream_exporter.detector.rules import RULES
from mcp_stream_exporter.lab.fleet import FleetPlan, run_fleet

from harness import TOKENS_USED, after_grace, detector

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(180)]

PLAN = FleetPlan(sessions=60, calls_per_session=10, lossy_sessions=6, concurrent=20, call_timeout_s=8.0)


async def test_a_fleet_of_concurrent_sessions_has_every_loss_found_once_and_no_false_positive():
    with detector() as (found, clock):
        outcome = await run_fleet(PLAN)
        TOKENS_USED.extend(outcome.tokens)
        findings = after_grace(found, clock)
    assert outcome.calls == PLAN.sessions * PLAN.calls_per_session
    assert outcome.peak_open == PLAN.concurrent
    assert len(outcome.lossy) == PLAN.lossy_sessions and outcome.lossy <= outcome.lost  # the losses were real
    assert outcome.results == outcome.calls - len(outcome.lost)  # every other call got its result
    losses = [f for f in findings if RULES[f.rule].loss]
    flagged = {f.session_id for f in losses}
    assert len(losses) == len(flagged)  # one finding per lost call
    assert outcome.lossy <= flagged <= outcome.lost  # every loss; a healthy call only if it too timed out
    assert {f.tool for f in losses} == {"poll"}
    assert {f.session_id for f in findings} <= outcome.lost  # nothing on a session whose calls all got results
    counted = sum(found.registry.get_sample_value("mcp_stream_silent_losses_total", {"tool": "poll", "rule": r})
                  or 0 for r, rule in RULES.items() if rule.loss)
    assert counted == len(flagged)
