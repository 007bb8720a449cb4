"""The alerting rules: valid for promtool, unit-tested by promtool, linted as mixtool lints a mixin,
each with a runbook, and together covering the detector's rule catalogue."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from promtool import promtool

from mcp_stream_exporter.detector.rules import RULES

ROOT = Path(__file__).resolve().parents[2]
RULE_FILE = ROOT / "alerts" / "mcp-stream-exporter.yaml"
TEST_FILE = ROOT / "alerts" / "tests" / "mcp-stream-exporter_test.yaml"
RUNBOOK_URL = re.compile(r"^https://\S+/docs/runbooks/(?P<alert>[A-Za-z]+)\.md$")
# findings that are shown on the dashboards and at /api/findings but page nobody: a duplicate delivery
# is not a loss, and a timeout attributed to a finding follows an alert that already fired
DASHBOARD_ONLY_RULES = {"duplicate_terminal", "timeout_attributed"}

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


def test_every_detector_rule_pages_through_some_alert_or_is_declared_dashboard_only():
    exprs = "\n".join(a["expr"] for a in ALERTS)
    losses = "mcp_stream_silent_losses" in exprs
    for rule in RULES.values():
        if rule.id in DASHBOARD_ONLY_RULES:
            assert rule.id not in exprs
            continue
        assert rule.id in exprs or (rule.loss and losses), f"rule {rule.id} reaches no alert"
