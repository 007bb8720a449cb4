"""The hooks' call book-keeping (``hooks._tracking.Tracker``), where the wire breaks the protocol."""

from __future__ import annotations

from mcp_stream_exporter import semconv as sc
from mcp_stream_exporter.auth import ABSENT
from mcp_stream_exporter.hooks._tracking import DeviationTracer, Tracker
from mcp_stream_exporter.wire import TOOLS_CALL, request_message


def test_a_request_id_reused_while_its_call_is_pending_does_not_replace_the_tracked_call():
    """MCP forbids reusing an id in a session (the guard answers 409): the pending call stays the one its id finds."""
    tracker = Tracker(DeviationTracer(), sc.ROLE_SERVER)
    pending = tracker.start_call("s1", request_message(5, TOOLS_CALL, {"name": "fetch"}), "2025-11-25", ABSENT, False)
    reused = tracker.start_call("s1", request_message(5, TOOLS_CALL, {"name": "search"}), "2025-11-25", ABSENT, False)
    assert tracker.call(("s1", "5")) is pending and reused is not pending and not pending.done
    assert tracker.call(("s2", "5")) is None
