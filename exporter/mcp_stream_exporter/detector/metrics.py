"""The detector's Prometheus metrics: defined once, here, with help texts an on-call reader can act on.

Label values are bounded: tools by :class:`ToolLabels` (the policy's tools, else the first few seen,
then ``other``), methods, error types, transports and protocol versions by fixed sets. Session, request
and trace ids never become labels; a trace id rides on the loss counters and the duration histograms'
buckets as an OpenMetrics exemplar instead.
"""

from __future__ import annotations

import re
import threading
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Sequence
from importlib.metadata import version
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.samples import Exemplar

from mcp_stream_exporter import semconv as sc
from mcp_stream_exporter.detector.events import Operation, StreamEnd
from mcp_stream_exporter.detector.findings import Finding, FindingStore
from mcp_stream_exporter.detector.ledger import Ledger
from mcp_stream_exporter.detector.rules import RULES
from mcp_stream_exporter.redaction import redact

OTHER = "other"
# semconv mcp.{client,server}.operation.duration advisory buckets, in seconds
SEMCONV_DURATION_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30, 60, 120, 300)
_METHODS = frozenset({
    "initialize", "ping", "tools/list", "tools/call", "resources/list", "resources/read", "resources/templates/list",
    "resources/subscribe", "resources/unsubscribe", "prompts/list", "prompts/get", "completion/complete",
    "logging/setLevel", "sampling/createMessage", "elicitation/create", "roots/list",
    "notifications/initialized", "notifications/cancelled", "notifications/progress", "notifications/message",
    "notifications/roots/list_changed", "notifications/tools/list_changed", "notifications/resources/updated",
    "notifications/resources/list_changed", "notifications/prompts/list_changed",
})
_JSONRPC_CODES = frozenset(str(c) for c in (-32700, -32600, -32601, -32602, -32603, *range(-32099, -31999)))
_ROLES = (sc.ROLE_CLIENT, sc.ROLE_SERVER)
MAX_OPERATION_SERIES = 2_000  # the duration histograms' label sets, both roles: a few MB, some 34,000 lines
_ERROR_TYPES = frozenset({"tool_error", "timeout", "error"}) | _JSONRPC_CODES
# semconv network.transport's well-known values, and the MCP protocol versions (eras) there are; absent: ""
_NETWORK_TRANSPORTS: dict[str | None, str] = {None: "", **{t: t for t in ("tcp", "quic", "udp", "pipe", "unix")}}
_PROTOCOL_VERSIONS: dict[str | None, str] = {
    None: "", **{v: v for v in ("2024-11-05", "2025-03-26", "2025-06-18", "2025-11-25", "2026-07-28")}}
# every label value known up front is exported at 0 from the start, so that increase() and rate()
# see the first event (a series born at 1 has no increase) and dashboards show 0, not "no data"
TRANSPORTS = ("otlp_http", "otlp_grpc", "embedded")
INGEST_REJECTIONS = ("too_large", "bad_encoding", "malformed", "unauthorized", "too_many_spans", "queue_full",
                     "busy", "timeout")
SPAN_REJECTIONS = ("span_model",)
RESUME_OUTCOMES = ("delivered", "progressed", "empty", "refused", "dropped", "closed", "http_error")
ERROR_PLACES = ("ingest", "snapshot")
# a tool name as MCP defines it (1-128 of these characters); a dynamic tool label is shorter still
_TOOL_NAME = re.compile(r"[A-Za-z0-9_.\-/]{1,64}", re.ASCII)


