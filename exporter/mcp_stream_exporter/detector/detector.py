"""The detector: spans -> lifecycle events -> ledger and rules -> findings and metrics.

One instance serves every entry point (OTLP over HTTP or gRPC, the in-process span processor); they
all call :meth:`Detector.consume`. It is safe to call from several threads: one lock guards the
ledger, and the work under it is a few dictionary updates per span.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeGuard

from prometheus_client import CollectorRegistry

from mcp_stream_exporter import semconv as sc
from mcp_stream_exporter.detector.events import (
    CallEnd,
    Lifecycle,
    Operation,
    Rejected,
    Replay,
    Span,
    StreamEnd,
    lifecycle,
    read_by_rules,
)
from mcp_stream_exporter.detector.findings import Finding, FindingStore
from mcp_stream_exporter.detector.ledger import CallState, Ledger, LedgerLimits
from mcp_stream_exporter.detector.metrics import (
    SPAN_REJECTIONS,
    DetectorMetrics,
    LedgerCollector,
    OperationCounts,
    ToolLabels,
)
from mcp_stream_exporter.detector.rules import RuleConfig, RuleEngine
from mcp_stream_exporter.detector.timeline import TimelineLimits, Timelines

Clock = Callable[[], int]  # nanoseconds since the epoch, like span timestamps
Event = Lifecycle | OperationCounts  # what ``read`` hands to ``apply``


@dataclass(frozen=True, slots=True)
class DetectorConfig:
    rules: RuleConfig = field(default_factory=RuleConfig)
    ledger: LedgerLimits = field(default_factory=LedgerLimits)
    max_findings: int = 10_000
    max_findings_bytes: int = 32 * 1024 * 1024  # an estimate of the findings' size; oldest dropped first
    max_timelines_bytes: int = 16 * 1024 * 1024  # the findings page's call timelines (timeline.py)
    tools: tuple[str, ...] = ()  # the ToolPolicy's tools: the only tool label values besides `other`
    max_tool_labels: int = 20  # without a policy: the first tools seen, then `other`


@dataclass(slots=True)
class Outcome:
    """What became of a batch: how many spans were taken, and why any were refused."""

    accepted: int = 0
    rejected: dict[str, int] = field(default_factory=dict)

    @property
    def rejected_count(self) -> int:
        return sum(self.rejected.values())

    def message(self) -> str:
        return "; ".join(f"{n} span(s): {reason}" for reason, n in sorted(self.rejected.items()))


def _counts_twice(event: Lifecycle) -> TypeGuard[StreamEnd]:
    """Whether the same span taken twice would change a finding: a stream that delivered a terminal event
    (``duplicate_terminal``), or a resume (``resume_loop``). Every other event leaves the ledger as it
    found it the first time, and findings are raised once each."""
    return type(event) is StreamEnd and (event.kind == sc.STREAM_KIND_RESUME or bool(event.terminal_ids))


class Detector:
    def __init__(self, config: DetectorConfig | None = None, *, clock: Clock = time.time_ns,
                 registry: CollectorRegistry | None = None,
                 on_finding: Callable[[Finding], None] | None = None) -> None:
        self.config = config or DetectorConfig()
        self.clock = clock
        self.lock = threading.Lock()
        self.ledger = Ledger(self.config.ledger)
        tools = ToolLabels(self.config.tools, self.config.max_tool_labels)
        self.findings = FindingStore(self.config.max_findings, self.config.max_findings_bytes, tools.counted_as)
        self.timelines = Timelines(TimelineLimits(max_findings=self.config.max_findings,
                                                  max_bytes=self.config.max_timelines_bytes),
                                   self.ledger.sdk_span_call)
        self.registry = registry or CollectorRegistry()
        self.metrics = DetectorMetrics(self.registry, tools)
        self.registry.register(LedgerCollector(self.ledger, self.findings, (
            ("ledger", self.ledger, self.config.ledger.max_bytes),
            ("findings", self.findings, self.config.max_findings_bytes),
            ("timelines", self.timelines, self.config.max_timelines_bytes))))
        self.rules = RuleEngine(self.ledger, self.config.rules, self._found, self.findings.get,
                                self.metrics.contradicted)
        self._on_finding = on_finding
        # when /metrics was last read (the detector's clock): a finding counted after it Prometheus has not seen,
        # and a restore counts it again (``Snapshots``)
        self.scraped_ns = 0

    def read(self, spans: Iterable[Span | Lifecycle | Rejected | OperationCounts],
             transport: str) -> tuple[list[Event], Outcome]:
        """Spans -> lifecycle events, without touching the ledger (no lock: callers may run it on
        their own thread). A span that breaks the span model is refused with its reason; spans
        outside the model are taken and ignored. An OTLP reader may hand over a span already read: its
        event, or its refusal. The SDK's request spans (as spans, already read by an OTLP reader, or
        counted by it) are counted for the metrics in one :class:`OperationCounts` per batch; only those
        that rules read (``read_by_rules``) are events."""
        events: list[Event] = []
        counts = OperationCounts()
        outcome = Outcome()
        rejected = outcome.rejected
        for span in spans:
            if isinstance(span, Span):
                try:
                    event = lifecycle(span)
                except Rejected as refused:
                    reason = str(refused)
                    rejected[reason] = rejected.get(reason, 0) + 1
                    continue
            elif isinstance(span, OperationCounts):
                counts.merge(span)
                continue
            elif isinstance(span, Rejected):
                reason = str(span)
                rejected[reason] = rejected.get(reason, 0) + 1
                continue
            else:
                event = span
            if type(event) is Operation:
                counts.add(event)
                if read_by_rules(event):
                    events.append(event)
            else:
                outcome.accepted += 1
                if event is not None:
                    events.append(event)
        outcome.accepted += counts.taken  # the SDK's request spans, and any an OTLP reader skipped
        if counts:
            events.append(counts)
        self.metrics.spans_received.labels(transport).inc(outcome.accepted + outcome.rejected_count)
        if outcome.rejected:
            self.metrics.spans_rejected.labels(SPAN_REJECTIONS[0]).inc(outcome.rejected_count)
        return events, outcome

    def apply(self, events: Iterable[Event], *, judge: bool = True) -> None:
        """Lifecycle events -> ledger, rules, findings and metrics; then, with ``judge``, the grace-period rules
        against the clock (not for a batch's part that the rest of the batch follows: a timer due meanwhile
        would judge a call its later events answer)."""
        with self.lock:
            now = self.clock()
            for event in events:
                if isinstance(event, OperationCounts):
                    self.metrics.operations.add(event)
                    continue
                if _counts_twice(event) and not self.ledger.first_sight(event.at.trace_id, event.at.span_id,
                                                                         event.at.scope):
                    continue  # delivered again (an exporter's retry): taken once
                self.timelines.record(event)
                if isinstance(event, StreamEnd):
                    self.metrics.stream_end(event)
                    self.rules.stream(event, now)
                elif isinstance(event, CallEnd):
                    self.rules.call(event, now)
                elif isinstance(event, Replay):
                    self.rules.replay(event, now)
                else:
                    self.rules.operation(event, now)
            if judge:
                self.rules.tick(now)
            self.ledger.account()
            self.metrics.flush()

    def consume(self, spans: Iterable[Span | Lifecycle | Rejected | OperationCounts],
                transport: str = "embedded") -> Outcome:
        """Read and apply a batch on the caller's thread."""
        events, outcome = self.read(spans, transport)
        self.apply(events)
        return outcome

    def tick(self) -> None:
        """Run the grace-period rules against the clock; call it periodically when idle."""
        with self.lock:
            self.rules.tick(self.clock())
            self.ledger.account()
            self.metrics.flush()

    def stuck_calls(self, limit: int) -> tuple[list[dict[str, Any]], int]:
        """The calls ``mcp_stream_calls_stuck`` counts (in flight, no sign of life for ``stuck_after_s``), the first
        ``limit`` as JSON, and how many there are: a stuck call may have no finding, and this is how the on-call
        finds its session, request id and trace."""
        with self.lock:
            now = self.clock()
            listed: list[dict[str, Any]] = []
            total = 0
            for call in self.ledger.stuck_calls(now, int(self.config.rules.stuck_after_s * 1e9)):
                total += 1
                if len(listed) < limit:
                    listed.append({
                        "session_id": call.scope if not call.scope.startswith("trace:") else None,
                        "request_id": call.request_id, "tool": call.tool, "era": call.era,
                        "owed_for_s": round((now - (call.owed_since or now)) / 1e9, 1),
                        "required": list(call.required), "roles": sorted(call.roles),
                        "trace_id": call.trace_id, "span_ids": list(call.span_ids)})
            return listed, total

    def _found(self, finding: Finding, call: CallState | None) -> None:
        if self.findings.add(finding):
            self.timelines.attach(finding, call.scope if call is not None else None)
            self.metrics.finding(finding)
            if self._on_finding is not None:
                self._on_finding(finding)
