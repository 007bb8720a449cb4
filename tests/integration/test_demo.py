"""`mcp-stream-exporter demo`, the README's first command: both runs of the incident end as expected."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e


def test_demo_naive_run_loses_fetch_and_is_flagged_and_guarded_run_delivers_it_with_no_finding():
    run = subprocess.run([sys.executable, "-m", "mcp_stream_exporter.cli", "demo", "--json"],
                         capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    outcome = json.loads(run.stdout)
    naive, guarded = outcome["naive"], outcome["guarded"]
    assert outcome["ok"] is True
    assert naive["search_result"].startswith("search results")
    assert naive["fetch_result"] is None and "timed out" in naive["fetch_error"]
    fetch_rules = sorted(f["rule"] for f in naive["findings"] if f["tool"] == "fetch")
    assert fetch_rules.count("narrowed_resume") == 1 and fetch_rules.count("clean_end_pending") == 1
    (narrowed,) = [f for f in naive["findings"] if f["rule"] == "narrowed_resume"]
    assert narrowed["evidence"]["missing_resources"] == ["https://mcp.example.com/tools/fetch"]
    assert narrowed["evidence"]["audience_held"] == ["https://mcp.example.com/tools/search"]
    assert any(line.startswith('mcp_stream_silent_losses_total{rule="clean_end_pending",tool="fetch"} 1.0')
               for line in naive["metric_lines"])
    assert any("ended clean" in line and "pending" in line for line in naive["timeline"])
    assert guarded["fetch_result"] == "contents of https://example.com/doc"
    assert guarded["findings"] == []
