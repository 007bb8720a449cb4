"""The findings page at ``/ui/``: what an on-call engineer opens from the alert.

Server-rendered HTML (no build step, no framework): a list of findings, newest first, filterable and
refreshed live, and a page per call telling its story from the spans: the timeline, the rules that
fired with their evidence, the gap in words, what to do first, and links out to the trace and the
runbook. Every value that came from a producer is escaped; the Content-Security-Policy allows only
this module's own script and style, so nothing a producer sent can run even if it got through.

Same auth as ``/api``: the bearer token in ``Authorization``, or a browser cookie obtained by typing
that token into the login form. The cookie holds an HMAC derived from the token, never the token.
"""

from __future__ import annotations

import hashlib
import hmac
import html
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any
from urllib.parse import parse_qs, quote, urlencode

from fastapi import FastAPI, Request, Response
from fastapi.responses import HTMLResponse, RedirectResponse

from mcp_stream_exporter import semconv as sc
from mcp_stream_exporter.detector.detector import Detector
from mcp_stream_exporter.detector.findings import Finding
from mcp_stream_exporter.detector.findings import Query as FindingQuery
from mcp_stream_exporter.detector.rules import RULES
from mcp_stream_exporter.detector.timeline import Entry

RUNBOOK_BASE_URL = "https://github.com/mcp-stream-exporter/mcp-stream-exporter/blob/main/docs/runbooks/"
COOKIE = "mcp_stream_ui"
LIST_LIMIT = 200
_SEVERITIES = ("critical", "warning")
_REPEATS_SHOWN = 2  # identical steps shown before the rest are folded into one row
_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
_STATIC = {"ui.css": "text/css", "ui.js": "text/javascript"}
_LOGIN_BYTES = 4096  # of a sign-in form's body: a token and its field name fit many times over

# rule -> the alert that pages on it (alerts/mcp-stream-exporter.yaml); its runbook is docs/runbooks/<alert>.md
ALERTS: dict[str, str] = {
    "clean_end_pending": "MCPToolResultSilentlyLost",
    "foreign_result": "MCPToolResultSilentlyLost",
    "not_reissued": "MCPToolResultSilentlyLost",
    "stored_not_delivered": "MCPToolResultSilentlyLost",
    "store_failed": "MCPToolResultSilentlyLost",
    "sent_not_received": "MCPToolResultSilentlyLost",
    "replay_truncated": "MCPReplayTruncatedWithoutError",
    "cursor_past_undelivered": "MCPReplayTruncatedWithoutError",
    "cross_stream_replay": "MCPReplayCrossedStreams",
    "narrowed_resume": "MCPResumeAudienceNarrowerThanNeeded",
    "resume_loop": "MCPResumeLoop",
    "unknown_cursor": "MCPResumeToUnknownCursor",
    "session_expired_in_flight": "MCPSessionExpiredWithCallsInFlight",
}

# the first steps of each runbook's "Confirm" and "Fix", short enough to read at a glance
FIRST_STEPS: dict[str, tuple[str, ...]] = {
    "MCPToolResultSilentlyLost": (
        "The caller is hung or has timed out: re-issue the call only if the tool is idempotent, and tell the "
        "owner of the client named in the trace.",
        "Find the cause on this call (below): a resume whose token lacked the resource, or a truncated replay.",
        "Server: run the replay guard (GuardedEventStore) so such a resume gets an explicit, resumable error "
        "frame instead of a silent end.",
        "Client: resume with a token covering every pending call's resources (resume.decide_resume), or "
        "re-issue the call.",
    ),
    "MCPReplayTruncatedWithoutError": (
        "Replace the filtering event store with the replay guard (GuardedEventStore): it refuses the whole "
        "replay with a resumable error frame and leaves the cursor where it was.",
        "Client: resume with a token whose audience covers what the pending calls need.",
    ),
    "MCPReplayCrossedStreams": (
        "Take the server's event store out of service, or restart with one that scopes replay to the resumed "
        "stream and session (the replay guard does).",
        "Follow your data-exposure process for the sessions in these findings.",
    ),
    "MCPResumeAudienceNarrowerThanNeeded": (
        "Client: before resuming, re-authorise for the union of the resources of every pending call "
        "(resume.decide_resume), or re-issue the call.",
        "Authorization server: a refresh must not narrow the audience unless the client asked for it.",
        "Server: run the replay guard in enforce mode so these resumes get an explicit error frame.",
    ),
    "MCPResumeLoop": (
        "Fix the cause the neighbouring finding names (a narrower token, an evicted cursor).",
        "Server: answer a resume it cannot serve with an explicit error (the replay guard does).",
    ),
    "MCPResumeToUnknownCursor": (
        "Size the event store's retention above the longest expected disconnect.",
        "Route every request of a session to the replica holding its events.",
        "Answer unknown cursors with an explicit error frame (the replay guard does).",
    ),
    "MCPSessionExpiredWithCallsInFlight": (
        "Keep the session idle timeout above the longest tool call plus reconnect time.",
        "Drain server replicas on shutdown instead of dropping sessions with calls in flight.",
        "Clients: fail pending calls on a 404 for their session, re-initialise, re-issue idempotent calls.",
    ),
}

