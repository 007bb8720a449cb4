"""docs/examples/: the incident as OTLP/JSON, posted to the real `serve` service, gives the findings
the examples say, from both sides' spans together and from one side's alone."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from mcp_stream_exporter import semconv as sc

from harness import detector_process, wait_for

EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"
CLIENT, SERVER = EXAMPLES / "incident-client.otlp.json", EXAMPLES / "incident-server.otlp.json"
EXPECTED = json.loads((EXAMPLES / "incident.findings.json").read_text())
HEX_ID = re.compile(r"[0-9a-f]{16}|[0-9a-f]{32}")


def _post_and_find(*files: Path, until: set[str]) -> dict[str, dict]:
    """Post the files to a fresh `serve` (1 s grace) and wait until findings of the ``until`` rules are in."""
    with detector_process("--clean-end-grace-s=1") as service:
        for path in files:
            answer = service.http.post("/v1/traces", content=path.read_bytes(),
                                       headers={"content-type": "application/json"})
            assert answer.status_code == 200, answer.text
            assert "rejected" not in answer.text.lower(), answer.text  # no partial success: every span taken

        def found() -> dict[str, dict] | None:
            by_rule = {f["rule"]: f for f in service.findings()}
            return by_rule if until <= set(by_rule) else None

        return dict(wait_for(found, 30, f"findings {sorted(until)}"))


def test_the_incident_examples_give_the_documented_findings_to_the_serve_service():
    findings = _post_and_find(CLIENT, SERVER, until={f["rule"] for f in EXPECTED})
    assert sorted(({"rule": f["rule"], "tool": f["tool"]} for f in findings.values()),
                  key=lambda f: f["rule"]) == EXPECTED
    assert sorted(findings["clean_end_pending"]["roles"]) == [sc.ROLE_CLIENT, sc.ROLE_SERVER]
    assert {f["rule"] for f in EXPECTED} >= {"clean_end_pending", "narrowed_resume", "replay_truncated"}


@pytest.mark.parametrize("path", [CLIENT, SERVER], ids=["client", "server"])
def test_one_sides_example_alone_still_finds_the_loss(path: Path):
    findings = _post_and_find(path, until={"clean_end_pending", "narrowed_resume"})
    assert findings["clean_end_pending"]["tool"] == "fetch"


def test_the_examples_are_otlp_json_with_hex_ids_and_no_token():
    for path in (CLIENT, SERVER):
        text = path.read_text()
        assert "eyJ" not in text  # no JWT, not even a part of one: fingerprints and audiences only
        doc = json.loads(text)
        for resource_spans in doc["resourceSpans"]:
            for scope_spans in resource_spans["scopeSpans"]:
                for span in scope_spans["spans"]:
                    assert HEX_ID.fullmatch(span["traceId"]) and HEX_ID.fullmatch(span["spanId"])
                    keys = {a["key"] for a in span.get("attributes", [])}
                    if sc.SPAN in keys:
                        assert sc.ROLE in keys