class ToolLabels:
    """Bounded ``tool`` label values: the policy's tools, or the first ``dynamic`` tools seen, then ``other``."""

    def __init__(self, known: Iterable[str] | None = None, dynamic: int = 20) -> None:
        self._seen: set[str] = set(known or ())
        self._fixed = bool(self._seen)
        self._dynamic = dynamic
        self.learned: Callable[[str], None] | None = None  # told each tool learned from the spans, once

    def __call__(self, tool: str | None) -> str:
        if tool is None:
            return OTHER
        if tool in self._seen:
            return tool
        if (not self._fixed and len(self._seen) < self._dynamic and _TOOL_NAME.fullmatch(tool)
                and redact(tool) == tool):
            self._seen.add(tool)
            if self.learned is not None:
                self.learned(tool)
            return tool
        return OTHER

    def counted_as(self, tool: str | None) -> str:
        """The label ``tool`` is counted under, learning nothing: what an alert's ``tool`` names of a finding."""
        return tool if tool is not None and tool in self._seen else OTHER

    @property
    def initial(self) -> tuple[str, ...]:
        """The values known before any span: the policy's tools, and ``other``."""
        return (*sorted(self._seen), OTHER)


BOUNDS = (*SEMCONV_DURATION_BUCKETS, float("inf"))
_LE = (*(repr(float(b)) for b in SEMCONV_DURATION_BUCKETS), "+Inf")  # as prometheus_client writes them


_Key = tuple[str, str, str | None, str, str | None, str | None]  # role, method, tool, error, transport, version
# a bucket's exemplar: the trace and span id (hex, W3C lengths), the duration and the span's end in seconds
Sample = tuple[str, str, float, float]
_KEY_BYTES = 1200  # a key's tuple and strings, its two lists and its dict slot
_SAMPLE_BYTES = 300  # a Sample: its tuple, two hex ids, two floats


class OperationCounts:
    """The SDK's request spans of one batch, counted per (role, method, tool, error, transport, protocol
    version): what the semconv duration histograms and the calls counter take, added to them at once
    (``Operations.add``) instead of span by span, with the last span of the batch in each bucket (its
    exemplar). The method and the error are from their closed sets already; the tool (``ToolLabels``
    keeps state), the transport and the protocol version are mapped to their labels when added, once
    per batch and key rather than per span.

    ``taken`` is how many spans of the batch these counts stand for: an OTLP reader counts the SDK's
    healthy request spans here without an :class:`Operation` each, and skips spans outside the model."""

    __slots__ = ("counts", "taken")

    def __init__(self, counts: dict[_Key, tuple[list[float], list[Sample | None]]] | None = None,
                 taken: int = 0) -> None:
        # key -> ([count per bucket (+Inf last), sum of durations], [the last span per bucket])
        self.counts = counts if counts is not None else {}
        self.taken = taken

    @staticmethod
    def key(e: Operation) -> _Key:
        method = e.method if e.method in _METHODS else OTHER
        error = "timeout" if e.timed_out else ("" if e.error_type is None else
                                               e.error_type if e.error_type in _ERROR_TYPES else OTHER)
        return (e.role, method, e.tool, error, e.transport, e.protocol_version)

    def add(self, e: Operation) -> None:
        self.taken += 1
        entry = self.counts.get(key := self.key(e))
        if entry is None:
            entry = self.counts[key] = new_tally()
        counts, last = entry
        bucket = bisect_left(BOUNDS, e.duration_s)
        counts[bucket] += 1
        counts[-1] += e.duration_s
        if len(e.trace_id) <= 32 and len(e.span_id) <= 16:
            # only a span that can be an exemplar is kept: ids longer than W3C's would break OpenMetrics'
            # 128 characters of exemplar labels (and Prometheus' whole scrape), and are not held for nothing
            last[bucket] = (e.trace_id, e.span_id, e.duration_s, e.start_ns / 1e9 + e.duration_s)

    def merge(self, other: OperationCounts) -> None:
        self.taken += other.taken
        if not self.counts:
            self.counts = other.counts
            return
        for key, (counts, last) in other.counts.items():
            mine = self.counts.get(key)
            if mine is None:
                self.counts[key] = (counts, last)
            else:
                _add_tally(mine, counts, last)

    def __bool__(self) -> bool:
        return bool(self.counts)

    def weight(self) -> int:
        """About the bytes it holds while it waits in the ingest queue, as ``sizes.event`` counts an
        event's, without walking every span it keeps."""
        return sum(_KEY_BYTES + _SAMPLE_BYTES * (len(last) - last.count(None)) for _, last in self.counts.values())