_STEPS = {"post": "POST (the call)", "get": "GET stream", "resume": "Resume", "delete": "DELETE session",
          "replay": "Replay (server)", "call": "Call ends", "timeout": "Caller's timeout",
          "error": "Caller's error"}
_ENDS = {sc.END_CLEAN: "ended cleanly", sc.END_DROPPED: "connection dropped", sc.END_CLOSED: "closed by the client",
         sc.END_OPEN: "still open, moving the call on", sc.END_TERMINATED: "ended with its session (DELETE)"}
_OUTCOMES = {sc.OUTCOME_RESULT: "result delivered", sc.OUTCOME_TOOL_ERROR: "tool error delivered",
             sc.OUTCOME_ERROR: "JSON-RPC error delivered", sc.OUTCOME_CANCELLED: "given up (cancelled or timed out)",
             sc.OUTCOME_NO_TERMINAL: "no result on its stream", sc.OUTCOME_EVICTED: "evicted while pending",
             sc.OUTCOME_REISSUED: "re-issued (sent again after its stream broke)",
             sc.OUTCOME_STORE_FAILED: "never sent: the server's event store failed",
             sc.OUTCOME_CANCELLED_LATE: "cancelled by its client after the server sent its result"}
_LOST_OUTCOMES = frozenset({sc.OUTCOME_STORE_FAILED, sc.OUTCOME_CANCELLED_LATE})  # the call's own span says it is lost


@dataclass(frozen=True, slots=True)
class UiLinks:
    """Where the page links out to: the tracing backend (``{trace_id}`` in the template) and the runbooks."""

    trace_url_template: str | None = None  # e.g. https://tempo.example.com/trace/{trace_id}
    runbook_base_url: str = RUNBOOK_BASE_URL

    def trace(self, trace_id: str) -> str | None:
        if not self.trace_url_template or not self.trace_url_template.startswith(("https://", "http://")):
            return None
        return self.trace_url_template.replace("{trace_id}", quote(trace_id, safe=""))

    def runbook(self, alert: str) -> str:
        return f"{self.runbook_base_url.rstrip('/')}/{alert}.md"


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _join(values: Iterable[Any]) -> str:
    return ", ".join(str(v) for v in values)


def _cookie_value(token: str) -> str:
    return hmac.new(token.encode(), b"mcp-stream-exporter findings page", hashlib.sha256).hexdigest()


async def _head(request: Request, size: int) -> bytes:
    """The first ``size`` bytes of the request's body, read no further: a sign-in needs no more, and anyone may
    send one (``Request.body`` would hold all of a body of any size)."""
    head = b""
    async for chunk in request.stream():
        head += chunk
        if len(head) >= size:
            break
    return head[:size]


