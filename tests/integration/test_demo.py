"""`mcp-stream-exporter demo`, the README's first command, reproduces the incident and says so."""

from __future__ import annotations

import json
import subprocess
import sys


def test_demo_reproduces_the_incident_and_exits_zero():
    run = subprocess.run([sys.executable, "-m", "mcp_stream_exporter.cli", "demo", "--json"],
                         capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    outcome = json.loads(run.stdout)
    assert outcome["reproduced"] is True
    assert outcome["search_result"].startswith("search results")
    assert "timed out" in outcome["fetch_error"]
    assert outcome["missing_resources"] == ["https://mcp.example.com/tools/fetch"]
    assert outcome["token_audience"] == ["https://mcp.example.com/tools/search"]
    assert outcome["client_resumes_clean_pending"] >= 1
    assert any("ended clean" in line and "pending" in line for line in outcome["timeline"])
