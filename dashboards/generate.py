"""Grafana dashboards as code: ``python dashboards/generate.py`` writes the committed JSON beside it.

Built with the pinned grafana-foundation-sdk (pyproject's dev extra). Classic dashboard JSON, the form
file provisioning and kube-prometheus-stack's sidecar read. tests/unit/test_dashboards.py checks that
the JSON matches this generator and applies the dashboard-linter rules.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from grafana_foundation_sdk.builders import common, dashboard, prometheus, stat, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.common import GraphThresholdsStyleMode
from grafana_foundation_sdk.models.dashboard import (
    DashboardLinkType,
    DataSourceRef,
    Threshold,
    ThresholdsMode,
    VariableOption,
    VariableRefresh,
    VariableSort,
)

from mcp_stream_exporter.detector.ui import RUNBOOK_BASE_URL

HERE = Path(__file__).resolve().parent
TAGS = ["mcp-stream-exporter"]
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
SEL = 'job=~"$job", instance=~"$instance"'  # every query: the linter's job and instance rules
# a series every target has (``up``, the client libraries' ``process_*``), kept to the detectors': with the variables'
# "All" (the linter's ``.+``) it would match whatever else Prometheus scrapes
OF_DETECTORS = f"and on (job, instance) mcp_stream_detector_build_info{{{SEL}}}"
DETECTOR_URL = "http://127.0.0.1:9464"  # the detector's external URL, a text box: its findings page is <url>/ui/
ANY = 1e-6  # a threshold for "any at all" on a per-second rate (one event in hours still crosses it)
# thresholds: (from this value up, colour); the first step is the base colour (Grafana's -Infinity)
Steps = list[tuple[float | None, str]]
QUIET_IS_GOOD: Steps = [(None, "green"), (ANY, "red")]
# every query's min step: the chart's scrape interval (serviceMonitor.interval), so that $__rate_interval spans at least
# four scrapes (Grafana takes a query's min step for the scrape interval); with the data source's default 15 s it
# spanned two, and one missed scrape blanked a panel
SCRAPE_INTERVAL = "30s"


def _query(expr: str, legend: str = "", ref: str = "A") -> prometheus.Dataquery:
    return (prometheus.Dataquery().expr(expr).legend_format(legend or "__auto").ref_id(ref).exemplar(True)
            .interval(SCRAPE_INTERVAL))


def _either_side(metric: str, by: str = "", matchers: str = "") -> str:
    """The per-second rate of ``metric`` as the side that saw more of it: with both sides instrumented each counts
    the same resume or call once, and a sum across ``role`` counted it twice."""
    inner = f"sum by (role{', ' + by if by else ''}) (rate({metric}{{{SEL}{matchers}}}[$__rate_interval]))"
    return f"max by ({by}) ({inner})" if by else f"max({inner})"


def _variables(board: dashboard.Dashboard, metric: str = "mcp_stream_detector_build_info") -> dashboard.Dashboard:
    """Data source, job and instance (the targets exporting ``metric``), as the dashboard linter expects them."""
    def query_variable(name: str, query: str) -> dashboard.QueryVariable:
        return (dashboard.QueryVariable(name).label(name).datasource(DATASOURCE).query(query)
                .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED).sort(VariableSort.ALPHABETICAL_ASC)
                .multi(True).include_all(True).all_value(".+")
                .current(VariableOption(selected=True, text="All", value="$__all")))

    return (board
            .with_variable(dashboard.DatasourceVariable("datasource").label("Data source").type("prometheus"))
            .with_variable(query_variable("job", f"label_values({metric}, job)"))
            .with_variable(query_variable("instance", f'label_values({metric}{{job=~"$job"}}, instance)'))
            .with_variable(dashboard.TextBoxVariable("detector_url").label("Detector URL")
                           .description("The detector's external URL; the findings links open <url>/ui/.")
                           .default_value(DETECTOR_URL)
                           .current(VariableOption(selected=True, text=DETECTOR_URL, value=DETECTOR_URL))))


def _findings_link(title: str, query: str = "") -> dashboard.DashboardLink:
    """A link to the detector's findings page (``/ui/``): the lost calls' timelines, newest first."""
    return (dashboard.DashboardLink(title).type(DashboardLinkType.LINK).url(f"${{detector_url}}/ui/{query}")
            .tooltip("The detector's findings page: each lost call's timeline, the gap, what to do")
            .target_blank(True))


def _api_link(title: str, query: str = "") -> dashboard.DashboardLink:
    """A link to the findings as JSON (``/api/findings``), the evidence each alert's description names."""
    return (dashboard.DashboardLink(title).type(DashboardLinkType.LINK).url(f"${{detector_url}}/api/findings{query}")
            .tooltip("The detector's findings as JSON, with their evidence (send the API token if one is set)")
            .target_blank(True))