def mount_ui(app: FastAPI, detector: Detector, links: UiLinks, api_token: str | None,
             bearer_ok: Callable[[Request], bool]) -> None:
    """Add ``/ui/`` to the detector's app, behind the same token as ``/api``."""

    def allowed(request: Request) -> bool:
        if bearer_ok(request):
            return True
        # as bytes: ``compare_digest`` refuses a str that is not ASCII, which a client may send (a 401, not a 500)
        cookie = request.cookies.get(COOKIE, "").encode("utf-8", "surrogatepass")
        return api_token is not None and hmac.compare_digest(cookie, _cookie_value(api_token).encode())

    def page(body: str, status: int = 200) -> HTMLResponse:
        return HTMLResponse(body, status_code=status, headers=_HEADERS)

    def login(status: int = 401, failed: bool = False) -> HTMLResponse:
        note = "<p class='bad'>That token was not accepted.</p>" if failed else ""
        return page(_document("Sign in", (
            "<h1>Findings</h1><p>This detector's <code>/api</code> requires a bearer token "
            "(<code>--api-token</code>); enter it to open the findings page.</p>" + note +
            "<form method='post' action='/ui/login' class='login'><label>API token "
            "<input type='password' name='token' autocomplete='current-password' required></label>"
            "<button type='submit'>Open</button></form>")), status)

    @app.get("/ui", include_in_schema=False)
    def ui_root() -> Response:
        return RedirectResponse("/ui/", status_code=308)

    @app.post("/ui/login", include_in_schema=False)
    async def ui_login(request: Request) -> Response:
        token = parse_qs((await _head(request, _LOGIN_BYTES)).decode("utf-8", "replace")).get("token", [""])[0]
        if api_token is None or not hmac.compare_digest(token.encode(), api_token.encode()):
            return login(failed=api_token is not None)
        answer = RedirectResponse("/ui/", status_code=303)
        answer.set_cookie(COOKIE, _cookie_value(api_token), httponly=True, samesite="strict", path="/ui",
                          secure=request.url.scheme == "https")
        return answer

    @app.get("/ui/static/{name}", include_in_schema=False)
    def ui_static(name: str) -> Response:
        if name not in _STATIC:
            return Response("not found", status_code=404)
        body = resources.files("mcp_stream_exporter.detector").joinpath("ui_static", name).read_bytes()
        return Response(body, media_type=_STATIC[name], headers=_HEADERS)

    @app.get("/ui/", include_in_schema=False)
    def ui_list(request: Request, rule: str = "", severity: str = "", tool: str = "", session: str = "",
                part: str = "", offset: str = "") -> Response:
        if not allowed(request):
            return login()
        filters = {"rule": rule if rule in RULES else "", "severity": severity if severity in _SEVERITIES else "",
                   "tool": tool[:200], "session": session[:200]}
        start = int(offset) if offset.isascii() and offset.isdigit() and len(offset) < 10 else 0  # else the newest
        with detector.lock:
            rows, total, retained = _matching(detector, filters, start)
            dropped = detector.timelines.evicted
        now = time.time()
        table = _findings_table(rows, total, start, filters, now)
        if part:
            return page(table)
        live = "/ui/?" + urlencode({**_shown(filters, start), "part": "rows"})
        return page(_document("Findings", (
            _header(retained, dropped) + _filter_form(filters) +
            f"<section id='live-part' data-live='{_e(live)}'>{table}</section>"), live=True))

    @app.get("/ui/findings/{finding_id}", include_in_schema=False)
    def ui_finding(request: Request, finding_id: str, part: str = "", full: str = "") -> Response:
        if not allowed(request):
            return login()
        with detector.lock:
            found = detector.findings.get(finding_id)
            if found is None:
                return page(_document("Finding not found", (
                    "<p><a href='/ui/'>&larr; all findings</a></p><h1>No such finding</h1><p>It may have aged "
                    "out of the detector's bounded store, or it is held by another replica (the alert's "
                    "<code>instance</code> label names the detector that raised it).</p>")), 404)
            related = _related(detector, found)
            timeline = detector.timelines.of(found)
            entries = timeline.entries() if timeline is not None else None
            omitted = timeline.omitted if timeline is not None else 0
        story = _story(found, related, entries, omitted, links, now=time.time(), show_all=bool(full))
        if part:
            return page(story)
        query = {"part": "1", **({"full": "1"} if full else {})}
        live = f"/ui/findings/{quote(finding_id, safe='')}?{urlencode(query)}"
        return page(_document(f"{found.tool or 'call'} {found.rule}", (
            "<p class='nav'><a href='/ui/'>&larr; all findings</a></p>"
            f"<section id='live-part' data-live='{_e(live)}'>{story}</section>"), live=True))


