"""The findings page (/ui/) in a real browser: Debian's chromium, headless, driven by Playwright (no browser
download). The lab incident's lost call, one click from the list; and spans carrying HTML and script in every
string field, which must render as text and run nothing."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from playwright.sync_api import BrowserContext, Page, sync_playwright

from mcp_stream_exporter import semconv as sc
from mcp_stream_exporter.detector import Span
from mcp_stream_exporter.detector.embedded import DetectorSpanProcessor, EmbeddedDetector
from mcp_stream_exporter.detector.events import KIND_CLIENT
from mcp_stream_exporter.detector.ui import COOKIE, UiLinks

from harness import TOKENS_USED, after_grace, detector, detector_process, incident, play_incident, wait_for

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
FETCH = "https://mcp.example.com/tools/fetch"
SEARCH = "https://mcp.example.com/tools/search"
TEMPO = "https://tempo.example.com/trace/{trace_id}"
API_TOKEN = "ui-api-token-for-tests"


@contextlib.contextmanager
def chromium(**options: Any) -> Iterator[BrowserContext]:
    """Debian's chromium under Playwright with a fresh profile; skipped, and said why, without it."""
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(f"SKIPPED: {CHROMIUM} is missing (make system-deps installs Debian's chromium); the findings "
                    "page was NOT tested in a browser")
    with tempfile.TemporaryDirectory(prefix="chromium-") as profile, sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(profile, executable_path=CHROMIUM, args=CHROMIUM_ARGS,
                                                        headless=True, **options)
        try:
            yield context
        finally:
            context.close()


def _watch(context: BrowserContext) -> list[str]:
    """Every dialog (alert, confirm, prompt) a page opens, dismissed and recorded."""
    dialogs: list[str] = []

    def opened(dialog: Any) -> None:
        dialogs.append(dialog.message)
        dialog.dismiss()

    context.on("dialog", opened)
    return dialogs


def test_the_lost_call_is_one_click_from_the_list_with_its_timeline_gap_and_next_steps(tmp_path: Path):
    with detector(grace_s=1.0, tools=("search", "fetch")) as (found, clock):
        async def scenario() -> list[Any]:
            async with incident("legacy") as lab:
                return await play_incident(lab)

        search, fetch = asyncio.run(scenario())
        assert not isinstance(search, BaseException) and isinstance(fetch, BaseException)
        after_grace(found, clock, 1.0)
    lost = next(f for f in found.findings if f.rule == "clean_end_pending" and f.tool == "fetch")
    embedded = EmbeddedDetector(found, DetectorSpanProcessor(found))
    base = f"http://127.0.0.1:{embedded.serve(port=0, links=UiLinks(TEMPO))}"
    try:
        with chromium(viewport={"width": 1280, "height": 900}) as context:
            dialogs = _watch(context)
            page = context.new_page()
            page.goto(f"{base}/ui/")
            rules = page.locator("table.findings a.finding").all_inner_texts()
            assert {"clean_end_pending", "narrowed_resume"} <= set(rules)
            shown = [t.get_attribute("datetime") or "" for t in page.locator("table.findings time").all()]
            assert shown == sorted(shown, reverse=True), "newest first"

            page.select_option("select[name=rule]", "clean_end_pending")
            page.fill("input[name=tool]", "fetch")
            page.click("form.filters button")
            assert page.locator("table.findings a.finding").all_inner_texts() == ["clean_end_pending"]
            page.click("table.findings a.finding")
            page.wait_for_url(f"**/ui/findings/{lost.id}")

            assert page.locator("h1").inner_text() == "fetch's result was lost"
            gaps = page.locator("p.gap").all_inner_texts()
            assert gaps[0].startswith(f"The resume's token lacks {FETCH} (it presented {SEARCH})")
            assert any("no error frame" in g for g in gaps) and any("The caller gave up after" in g for g in gaps)

            rows = page.locator("table.timeline tbody tr")
            steps = [r.get_attribute("data-step") for r in rows.all()]
            assert steps[0] == "post" and page.locator("tr[data-step=post]").first.get_attribute("class") == "warn"
            post = page.locator("tr[data-step=post]").first.inner_text()
            assert "connection dropped" in post and "still pending: " + str(lost.request_id) in post
            resume = page.locator("tr[data-step=resume]").first.inner_text()
            assert "from Last-Event-ID" in resume and f"token audience presented: {SEARCH}" in resume
            assert f"required: {FETCH}" in resume and f"lacks {FETCH}" in resume and "no error frame" in resume
            assert "truncated" in page.locator("tr[data-step=replay]").first.inner_text()
            assert "the caller gave up after" in page.locator("tr[data-step=timeout]").inner_text()
            assert steps.index("post") < steps.index("resume") < steps.index("timeout")
            assert "No stream carried an error frame" in rows.last.inner_text()

            trace = page.locator("a.trace").first.get_attribute("href")
            assert trace == TEMPO.format(trace_id=lost.trace_ids[0])
            runbooks = [a.get_attribute("href") for a in page.locator("a.runbook").all()]
            assert runbooks[0] == ("https://github.com/mcp-stream-exporter/mcp-stream-exporter/blob/main/docs/"
                                   "runbooks/MCPToolResultSilentlyLost.md")
            assert page.locator(".todo li").count() >= 2
            fired = page.locator("article.rule code").all_inner_texts()
            assert fired[0] == "clean_end_pending" and "narrowed_resume" in fired

            shot = tmp_path / "lost-call.png"
            page.screenshot(path=str(shot), full_page=True)
            assert shot.stat().st_size > 10_000

            page.goto(f"{base}/ui/")  # live: a new finding shows up without a reload
            page.wait_for_selector("table.findings")
            found.consume([_narrowed_resume("search-live-session")])
            page.wait_for_selector("td.id[title=search-live-session]", timeout=20_000)
            assert page.locator("#refreshed").inner_text().startswith("refreshed")
            assert dialogs == []
            html = page.content()
            assert all(token not in html for token in TOKENS_USED)
    finally:
        embedded.close()