def _runbook_link(alert: str) -> dashboard.DashboardLink:
    """The runbook of the alert that fires on what the panel shows."""
    return (dashboard.DashboardLink(f"Runbook: {alert}").type(DashboardLinkType.LINK)
            .url(f"{RUNBOOK_BASE_URL}{alert}.md").tooltip(f"What {alert} means, how to confirm it, how to fix it")
            .target_blank(True))


def _board(title: str, uid: str, description: str,
           metric: str = "mcp_stream_detector_build_info") -> dashboard.Dashboard:
    return _variables(dashboard.Dashboard(title).uid(uid).description(description).tags(TAGS).readonly()
                      .refresh("30s").time("now-1h", "now").timezone("browser")
                      .link(_findings_link("Findings")).link(_api_link("Findings API"))
                      .link(dashboard.DashboardLink("Runbooks").type(DashboardLinkType.LINK).url(RUNBOOK_BASE_URL)
                            .tooltip("What each alert means, how to confirm it, how to fix it").target_blank(True)),
                      metric)


def _row(pid: int, title: str) -> dashboard.Row:
    return dashboard.Row(title).id(pid)


def _thresholds(steps: Steps) -> dashboard.ThresholdsConfig:
    return (dashboard.ThresholdsConfig().mode(ThresholdsMode.ABSOLUTE)
            .steps([Threshold(value=value, color=color) for value, color in steps]))


def _series(pid: int, title: str, description: str, unit: str, *queries: prometheus.Dataquery, span: int = 12,
            alert: str | None = None, steps: Steps | None = None) -> timeseries.Panel:
    """A time series; ``alert`` links the runbook of the alert it feeds, ``steps`` draws its thresholds."""
    panel = (timeseries.Panel().id(pid).title(title).description(description).datasource(DATASOURCE).unit(unit)
             .min(0).height(8).span(span).fill_opacity(10))
    for q in queries:
        panel = panel.with_target(q)
    if alert:
        panel = panel.links([_runbook_link(alert)])
    if steps:
        panel = (panel.thresholds(_thresholds(steps))
                 .thresholds_style(common.GraphThresholdsStyleConfig().mode(GraphThresholdsStyleMode.DASHED)))
    return panel


def _stat(pid: int, title: str, description: str, unit: str, expr: str, span: int = 6, alert: str | None = None,
          steps: Steps | None = None) -> stat.Panel:
    """A single number coloured by ``steps`` (the panel's thresholds), linking ``alert``'s runbook."""
    panel = (stat.Panel().id(pid).title(title).description(description).datasource(DATASOURCE).unit(unit)
             .height(4).span(span).with_target(_query(expr)))
    if alert:
        panel = panel.links([_runbook_link(alert)])
    return panel.thresholds(_thresholds(steps or [(None, "blue")]))


def _quantiles(metric: str, matchers: str) -> list[prometheus.Dataquery]:
    return [_query(f"histogram_quantile({q}, sum by (le) (rate({metric}_bucket{{{SEL}{matchers}}}"
                   "[$__rate_interval])))", f"p{round(q * 100)}", ref)
            for q, ref in ((0.5, "A"), (0.95, "B"), (0.99, "C"))]


def _counted(counter: str) -> str:
    """What ``counter`` counted per interval, a series born within it included: a counter's first sample (a tool seen
    for the first time, a restarted detector's first finding of a rule) is already at its count, where ``increase()``
    sees nothing, and the alert it pages shows as nothing (the alerts' recording rules count it)."""
    selected = f"{counter}{{{SEL}}}"
    return f"increase({selected}[$__rate_interval]) or ({selected} unless {selected} offset $__rate_interval)"


