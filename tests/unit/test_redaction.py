"""Token-shaped text is replaced wherever it is kept: whole in free text, by a digest in identifiers, and
when a peer's text is cut, a token the cut splits is replaced too."""

from __future__ import annotations

import pytest

from mcp_stream_exporter.redaction import REDACTED, holds_token, redact, redact_cut, redact_id

JWT = "eyJhbGciOiJSUzI1NiJ9.eyJzdWIiOiJ1c2VyIn0.c2lnbmF0dXJlLWJ5dGVz"


def test_free_text_loses_every_token_and_keeps_the_rest():
    assert redact(f"denied: Bearer {JWT}, token {JWT}") == f"denied: {REDACTED}, token {REDACTED}"
    assert redact("no credential here") == "no credential here"


@pytest.mark.parametrize("written", ["Bearer: {}", "Bearer={}", 'Bearer "{}"', "Bearer%20{}", "Bearer\u00a0{}",
                                     "Basic\u2003{}", "DPoP {}", "bearer  {}", "authorization='Basic {}'",
                                     "Authorization=Bearer+{}", "authorization:Bearer\\u0020{}", "Bearer&#32;{}",
                                     "Bearer&#x20;{}", "Bearer&nbsp;{}", "Bearer\u200b{}", "Bearer\\x20{}"])
def test_a_credential_quoted_logged_or_url_encoded_is_replaced_and_its_bytes_are_told(written: str):
    secret = "s3cr3tV4lue"
    text = written.format(secret)
    assert secret not in redact(f"session {text}") and secret not in redact_id(f"session {text}")
    assert holds_token(f"session {text}".encode())


def test_identifiers_keep_apart_once_redacted_and_never_show_the_token():
    one, other = redact_id(f"s-{JWT}"), redact_id(f"s-{JWT}x")
    assert one != other and one == redact_id(f"s-{JWT}") and one.startswith("s-[redacted:")
    assert JWT not in one + other and "c2lnbmF0dXJl" not in one + other


def test_a_cut_peer_text_keeps_no_part_of_a_token_the_cut_splits():
    for at in range(len(JWT) + 1):  # the cut anywhere in the token, first dot and second dot included
        kept = redact_cut("x" * (100 - at) + JWT + " more", 100)
        assert len(kept) <= 100 and JWT[:max(at, 3)] not in kept and "c2ln" not in kept
    assert redact_cut("short text", 100) == "short text"
    assert redact_cut("a" * 300, 100) == "a" * 100


def test_a_cut_peer_text_is_read_only_as_far_as_the_cut():
    """The token pattern backtracks on a run with no dot (quadratic): a megabyte of it must still be quick."""
    assert redact_cut("eyJ" * 400_000, 1024) == REDACTED