# --- the list ---

def _matching(detector: Detector, filters: dict[str, str], start: int) -> tuple[list[Finding], int, int]:
    """A page of the matching findings, newest first, from ``start``; how many match; how many are kept."""
    q = FindingQuery(filters["rule"] or None, filters["tool"] or None, filters["severity"] or None,
                     limit=max(1, len(detector.findings)))
    found, _ = detector.findings.query(q)
    if filters["session"]:
        found = [f for f in found if filters["session"] in (f.session_id or "")]
    return found[start:start + LIST_LIMIT], len(found), len(detector.findings)


def _shown(filters: dict[str, str], start: int) -> dict[str, str]:
    """The list's query: its filters set, and where its page starts unless at the newest."""
    return {**{k: v for k, v in filters.items() if v}, **({"offset": str(start)} if start else {})}


def _header(retained: int, dropped: int) -> str:
    evicted = f", the timelines of {dropped} dropped to bound memory" if dropped else ""
    return ("<header><h1>Findings</h1><span class='muted'>" + _e(retained) + " retained by this detector"
            + _e(evicted) + "</span>"
            "<label class='live'><input type='checkbox' id='live' checked> live</label>"
            "<span class='muted' id='refreshed'></span></header>")


def _filter_form(filters: dict[str, str]) -> str:
    def select(name: str, options: Sequence[str]) -> str:
        opts = "".join(f"<option value='{_e(o)}'{' selected' if filters[name] == o else ''}>{_e(o)}</option>"
                       for o in options)
        return f"<label>{name} <select name='{name}'><option value=''>any</option>{opts}</select></label>"

    def text(name: str, hint: str) -> str:
        return (f"<label>{name} <input type='search' name='{name}' value='{_e(filters[name])}' "
                f"placeholder='{_e(hint)}'></label>")

    return ("<form method='get' action='/ui/' class='filters'>" + select("rule", sorted(RULES)) +
            select("severity", _SEVERITIES) + text("tool", "e.g. fetch") + text("session", "id or part of it") +
            "<button type='submit'>Filter</button> <a href='/ui/'>clear</a></form>")


def _findings_table(rows: list[Finding], total: int, start: int, filters: dict[str, str], now: float) -> str:
    if not rows:
        if start and total:
            return (f"<p class='empty'>No findings this far back: {_e(total)} match. "
                    f"<a href='/ui/?{_e(urlencode(_shown(filters, 0)))}'>The newest</a></p>")
        return "<p class='empty'>No findings match. Nothing lost that the detector could see.</p>"
    body = "".join(
        f"<tr class='sev-{_e(f.severity)}'><td>{_when(f.detected_ns, now)}</td>"
        f"<td><span class='badge {_e(f.severity)}'>{_e(f.severity)}</span></td>"
        f"<td><a class='finding' href='/ui/findings/{quote(f.id, safe='')}'>{_e(f.rule)}</a></td>"
        f"<td>{_e(f.tool or '—')}</td><td>{_e(f.request_id or '—')}</td>"
        f"<td class='id' title='{_e(f.session_id or '')}'>{_e(_short(f.session_id or '—'))}</td>"
        f"<td>{_e(_gap_line(f))}</td></tr>" for f in rows)
    more = ""
    if total > len(rows):  # pages of the rest: a flood of findings alike must not hide an older one
        pages = []
        if start:
            pages.append(f"<a href='/ui/?{_e(urlencode(_shown(filters, max(0, start - LIST_LIMIT))))}' "
                         "rel='prev'>&larr; newer</a>")
        if start + LIST_LIMIT < total:
            pages.append(f"<a href='/ui/?{_e(urlencode(_shown(filters, start + LIST_LIMIT)))}' "
                         "rel='next'>older &rarr;</a>")
        more = (f"<p class='muted pages'>Showing {start + 1}&ndash;{start + len(rows)} of {total}, newest first. "
                + " ".join(pages) + "</p>")
    return ("<table class='findings'><thead><tr><th>When</th><th>Severity</th><th>Rule</th><th>Tool</th>"
            f"<th>Request</th><th>Session</th><th>What happened</th></tr></thead><tbody>{body}</tbody></table>{more}")


