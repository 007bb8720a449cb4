"""What CPython takes for the strings, tuples and lifecycle events the detector keeps, by arithmetic.

``sys.getsizeof`` looks up and calls ``__sizeof__`` (about 0.2 µs), and the ledger and the ingest queue size a
dozen values for every event they keep: an ASCII string is a fixed header and a byte a character, a tuple a
header and a pointer an item, so one ``isascii`` over them all replaces the calls. The figures are
CPython's own (taken at import), and a string that is not ASCII is still asked. The ingest queue's budget
counts an event so.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable

from mcp_stream_exporter.detector.events import CallEnd, Common, Lifecycle, Operation, Replay, StreamEnd, Token

STR = sys.getsizeof("")  # an ASCII string, before its characters
TUPLE = sys.getsizeof(())  # a tuple (its GC header included), before its items
ITEM = sys.getsizeof((None,)) - TUPLE


def strings(values: Iterable[str]) -> int:
    """Bytes of ``values``, each counted (a string held twice is counted twice: an upper bound)."""
    held = values if isinstance(values, (list, tuple)) else list(values)
    joined = "".join(held)
    if joined.isascii():
        return STR * len(held) + len(joined)
    return sum(map(sys.getsizeof, held))


def strings_tuple(values: tuple[str, ...]) -> int:
    """Bytes of a tuple of strings and of its strings."""
    return TUPLE + ITEM * len(values) + strings(values)


_TIMESTAMP = sys.getsizeof(2**62)  # an int past the small ones CPython shares: one object per span time
# an event: itself, its Common (with its two timestamps) and its Token
_EVENT = {kind: sys.getsizeof(object.__new__(kind)) + sys.getsizeof(object.__new__(Common)) + 2 * _TIMESTAMP
          + sys.getsizeof(object.__new__(Token)) for kind in (StreamEnd, Replay, CallEnd)}
_OPERATION = sys.getsizeof(object.__new__(Operation)) + 2 * _TIMESTAMP  # its start, its duration


def event(e: Lifecycle) -> int:
    """The bytes an event holds (shared strings counted each time): itself, its ``Common`` and ``Token``,
    their strings and lists, and its timestamps."""
    if isinstance(e, Operation):
        return _OPERATION + strings([*filter(None, (e.role, e.method, e.tool, e.trace_id, e.span_id, e.error_type,
                                                    e.origin, e.transport, e.protocol_version))])
    # few bytecodes (each costs CPython 3.11 about 60 instructions): attribute loads, C calls; one tuple a kind
    at, token = e.at, e.token
    lists: tuple[tuple[str, ...], ...]
    if isinstance(e, StreamEnd):
        held = [*filter(None, (at.role, at.era, at.scope, at.session_id, at.trace_id, at.span_id, at.origin,
                               token.fingerprint, e.kind, e.reason, e.first_event_id, e.last_event_id, e.cursor,
                               e.tool))]
        lists = (e.request_ids, e.pending_ids, e.terminal_ids, e.required, token.audience, token.missing_resources,
                 token.missing_scopes)
    elif isinstance(e, Replay):
        held = [*filter(None, (at.role, at.era, at.scope, at.session_id, at.trace_id, at.span_id, at.origin,
                               token.fingerprint, e.cursor, e.request_id, e.decision, e.sent_last_id,
                               e.offending_event_id, e.guard_decision))]
        lists = e.foreign_event_ids, e.required, token.audience, token.missing_resources, token.missing_scopes
    else:
        held = [*filter(None, (at.role, at.era, at.scope, at.session_id, at.trace_id, at.span_id, at.origin,
                               token.fingerprint, e.request_id, e.tool, e.outcome, e.terminal_event_id,
                               e.sdk_span_id, e.terminal_stream_kind, e.fingerprint))]
        lists = e.required, token.audience, token.missing_resources, token.missing_scopes
    count = len(held)
    for items in lists:
        if items:  # most are empty
            held += items
    joined = "".join(held)
    n = len(held)
    # CPython holds a string that is not ASCII in 2 or 4 bytes a character: ask it then
    size = STR * n + len(joined) if joined.isascii() else sum(map(sys.getsizeof, held))
    return _EVENT[type(e)] + size + TUPLE * (len(lists) - lists.count(())) + ITEM * (n - count)
