"""The incident, end to end on 127.0.0.1, with the embedded detector watching.

Two runs of the incident (``docs/incident.md``): the SDK's server behind a proxy that cuts the
connection mid-call, an SDK client in legacy mode whose token refresh narrows ``aud`` to ``search``,
and the resume. The naive server loses ``fetch``'s result silently and the detector says so; the
guarded server answers with an error frame, the client re-authorises and resumes, nothing is lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
import threading
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any

from mcp.shared.exceptions import MCPError
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import generate_latest

from mcp_stream_exporter import semconv as sc
from mcp_stream_exporter.detector import Detector, DetectorConfig, RuleConfig
from mcp_stream_exporter.detector.embedded import DetectorSpanProcessor, EmbeddedDetector
from mcp_stream_exporter.detector.ui import UiLinks
from mcp_stream_exporter.lab import incident


@dataclass
class RunOutcome:
    """One run of the incident: what the caller got, and what the embedded detector found."""

    server: str  # "naive" or "guarded"
    search_result: str | None
    fetch_result: str | None
    fetch_error: str | None
    fetch_request_id: str | None
    findings: list[dict[str, Any]] = field(default_factory=list)
    metric_lines: list[str] = field(default_factory=list)
    timeline: list[str] = field(default_factory=list)

    def rules(self, tool: str = "fetch") -> list[str]:
        return sorted(f["rule"] for f in self.findings if f["tool"] == tool)

    @property
    def as_expected(self) -> bool:
        """Naive: fetch lost silently, one narrowed_resume and one clean_end_pending for it, with the
        gap in evidence. Guarded: fetch delivered after the error frame, and nothing found."""
        if self.server == "guarded":
            return self.fetch_result is not None and not self.findings
        rules = self.rules()
        gap = any(f["rule"] == "narrowed_resume" and f["evidence"].get("missing_resources") for f in self.findings)
        return (self.search_result is not None and self.fetch_result is None and self.fetch_error is not None
                and rules.count("narrowed_resume") == 1 and rules.count("clean_end_pending") == 1 and gap)


def _a(span: ReadableSpan, key: str) -> Any:
    return (span.attributes or {}).get(key)


def _line(t0: int, span: ReadableSpan) -> str:
    at = f"+{(span.start_time or t0) / 1e9 - t0 / 1e9:7.3f}s"
    role = _a(span, sc.ROLE)
    if _a(span, sc.SPAN) == sc.SPAN_REPLAY:
        gap = ""
        if _a(span, sc.AUTH_MISSING_RESOURCES):
            gap = (f"; token aud {list(_a(span, sc.AUTH_AUDIENCE) or ())} lacks "
                   f"{list(_a(span, sc.AUTH_MISSING_RESOURCES))}")
        return (f"{at} server replay  cursor {_a(span, sc.RESUME_CURSOR)}: {_a(span, sc.REPLAY_BUFFERED)} buffered, "
                f"{_a(span, sc.REPLAY_SENT)} sent, {_a(span, sc.REPLAY_DECISION)}"
                + (f" at event {_a(span, sc.REPLAY_OFFENDING_EVENT_ID)}" if _a(span, sc.REPLAY_OFFENDING_EVENT_ID)
                   else "") + gap)
    kind = _a(span, sc.STREAM_KIND)
    cursor = f" Last-Event-ID {_a(span, sc.RESUME_CURSOR)}" if _a(span, sc.RESUME_CURSOR) else ""
    events = f"events {_a(span, sc.EVENT_FIRST_ID)}..{_a(span, sc.EVENT_LAST_ID)}" if _a(span, sc.EVENT_FIRST_ID) \
        else "no events"
    pending = _a(span, sc.PENDING_REQUEST_IDS)
    aud = f"  aud {list(_a(span, sc.AUTH_AUDIENCE))}" if _a(span, sc.AUTH_AUDIENCE) else ""
    return (f"{at} {role:6} {kind:6}{cursor}{aud}  {events}  "
            f"ended {_a(span, sc.END_REASON)}" + (f"  pending {list(pending)}" if pending else ""))


def _timeline(spans: list[ReadableSpan], request_id: str) -> list[str]:
    mine = [s for s in spans
            if request_id in (_a(s, sc.STREAM_REQUEST_IDS) or ())
            or (_a(s, sc.SPAN) == sc.SPAN_REPLAY and _a(s, sc.JSONRPC_REQUEST_ID) == request_id)]
    mine.sort(key=lambda s: s.start_time or 0)
    if not mine:
        return []
    t0 = mine[0].start_time or 0
    lines: list[str] = []
    resumes = 0
    for span in mine:
        if _a(span, sc.STREAM_KIND) == sc.STREAM_KIND_RESUME and _a(span, sc.ROLE) == sc.ROLE_CLIENT:
            resumes += 1
        if (resumes > 2 and _a(span, sc.STREAM_KIND) == sc.STREAM_KIND_RESUME) or (
                resumes > 2 and _a(span, sc.SPAN) == sc.SPAN_REPLAY):
            continue
        lines.append(_line(t0, span))
    if resumes > 2:
        lines.append(f"          ... {resumes - 2} more resumes with the same cursor, each ending the same way, "
                     "until the caller's timeout")
    return lines


_PAGING_METRICS = ("mcp_stream_silent_losses_total", "mcp_stream_findings_total", "mcp_stream_audience_gaps_total",
                   "mcp_stream_resumes_total", "mcp_stream_calls_in_flight")


def _metric_lines(detector: Detector) -> list[str]:
    text = generate_latest(detector.registry).decode()
    return [line for line in text.splitlines()
            if line.startswith(_PAGING_METRICS) and not line.endswith(" 0.0")]


def _text(result: Any) -> str | None:
    return None if isinstance(result, BaseException) else str(result.content[0].model_dump().get("text"))


class _Feed(DetectorSpanProcessor):
    """The embedded detector's processor, pointed at each run's own detector, and a recorder of the
    run's spans for the timeline."""

    recorder: InMemorySpanExporter | None = None

    def on_end(self, span: ReadableSpan) -> None:
        super().on_end(span)
        if self.recorder is not None:
            self.recorder.export([span])


