"""Every span name, attribute key and value that hooks emit and the detector reads.

This module is the code half of the contract in ``docs/span-model.md``: OpenTelemetry
semantic-convention names where they exist, this project's own keys under ``mcp_stream.``.
"""

from __future__ import annotations

from importlib.metadata import version
from typing import Final

INSTRUMENTATION_NAME: Final = "mcp_stream_exporter"
INSTRUMENTATION_VERSION: Final = version("mcp-stream-exporter")
# the semantic-conventions release whose MCP, JSON-RPC and GenAI names the spans use
SCHEMA_URL: Final = "https://opentelemetry.io/schemas/1.39.0"

# --- OpenTelemetry semantic conventions (MCP, JSON-RPC, GenAI, HTTP, errors) ---
MCP_METHOD_NAME: Final = "mcp.method.name"
MCP_SESSION_ID: Final = "mcp.session.id"
MCP_PROTOCOL_VERSION: Final = "mcp.protocol.version"
JSONRPC_REQUEST_ID: Final = "jsonrpc.request.id"
GEN_AI_TOOL_NAME: Final = "gen_ai.tool.name"
ERROR_TYPE: Final = "error.type"
HTTP_REQUEST_METHOD: Final = "http.request.method"
HTTP_RESPONSE_STATUS_CODE: Final = "http.response.status_code"
NETWORK_PROTOCOL_NAME: Final = "network.protocol.name"
NETWORK_TRANSPORT: Final = "network.transport"
RPC_RESPONSE_STATUS_CODE: Final = "rpc.response.status_code"

# --- span names: ours (for humans; ``SPAN`` below is for machines) and the MCP SDK's own ---
SPAN_NAME_CALL: Final = "MCP call"  # "MCP call tools/call {tool}"
SPAN_NAME_STREAM: Final = "MCP stream"  # "MCP stream {kind}"
SPAN_NAME_REPLAY: Final = "MCP replay"
SDK_CLIENT_SPAN_PREFIX: Final = "MCP send "  # the SDK client's request span: "MCP send {method} {target}"
SDK_CLIENT_CALL_SPAN: Final = SDK_CLIENT_SPAN_PREFIX + "tools/call"  # ... " {tool}": pinned by test_sdk_contract

# The most a span-model string and string array may carry: a consumer (the detector) refuses a span
# with a longer one, rather than cut an id into another call's. Producers keep within them.
MAX_CHARS: Final = 256
MAX_ITEMS: Final = 256

# --- which span of the model a span is (names are for humans, this is for machines) ---
SPAN: Final = "mcp_stream.span"
SPAN_STREAM: Final = "stream"
SPAN_CALL: Final = "call"
SPAN_REPLAY: Final = "replay"

ROLE: Final = "mcp_stream.role"
ROLE_CLIENT: Final = "client"
ROLE_SERVER: Final = "server"

ERA: Final = "mcp_stream.era"
ERA_RESUMABLE: Final = "resumable"  # 2025-03-26 .. 2025-11-25: sessions, event ids, Last-Event-ID
ERA_STATELESS: Final = "stateless"  # 2026-07-28: no session, no event ids, re-issue on a broken stream

