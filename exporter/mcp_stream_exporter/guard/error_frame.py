"""The guard's refusal, as the client reads it: an ``event: error`` frame with no ``id:`` (the cursor never
moves past an event not delivered), its reasons, and the in-process notice the replay sends through the SDK's
callback, which the guard's ASGI layer renders as that frame (docs/guard.md, "The error frame")."""

from __future__ import annotations

import json
from typing import Any, Final

from mcp.server.streamable_http import EventMessage
from mcp_types import JSONRPCNotification

from mcp_stream_exporter import semconv as sc
from mcp_stream_exporter.auth import NO_REQUIREMENT, AuthView, Requirement
from mcp_stream_exporter.exchange import request_id_of
from mcp_stream_exporter.sse import SSEFrame, SSEParser, render

REFUSAL_METHOD: Final = "notifications/mcp_stream/replay_refused"  # the in-process notice asgi() rewrites
# The ``error`` of a refusal frame: why the replay stopped (docs/guard.md, "The error frame").
INSUFFICIENT_AUDIENCE: Final = "insufficient_audience"
UNKNOWN_CURSOR: Final = "unknown_cursor"
REQUIREMENT_UNKNOWN: Final = "requirement_unknown"
TOKEN_UNVERIFIED: Final = "token_unverified"  # noqa: S105 (a refusal reason, not a secret)
AUDIENCE_UNKNOWN: Final = "audience_unknown"
PRINCIPAL_MISMATCH: Final = "principal_mismatch"
NO_REQUEST_CONTEXT: Final = "no_request_context"
AMBIGUOUS_REQUEST: Final = "ambiguous_request"
STORE_UNAVAILABLE: Final = "store_unavailable"
SESSION_OWNER_GONE: Final = "session_owner_gone"
SESSION_ENDED: Final = "session_ended"
STREAM_ENCODED: Final = "stream_encoded"

DETAILS: Final = {
    INSUFFICIENT_AUDIENCE: "the token's aud or scopes do not cover this event's call: re-authorise for "
                           "required_resources and resume from cursor",
    REQUIREMENT_UNKNOWN: "the guard has no record of what this event's call requires (never recorded or "
                         "evicted): re-issue the call",
    TOKEN_UNVERIFIED: "the token's signature did not verify: only a verified token's audience counts",
    AUDIENCE_UNKNOWN: "an opaque token's audience cannot be read: present a JWT access token covering "
                      "required_resources",
    PRINCIPAL_MISMATCH: "the token is another principal's than the one whose event this is (who posted its call, "
                        "or opened the session)",
    NO_REQUEST_CONTEXT: "the guard's ASGI layer is not in front of this server: no session or token to "
                        "check a replay against",
    AMBIGUOUS_REQUEST: "the resume carried more than one Authorization or Mcp-Session-Id header",
    UNKNOWN_CURSOR: "event id unknown or evicted in this session; re-issue the pending calls",
    STORE_UNAVAILABLE: "the guard's event storage is unavailable: resume from cursor later, or re-issue",
    SESSION_OWNER_GONE: "the server process that ran this session is gone and the call did not finish: "
                        "re-issue it",
    SESSION_ENDED: "the session was ended (deleted) or expired, or the guard's storage lost it, while the call was "
                   "pending: start a new session and re-issue it",
    STREAM_ENCODED: "a middleware inside the guard compresses this stream, whose events the guard must read: the "
                    "server's operator must compress outside the guard's ASGI layer",
}


def plain(error: str, cursor: str) -> dict[str, Any]:
    """A refusal that names no event: the request, the cursor or the storage is at fault, not a token's reach."""
    return {"error": error, "cursor": cursor, "detail": DETAILS[error]}


def refusal_data(error: str, event_id: str | None, stream_id: str, requirement: Requirement | None,
                 auth: AuthView, cursor: str) -> dict[str, Any]:
    """A refusal's data: the offending event (None: the stream's live tail), what its call requires, what the
    token lacks and holds, and the cursor to resume from."""
    known = requirement or NO_REQUIREMENT
    missing = auth.missing(known) if error == INSUFFICIENT_AUDIENCE else (known.resources, known.scopes)
    return {
        "error": error,
        "event_id": event_id,  # None: the live tail of the stream, not a buffered event
        "request_id": request_id_of(stream_id),
        "required_resources": sorted(known.resources),
        "required_scopes": sorted(known.scopes),
        "missing_resources": sorted(missing[0]),
        "missing_scopes": sorted(missing[1]),
        "token_audience": sorted(auth.audience),
        "cursor": cursor,  # resume from here with a token that covers the requirement
        "detail": DETAILS[error],
    }


def refusal_notice(data: dict[str, Any]) -> EventMessage:
    """The notice sent through the SDK's replay callback; ``asgi()`` renders it as ``event: error``."""
    return EventMessage(JSONRPCNotification(jsonrpc="2.0", method=REFUSAL_METHOD, params=data), None)


def span_attributes(mode: str, decision: str, refusal: dict[str, Any] | None) -> dict[str, Any]:
    attrs: dict[str, Any] = {sc.GUARD_MODE: mode, sc.GUARD_DECISION: decision}
    if refusal is None:
        return attrs
    attrs[sc.GUARD_REASON] = refusal["error"]
    attrs[sc.GUARD_CURSOR] = refusal["cursor"]
    if refusal.get("event_id") is not None:
        attrs[sc.GUARD_OFFENDING_EVENT_ID] = refusal["event_id"]
    if "missing_resources" in refusal:
        attrs[sc.GUARD_MISSING_RESOURCES] = refusal["missing_resources"]
        attrs[sc.GUARD_MISSING_SCOPES] = refusal["missing_scopes"]
    return attrs


def rewrite_refusal(chunk: bytes) -> bytes:
    """Render our refusal notices in a body chunk as ``event: error`` frames; leave the rest as is."""
    parser = SSEParser()
    frames = [*parser.feed(chunk), *parser.close()]
    out: list[bytes] = []
    for frame in frames:
        notice = _notice(frame)
        out.append(render(SSEFrame(json.dumps(notice), event="error")) if notice is not None else render(frame))
    return b"".join(out) if frames else chunk


def _notice(frame: SSEFrame) -> dict[str, Any] | None:
    if frame.id is not None or REFUSAL_METHOD not in frame.data:
        return None
    try:
        obj = json.loads(frame.data)
    except ValueError:
        return None
    params = obj.get("params") if isinstance(obj, dict) and obj.get("method") == REFUSAL_METHOD else None
    return params if isinstance(params, dict) else None


def sse_bytes(event: EventMessage) -> bytes:
    """An event as the SDK writes it (``event: message`` with its ``id:``), or a refusal notice as
    ``event: error``: the bytes of a resume this process answers itself."""
    message = event.message
    if event.event_id is None and isinstance(message, JSONRPCNotification) and message.method == REFUSAL_METHOD:
        return render(SSEFrame(json.dumps(message.params), event="error"))
    return render(SSEFrame(message.model_dump_json(by_alias=True, exclude_unset=True), event="message",
                           id=event.event_id))