# --- one call ---

def _related(detector: Detector, finding: Finding) -> list[Finding]:
    """Every finding on the same call (same session and request id), this one first."""
    if finding.request_id is None:
        return [finding]
    others = [f for f in detector.findings if f.id != finding.id and f.request_id == finding.request_id
              and f.session_id == finding.session_id]
    return [finding, *sorted(others, key=lambda f: f.detected_ns)]


def _story(finding: Finding, related: list[Finding], entries: list[Entry] | None, omitted: int, links: UiLinks,
           *, now: float, show_all: bool) -> str:
    lost = any(RULES[f.rule].loss for f in related if f.rule in RULES)
    title = (f"{finding.tool or 'A call'}'s result was lost" if lost
             else f"{finding.tool or 'A call'}: {RULES[finding.rule].summary if finding.rule in RULES else ''}")
    gaps = _gap_sentences(finding, related, entries or [])
    facts = [("Rule", f"<span class='badge {_e(finding.severity)}'>{_e(finding.severity)}</span> "
                      f"<code>{_e(finding.rule)}</code>"),
             ("Tool", _e(finding.tool or "—")), ("Request id", _e(finding.request_id or "—")),
             ("Session", f"<code>{_e(finding.session_id or '— (no session)')}</code>"),
             ("Detected", _when(finding.detected_ns, now, absolute=True)),
             ("Seen by", _e(_join(finding.roles) or "—")),
             ("Trace", _traces(finding, entries or [], links))]
    return (f"<h1 class='sev-{_e(finding.severity)}'>{_e(title)}</h1>"
            + "".join(f"<p class='gap'>{_e(g)}</p>" for g in gaps)
            + "<dl class='facts'>" + "".join(f"<dt>{k}</dt><dd>{v}</dd>" for k, v in facts) + "</dl>"
            + _what_to_do(related, links)
            + "<h2>Timeline</h2>" + _timeline(entries, omitted, finding, show_all)
            + "<h2>Rules that fired on this call</h2>" + "".join(_rule_card(f, f.id == finding.id) for f in related))


def _traces(finding: Finding, entries: list[Entry], links: UiLinks) -> str:
    ids = list(dict.fromkeys([*finding.trace_ids, *(e.trace_id for e in entries)]))[:6]
    if not ids:
        return "—"
    out = []
    for trace_id in ids:
        url = links.trace(trace_id)
        out.append(f"<a class='trace' href='{_e(url)}' rel='noreferrer'><code>{_e(trace_id)}</code></a>" if url
                   else f"<code>{_e(trace_id)}</code>")
    hint = "" if links.trace_url_template else " <span class='muted'>(set --trace-url-template to link these)</span>"
    return " ".join(out) + hint


def _what_to_do(related: list[Finding], links: UiLinks) -> str:
    alerts = list(dict.fromkeys(ALERTS[f.rule] for f in related if f.rule in ALERTS))
    if not alerts:
        return ""
    steps = "".join(f"<li>{_e(step)}</li>" for step in FIRST_STEPS[alerts[0]])
    books = " · ".join(f"<a class='runbook' href='{_e(links.runbook(a))}' rel='noreferrer'>runbook {_e(a)}</a>"
                       for a in alerts)
    return f"<section class='todo'><h2>What to do</h2><ol>{steps}</ol><p>{books}</p></section>"


