"""What the server hooks' EventStore wrapper keeps of each stream: bounded, oldest first out."""

from __future__ import annotations

import pytest
from mcp_types import JSONRPCNotification
from opentelemetry.sdk.trace import TracerProvider

from mcp_stream_exporter import semconv as sc
from mcp_stream_exporter.hooks._recorder import StoreRecorder
from mcp_stream_exporter.hooks._tracking import DeviationTracer, Requirements, Tracker


def _recorder(**bounds: int) -> StoreRecorder:
    tracer = DeviationTracer(TracerProvider())
    return StoreRecorder(Tracker(tracer, sc.ROLE_SERVER), tracer, Requirements(10), **bounds)


@pytest.mark.parametrize("bound", [0, 1, 2, 5])
def test_a_stream_keeps_its_last_events_up_to_the_bound(bound):
    recorder = _recorder(max_events_per_stream=bound)
    events = ["1", "2", "3", "4"]
    for event_id in events:
        recorder.on_stored("s", "7", event_id, JSONRPCNotification(jsonrpc="2.0", method="notifications/progress"))
    assert recorder.buffered_after("s", "7", "unknown-cursor") == events[len(events) - min(bound, 4):]


def test_negative_bounds_are_refused_rather_than_silently_keeping_nothing():
    with pytest.raises(ValueError, match="must not be negative"):
        _recorder(max_events_per_stream=-1)
    with pytest.raises(ValueError, match="must not be negative"):
        _recorder(max_streams=-1)
