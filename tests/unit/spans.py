"""Spans of the span model, built by hand for the detector's unit tests (as the hooks emit them)."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

from mcp_stream_exporter import semconv as sc
from mcp_stream_exporter.detector import Span
from mcp_stream_exporter.detector.events import KIND_CLIENT, KIND_INTERNAL, KIND_SERVER

FETCH = "https://mcp.example.com/tools/fetch"
SEARCH = "https://mcp.example.com/tools/search"
S = 1_000_000_000
_ids = itertools.count(1)


class Clock:
    """The detector's clock, moved by hand (``now``, in nanoseconds)."""

    def __init__(self) -> None:
        self.now = 100 * S

    def __call__(self) -> int:
        return self.now


def _span(name: str, kind: str, attrs: dict[str, Any], at: float, *, trace: str = "t1", parent: str | None = None,
          exceptions: tuple[str, ...] = (), origin: str = "client-app") -> Span:
    return Span(trace_id=trace.ljust(32, "0"), span_id=format(next(_ids), "016x"), parent_span_id=parent,
                name=name, kind=kind, start_ns=int(at * S), end_ns=int(at * S) + 1000,
                attributes={k: v for k, v in attrs.items() if v is not None}, exception_types=exceptions,
                error=bool(exceptions), origin=origin)


def stream(role: str, kind: str, reason: str, *, at: float = 1.0, session: str | None = "s1",
           ids: tuple[str, ...] = ("3",), pending: tuple[str, ...] = (), terminal: tuple[str, ...] = (),
           cursor: str | None = None, audience: tuple[str, ...] = (FETCH, SEARCH), missing: tuple[str, ...] = (),
           error_frames: int = 0, status: int = 200, first: str | None = None, last: str | None = None,
           events: int = 0, era: str = sc.ERA_RESUMABLE, tool: str | None = "fetch", trace: str = "t1",
           running: tuple[str, ...] = (), repeated: tuple[str, ...] = (), owner: str | None = None,
           fingerprint: str | None = None) -> Span:
    return _span(f"MCP stream {kind}", KIND_CLIENT if role == sc.ROLE_CLIENT else KIND_SERVER, {
        sc.SPAN: sc.SPAN_STREAM, sc.ROLE: role, sc.STREAM_KIND: kind, sc.END_REASON: reason, sc.ERA: era,
        sc.MCP_SESSION_ID: session, sc.STREAM_REQUEST_IDS: ids or None, sc.PENDING_REQUEST_IDS: pending or None,
        sc.TERMINAL_REQUEST_IDS: terminal or None, sc.RESUME_CURSOR: cursor, sc.HTTP_RESPONSE_STATUS_CODE: status,
        sc.AUTH_AUDIENCE: audience, sc.AUTH_MISSING_RESOURCES: missing or None,
        sc.ERROR_FRAMES_COUNT: error_frames or None, sc.EVENT_FIRST_ID: first, sc.EVENT_LAST_ID: last,
        sc.EVENTS_COUNT: events, sc.GEN_AI_TOOL_NAME: tool if len(ids) == 1 or (not ids and terminal) else None,
        sc.REQUIRED_RESOURCES: (FETCH,) if pending and tool == "fetch" else None,
        sc.RUNNING_REQUEST_IDS: running or None, sc.REPEATED_REQUEST_IDS: repeated or None, sc.SESSION_OWNER: owner,
        sc.CALL_ARGUMENTS_HASH: fingerprint,
    }, at, trace=trace)