def _rule_card(f: Finding, current: bool) -> str:
    evidence = "".join(f"<tr><th>{_e(k)}</th><td>{_e(_evidence(k, v))}</td></tr>" for k, v in f.evidence.items())
    head = (f"<span class='badge {_e(f.severity)}'>{_e(f.severity)}</span> <code>{_e(f.rule)}</code>"
            + ("" if current else f" <a href='/ui/findings/{quote(f.id, safe='')}'>open</a>"))
    cause = f"<p class='muted'>caused by finding <code>{_e(f.caused_by)}</code></p>" if f.caused_by else ""
    return (f"<article class='rule'><h3>{head}</h3><p><strong>{_e(_gap_line(f))}</strong></p>"
            f"<p class='muted'>{_e(f.summary)}</p>{cause}"
            f"<table class='evidence'>{evidence}</table></article>")


def _timeline(entries: list[Entry] | None, omitted: int, finding: Finding, show_all: bool) -> str:
    if entries is None:
        return ("<p class='muted'>This finding's timeline is no longer held (evicted to keep the detector's "
                "memory bounded, or the detector restarted). The trace has every span.</p>")
    entries = sorted(entries, key=_at)
    t0 = min((_at(e) for e in entries), default=0)
    rows: list[str] = []
    seen: dict[tuple[Any, ...], int] = {}
    folded: list[Entry] = []

    def fold() -> None:
        if folded:
            kinds = _join(dict.fromkeys(f"{_STEPS.get(e.step, e.step).lower()} ({e.role})" for e in folded))
            rows.append(f"<tr class='folded'><td>+{(_at(folded[-1]) - t0) / 1e9:.3f}s</td><td colspan='3'>"
                        f"&hellip; {len(folded)} more steps like the ones above ({_e(kinds)}), each ending the same "
                        "way. <a href='?full=1'>show all</a></td></tr>")
            folded.clear()

    for entry in entries:
        key = _signature(entry)
        seen[key] = seen.get(key, 0) + 1
        if not show_all and seen[key] > _REPEATS_SHOWN:
            folded.append(entry)
            continue
        fold()
        rows.append(_row(entry, t0))
    fold()
    if omitted:
        rows.append(f"<tr class='folded'><td></td><td colspan='3'>{omitted} steps in the middle were not kept "
                    "(the detector keeps the first and the last of a long story)</td></tr>")
    if finding.rule == "clean_end_pending" and not any(e.error_frames for e in entries):
        rows.append("<tr class='bad'><td></td><td></td><td>No error frame</td><td>No stream carried an error frame "
                    "or a JSON-RPC error for this call: nothing told the caller.</td></tr>")
    return ("<table class='timeline'><thead><tr><th>At</th><th>Side</th><th>Step</th><th>What the spans say</th>"
            f"</tr></thead><tbody>{''.join(rows)}</tbody></table>")


def _row(e: Entry, t0: int) -> str:
    words, tone = _describe(e)
    step = _STEPS.get(e.step, e.step)
    return (f"<tr class='{tone}' data-step='{_e(e.step)}' title='span {_e(e.span_id)}'>"
            f"<td>+{(_at(e) - t0) / 1e9:.3f}s</td><td>{_e(e.role)}</td><td>{_e(step)}</td>"
            f"<td>{' · '.join(_e(w) for w in words)}</td></tr>")


