"""The incident, end to end on 127.0.0.1, and what the hooks saw of it.

Runs the incident server (naive replay store) behind a proxy that cuts the connection mid-call, an
SDK client in legacy mode whose token refresh narrows ``aud`` to ``search``, and the resume. Then
reads the spans the hooks emitted and prints the lost call's timeline.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any

from mcp.shared.exceptions import MCPError
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from mcp_stream_exporter import semconv as sc
from mcp_stream_exporter.lab import incident


@dataclass
class IncidentOutcome:
    search_result: str | None
    fetch_error: str | None
    fetch_request_id: str | None
    client_resumes_clean_pending: int
    replay_truncated: bool
    token_audience: list[str] = field(default_factory=list)
    missing_resources: list[str] = field(default_factory=list)
    offending_event_id: str | None = None
    timeline: list[str] = field(default_factory=list)

    @property
    def reproduced(self) -> bool:
        """The incident as written: search delivered, fetch lost silently, the gap on record."""
        return (self.search_result is not None and self.fetch_error is not None
                and self.client_resumes_clean_pending > 0 and self.replay_truncated
                and bool(self.missing_resources))


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
    return (f"{at} {role:6} {kind:6}{cursor}  aud {list(_a(span, sc.AUTH_AUDIENCE) or ())}  {events}  "
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


async def run_incident(*, fetch_timeout: float = 2.5) -> IncidentOutcome:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    async with incident("legacy", tracer_provider=provider) as lab:
        lab.proxy.arm(b"fetch step 1", on_cut=lab.refresh_narrows)
        search, fetch = await asyncio.gather(
            lab.call("search", {"query": "incident", "steps": 4}),
            lab.call("fetch", {"url": "https://example.com/doc", "steps": 4}, timeout=fetch_timeout),
            return_exceptions=True,
        )
    spans = list(exporter.get_finished_spans())
    replays = [s for s in spans if _a(s, sc.SPAN) == sc.SPAN_REPLAY
               and _a(s, sc.REPLAY_DECISION) == sc.REPLAY_TRUNCATED]
    fetch_id = next((_a(s, sc.JSONRPC_REQUEST_ID) for s in spans
                     if _a(s, sc.SPAN) == sc.SPAN_CALL and _a(s, sc.GEN_AI_TOOL_NAME) == "fetch"), None)
    clean_pending = [s for s in spans if _a(s, sc.ROLE) == sc.ROLE_CLIENT
                     and _a(s, sc.STREAM_KIND) == sc.STREAM_KIND_RESUME and _a(s, sc.END_REASON) == sc.END_CLEAN
                     and fetch_id in (_a(s, sc.PENDING_REQUEST_IDS) or ())]
    gap = replays[0] if replays else None
    return IncidentOutcome(
        search_result=None if isinstance(search, BaseException) else str(search.content[0].model_dump().get("text")),
        fetch_error=f"{fetch.error.code} {fetch.error.message}" if isinstance(fetch, MCPError) else None,
        fetch_request_id=fetch_id,
        client_resumes_clean_pending=len(clean_pending),
        replay_truncated=gap is not None,
        token_audience=list(_a(gap, sc.AUTH_AUDIENCE) or ()) if gap else [],
        missing_resources=list(_a(gap, sc.AUTH_MISSING_RESOURCES) or ()) if gap else [],
        offending_event_id=_a(gap, sc.REPLAY_OFFENDING_EVENT_ID) if gap else None,
        timeline=_timeline(spans, fetch_id) if fetch_id else [],
    )


def _print_human(outcome: IncidentOutcome, seconds: float) -> None:
    print(f"\nTimeline of the lost call (fetch, request id {outcome.fetch_request_id}):")
    for line in outcome.timeline:
        print("  " + line)
    print("\nOutcome:")
    print(f"  search: {'delivered: ' + outcome.search_result if outcome.search_result else 'NOT delivered'}")
    fetch = f"lost; the caller only saw its own timeout: {outcome.fetch_error}" if outcome.fetch_error else "delivered"
    print(f"  fetch:  {fetch}")
    if outcome.replay_truncated:
        print(f"  the server's replay stopped at event {outcome.offending_event_id} without an error frame: "
              f"token aud {outcome.token_audience} lacks {outcome.missing_resources}")
    print(f"  client resumes that ended clean with fetch pending: {outcome.client_resumes_clean_pending}")
    verdict = "reproduced" if outcome.reproduced else "NOT reproduced"
    print(f"\nIncident {verdict} in {seconds:.1f}s; every fact above comes from the hooks' spans.")


def main(argv: list[str] | None = None, *, as_json: bool = False) -> int:
    """Run the incident; exit 0 when it ran as expected (the loss reproduced and recorded)."""
    warnings.filterwarnings("ignore")
    logging.basicConfig(level=logging.WARNING)
    for noisy in ("mcp", "httpx2", "uvicorn", "sse_starlette"):
        logging.getLogger(noisy).setLevel(logging.CRITICAL)
    if not as_json:
        print("Replaying the incident on 127.0.0.1: search and fetch, a dropped connection after fetch's first "
              "progress event,\na refresh that narrows aud to search only, and the resume ...", flush=True)
    started = time.monotonic()
    outcome = asyncio.run(run_incident())
    if as_json:
        print(json.dumps({**asdict(outcome), "reproduced": outcome.reproduced}, indent=2))
    else:
        _print_human(outcome, time.monotonic() - started)
    return 0 if outcome.reproduced else 1


if __name__ == "__main__":
    sys.exit(main())