def overview() -> dashboard.Dashboard:
    return (_board("MCP streams / Overview", "mcp-stream-overview",
                   "Lost tool results on resumable MCP streams: what was lost, why, and the resumes around it.")
            .with_row(_row(1, "Lost results"))
            .with_panel(_series(
                2, "Silent losses by tool and rule",
                "Tool results that never reached their caller, with no error (mcp_stream_silent_losses_total). "
                "Anything above zero pages as MCPToolResultSilentlyLost; exemplars link to the trace, a click on a "
                "series to the lost calls on the detector's findings page.",
                "short",
                _query(f"sum by (tool, rule) ({_counted('mcp_stream_silent_losses_total')})", "{{tool}} {{rule}}"),
                alert="MCPToolResultSilentlyLost", steps=[(None, "green"), (1, "red")])
                        .data_links([_findings_link(
                            "Lost calls of ${__field.labels.tool} (${__field.labels.rule})",
                            "?rule=${__field.labels.rule}&tool=${__field.labels.tool}")]))
            .with_panel(_series(
                3, "Findings by rule",
                "Findings raised by the detector per interval; a click on a series opens them on the detector's "
                "findings page (/ui/?rule=<rule>), each with its call's timeline, or as JSON from /api/findings.",
                "short",
                _query(f"sum by (rule, severity) ({_counted('mcp_stream_findings_total')})", "{{rule}} ({{severity}})"))
                        .data_links([_findings_link("Findings of rule ${__field.labels.rule}",
                                                    "?rule=${__field.labels.rule}"),
                                     _api_link("Findings of rule ${__field.labels.rule} (JSON)",
                                               "?rule=${__field.labels.rule}")]))
            .with_panel(_stat(
                4, "Calls in flight",
                "Calls whose stream ended without their result and that are still owed one; one of them with no "
                "sign of life for 15 minutes (mcp_stream_calls_stuck) raises MCPToolCallsStuckInFlight.",
                "short", f"sum(mcp_stream_calls_in_flight{{{SEL}}})", alert="MCPToolCallsStuckInFlight",
                steps=[(None, "green"), (1, "orange")]))
            .with_panel(_stat(
                5, "Audience gaps",
                "Resumes per second whose token lacks a resource the pending call requires, as the side (client or "
                "server) that saw more: any at all raises MCPResumeAudienceNarrowerThanNeeded.",
                "reqps", _either_side("mcp_stream_audience_gaps_total"),
                alert="MCPResumeAudienceNarrowerThanNeeded", steps=[(None, "green"), (ANY, "orange")]))
            .with_panel(_stat(
                6, "Refused resumes",
                "Resumes the replay guard answered with an explicit error frame, as the side that saw more: the "
                "invariant working.",
                "reqps", _either_side("mcp_stream_resumes_total", matchers=', outcome="refused"')))
            .with_panel(_stat(
                7, "Tool calls",
                "tools/call operations finished per second, all outcomes, as the SDK's spans of the side that saw more "
                "of them saw them.",
                "reqps", _either_side("mcp_stream_calls_total")))
            .with_row(_row(8, "Calls"))
            .with_panel(_series(
                9, "Tool call outcomes",
                "tools/call per second by tool and outcome (result, tool_error, error, timeout) and by the side "
                "that saw it. Timeouts after a silent loss are the incident's only visible trace.",
                "reqps",
                _query(f"sum by (role, tool, outcome) (rate(mcp_stream_calls_total{{{SEL}}}[$__rate_interval]))",
                       "{{role}} {{tool}} {{outcome}}")))
            .with_panel(_series(
                10, "Terminal-event latency (client)",
                "p50, p95 and p99 of tools/call from request to response as the client saw it, reconnects and "
                "replays included (semconv mcp.client.operation.duration). Exemplars link to traces.",
                "s", *_quantiles("mcp_client_operation_duration_seconds", ', mcp_method_name="tools/call"')))
            .with_row(_row(11, "Resumes and audiences"))
            .with_panel(_series(
                12, "Resumes by outcome",
                "Resume streams per second, as the side that saw more of each outcome: delivered, progressed, empty "
                "(clean end, nothing sent: the incident's shape), refused (explicit error frame), dropped, closed, "
                "http_error.",
                "reqps",
                _query(_either_side("mcp_stream_resumes_total", "outcome"),
                       "{{outcome}}"), span=8))
            .with_panel(_series(
                13, "Audience gaps by tool",
                "Resumes per second whose token lacks a resource or scope the pending call of that tool requires, as "
                "the side that saw more.",
                "reqps",
                _query(_either_side("mcp_stream_audience_gaps_total", "tool"),
                       "{{tool}}"), span=8, alert="MCPResumeAudienceNarrowerThanNeeded", steps=QUIET_IS_GOOD))
            .with_panel(_series(
                14, "Calls in flight and stuck",
                "Calls owed a result after their stream ended, per detector, and of them those stuck: no sign of "
                "life for 15 minutes. A stuck call fires MCPToolCallsStuckInFlight; calls in flight alone are "
                "not stuck (a polling tool keeps some in flight).",
                "short", _query(f"sum by (instance) (mcp_stream_calls_in_flight{{{SEL}}})", "{{instance}} in flight"),
                _query(f"sum by (instance) (mcp_stream_calls_stuck{{{SEL}}})", "{{instance}} stuck", "B"),
                span=8, alert="MCPToolCallsStuckInFlight", steps=[(None, "green"), (1, "orange")]))
            .with_panel(_series(
                15, "Stream ends by reason",
                "Streams that told a call's fate, by role, kind (post, get, resume, delete) and end reason.",
                "reqps",
                _query(f"sum by (role, kind, reason) (rate(mcp_stream_stream_ends_total{{{SEL}}}[$__rate_interval]))",
                       "{{role}} {{kind}} {{reason}}"), span=24)))


