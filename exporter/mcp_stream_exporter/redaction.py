"""Token-shaped text out of what the hooks record of a peer's text, and of everything the detector keeps
or shows: ledger, findings, labels, logs.

A server's ``event: error`` frame may quote the request's credential; the hooks record its text only
redacted. Producers should never put a credential in a span, but one that does must not see it come
back on ``/metrics``, ``/api/findings``, in the snapshot file or in a log line. A
``Bearer``/``Basic``/``DPoP`` credential and anything shaped like a JWT (``eyJ...x.y.z``) is replaced.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable

REDACTED = "[redacted]"
_SCHEMES = "bearer|basic|dpop"
# what stands between scheme and credential as a header writes it, and as text quotes, logs or encodes it:
# ``Bearer: x``, ``Bearer=x``, ``Bearer "x"``, ``Bearer+x`` (a form), ``Bearer%20x``, ``Bearer\u0020x`` (JSON),
# ``Bearer&#32;x`` (HTML), any Unicode space or zero-width character between
_ESCAPED = r"%[0-9a-f]{2}|\\u[0-9a-f]{4}|\\x[0-9a-f]{2}|&#x?[0-9a-f]+;|&nbsp;"
_TOKEN = re.compile(rf"\b(?:{_SCHEMES})(?:[\s:=\"'+\u200b-\u200d\u2060\ufeff]|{_ESCAPED})+[^\s,;\"'&]+"
                    r"|eyJ[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+\.[A-Za-z0-9_-]*", re.IGNORECASE)


# without the word boundary: in encoded bytes a length byte may stand before the scheme, and may be a letter;
# any byte of a non-ASCII character may be (part of) a space between scheme and credential
_TOKEN_BYTES = re.compile(rf"(?:{_SCHEMES})(?:[\s:=\"'+\x80-\xff]|{_ESCAPED})+[^\s,;\"'&]"
                          r"|eyJ[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+\.".encode(), re.IGNORECASE)


def holds_token(encoded: bytes) -> bool:
    """Whether encoded text (a span's raw bytes, before decoding) holds anything token-shaped: what a
    cache of raw values must not keep (erring towards yes)."""
    return _TOKEN_BYTES.search(encoded) is not None


# a process-wide cache outside every budget: small enough (about 80 KiB at most) not to blur them. Session
# ids, tools, event ids and most resources fit; a longer string is scanned each time
_CLEAN_CACHE = 512
_CLEAN_MAX_CHARS = 64
_clean: dict[str, None] = {}


def redact(text: str) -> str:
    """``text`` with every token-shaped part replaced by ``[redacted]``.

    Text found clean is remembered (bounded): the same session ids, tools, resources and audiences
    come back on every span of a session, and a look-up costs a tenth of the scan. Text that held a
    token is never remembered, so no credential stays in the cache."""
    return _replaced(text, REDACTED)


# what a cut may leave of a JWT at the end of the text: its start, with fewer than its two dots
_CUT_JWT = re.compile(r"eyJ[A-Za-z0-9_-]*(?:\.[A-Za-z0-9_-]*)?\Z", re.ASCII)


def redact_cut(text: str, limit: int) -> str:
    """The first ``limit`` characters of ``text``, redacted, a token the cut splits included.

    For a peer's text of any length (an ``event: error`` frame's data): the token pattern backtracks,
    so it is run on the part kept only, which bounds the cost whatever the peer sends."""
    kept = _TOKEN.sub(REDACTED, text[:limit])
    if len(text) > limit:
        kept = _CUT_JWT.sub(REDACTED, kept)
    return kept[:limit]


def redact_id(text: str) -> str:
    """``text`` with every token-shaped part replaced by ``[redacted:<12 hex digits of its SHA-256>]``.

    For identifiers: a session id may be a JWT (the MCP spec names one as an example), and sessions
    whose ids are redacted must stay told apart, or one session's answer would hide another's loss."""
    return _replaced(text, _digest)


def _digest(match: re.Match[str]) -> str:
    return f"[redacted:{hashlib.sha256(match.group().encode()).hexdigest()[:12]}]"


def _replaced(text: str, replacement: str | Callable[[re.Match[str]], str]) -> str:
    if text in _clean:
        return text
    redacted = _TOKEN.sub(replacement, text)
    if redacted == text and len(text) <= _CLEAN_MAX_CHARS:
        if len(_clean) >= _CLEAN_CACHE:
            _clean.clear()
        _clean[text] = None
    return redacted