def call(role: str, outcome: str, *, at: float = 1.0, session: str | None = "s1", request_id: str = "3",
         tool: str = "fetch", era: str = sc.ERA_RESUMABLE, parent: str | None = None, trace: str = "t1",
         origin: str = "client-app", fingerprint: str | None = None, stream_kind: str | None = "post",
         terminal_event_id: str | None = None) -> Span:
    """``stream_kind`` is where a terminal outcome was delivered; None on a server span ended at storage."""
    terminal = outcome in (sc.OUTCOME_RESULT, sc.OUTCOME_TOOL_ERROR, sc.OUTCOME_ERROR)
    return _span(f"MCP call tools/call {tool}", KIND_INTERNAL, {
        sc.SPAN: sc.SPAN_CALL, sc.ROLE: role, sc.ERA: era, sc.MCP_SESSION_ID: session,
        sc.JSONRPC_REQUEST_ID: request_id, sc.GEN_AI_TOOL_NAME: tool, sc.CALL_OUTCOME: outcome,
        sc.REQUIRED_RESOURCES: (FETCH,) if tool == "fetch" else (SEARCH,), sc.CALL_ARGUMENTS_HASH: fingerprint,
        sc.TERMINAL_STREAM_KIND: stream_kind if terminal else None, sc.TERMINAL_EVENT_ID: terminal_event_id,
    }, at, trace=trace, parent=parent, origin=origin)


def cancelled_late(sent: float = 1.0, cancelled: float = 3.0) -> Span:
    """The server's span of a cancel that came after it sent the call's result (event 6): from ``sent`` to
    ``cancelled``."""
    span = call(sc.ROLE_SERVER, sc.OUTCOME_CANCELLED_LATE, terminal_event_id="6")
    return dataclasses.replace(span, start_ns=int(sent * S), end_ns=int(cancelled * S))


def replay(decision: str, *, at: float = 1.0, session: str = "s1", request_id: str | None = "3", cursor: str = "6",
           buffered: int = 4, sent: int = 0, skipped: int = 0, missing: tuple[str, ...] = (),
           foreign: tuple[str, ...] = (), guard: str | None = None, offending: str | None = "8",
           audience: tuple[str, ...] | None = None, verification: str | None = None) -> Span:
    """The resuming token's audience defaults to what the call requires (``missing`` empty) or to search only."""
    held = audience if audience is not None else (SEARCH,) if missing else (FETCH, SEARCH)
    return _span("MCP replay", KIND_INTERNAL, {
        sc.SPAN: sc.SPAN_REPLAY, sc.ROLE: sc.ROLE_SERVER, sc.MCP_SESSION_ID: session, sc.RESUME_CURSOR: cursor,
        sc.JSONRPC_REQUEST_ID: request_id, sc.REPLAY_DECISION: decision, sc.REPLAY_BUFFERED: buffered,
        sc.REPLAY_SENT: sent, sc.REPLAY_SKIPPED: skipped or None, sc.REPLAY_FOREIGN_EVENT_IDS: foreign or None,
        sc.AUTH_AUDIENCE: held, sc.AUTH_MISSING_RESOURCES: missing or None, sc.AUTH_VERIFICATION: verification,
        sc.GUARD_DECISION: guard,
        sc.REPLAY_OFFENDING_EVENT_ID: offending if decision == sc.REPLAY_TRUNCATED else None,
        sc.REQUIRED_RESOURCES: (FETCH,),
    }, at)


def sdk_call(role: str, tool: str, *, at: float = 1.0, request_id: str = "3", timed_out: bool = False,
             error_type: str | None = None, origin: str = "client-app", span_id: str | None = None) -> Span:
    name = f"MCP send tools/call {tool}" if role == sc.ROLE_CLIENT else f"tools/call {tool}"
    attrs: dict[str, Any] = {sc.MCP_METHOD_NAME: "tools/call", sc.JSONRPC_REQUEST_ID: request_id,
                             sc.ERROR_TYPE: error_type}
    if role == sc.ROLE_SERVER:
        attrs[sc.GEN_AI_TOOL_NAME] = tool
    span = _span(name, KIND_CLIENT if role == sc.ROLE_CLIENT else KIND_SERVER, attrs, at,
                 exceptions=("TimeoutError",) if timed_out else (), origin=origin)
    if span_id is not None:
        object.__setattr__(span, "span_id", span_id)
    return span