def _narrowed_resume(session: str) -> Span:
    now = time.time_ns()
    return Span("ab" * 16, "cd" * 8, None, "MCP stream resume", KIND_CLIENT, now, now + 1000, {
        sc.SPAN: sc.SPAN_STREAM, sc.ROLE: sc.ROLE_CLIENT, sc.STREAM_KIND: sc.STREAM_KIND_RESUME,
        sc.END_REASON: sc.END_CLEAN, sc.MCP_SESSION_ID: session, sc.RESUME_CURSOR: "6",
        sc.STREAM_REQUEST_IDS: ("9",), sc.PENDING_REQUEST_IDS: ("9",), sc.GEN_AI_TOOL_NAME: "search",
        sc.AUTH_AUDIENCE: (FETCH,), sc.AUTH_MISSING_RESOURCES: (SEARCH,), sc.REQUIRED_RESOURCES: (SEARCH,)})


# --- a producer sending HTML and script in every string it controls ---

PAYLOADS = ["<img src=x onerror=alert('img')>", "\"><script>alert('script')</script>",
            "'><svg onload=alert('svg')>", "javascript:alert('href')", "<iframe src=javascript:alert('frame')>",
            "</td></tr></table><b id=injected>bold</b>", "W" * 200]  # the last: no break in it, as an id may be


def _value(v: Any) -> dict[str, Any]:
    if isinstance(v, list):
        return {"arrayValue": {"values": [_value(x) for x in v]}}
    return {"intValue": str(v)} if isinstance(v, int) else {"stringValue": v}


def _otlp_span(span_id: str, name: str, kind: int, attrs: dict[str, Any], at_ns: int, duration_ns: int = 1000,
               parent: str | None = None) -> dict[str, Any]:
    span = {"traceId": base64.b64encode(bytes.fromhex("7e" * 16)).decode(),
            "spanId": base64.b64encode(bytes.fromhex(span_id)).decode(), "name": name, "kind": kind,
            "startTimeUnixNano": str(at_ns), "endTimeUnixNano": str(at_ns + duration_ns),
            "attributes": [{"key": k, "value": _value(v)} for k, v in attrs.items()]}
    if parent is not None:
        span["parentSpanId"] = base64.b64encode(bytes.fromhex(parent)).decode()
    return span


def _id(n: int, k: int) -> str:
    return f"{n:02x}{k:02x}" * 4