# --- stream spans ---
STREAM_KIND: Final = "mcp_stream.stream.kind"
STREAM_KIND_POST: Final = "post"
STREAM_KIND_GET: Final = "get"  # the standalone server->client stream
STREAM_KIND_RESUME: Final = "resume"  # a GET with Last-Event-ID
STREAM_KIND_DELETE: Final = "delete"
STREAM_KINDS: Final = (STREAM_KIND_POST, STREAM_KIND_GET, STREAM_KIND_RESUME, STREAM_KIND_DELETE)
STREAM_CONTENT: Final = "mcp_stream.stream.content"  # sse | json | none
STREAM_REQUEST_IDS: Final = "mcp_stream.stream.request_ids"
RESUME_CURSOR: Final = "mcp_stream.resume.cursor"
# (server) on a 404 the SDK gave a request of another principal than the one that opened the session it names (it
# answers so as if the session did not exist): the session lives; its owner's own 404 carries no such attribute
SESSION_OWNER: Final = "mcp_stream.session.owner"
SESSION_OWNER_OTHER: Final = "other"
END_REASON: Final = "mcp_stream.end.reason"
END_CLEAN: Final = "clean"  # the server ended the response body
END_DROPPED: Final = "dropped"  # the connection broke before the server ended it
END_CLOSED: Final = "closed"  # the client closed the response before the server ended it
END_HTTP_ERROR: Final = "http_error"  # status >= 400 or a redirect, no stream
# the session was deleted (a DELETE its side saw accepted) while the stream was open: it ended with the session
END_TERMINATED: Final = "terminated"
# a resume still open, told as it first moves a pending call on: a span of its own, ended at once (the resume's
# span ends when it does, maybe long after: a tool that polls)
END_OPEN: Final = "open"
# the ends of a stream (``open``: not yet one)
END_REASONS: Final = (END_CLEAN, END_DROPPED, END_CLOSED, END_HTTP_ERROR, END_TERMINATED)
PENDING_REQUEST_IDS: Final = "mcp_stream.pending.request_ids"
# (server) of those, the calls whose tool had not answered yet (no terminal event stored or sent): it still runs them
RUNNING_REQUEST_IDS: Final = "mcp_stream.running.request_ids"
TERMINAL_REQUEST_IDS: Final = "mcp_stream.terminal.request_ids"
# of those, calls this side had seen answered before, on a stream that left no span (the healthy path): a repeat
REPEATED_REQUEST_IDS: Final = "mcp_stream.terminal.repeated.request_ids"
EVENTS_COUNT: Final = "mcp_stream.events.count"
EVENT_FIRST_ID: Final = "mcp_stream.event.first_id"
EVENT_LAST_ID: Final = "mcp_stream.event.last_id"
ERROR_FRAMES_COUNT: Final = "mcp_stream.error_frames.count"

# --- span events on stream spans ---
EVENT_FRAME: Final = "mcp_stream.frame"
EVENT_ERROR_FRAME: Final = "mcp_stream.error_frame"
EVENT_ID: Final = "mcp_stream.event.id"
EVENT_TYPE: Final = "mcp_stream.event.type"
FRAME_KIND: Final = "mcp_stream.frame.kind"
FRAME_PRIMING: Final = "priming"
FRAME_REQUEST: Final = "request"
FRAME_NOTIFICATION: Final = "notification"
FRAME_RESPONSE: Final = "response"
FRAME_ERROR: Final = "error"  # a JSON-RPC error response
FRAME_ERROR_FRAME: Final = "error_frame"  # an SSE `event: error` frame
FRAME_OTHER: Final = "other"
ERROR_FRAME_DATA: Final = "mcp_stream.error_frame.data"  # the frame's data, truncated

# --- call spans ---
CALL_OUTCOME: Final = "mcp_stream.call.outcome"
OUTCOME_RESULT: Final = "result"
OUTCOME_TOOL_ERROR: Final = "tool_error"  # a result with isError: true
OUTCOME_ERROR: Final = "error"  # a JSON-RPC error response
OUTCOME_CANCELLED: Final = "cancelled"  # the client sent notifications/cancelled
OUTCOME_NO_TERMINAL: Final = "no_terminal"  # stateless era: its only stream ended without a terminal event
OUTCOME_EVICTED: Final = "evicted"  # dropped from the bounded tracker while still pending
# server, resumable era: storing an event of its session failed (``EventStore.store_event`` raised), and the SDK
# then sends none of the session's messages again: the call's result is never sent nor stored. ``error.type``
# names the exception's class (never its message)
OUTCOME_STORE_FAILED: Final = "store_failed"
# server, resumable era: the client cancelled the call after its terminal event went out on a stream, so it never got
# it (a connection its side lost while the server's stayed open: a proxy, a NAT). A span of its own, from that event's
# send to the cancel, with ``TERMINAL_EVENT_ID``: the call's own span, if it had one, ended when the event went out
OUTCOME_CANCELLED_LATE: Final = "cancelled_late"
# client, stateless: a call that re-issues one whose stream broke, at its start (a span of its own, ended at once:
# the call's span ends only with the call, and a long tool would outlast the grace the detector gives a re-issue)
OUTCOME_REISSUED: Final = "reissued"
TERMINAL_EVENT_ID: Final = "mcp_stream.terminal.event_id"
TERMINAL_STREAM_KIND: Final = "mcp_stream.terminal.stream_kind"
CALL_STREAMS: Final = "mcp_stream.call.streams"
CALL_ARGUMENTS_HASH: Final = "mcp_stream.call.arguments_hash"  # client: salted hash of the tool and its arguments
# 2026-07-28: the span id in the request's traceparent (the client SDK's request span), on both sides' call and
# stream spans: two clients' calls of one id in one trace (an agent's turn using two servers) are told apart by it
CALL_REQUEST_SPAN_ID: Final = "mcp_stream.call.request_span_id"
REQUIRED_RESOURCES: Final = "mcp_stream.required.resources"
REQUIRED_SCOPES: Final = "mcp_stream.required.scopes"
POLICY_DECISION: Final = "mcp_stream.policy.decision"  # allowed | refused | unknown_tool
EVENT_STORED: Final = "mcp_stream.event.stored"  # span event: the server stored an event of this call
LINK_TYPE: Final = "mcp_stream.link"
LINK_SDK_REQUEST: Final = "sdk_request"  # the SDK's own span for this request (from params._meta)
LINK_STREAM: Final = "stream"  # a stream that carried this call
LINK_TERMINAL_STREAM: Final = "terminal_stream"  # the stream that delivered the terminal event
LINK_REISSUE: Final = "reissue"  # (a re-issue's start, in the broken call's trace) the re-issue's own call span

