from __future__ import annotations

import json
import logging

import pytest
from prometheus_client import generate_latest

from harness import DETECTORS_USED, TOKENS_USED, span_exporter


@pytest.fixture(autouse=True)
def no_raw_token_leaves_the_process(caplog):
    """After every scenario: no bearer token it used appears in any exported span, log record, or any
    detector's metrics, findings or snapshot content."""
    caplog.set_level(logging.DEBUG)
    TOKENS_USED.clear()
    DETECTORS_USED.clear()
    yield
    if not TOKENS_USED:
        return
    blob = "\n".join([s.to_json() for s in span_exporter().get_finished_spans()]
                     + [r.getMessage() + repr(r.args) for r in caplog.records]
                     + [generate_latest(d.registry).decode() for d in DETECTORS_USED]
                     + [json.dumps([d.ledger.dump(), d.findings.dump()]) for d in DETECTORS_USED])
    for token in TOKENS_USED:
        assert token not in blob
        if token.count(".") == 2:  # a JWT: not even its signature alone
            assert token.split(".")[2] not in blob
