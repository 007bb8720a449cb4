"""The alerting rules: valid for promtool, unit-tested by promtool, linted as mixtool lints a mixin,
each with a runbook, and together covering the detector's rule catalogue."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from promtool import promtool

from mcp_stream_exporter.detector.rules import RULES

ROOT = Path(__file__).resolve().parents[2]
RULE_FILE = ROOT / "alerts" / "mcp-stream-exporter.yaml"
TEST_FILE = ROOT / "alerts" / "tests" / "mcp-stream-exporter_test.yaml"
RUNBOOK_URL = re.compile(r"^https://\S+/docs/runbooks/(?P<alert>[A-Za-z]+)\.md$")
# which alert pages on a finding of each detector rule; duplicate_terminal and timeout_attributed page
# nobody (on the dashboards and at /api/findings): a duplicate delivery is not a loss, and a timeout
# attributed to a finding follows an alert that already fired
PAGES = {
    "clean_end_pending": {"MCPToolResultSilentlyLost"},
    "foreign_result": {"MCPToolResultSilentlyLost"},
    "not_reissued": {"MCPToolResultSilentlyLost"},
    "stored_not_delivered": {"MCPToolResultSilentlyLost"},
    "store_failed": {"MCPToolResultSilentlyLost"},
    "sent_not_received": {"MCPToolResultSilentlyLost"},
    "narrowed_resume": {"MCPResumeAudienceNarrowerThanNeeded"},
    "replay_truncated": {"MCPReplayTruncatedWithoutError"},
    "cursor_past_undelivered": {"MCPReplayTruncatedWithoutError"},
    "cross_stream_replay": {"MCPReplayCrossedStreams"},
    "resume_loop": {"MCPResumeLoop"},
    "unknown_cursor": {"MCPResumeToUnknownCursor"},
    "session_expired_in_flight": {"MCPSessionExpiredWithCallsInFlight"},
    "duplicate_terminal": set(),
    "timeout_attributed": set(),
}

ALERTS = [r for g in yaml.safe_load(RULE_FILE.read_text())["groups"] for r in g["rules"] if "alert" in r]


def test_promtool_accepts_the_rules():
    check = promtool("check", "rules", str(RULE_FILE))
    assert check.returncode == 0, check.stdout + check.stderr


def test_promtool_unit_tests_pass():
    run = promtool("test", "rules", str(TEST_FILE))
    assert run.returncode == 0, run.stdout + run.stderr


def test_every_alert_is_tested_firing_and_quiet_and_every_held_alert_pending():
    cases = [c for t in yaml.safe_load(TEST_FILE.read_text())["tests"] for c in t.get("alert_rule_test", [])]
    for alert in ALERTS:
        mine = [c for c in cases if c["alertname"] == alert["alert"]]
        assert any(c["exp_alerts"] for c in mine), f"{alert['alert']} never tested firing"
        assert any(not c["exp_alerts"] for c in mine), f"{alert['alert']} never tested quiet or pending"


@pytest.mark.parametrize("alert", ALERTS, ids=[a["alert"] for a in ALERTS])
def test_alert_follows_the_mixin_lint_rules(alert):
    name, labels, annotations = alert["alert"], alert.get("labels", {}), alert.get("annotations", {})
    assert re.fullmatch(r"([A-Z]+[a-z0-9]+)+", name), "alert-name-camelcase"
    assert name.startswith("MCP"), "one component prefix for every alert"
    assert labels.get("severity") in {"critical", "warning", "info"}, "alert-severity-rule"
    assert "{{" in annotations.get("description", ""), "alert-description-templating"
    summary = annotations.get("summary", "")
    assert summary and "{{" not in summary, "alert-summary-missing-rule / alert-summary-templating"
    assert re.fullmatch(r"[A-Z].+\.", summary), "alert-summary-style"


@pytest.mark.parametrize("alert", ALERTS, ids=[a["alert"] for a in ALERTS])
def test_alert_links_a_runbook_that_says_what_it_means_how_to_confirm_and_how_to_fix(alert):
    match = RUNBOOK_URL.match(alert["annotations"].get("runbook_url", ""))
    assert match and match["alert"] == alert["alert"]
    runbook = ROOT / "docs" / "runbooks" / f"{alert['alert']}.md"
    text = runbook.read_text()
    assert text.startswith(f"# {alert['alert']}\n")
    for section in ("## What it means", "## Confirm", "## Fix"):
        assert section in text, f"{runbook.name} lacks {section}"
    assert f"Severity: {alert['labels']['severity']}" in text


def test_every_runbook_belongs_to_an_alert():
    assert {p.stem for p in (ROOT / "docs" / "runbooks").glob("*.md")} == {a["alert"] for a in ALERTS}


def test_each_detector_rule_pages_through_exactly_its_alert(tmp_path):
    """One promtool scenario per rule: its finding (and, for a loss, its silent-loss count) goes from 0 to
    1 on a scraped detector, and two minutes later exactly the alerts of PAGES fire, no other."""
    assert set(PAGES) == set(RULES), "a new rule needs its line in PAGES"
    labels = 'job="mcp-stream-exporter",instance="d-0:8000",tool="fetch"'
    tests = []
    for rule in RULES.values():
        series = [{"series": 'up{job="mcp-stream-exporter",instance="d-0:8000"}', "values": "1x20"},
                  {"series": f'mcp_stream_findings_total{{{labels},rule="{rule.id}"}}', "values": "0 0 0 1x17"}]
        if rule.loss:
            series.append({"series": f'mcp_stream_silent_losses_total{{{labels},rule="{rule.id}"}}',
                           "values": "0 0 0 1x17"})
        tests.append({
            "name": f"a {rule.id} finding", "interval": "1m", "input_series": series,
            "promql_expr_test": [{
                "expr": 'count by (alertname) (ALERTS{alertstate="firing"})', "eval_time": "5m",
                "exp_samples": [{"labels": f'{{alertname="{name}"}}', "value": 1} for name in sorted(PAGES[rule.id])],
            }],
        })
    groups = [g["name"] for g in yaml.safe_load(RULE_FILE.read_text())["groups"]]
    suite = tmp_path / "rule_mapping_test.yaml"
    suite.write_text(yaml.safe_dump({"rule_files": [str(RULE_FILE)], "evaluation_interval": "1m",
                                     "group_eval_order": groups, "tests": tests}))
    run = promtool("test", "rules", str(suite))
    assert run.returncode == 0, run.stdout + run.stderr


def _readme_route() -> dict[str, object]:
    """The Alertmanager routing tree the README's Alerts reference gives (its one ``route:`` block)."""
    readme = (ROOT / "README.md").read_text()
    (block,) = re.findall(r"```yaml\n(route:\n.*?)```", readme, re.S)
    return dict(yaml.safe_load(block)["route"])


def test_the_readmes_alertmanager_route_pages_every_critical_alert_and_tickets_every_warning(tmp_path):
    """Copied as it is, the README's route paged on-call for two warnings and left a critical alert
    (MCPReplayCrossedStreams) to the default receiver."""
    route = {"receiver": "default", **_readme_route()}  # Alertmanager's root must name one: "default" if it does not
    receivers = sorted({route["receiver"], *(r["receiver"] for r in route["routes"])})  # type: ignore[index, union-attr]
    config = tmp_path / "alertmanager.yml"
    config.write_text(yaml.safe_dump({"route": route, "receivers": [{"name": name} for name in receivers]}))
    amtool = shutil.which("amtool")
    assert amtool, "amtool is installed by `make test` (Debian package prometheus-alertmanager)"
    for alert in ALERTS:
        severity = alert["labels"]["severity"]
        routed = subprocess.run([amtool, "config", "routes", "test", f"--config.file={config}",
                                 f"alertname={alert['alert']}", f"severity={severity}", "tool=fetch"],
                                capture_output=True, text=True, check=True).stdout.split()
        assert routed == (["on-call"] if severity == "critical" else ["tickets"]), alert["alert"]
