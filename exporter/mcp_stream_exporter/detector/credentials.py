"""The ``Authorization`` header checked against a configured secret, whatever bytes a client sends.

RFC 7235: the scheme is case-insensitive, one or more spaces separate it from the credentials.
Compared as bytes with :func:`hmac.compare_digest`: a header with non-ASCII bytes is a wrong
credential (401), never an error, and the comparison time does not depend on where they differ.
"""

from __future__ import annotations

import base64
import hmac


def _credentials(header: str, scheme: bytes) -> bytes:
    try:  # Starlette decodes the header's bytes as latin-1: back to the bytes sent
        raw = header.encode("latin-1")
    except UnicodeEncodeError:  # gRPC metadata is text
        raw = header.encode("utf-8", "surrogatepass")
    name, _, value = raw.strip().partition(b" ")
    return value.strip() if name.lower() == scheme else b""


def bearer_matches(header: str, token: str) -> bool:
    """``Authorization: Bearer <token>`` (any case of ``Bearer``)."""
    sent = _credentials(header, b"bearer")
    return bool(sent) and hmac.compare_digest(sent, token.encode())


def basic_matches(header: str, user: str, password: str) -> bool:
    """``Authorization: Basic base64(user:password)`` (any case of ``Basic``)."""
    sent = _credentials(header, b"basic")
    return bool(sent) and hmac.compare_digest(sent, base64.b64encode(f"{user}:{password}".encode()))
