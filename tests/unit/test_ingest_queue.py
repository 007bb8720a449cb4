"""The ingest queue's worker: a batch applied in parts, the detector's lock let go between, judged as one."""

from __future__ import annotations

from mcp_stream_exporter import semconv as sc
from mcp_stream_exporter.detector import Detector, DetectorConfig, RuleConfig
from mcp_stream_exporter.detector.ingest import IngestLimits, IngestQueue

from spans import Clock, S, call, stream

C = sc.ROLE_CLIENT


def test_a_batch_applied_in_parts_is_judged_once_all_of_it_is_in():
    """A grace that ran out while a batch waited is judged after the whole batch: not after its first part, when
    a later part holds the call's delivery (a loss paged that the batch itself disproves)."""
    clock = Clock()
    detector = Detector(DetectorConfig(rules=RuleConfig(clean_end_grace_s=5)), clock=clock)
    detector.consume([stream(C, "resume", "clean", pending=("3",), cursor="6")])  # call 3 pending after a clean end
    clock.now += 6 * S  # the next batch waited in the queue past the grace
    others = [call(C, sc.OUTCOME_RESULT, session=f"other{i}", request_id="1", at=2.0) for i in range(600)]
    delivered = stream(C, "resume", "clean", cursor="6", terminal=("3",), last="9", at=2.0)
    events, _ = detector.read([*others, delivered], "otlp_http")
    queue = IngestQueue(detector, IngestLimits(), tick_interval_s=3600)
    try:
        assert queue.offer(events) and queue.wait_idle(30)
    finally:
        queue.close()
    assert list(detector.findings) == [] and detector.ledger.in_flight == 0


def test_slow_bodies_make_way_only_when_that_makes_room_and_the_fewest_longest_first():
    """A slow body evicted for nothing wastes its sender's upload and helps no one: none makes way unless enough do."""
    queue = IngestQueue(Detector(), IngestLimits(max_buffered_bytes=1024, body_grace_s=0.0), tick_interval_s=3600)
    woken: list[str] = []
    try:
        assert queue.reserve(900)  # a gRPC message in whole: it never makes way
        slow = queue.hold(lambda: woken.append("slow"))
        assert queue.reserve(20, slow)
        assert not queue.reserve(200, queue.hold(lambda: woken.append("new"))) and woken == [] and not slow.evicted
        later = queue.hold(lambda: woken.append("later"))
        queue.release(900)
        assert queue.reserve(500, later) and queue.reserve(400, slow)
        assert queue.reserve(300)  # the longest-held (``slow``, 420) is enough
        assert woken == ["slow"] and slow.evicted and not later.evicted and queue.buffered == 800
        queue.let_go(slow)
        queue.let_go(later)
        queue.release(300)
        assert queue.buffered == 0
        tiny, small, large = (queue.hold(lambda name=name: woken.append(name)) for name in ("tiny", "small", "large"))
        assert queue.reserve(10, tiny) and queue.reserve(10, small) and queue.reserve(900, large)
        assert queue.reserve(500) and woken[1:] == ["large"]  # the one that makes room alone, not the two before it
        assert not queue.reserve(1, large)  # one that made way has no room made for it
        for hold in (tiny, small, large):
            queue.let_go(hold)
        queue.release(500)
        assert queue.buffered == 0
    finally:
        queue.close()