def _hostile_batch(n: int, p: str) -> bytes:
    """The incident's shape, every free string a payload: session, request id, tool, cursor, event ids,
    audiences, resources, span names, the caller's error type, the emitting service."""
    now = time.time_ns()
    common = {sc.MCP_SESSION_ID: f"session {p}", sc.ROLE: sc.ROLE_CLIENT, sc.ERA: sc.ERA_RESUMABLE}
    rid, tool = f"id {p}", f"tool {p}"
    stream = {sc.SPAN: sc.SPAN_STREAM, sc.STREAM_REQUEST_IDS: [rid], sc.PENDING_REQUEST_IDS: [rid],
              sc.GEN_AI_TOOL_NAME: tool, sc.REQUIRED_RESOURCES: [f"res {p}"], sc.EVENTS_COUNT: 2,
              sc.EVENT_FIRST_ID: f"first {p}", sc.EVENT_LAST_ID: f"last {p}", sc.HTTP_RESPONSE_STATUS_CODE: 200}
    spans = [
        _otlp_span(_id(n, 1), f"POST {p}", 3, {**common, **stream, sc.STREAM_KIND: sc.STREAM_KIND_POST,
                                             sc.END_REASON: sc.END_DROPPED}, now),
        _otlp_span(_id(n, 2), f"resume {p}", 3, {**common, **stream, sc.STREAM_KIND: sc.STREAM_KIND_RESUME,
                                               sc.END_REASON: sc.END_CLEAN, sc.RESUME_CURSOR: f"cursor {p}",
                                               sc.EVENTS_COUNT: 0, sc.AUTH_AUDIENCE: [f"aud {p}"],
                                               sc.AUTH_MISSING_RESOURCES: [f"res {p}"],
                                               sc.AUTH_MISSING_SCOPES: [f"scope {p}"],
                                               sc.AUTH_FINGERPRINT: f"fp {p}"}, now + 10_000_000),
        _otlp_span(_id(n, 3), f"replay {p}", 1, {**common, sc.ROLE: sc.ROLE_SERVER, sc.SPAN: sc.SPAN_REPLAY,
                                               sc.JSONRPC_REQUEST_ID: rid, sc.RESUME_CURSOR: f"cursor {p}",
                                               sc.REPLAY_DECISION: sc.REPLAY_TRUNCATED, sc.REPLAY_BUFFERED: 3,
                                               sc.REPLAY_SENT: 0, sc.REPLAY_OFFENDING_EVENT_ID: f"offending {p}",
                                               sc.GUARD_DECISION: f"guard {p}", sc.AUTH_AUDIENCE: [f"aud {p}"],
                                               sc.AUTH_MISSING_RESOURCES: [f"res {p}"]}, now + 11_000_000),
        _otlp_span(_id(n, 5), f"MCP send tools/call {tool}", 3, {
            sc.MCP_METHOD_NAME: "tools/call", sc.ERROR_TYPE: f"err {p}", sc.RPC_RESPONSE_STATUS_CODE: "-32001"},
            now, 2_000_000_000),
        _otlp_span(_id(n, 4), f"call {p}", 1, {**common, sc.SPAN: sc.SPAN_CALL, sc.JSONRPC_REQUEST_ID: rid,
                                             sc.GEN_AI_TOOL_NAME: tool, sc.CALL_OUTCOME: f"outcome {p}",
                                             sc.REQUIRED_RESOURCES: [f"res {p}"]}, now, 2_000_000_000,
                   parent=_id(n, 5)),
    ]
    doc = {"resourceSpans": [{"resource": {"attributes": [
        {"key": "service.name", "value": {"stringValue": f"svc {p}"}},
        {"key": "service.instance.id", "value": {"stringValue": f"instance {p}"}}]},
        "scopeSpans": [{"spans": spans}]}]}
    return json_format.ParseDict(doc, trace_service_pb2.ExportTraceServiceRequest()).SerializeToString()


_INJECTED = """() => ({
  scripts: [...document.scripts].map(s => s.getAttribute('src')),
  elements: document.querySelectorAll('img, svg, iframe, object, embed, #injected, b').length,
  handlers: [...document.querySelectorAll('*')]
    .filter(e => [...e.attributes].some(a => a.name.startsWith('on'))).length,
  hrefs: [...document.querySelectorAll('a')].map(a => a.getAttribute('href')).filter(h => !/^(\\/|\\?|https:)/.test(h)),
})"""


def _inert(page: Page) -> None:
    found = page.evaluate(_INJECTED)
    assert found["scripts"] in ([], ["/ui/static/ui.js"]), found
    assert found["elements"] == 0 and found["handlers"] == 0 and found["hrefs"] == [], found


def _fits(page: Page) -> bool:
    """Whether the page is no wider than its window: a long unbroken value (a tool name MCP allows, an id) must wrap,
    not push the columns after it, a finding's gap line among them, off the screen."""
    return bool(page.evaluate("document.documentElement.scrollWidth <= window.innerWidth"))