def new_tally() -> tuple[list[float], list[Any]]:
    """A key's counts per bucket (+Inf, then the sum of durations) and its last span per bucket."""
    return [0.0] * (len(BOUNDS) + 1), [None] * len(BOUNDS)


def _add_tally(total: tuple[list[float], list[Sample | None]], counts: list[float],
               last: list[Sample | None]) -> None:
    for i, n in enumerate(counts):
        total[0][i] += n
    for i, sample in enumerate(last):
        if sample is not None:
            total[1][i] = sample


class Operations(Collector):
    """The semconv ``mcp.{client,server}.operation.duration`` histograms and ``mcp_stream_calls``, kept as
    plain counts per label set and exposed at scrape time: one dictionary update per batch and label set.
    Each bucket keeps the last span that landed in it, exposed as its exemplar (trace and span id, the
    duration, the span's end) in the OpenMetrics format only. Each label is of a closed set, but their
    product is millions: past ``MAX_OPERATION_SERIES`` label sets, a new one is counted under its role with
    every other label ``other``."""

    def __init__(self, tools: ToolLabels) -> None:
        self._tools = tools
        self._lock = threading.Lock()
        # (role, method, tool, error, transport, protocol version) -> (counts as in OperationCounts, last spans)
        self._histograms: dict[tuple[str, ...], tuple[list[float], list[Sample | None]]] = {}
        self._calls: dict[tuple[str, str, str], float] = {}  # (role, tool, outcome)

    def add(self, batch: OperationCounts) -> None:
        with self._lock:
            for (role, method, tool, error, transport, protocol), (counts, last) in batch.counts.items():
                key = (role, method, self._tools(tool) if tool is not None else "", error,
                       _NETWORK_TRANSPORTS.get(transport, OTHER), _PROTOCOL_VERSIONS.get(protocol, OTHER))
                total = self._histograms.get(key)
                if total is None and len(self._histograms) >= MAX_OPERATION_SERIES:
                    key = (role, OTHER, OTHER, OTHER, OTHER, OTHER)
                    total = self._histograms.get(key)
                if total is None:
                    self._histograms[key] = (list(counts), list(last))
                else:
                    _add_tally(total, counts, last)
                if method == "tools/call":
                    outcome = "result" if not error else (error if error in ("tool_error", "timeout") else "error")
                    calls = (role, self._tools(tool), outcome)
                    self._calls[calls] = self._calls.get(calls, 0) + sum(counts[:-1])

    def collect(self) -> Iterator[Any]:
        labels = ["mcp_method_name", "gen_ai_tool_name", "error_type", "network_transport", "mcp_protocol_version"]
        client = HistogramMetricFamily(
            "mcp_client_operation_duration_seconds", "Semconv mcp.client.operation.duration: an MCP request as "
            "the client saw it, from sending to its response (including any reconnect and replay time).",
            labels=labels)
        server = HistogramMetricFamily(
            "mcp_server_operation_duration_seconds", "Semconv mcp.server.operation.duration: an MCP request as "
            "the server handled it.", labels=labels)
        calls = CounterMetricFamily(
            "mcp_stream_calls", "tools/call operations finished, by the side that saw them (role), tool and "
            "outcome (result, tool_error, error, timeout), from the SDK's own request spans.",
            labels=["role", "tool", "outcome"])
        with self._lock:
            histograms = [(key, list(counts), list(last)) for key, (counts, last) in self._histograms.items()]
            totals = list(self._calls.items())
        for (role, *values), counts, last in histograms:
            cumulative = 0.0
            buckets: list[tuple[str, float] | tuple[str, float, Exemplar]] = []
            for le, n, sample in zip(_LE, counts, last, strict=False):
                cumulative += n
                buckets.append((le, cumulative) if sample is None else (le, cumulative, _exemplar(sample)))
            (client if role == sc.ROLE_CLIENT else server).add_metric(values, buckets, counts[-1])
        for key, value in totals:
            calls.add_metric(list(key), value)
        yield client
        yield server
        yield calls