async def run_incident(feed: _Feed, *, guarded: bool, grace_s: float,
                       fetch_timeout: float = 2.5) -> RunOutcome:
    """Play the incident against the naive or the guarded server, with a fresh detector fed the spans."""
    detector = feed.detector = Detector(DetectorConfig(rules=RuleConfig(clean_end_grace_s=grace_s),
                                                       tools=("search", "fetch")))
    spans = InMemorySpanExporter()
    feed.recorder = spans
    fetch_result: Any
    async with incident("legacy", guarded=guarded) as lab:
        lab.proxy.arm(b"fetch step 1", on_cut=lab.refresh_narrows)
        search, fetch = await asyncio.gather(
            lab.call("search", {"query": "incident", "steps": 4}),
            lab.call("fetch", {"url": "https://example.com/doc", "steps": 4},
                     timeout=20 if guarded else fetch_timeout),
            return_exceptions=True)
        fetch_result = fetch
        if guarded and isinstance(fetch, MCPError):  # the error frame, as -32003: re-authorise and resume
            _say(f"  guarded: fetch answered with an explicit error ({fetch.code}): re-authorising and resuming")
            fetch_result = await lab.recover(fetch, "fetch", {"url": "https://example.com/doc", "steps": 4})
    await asyncio.sleep(grace_s + 0.2)  # let the silent-loss grace period run out, then look
    detector.tick()
    recorded = list(spans.get_finished_spans())
    fetch_id = next((_a(s, sc.JSONRPC_REQUEST_ID) for s in recorded
                     if _a(s, sc.SPAN) == sc.SPAN_CALL and _a(s, sc.GEN_AI_TOOL_NAME) == "fetch"), None)
    with detector.lock:
        findings = [f.to_json() for f in detector.findings]
    return RunOutcome(
        server="guarded" if guarded else "naive", search_result=_text(search),
        fetch_result=None if isinstance(fetch_result, BaseException) else _text(fetch_result),
        fetch_error=f"{fetch.error.code} {fetch.error.message}" if isinstance(fetch, MCPError) else None,
        fetch_request_id=fetch_id, findings=findings, metric_lines=_metric_lines(detector),
        timeline=_timeline(recorded, fetch_id) if fetch_id and not guarded else [])