# --- replay spans (server: one per resume, from the EventStore wrapper) ---
REPLAY_STREAM_ID: Final = "mcp_stream.replay.stream_id"
REPLAY_BUFFERED: Final = "mcp_stream.replay.buffered"  # events stored after the cursor on that stream
REPLAY_SENT: Final = "mcp_stream.replay.sent"
REPLAY_SENT_LAST_ID: Final = "mcp_stream.replay.sent.last_id"
REPLAY_DECISION: Final = "mcp_stream.replay.decision"
REPLAY_COMPLETE: Final = "complete"  # every buffered event was sent
REPLAY_TRUNCATED: Final = "truncated"  # the store sent fewer events than it held, without an error frame
REPLAY_REFUSED: Final = "refused"  # the store answered with an `event: error` frame
REPLAY_UNKNOWN_CURSOR: Final = "unknown_cursor"  # the cursor was never seen (or evicted)
REPLAY_INTERRUPTED: Final = "interrupted"  # stopped before the store was done: the client left, or the server stopped
REPLAY_OFFENDING_EVENT_ID: Final = "mcp_stream.replay.offending_event_id"
REPLAY_SKIPPED: Final = "mcp_stream.replay.skipped"  # buffered events left out before the last one sent
REPLAY_FOREIGN_EVENT_IDS: Final = "mcp_stream.replay.foreign_event_ids"  # sent, but stored on another stream or session

# --- the token, never raw ---
AUTH_AUDIENCE: Final = "mcp_stream.auth.audience"
AUTH_SCOPES: Final = "mcp_stream.auth.scopes"
AUTH_SUBJECT_HASH: Final = "mcp_stream.auth.subject_hash"
AUTH_FINGERPRINT: Final = "mcp_stream.auth.fingerprint"
AUTH_VERIFICATION: Final = "mcp_stream.auth.verification"
VERIFICATION_OPAQUE: Final = "opaque"  # not a JWT: its audience is unknown
VERIFICATION_ABSENT: Final = "absent"  # no bearer token
AUTH_MISSING_RESOURCES: Final = "mcp_stream.auth.missing_resources"
AUTH_MISSING_SCOPES: Final = "mcp_stream.auth.missing_scopes"

# --- the replay guard's verdict, on the replay span it runs under (guard/) ---
GUARD_MODE: Final = "mcp_stream.guard.mode"  # enforce | observe
GUARD_DECISION: Final = "mcp_stream.guard.decision"
GUARD_ALLOW: Final = "allow"
GUARD_REFUSE: Final = "refuse"  # an `event: error` frame was sent, the cursor did not move
GUARD_WOULD_REFUSE: Final = "would_refuse"  # observe mode: replayed anyway, the violation recorded
GUARD_UNKNOWN_CURSOR: Final = "unknown_cursor"  # answered with an explicit error frame
GUARD_REASON: Final = "mcp_stream.guard.reason"  # the refusal frame's `error` (docs/guard.md)
GUARD_OFFENDING_EVENT_ID: Final = "mcp_stream.guard.offending_event_id"
GUARD_MISSING_RESOURCES: Final = "mcp_stream.guard.missing_resources"
GUARD_MISSING_SCOPES: Final = "mcp_stream.guard.missing_scopes"
GUARD_CURSOR: Final = "mcp_stream.guard.cursor"  # where the client may resume from