def _exemplar(sample: Sample) -> Exemplar:
    trace_id, span_id, duration_s, end_s = sample
    return Exemplar({"trace_id": trace_id, "span_id": span_id}, duration_s, end_s)


def _closed(value: str, allowed: tuple[str, ...]) -> str:
    return value if value in allowed else OTHER


def _resume_outcome(e: StreamEnd) -> str:
    if e.reason == sc.END_HTTP_ERROR:
        return "http_error"
    if e.error_frames:
        return "refused"
    if any(t in e.request_ids for t in e.terminal_ids):
        return "delivered"
    if e.reason == sc.END_DROPPED:
        return "dropped"
    if e.reason in (sc.END_CLOSED, sc.END_TERMINATED):  # the client closed it, or deleted its session
        return "closed"
    return "progressed" if e.last_event_id is not None and e.last_event_id != e.cursor else "empty"


class DetectorMetrics:
    def __init__(self, registry: CollectorRegistry, tools: ToolLabels) -> None:
        self.registry = registry
        self.tools = tools
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        # stream ends of the batch being applied, by (role, kind, reason, (resume outcome, gap tool label))
        self._stream_ends: dict[tuple[str, str, str, tuple[str, str | None] | None], int] = {}
        self._findings: dict[tuple[str, str, str], int] = {}  # new findings of the batch, by (rule, severity, tool)
        self.silent_losses = Counter(
            "mcp_stream_silent_losses", "Tool calls whose result never reached the caller (or a wrong one did) "
            "without any error, by tool and rule. Any increase is a lost result: see /api/findings?rule=<rule>.",
            ["tool", "rule"], registry=registry)
        self.findings = Counter(
            "mcp_stream_findings", "Findings raised by the detector, by rule, severity and tool; details and "
            "evidence at /api/findings?rule=<rule>&tool=<tool>.", ["rule", "severity", "tool"], registry=registry)
        self._contradicted = Counter(
            "mcp_stream_findings_contradicted", "Losses paged (a result that never reached its caller) whose call a "
            "later span showed delivered while its caller still waited, by rule: the page was wrong, the spans that "
            "would have held it back having come past the grace. Cut the export delay or raise clean_end_grace_s; "
            "the finding's evidence has delivered_after.", ["rule"], registry=registry)
        self.resumes = Counter(
            "mcp_stream_resumes", "Resume streams (GET with Last-Event-ID) by role and outcome: delivered, "
            "progressed, empty (clean end, nothing sent: the incident's shape), refused (an explicit error frame), "
            "dropped, closed, http_error.", ["role", "outcome"], registry=registry)
        self.audience_gaps = Counter(
            "mcp_stream_audience_gaps", "Resumes whose token lacks a resource or scope the pending call requires "
            "(the superset-audience invariant broken), by role and tool. Fix: resume with a superset token.",
            ["role", "tool"], registry=registry)
        self.stream_ends = Counter(
            "mcp_stream_stream_ends", "MCP streams that told something about a call's fate, by role, kind "
            "(post, get, resume, delete) and end reason (clean, dropped, closed, http_error, terminated: its session's "
            "DELETE ended it). Healthy calls "
            "answered on their own POST are not counted here.", ["role", "kind", "reason"], registry=registry)
        self.operations = Operations(tools)
        registry.register(self.operations)
        self.spans_received = Counter(
            "mcp_stream_detector_spans_received", "Spans received by the detector, by transport.",
            ["transport"], registry=registry)
        self.spans_rejected = Counter(
            "mcp_stream_detector_spans_rejected", "Spans the detector refused, by reason; the sender was told "
            "(OTLP partial success). A rising rate means a peer emits spans that break docs/span-model.md.",
            ["reason"], registry=registry)
        self.requests_rejected = Counter(
            "mcp_stream_detector_ingest_requests_rejected", "Ingest requests refused whole, by reason "
            "(too_large, bad_encoding, malformed, unauthorized, too_many_spans, queue_full, busy, timeout). "
            "queue_full and busy (every decoding slot or the body buffer taken) mean backpressure: scale out or "
            "raise the bounds; timeout, a body sent too slowly.", ["reason"], registry=registry)
        self.errors = Counter(
            "mcp_stream_detector_errors", "Internal errors, by where (ingest: a batch not applied; snapshot: a "
            "snapshot not written or not read). Each one is logged with its cause.", ["where"], registry=registry)
        self.ingest_latency = Histogram(
            "mcp_stream_detector_ingest_duration_seconds", "Time from a batch's arrival to its spans being in "
            "the ledger, queueing included.", buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5),
            registry=registry)
        self.snapshot_time = Gauge(
            "mcp_stream_detector_snapshot_timestamp_seconds", "When the ledger was last written to (or read from) "
            "its SQLite snapshot; 0 with snapshots off. Older than --snapshot-interval-s means writes fail and a "
            "restart would lose more than the interval.", registry=registry)
        self.unjudged_calls = Counter(
            "mcp_stream_detector_unjudged_calls", "Calls a restore from the snapshot did not judge: owed a result as "
            "it was taken, and their spans may be lost since (a crash after it; a downtime longer than "
            "--senders-retry-s). A loss among them is not found. Rises at a crash; after a deploy, raise "
            "--senders-retry-s to what the senders retry, or shorten the downtime.", registry=registry)
        self.ingest_queue_spans = Gauge(
            "mcp_stream_detector_ingest_queue_spans", "Spans accepted over OTLP and waiting for the ledger; at "
            "--max-queued-spans (or the queue's share of --max-memory-mb) ingest answers 429. 0 when embedded.",
            registry=registry)
        Gauge("mcp_stream_detector_build_info", "The detector's version; always 1.", ["version"],
              registry=registry).labels(version("mcp-stream-exporter")).set(1)
        ProcessCollector(registry=registry)  # process_*: the CPU, memory and file descriptors of its process
        for tool in tools.initial:
            self._zeroed(tool)
        tools.learned = self._zeroed
        for role in _ROLES:
            for outcome in RESUME_OUTCOMES:
                self.resumes.labels(role, outcome)
        for transport in TRANSPORTS:
            self.spans_received.labels(transport)
        for reason in SPAN_REJECTIONS:
            self.spans_rejected.labels(reason)
        for reason in INGEST_REJECTIONS:
            self.requests_rejected.labels(reason)
        for where in ERROR_PLACES:
            self.errors.labels(where)
        for rule in RULES.values():
            if rule.loss:
                self._contradicted.labels(rule.id)

    def _zeroed(self, tool: str) -> None:
        """A tool's finding series, exported at 0 from when the detector knows the tool (its policy, or its first
        span): a series born at its first count has no ``increase()``, and its alert and dashboards would read it
        as 0 (the alert rules hold it for 10 minutes by its instant value alone, which one missed scrape or a
        restart drops)."""
        for rule in RULES.values():
            self.findings.labels(rule.id, rule.severity, tool)
            if rule.loss:
                self.silent_losses.labels(tool, rule.id)
        for role in _ROLES:
            self.audience_gaps.labels(role, tool)

    def finding(self, f: Finding) -> None:
        """A new finding: counted here, added to ``findings`` by :meth:`flush`; a loss at once, with its exemplar."""
        tool = self.tools(f.tool)
        key = (f.rule, f.severity, tool)
        self._findings[key] = self._findings.get(key, 0) + 1
        if RULES[f.rule].loss:
            exemplar = {"trace_id": f.trace_ids[0]} if f.trace_ids else None
            self._child(self.silent_losses, tool, f.rule).inc(exemplar=exemplar)

    def contradicted(self, f: Finding) -> None:
        """A loss paged whose call a later span showed delivered to its waiting caller (``RuleEngine``)."""
        self._contradicted.labels(f.rule).inc()

    def stream_end(self, e: StreamEnd) -> None:
        """Counted here, added to the counters by :meth:`flush`: one ``inc`` per label set and batch, not
        three per stream (a counter's ``inc`` takes a lock)."""
        if e.reason == sc.END_OPEN:
            return  # a resume still open, told early (docs/span-model.md): counted when it ends
        resume = None
        if e.kind == sc.STREAM_KIND_RESUME:
            # the tool label now, not at flush: ToolLabels takes the first tools seen, in the order they come
            resume = (_resume_outcome(e), self.tools(e.tool) if e.token.gap else None)
        key = (e.at.role, e.kind, e.reason, resume)
        self._stream_ends[key] = self._stream_ends.get(key, 0) + 1

    def flush(self) -> None:
        """Add what :meth:`stream_end` and :meth:`finding` counted to the counters (at the end of each batch
        and tick)."""
        for (rule, severity, tool), n in self._findings.items():
            self._child(self.findings, rule, severity, tool).inc(n)
        self._findings.clear()
        for (role, kind, reason, resume), n in self._stream_ends.items():
            self._child(self.stream_ends, role, _closed(kind, sc.STREAM_KINDS), _closed(reason, sc.END_REASONS)).inc(n)
            if resume is not None:
                outcome, gap_tool = resume
                self._child(self.resumes, role, outcome).inc(n)
                if gap_tool is not None:
                    self._child(self.audience_gaps, role, gap_tool).inc(n)
        self._stream_ends.clear()

    def _child(self, metric: Counter, *values: str) -> Any:
        """``metric.labels(*values)``, remembered: label values come from closed sets, so this stays small."""
        key = (id(metric), values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*values)
        return child