_QUIET = False


def _say(line: str) -> None:
    if not _QUIET:
        print(line, flush=True)


def _print_run(run: RunOutcome) -> None:
    if run.server == "naive":
        print(f"\nTimeline of the lost call (fetch, request id {run.fetch_request_id}), from the hooks' spans:")
        for line in run.timeline:
            print("  " + line)
        print("\n  search: " + ("delivered" if run.search_result else "NOT delivered"))
        print(f"  fetch:  lost; the caller only saw its own timeout: {run.fetch_error}")
    else:
        print(f"  fetch:  {'delivered: ' + run.fetch_result if run.fetch_result else 'NOT delivered'}")
    print(f"\n  Findings of the embedded detector ({run.server} server): {len(run.findings) or 'none'}")
    for f in sorted(run.findings, key=lambda f: f["rule"]):
        gap = ""
        if f["evidence"].get("missing_resources"):
            gap = (f"  token aud {f['evidence'].get('audience_held')} lacks {f['evidence']['missing_resources']}")
        print(f"    [{f['severity']:8}] {f['rule']:20} tool={f['tool']} request={f['request_id']} "
              f"roles={','.join(f['roles'])}{gap}")
    if run.metric_lines:
        print("\n  Metric lines an alert pages on (GET /metrics):")
        for line in run.metric_lines:
            print("    " + line)


def main(argv: list[str] | None = None, *, as_json: bool = False, serve_port: int | None = None,
         grace_s: float = 1.0, links: UiLinks | None = None) -> int:
    """Run the incident twice (naive, then guarded); exit 0 when both ended as expected."""
    global _QUIET
    _QUIET = as_json
    warnings.filterwarnings("ignore")
    logging.basicConfig(level=logging.WARNING)
    for noisy in ("mcp", "httpx2", "uvicorn", "sse_starlette"):
        logging.getLogger(noisy).setLevel(logging.CRITICAL)
    provider = TracerProvider()
    trace.set_tracer_provider(provider)  # the SDK's own spans go here too: the detector reads both
    feed = _Feed(Detector())
    provider.add_span_processor(feed)
    started = time.monotonic()
    _say("Run 1/2, the naive server: search and fetch, a dropped connection after fetch's first progress event,\n"
         "a refresh that narrows aud to search only, and the resume ...")
    naive = asyncio.run(run_incident(feed, guarded=False, grace_s=grace_s))
    naive_detector = feed.detector
    if not as_json:
        _print_run(naive)
    _say("\nRun 2/2, the same with the replay guard (guard/) on the server ...")
    guarded = asyncio.run(run_incident(feed, guarded=True, grace_s=grace_s))
    if not as_json:
        _print_run(guarded)
    ok = naive.as_expected and guarded.as_expected
    if as_json:
        print(json.dumps({"naive": asdict(naive), "guarded": asdict(guarded),
                          "naive_as_expected": naive.as_expected, "guarded_as_expected": guarded.as_expected,
                          "ok": ok}, indent=2))
    else:
        print(f"\nSummary ({time.monotonic() - started:.1f}s): naive server "
              f"{'lost fetch silently, and the detector said so' if naive.as_expected else 'NOT as expected'}; "
              f"guarded server {'delivered fetch, no finding' if guarded.as_expected else 'NOT as expected'}.")
    if serve_port is not None:
        embedded = EmbeddedDetector(naive_detector, feed)
        port = embedded.serve(port=serve_port, links=links)
        base = f"http://127.0.0.1:{port}"
        lost = next((f["id"] for f in naive.findings if f["rule"] == "clean_end_pending"), None)
        _say(f"\nServing the naive run's detector: {base}/metrics and {base}/api/findings (Ctrl-C to stop)")
        _say(f"Findings page: {base}/ui/" + (f"\nThe lost call: {base}/ui/findings/{lost}" if lost else ""))
        with contextlib.suppress(KeyboardInterrupt):
            threading.Event().wait()
        embedded.close()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
