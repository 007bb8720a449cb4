"""HTTP headers as raw byte pairs (an ASGI scope's, httpx2's ``Headers.raw``), read for a few names.

The hooks read four or five headers of every request on the hot path; decoding only those, in one
pass, costs a fraction of a full case-insensitive mapping (``httpx2.Headers.get`` scans and decodes
every header on each look-up).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping


def pick(raw: Iterable[tuple[bytes, bytes]], names: Mapping[bytes, str], lowered: bool = False) -> dict[str, str]:
    """The values of the headers in ``names`` (lower-case bytes, to the name each is keyed by: no name
    decoded on every request); HTTP/1.1 headers are latin-1. A repeated header keeps its first value, the one
    Starlette, so the MCP SDK, acts on (a DELETE naming two sessions ends the first).
    ``lowered``: the names in ``raw`` are lower-case already, as ASGI requires of a server (and
    Starlette, so the MCP SDK, relies on)."""
    found: dict[str, str] = {}
    if lowered:
        for key, value in raw:
            if key in names and names[key] not in found:
                found[names[key]] = value.decode("latin-1")
        return found
    for key, value in raw:
        key = key.lower()
        if key in names and names[key] not in found:
            found[names[key]] = value.decode("latin-1")
    return found


def values(raw: Iterable[tuple[bytes, bytes]], name: str) -> list[str]:
    """Every value of one header (``name`` lower-case; latin-1): a repeat is kept, so it can be refused,
    not guessed at."""
    key = name.encode("latin-1")
    return [v.decode("latin-1") for k, v in raw if k.lower() == key]
