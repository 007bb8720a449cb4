from __future__ import annotations

import logging

import pytest

from harness import TOKENS_USED, span_exporter


@pytest.fixture(autouse=True)
def no_raw_token_leaves_the_process(caplog):
    """After every scenario: no bearer token it used appears in any exported span or log record."""
    caplog.set_level(logging.DEBUG)
    TOKENS_USED.clear()
    yield
    if not TOKENS_USED:
        return
    blob = "\n".join([s.to_json() for s in span_exporter().get_finished_spans()]
                     + [r.getMessage() + repr(r.args) for r in caplog.records])
    for token in TOKENS_USED:
        assert token not in blob
        assert token.split(".")[2] not in blob  # not even the signature alone