def _describe(e: Entry) -> tuple[list[str], str]:
    """An entry in words, and its tone: bad (the loss), warn (a drop), ok (a delivery or an explicit error)."""
    words: list[str] = []
    tone = ""
    if e.step == "timeout" or e.step == "error":
        return [f"the caller gave up after {e.duration_s or 0:.1f}s ({e.error_type or 'error'})"], "bad"
    if e.step == "call":
        outcome = _OUTCOMES.get(e.outcome or "", e.outcome or "")
        tone = "ok" if e.outcome == sc.OUTCOME_RESULT else "bad" if e.outcome in _LOST_OUTCOMES else "warn"
        return [f"outcome: {outcome}"], tone
    if e.cursor is not None:
        words.append(f"from Last-Event-ID {e.cursor}" if e.step != "replay" else f"after cursor {e.cursor}")
    if e.audience or e.missing_resources:
        words.append(f"token audience presented: {_join(e.audience) or 'none'}")
    if e.required and (e.step in ("resume", "replay") or e.missing_resources):
        words.append(f"required: {_join(e.required)}")
    if e.missing_resources or e.missing_scopes:
        words.append(f"lacks {_join((*e.missing_resources, *e.missing_scopes))}")
        tone = "bad"
    if e.step == "replay":
        words.append(f"{e.buffered or 0} buffered, {e.sent or 0} sent: {e.decision}")
        if e.offending_event_id:
            words.append(f"held back from event {e.offending_event_id}")
        if e.guard_decision:
            words.append(f"guard: {e.guard_decision}")
        if e.decision in (sc.REPLAY_TRUNCATED, sc.REPLAY_UNKNOWN_CURSOR):
            tone = "bad"
        elif e.decision == sc.REPLAY_REFUSED:
            tone = "ok"
        return words, tone
    if e.events:
        ids = f", ids {e.first_event_id}…{e.last_event_id}" if e.first_event_id else ""
        words.append(f"{e.events} event{'s' if e.events != 1 else ''}{ids}")
    else:
        words.append("no events")
    if e.reason == sc.END_HTTP_ERROR:
        words.append(f"HTTP {e.status}")
        tone = tone or "warn"
    elif e.reason:
        words.append(_ENDS.get(e.reason, e.reason))
    if e.error_frames:
        words.append(f"{e.error_frames} error frame{'s' if e.error_frames != 1 else ''}")
        tone = "ok"
    elif e.pending and e.reason == sc.END_CLEAN:
        words.append("no error frame")
        tone = "bad"
    if e.terminal:
        words.append(f"delivered the result of {_join(e.terminal)}")
        tone = tone or "ok"
    if e.pending:
        words.append(f"still pending: {_join(e.pending)}")
        if e.reason == sc.END_DROPPED:
            tone = tone or "warn"
    return words, tone


def _gap_sentences(finding: Finding, related: list[Finding], entries: list[Entry]) -> list[str]:
    """The story in three sentences at most: the gap (what the token lacked), what this finding saw, and
    what the caller got. From the findings' evidence first, else from the timeline."""
    lines = [_gap_line(f) for f in related]
    gap = next((line for line in lines if " lacks " in line), None)
    if gap is None:
        e = next((e for e in entries if e.missing_resources or e.missing_scopes), None)
        if e is not None:
            gap = (f"The resume's token lacks "
                   f"{_join((*e.missing_resources, *e.missing_scopes))} "
                   f"(it presented {_join(e.audience) or 'no audience'}).")
    out = [line for line in (gap, _gap_line(finding)) if line]
    gave_up = next((e for e in entries if e.step == "timeout"), None)
    if gave_up is not None:
        out.append(f"The caller gave up after {gave_up.duration_s or 0:.1f}s ({gave_up.error_type}); it was never "
                   "told why.")
    return list(dict.fromkeys(out))