def test_html_and_script_in_every_span_string_render_as_text_and_nothing_runs(tmp_path: Path):
    flags = ("--api-token=" + API_TOKEN, "--clean-end-grace-s=0.2", f"--trace-url-template={TEMPO}",
             "--runbook-base-url=https://wiki.example.com/runbooks")
    with detector_process(*flags) as service:
        auth = {"authorization": f"Bearer {API_TOKEN}"}
        for n, p in enumerate(PAYLOADS):
            answer = service.http.post("/v1/traces", content=_hostile_batch(n, p),
                                       headers={"content-type": "application/x-protobuf"})
            assert answer.status_code == 200, answer.text
        findings = wait_for(lambda: (lambda fs: fs if {f["rule"] for f in fs} >= {
            "narrowed_resume", "replay_truncated", "clean_end_pending"} else None)(
            service.http.get("/api/findings", params={"limit": 500}, headers=auth).json()["findings"]),
            20, "the hostile spans' findings")
        assert service.http.get("/ui/").status_code == 401  # same token as /api
        assert service.http.get("/ui/", headers={"authorization": "Bearer wrong"}).status_code == 401
        assert service.http.get("/ui/", headers=auth).status_code == 200

        with chromium(extra_http_headers=auth) as context:
            dialogs = _watch(context)
            page = context.new_page()
            page.goto(f"{service.url}/ui/")
            _inert(page)
            text = page.locator("main").inner_text()
            assert all(f"tool {p}" in text for p in PAYLOADS), text  # shown as text, not parsed
            assert _fits(page)
            page.wait_for_selector("#refreshed:text-matches('^refreshed')", timeout=20_000)
            # ... and after a live refresh swapped the rows in
            _inert(page)
            for f in findings:
                for suffix in ("", "?full=1"):
                    page.goto(f"{service.url}/ui/findings/{f['id']}{suffix}")
                    assert page.locator("h1").count() == 1
                    _inert(page)
                    assert _fits(page)
                    assert page.locator("a.trace").first.get_attribute("href") == TEMPO.format(trace_id="7e" * 16)
                    assert all(a.get_attribute("href").startswith("https://wiki.example.com/runbooks/MCP")
                               for a in page.locator("a.runbook").all())
                    if f["rule"] == "narrowed_resume":
                        payload = f["tool"].removeprefix("tool ")
                        text = page.locator("main").inner_text()
                        assert f"The resume's token lacks res {payload}, scope {payload}" in text
                        assert f"from Last-Event-ID cursor {payload}" in text
            page.screenshot(path=str(tmp_path / "hostile.png"), full_page=True)
            assert dialogs == []
        with chromium() as login:  # a browser without the header: the login form, then a cookie
            page = login.new_page()
            page.goto(f"{service.url}/ui/")
            page.fill("input[name=token]", "not-the-token")
            page.click("form.login button")
            assert "not accepted" in page.locator("main").inner_text()
            page.fill("input[name=token]", API_TOKEN)
            page.click("form.login button")
            page.wait_for_selector("table.findings")
            (cookie,) = [c for c in login.cookies() if c["name"] == COOKIE]
            assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and API_TOKEN not in cookie["value"]
        with httpx.Client(base_url=service.url) as http:
            assert http.get("/api/findings", cookies={COOKIE: cookie["value"]}).status_code == 401  # /api: bearer only


def test_demo_serve_prints_the_findings_page_and_the_lost_call_s_page():
    proc = subprocess.Popen([sys.executable, "-m", "mcp_stream_exporter.cli", "demo", "--serve", "0",
                             "--trace-url-template", TEMPO], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True)
    try:
        urls: dict[str, str] = {}
        deadline = time.monotonic() + 120
        assert proc.stdout is not None
        while len(urls) < 2 and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            for label in ("Findings page: ", "The lost call: "):
                if line.startswith(label):
                    urls[label] = line[len(label):].strip()
        assert urls["Findings page: "].endswith("/ui/"), urls
        lost = httpx.get(urls["The lost call: "], timeout=10)
        assert lost.status_code == 200 and "fetch&#x27;s result was lost" in lost.text
        assert f"The resume&#x27;s token lacks {FETCH}" in lost.text and "https://tempo.example.com/trace/" in lost.text
    finally:
        proc.terminate()
        proc.wait(timeout=20)