def detector() -> dashboard.Dashboard:
    return (_board("MCP streams / Detector", "mcp-stream-detector",
                   "The detector's own health: is it up, taking spans, and keeping up.")
            .with_row(_row(1, "Ingest"))
            .with_panel(_stat(2, "Detectors up", "Detector targets Prometheus scrapes successfully; none: "
                              "MCPStreamExporterDown (or MCPStreamExporterAbsent).", "short",
                              f"sum(up{{{SEL}}} {OF_DETECTORS}) or vector(0)",
                              alert="MCPStreamExporterDown", steps=[(None, "red"), (1, "green")]))
            .with_panel(_stat(3, "Spans received", "Spans per second into the detector, all transports; none for "
                              "15 minutes while up: MCPStreamExporterNoSpans.", "reqps",
                              f"sum(rate(mcp_stream_detector_spans_received_total{{{SEL}}}[$__rate_interval]))",
                              alert="MCPStreamExporterNoSpans", steps=[(None, "red"), (ANY, "green")]))
            .with_panel(_stat(4, "Ledger sessions", "Sessions (or traces, 2026-07-28) the ledgers hold.", "short",
                              f"sum(mcp_stream_detector_ledger_sessions{{{SEL}}})"))
            .with_panel(_stat(5, "Findings retained", "Findings kept for /api/findings.", "short",
                              f"sum(mcp_stream_detector_findings_retained{{{SEL}}})"))
            .with_panel(_series(
                6, "Spans received by transport", "Spans per second by transport (OTLP HTTP, OTLP gRPC, embedded).",
                "reqps",
                _query(f"sum by (transport) (rate(mcp_stream_detector_spans_received_total{{{SEL}}}"
                       "[$__rate_interval]))", "{{transport}}"), alert="MCPStreamExporterNoSpans"))
            .with_panel(_series(
                7, "Spans rejected by reason",
                "Spans refused as breaking the span model; the sender got an OTLP partial success. "
                "Over 1% for 10 minutes: MCPStreamExporterSpansRejected.",
                "reqps",
                _query(f"sum by (reason) (rate(mcp_stream_detector_spans_rejected_total{{{SEL}}}[$__rate_interval]))",
                       "{{reason}}"), alert="MCPStreamExporterSpansRejected"))
            .with_panel(_series(
                8, "Ingest requests rejected by reason",
                "Requests refused whole (too_large, bad_encoding, malformed, unauthorized, too_many_spans, "
                "queue_full). queue_full is backpressure: MCPStreamExporterIngestRejecting.",
                "reqps",
                _query(f"sum by (reason) (rate(mcp_stream_detector_ingest_requests_rejected_total{{{SEL}}}"
                       "[$__rate_interval]))", "{{reason}}"), alert="MCPStreamExporterIngestRejecting",
                steps=QUIET_IS_GOOD))
            .with_panel(_series(
                9, "Ingest latency", "p50, p95, p99 from a batch's arrival to its spans in the ledger, queueing "
                "included; a second or more means the ledger's worker falls behind.", "s",
                *_quantiles("mcp_stream_detector_ingest_duration_seconds", ""),
                steps=[(None, "green"), (1, "orange")]))
            .with_row(_row(10, "Ledger"))
            .with_panel(_series(
                11, "Ledger size", "Sessions and calls held; bounded by --max-sessions and --max-calls-per-session.",
                "short",
                _query(f"sum by (instance) (mcp_stream_detector_ledger_sessions{{{SEL}}})", "sessions {{instance}}"),
                _query(f"sum by (instance) (mcp_stream_detector_ledger_calls{{{SEL}}})", "calls {{instance}}", "B")))
            .with_panel(_series(
                12, "Ledger evictions by reason",
                "Evictions per second: ttl is housekeeping; capacity means losses there go undetected "
                "(MCPStreamExporterLedgerEvicting).",
                "reqps",
                _query(f"sum by (reason) (rate(mcp_stream_detector_ledger_evictions_total{{{SEL}}}[$__rate_interval]))",
                       "{{reason}}"), alert="MCPStreamExporterLedgerEvicting"))
            .with_row(_row(13, "Process"))
            .with_panel(_series(
                14, "Ingest queue", "Spans accepted over OTLP and waiting for the ledger, per detector. At "
                "--max-queued-spans (or the queue's memory share) ingest answers 429 queue_full.", "short",
                _query(f"sum by (instance) (mcp_stream_detector_ingest_queue_spans{{{SEL}}})", "{{instance}}"),
                span=6, alert="MCPStreamExporterIngestRejecting"))
            .with_panel(_series(
                15, "Memory", "The process's resident memory beside the detector's estimate of its state (its "
                "budget is --max-memory-mb); keep resident memory under the pod's limit.", "bytes",
                _query(f"sum by (instance) (process_resident_memory_bytes{{{SEL}}} {OF_DETECTORS})",
                       "resident {{instance}}"),
                _query(f"sum by (instance) (mcp_stream_detector_state_bytes{{{SEL}}})", "state {{instance}}", "B"),
                span=6, alert="MCPStreamExporterDown"))
            .with_panel(_series(
                16, "CPU", "CPU seconds per second of the process (1 is one core). Decoding runs on "
                "--max-decoding threads, the ledger on one.", "short",
                _query(f"sum by (instance) (rate(process_cpu_seconds_total{{{SEL}}}[$__rate_interval]) {OF_DETECTORS})",
                       "{{instance}}"), span=6))
            .with_panel(_series(
                17, "Open file descriptors", "File descriptors the process holds (connections included) against its "
                "limit; at the limit new connections fail.", "short",
                _query(f"sum by (instance) (process_open_fds{{{SEL}}} {OF_DETECTORS})", "open {{instance}}"),
                _query(f"sum by (instance) (process_max_fds{{{SEL}}} {OF_DETECTORS})", "limit {{instance}}", "B"),
                span=6)))