def _gap_line(f: Finding) -> str:
    """One finding in one sentence, from its evidence."""
    ev = f.evidence
    missing = [*ev.get("missing_resources", ()), *ev.get("missing_scopes", ())]
    if missing:
        held = _join(ev.get("audience_held") or ()) or "no audience"
        need = f"; the pending {f.tool or 'call'} requires {_join(ev['required'])}" if ev.get("required") else ""
        return f"The resume's token lacks {_join(missing)} (it presented {held}){need}."
    sentences: dict[str, Callable[[], str]] = {
        "clean_end_pending": lambda: (f"The stream ended cleanly with the call still pending: no result, no error "
                                      f"frame, nothing within the {ev.get('grace_s', '?')}s grace period."),
        "replay_truncated": lambda: (f"The server replayed {ev.get('sent', '?')} of {ev.get('buffered', '?')} buffered "
                                     "events and ended the stream without an error frame."),
        "cursor_past_undelivered": lambda: (f"The replay skipped {ev.get('skipped', '?')} events from "
                                            f"{ev.get('first_undelivered_event_id', '?')}: the client's cursor is "
                                            "now past events it never got."),
        "resume_loop": lambda: (f"Resumed {ev.get('resumes', '?')} times from cursor {ev.get('cursor', '?')} in "
                                f"{_value(ev.get('window_s', '?'))}s without progress."),
        "unknown_cursor": lambda: f"A resume to cursor {ev.get('cursor', '?')} got an empty stream, not an error.",
        "session_expired_in_flight": lambda: (f"The session was gone (HTTP {ev.get('status', '?')}) while the call "
                                              "was still owed its result."),
        "foreign_result": lambda: (f"The stream delivered the result of request {_join(ev.get('wire_ids', ()))}, "
                                   "not this call's; the client took it as its own."),
        "cross_stream_replay": lambda: (f"The replay sent events {_join(ev.get('foreign_event_ids', ()))} stored on "
                                        "another stream or session."),
        "duplicate_terminal": lambda: f"The call's result was delivered {ev.get('deliveries', '?')} times.",
        "not_reissued": lambda: (f"The response stream broke before the response and the call was not re-issued "
                                 f"within {ev.get('grace_s', '?')}s."),
        "stored_not_delivered": lambda: (f"The server stored the result (event {ev.get('stored_event_id', '?')}) while "
                                         "no stream was open to carry it, and the client never received it within "
                                         f"{ev.get('grace_s', '?')}s."),
        "store_failed": lambda: ("The server's event store failed while the call was owed its result: the server "
                                 "sends none of the session's messages after that, and no result reached the "
                                 f"client within {ev.get('grace_s', '?')}s."),
        "sent_not_received": lambda: (f"The server sent the result (event {ev.get('sent_event_id', '?')}) on a "
                                      "connection its client had lost, and the client, which never got it, cancelled "
                                      "the call."),
        "timeout_attributed": lambda: "The caller gave up on this call after the findings below: they are the cause.",
    }
    say = sentences.get(f.rule)
    return say() if say is not None else f.summary


# --- small things ---

def _signature(e: Entry) -> tuple[Any, ...]:
    return (e.role, e.step, e.reason, e.status, e.events, e.cursor, e.error_frames, e.pending, e.terminal,
            e.missing_resources, e.missing_scopes, e.decision, e.buffered, e.sent, e.outcome, e.error_type)


def _at(e: Entry) -> int:
    """When a step happened as the story goes: a give-up or a call's end at its end, a stream at its start."""
    return e.end_ns if e.step in ("timeout", "error", "call") else e.at_ns


def _when(ns: int, now: float, *, absolute: bool = False) -> str:
    at = ns / 1e9
    ago = max(0.0, now - at)
    rel = f"{ago:.0f}s ago" if ago < 120 else f"{ago / 60:.0f} min ago" if ago < 7200 else f"{ago / 3600:.0f} h ago"
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(at))
    shown = f"{rel} ({stamp} UTC)" if absolute else rel
    return f"<time datetime='{_e(stamp)}Z' title='{_e(stamp)} UTC'>{_e(shown)}</time>"


def _short(value: str) -> str:
    return value if len(value) <= 14 else value[:12] + "…"


def _evidence(key: str, v: Any) -> str:
    if key.endswith("_at") and isinstance(v, (int, float)) and not isinstance(v, bool):
        return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(v))
    return _value(v)


def _value(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3f}".rstrip("0").rstrip(".")
    if isinstance(v, (list, tuple)):
        return _join(_value(x) for x in v) or "—"
    if isinstance(v, dict):
        return "; ".join(f"{k}: {_value(x)}" for k, x in v.items())
    return "—" if v is None else str(v)


def _document(title: str, body: str, *, live: bool = False) -> str:
    script = "<script src='/ui/static/ui.js' defer></script>" if live else ""
    return ("<!doctype html><html lang='en'><head><meta charset='utf-8'>"
            "<meta name='viewport' content='width=device-width, initial-scale=1'>"
            f"<title>{_e(title)} · mcp-stream-exporter</title><link rel='icon' href='data:,'>"
            "<link rel='stylesheet' href='/ui/static/ui.css'>"
            f"{script}</head><body><main>{body}</main></body></html>")
