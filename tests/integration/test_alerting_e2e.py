"""End to end: the incident through the real SDK, the embedded detector scraped by real Prometheus
loading alerts/, real Alertmanager paging a webhook; the dashboards' queries answered by that Prometheus.
The guarded run goes first and must leave Prometheus with no alert at all, pending or firing."""

from __future__ import annotations

import asyncio
import time

import pytest
from mcp.shared.exceptions import MCPError

from mcp_stream_exporter.detector.embedded import DetectorSpanProcessor, EmbeddedDetector

from harness import after_grace, detector, incident, play_incident, wait_for
from panel_queries import dashboards, queries, substitute
from prometheus_stack import JOB, prometheus_stack

pytestmark = [pytest.mark.e2e, pytest.mark.anyio, pytest.mark.timeout(300)]

GRACE_S = 5.0
# the incident's findings (test_detector_incident) and the alerts they page with; `for: 1m` each
INCIDENT_ALERTS = {"MCPToolResultSilentlyLost", "MCPResumeAudienceNarrowerThanNeeded",
                   "MCPReplayTruncatedWithoutError", "MCPResumeLoop"}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with prometheus_stack(tmp_path_factory.mktemp("prometheus")) as running:
        yield running


def _rules_evaluated_since(stack, since: float) -> bool:
    return stack.last_rule_evaluation() >= since + 2


async def _scraped(stack, run: str, found) -> tuple[str, EmbeddedDetector]:
    """The detector served in this process (embedded mode) and scraped; returns its instance label."""
    served = EmbeddedDetector(found, DetectorSpanProcessor(found))
    instance = stack.scrape(run, served.serve())
    # the loss counters start at 0 in Prometheus, so the first loss is an increase
    await asyncio.to_thread(wait_for, lambda: stack.query(
        f'mcp_stream_silent_losses_total{{instance="{instance}", tool="fetch", rule="clean_end_pending"}} == 0'),
        30, "the pre-initialised loss series scraped at 0")
    return instance, served


async def test_the_guarded_incident_leaves_prometheus_without_any_alert(stack):
    with detector(GRACE_S, tools=("search", "fetch")) as (found, clock):
        instance, served = await _scraped(stack, "guarded", found)
        try:
            async with incident("legacy", guarded=True) as lab:
                _, fetch = await play_incident(lab, fetch_timeout=20)
                assert isinstance(fetch, MCPError)
                await lab.recover(fetch, "fetch", {"url": "u", "steps": 4})
            assert after_grace(found, clock, GRACE_S) == []
            await asyncio.to_thread(wait_for, lambda: stack.query(
                f'mcp_stream_resumes_total{{instance="{instance}", role="client", outcome="refused"}} == 1'),
                30, "the guarded run's refused resume in Prometheus")
            seen = time.time()
            await asyncio.to_thread(wait_for, lambda: _rules_evaluated_since(stack, seen), 30,
                                    "a rule evaluation after the run")
            assert [a for a in stack.alerts() if a["labels"].get("instance") == instance] == []
            assert [a for a in stack.webhook.alerts if a["labels"].get("instance") == instance] == []
        finally:
            served.close()
            stack.forget("guarded")


async def test_the_naive_incident_pages_through_alertmanager_and_fills_every_dashboard_panel(stack):
    with detector(GRACE_S, tools=("search", "fetch")) as (found, clock):
        instance, served = await _scraped(stack, "naive", found)
        try:
            async with incident("legacy") as lab:
                await play_incident(lab)
            findings = after_grace(found, clock, GRACE_S)
            assert {f.rule for f in findings} >= {"clean_end_pending", "narrowed_resume"}

            def paged():
                return [a for a in stack.webhook.alerts if a["labels"]["alertname"] == "MCPToolResultSilentlyLost"
                        and a["labels"].get("instance") == instance]

            (page,) = await asyncio.to_thread(wait_for, paged, 150, "MCPToolResultSilentlyLost at the webhook", 1.0)
            assert page["status"] == "firing"
            assert page["labels"] == {"alertname": "MCPToolResultSilentlyLost", "severity": "critical", "job": JOB,
                                      "instance": instance, "tool": "fetch", "rule": "clean_end_pending"}
            assert "Evidence: /api/findings?rule=clean_end_pending&tool=fetch" in page["annotations"]["description"]
            assert page["annotations"]["runbook_url"].endswith("/docs/runbooks/MCPToolResultSilentlyLost.md")
            firing = {a["labels"]["alertname"] for a in stack.alerts()
                      if a["state"] == "firing" and a["labels"].get("instance") == instance}
            assert firing == INCIDENT_ALERTS

            empty = []
            for name, board in dashboards().items():
                if name == "mcp-stream-guard.json":
                    continue  # MCP servers' replay guard on Redis: their metrics, not the detector's
                for title, expr in queries(board):
                    if not stack.query(substitute(expr, job=JOB, instance=instance, rate_interval="30s")):
                        empty.append(f"{name}: {title}: {expr}")
            assert empty == []

            # the variables' "All" (the linter's ``.+``) matches every target Prometheus scrapes: the detector's own
            # panels (up, the process's memory, CPU and file descriptors) count the detectors alone
            board = dashboards()["mcp-stream-detector.json"]
            for title, expr in queries(board):
                assert all(s["metric"].get("instance") != stack.other_instance
                           for s in stack.query(substitute(expr, rate_interval="30s"))), title
            (up,) = [expr for title, expr in queries(board) if title == "Detectors up"]
            assert [s["value"][1] for s in stack.query(substitute(up))] == [
                s["value"][1] for s in stack.query("count(mcp_stream_detector_build_info)")]

            # the latency panel's exemplars (Prometheus' exemplar storage on) lead to the lost call's trace
            (lost,) = [f for f in findings if f.rule == "clean_end_pending"]
            latency = [expr for _, expr in queries(dashboards()["mcp-stream-overview.json"])
                       if "mcp_client_operation_duration_seconds" in expr]
            assert latency
            for expr in latency:
                await asyncio.to_thread(wait_for, lambda expr=expr: lost.trace_ids[0] in {
                    e["labels"]["trace_id"] for e in stack.exemplars(substitute(expr, job=JOB, instance=instance))},
                    30, "the lost call's trace id among the latency panel's exemplars")
        finally:
            served.close()
            stack.forget("naive")