class Sized(Protocol):
    """A part of the detector's state that keeps an estimate of its size."""

    @property
    def bytes(self) -> int: ...


class LedgerCollector(Collector):
    """The ledger's and the findings' size, read at scrape time (gauges can go down; evictions only up)."""

    def __init__(self, ledger: Ledger, findings: FindingStore, parts: Sequence[tuple[str, Sized, int]]) -> None:
        self._ledger = ledger
        self._findings = findings
        self._parts = parts  # (part, what keeps its size in ``bytes``, its budget in bytes)

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        ledger = self._ledger
        yield GaugeMetricFamily("mcp_stream_calls_in_flight", "Calls a stream ended on without their result "
                                "and still owed one: not once their caller gave up or was told they failed, or "
                                "nothing can deliver them (deviating calls only; healthy calls are never tracked).",
                                value=ledger.in_flight)
        yield GaugeMetricFamily("mcp_stream_calls_stuck", "Calls in flight that no span of ours has shown moving "
                                "on for 15 minutes since they were owed: owed a result that neither came nor was "
                                "declared lost. Counted every 10 seconds.", value=ledger.stuck)
        yield GaugeMetricFamily("mcp_stream_detector_ledger_sessions", "Sessions (or traces, 2026-07-28) the "
                                "ledger holds.", value=ledger.sessions)
        yield GaugeMetricFamily("mcp_stream_detector_ledger_calls", "Calls the ledger holds.", value=ledger.calls)
        yield GaugeMetricFamily("mcp_stream_detector_findings_retained", "Findings kept for /api/findings.",
                                value=len(self._findings))
        size = GaugeMetricFamily("mcp_stream_detector_state_bytes", "The detector's estimate of what its state "
                                 "holds, in bytes, by part (ledger, findings, timelines).", labels=["part"])
        budget = GaugeMetricFamily("mcp_stream_detector_state_budget_bytes", "The budget of each part of the "
                                   "state (from --max-memory-mb); past it the oldest sessions (ledger) or findings "
                                   "are dropped.", labels=["part"])
        for part, sized, limit in self._parts:
            size.add_metric([part], sized.bytes)
            budget.add_metric([part], limit)
        yield size
        yield budget
        evictions = CounterMetricFamily("mcp_stream_detector_ledger_evictions", "Sessions and calls evicted from "
                                        "the ledger, by reason (ttl, capacity, memory). Capacity and memory "
                                        "evictions mean the ledger is too small: losses there go undetected.",
                                        labels=["reason"])
        for reason, count in sorted(ledger.evictions.items()):
            evictions.add_metric([reason], count)
        yield evictions