def guard() -> dashboard.Dashboard:
    """The MCP servers' replay guard on Redis: its job and instance are the servers', not the detector's."""
    return (_board("MCP streams / Replay guard", "mcp-stream-guard",
                   "The replay guard's shared Redis storage, as each MCP server sees it: errors refuse resumes.",
                   "mcp_stream_guard_store_operation_seconds_count")
            .with_row(_row(1, "Redis storage"))
            .with_panel(_series(
                2, "Store errors by operation",
                "Redis operations of the guard that failed, per second. While above zero every resume gets "
                "event: error store_unavailable and events go unstored: MCPGuardStoreErrors pages after 5 minutes.",
                "reqps",
                _query(f"sum by (instance, operation) (rate(mcp_stream_guard_store_errors_total{{{SEL}}}"
                       "[$__rate_interval]))", "{{instance}} {{operation}}"), span=12, alert="MCPGuardStoreErrors",
                steps=QUIET_IS_GOOD))
            .with_panel(_series(
                3, "Store latency", "p50, p95, p99 of the guard's Redis operations: every SSE event waits for one "
                "(append) and every resume for three (get, after, requirement).",
                "s", *_quantiles("mcp_stream_guard_store_operation_seconds", ""), span=12,
                steps=[(None, "green"), (0.1, "orange")]))
            .with_panel(_series(
                4, "Store operations by operation", "Redis operations per second, by operation.", "reqps",
                _query(f"sum by (operation) (rate(mcp_stream_guard_store_operation_seconds_count{{{SEL}}}"
                       "[$__rate_interval]))", "{{operation}}"), span=12))
            .with_panel(_series(
                5, "Store evictions",
                "Events and requirements dropped per second; resumes from them are refused. cap: raise "
                "max_events_per_session or max_calls_per_session if honest sessions reach them. session_gone: the "
                "session's keys are not in Redis (expired, evicted by Redis's maxmemory-policy, or lost in a restart).",
                "reqps",
                _query(f"sum by (instance, reason) (rate(mcp_stream_guard_store_evictions_total{{{SEL}}}"
                       "[$__rate_interval]))", "{{instance}} {{reason}}"), span=12)))


DASHBOARDS: dict[str, Callable[[], dashboard.Dashboard]] = {
    "mcp-stream-overview.json": overview,
    "mcp-stream-detector.json": detector,
    "mcp-stream-guard.json": guard,
}


def render(build: Callable[[], dashboard.Dashboard]) -> str:
    """The committed form: the SDK's JSON, keys sorted, two-space indent, a final newline."""
    encoded: Any = json.loads(JSONEncoder(sort_keys=True, indent=2).encode(build().build()))
    return json.dumps(encoded, sort_keys=True, indent=2) + "\n"


def main(out: Path = HERE) -> int:
    for name, build in DASHBOARDS.items():
        (out / name).write_text(render(build))
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE))
