"""The README's metrics and alerts references name exactly what the detector exports and what
alerts/ defines."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from mcp_stream_exporter.detector import Detector
from mcp_stream_exporter.detector.connections import ConnectionLimits, server_config

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def test_the_readme_metrics_reference_matches_the_exported_metrics():
    documented = set(re.findall(r"^\| `([a-z_]+)` \| (?:counter|gauge|histogram) \|", README, re.M))
    exported = set()
    registry = Detector().registry
    server_config(None, "127.0.0.1", 0, ConnectionLimits(), registry)  # serve's HTTP server counts into it
    for family in registry.collect():
        exported.add(f"{family.name}_total" if family.type == "counter" else family.name)
    assert documented == exported


def test_the_readme_alerts_reference_matches_the_alerting_rules():
    documented = set(re.findall(r"^\| \[`(\w+)`\]\(docs/runbooks/\1\.md\) \| (\w+) \| (\w+) \| (.+) \|$", README, re.M))
    groups = yaml.safe_load((ROOT / "alerts" / "mcp-stream-exporter.yaml").read_text())["groups"]
    defined = {(r["alert"], r["labels"]["severity"], r["for"], r["annotations"]["summary"])
               for g in groups for r in g["rules"] if "alert" in r}
    assert documented == defined
