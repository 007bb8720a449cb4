"""The findings page's contracts without a browser: it names the alert that pages on each rule (as
alerts/ defines it) and that alert's runbook, it sits behind the /api token, and it tells the gap in words."""

from __future__ import annotations

import re
from pathlib import Path

import yaml
from fastapi.testclient import TestClient

from mcp_stream_exporter import semconv as sc
from mcp_stream_exporter.detector import Detector, DetectorConfig, RuleConfig
from mcp_stream_exporter.detector.app import Access, create_app
from mcp_stream_exporter.detector.rules import RULES
from mcp_stream_exporter.detector.ui import ALERTS, COOKIE, FIRST_STEPS, UiLinks

from spans import FETCH, SEARCH, S, call, replay, stream

ROOT = Path(__file__).resolve().parents[2]
GROUPS = yaml.safe_load((ROOT / "alerts" / "mcp-stream-exporter.yaml").read_text())["groups"]
RULE_ALERTS = [r for g in GROUPS for r in g["rules"] if "alert" in r and "rule" in r["expr"]]
TOKEN = "page-token"
C = sc.ROLE_CLIENT


def _rules_of(expr: str) -> set[str]:
    """The detector rules an alert's selector admits: rule="x", rule=~"a|b" or rule!="x"."""
    m = re.search(r'rule(=~|!=|=)"([^"]+)"', expr)
    assert m, expr
    op, value = m.groups()
    if op == "=":
        return {value}
    if op == "=~":
        return set(value.split("|"))
    return {r for r, spec in RULES.items() if spec.loss} - {value}


def test_each_rule_names_the_alert_that_pages_on_it():
    paged = {rule: alert["alert"] for alert in RULE_ALERTS for rule in _rules_of(alert["expr"])}
    assert paged == ALERTS


def test_each_paging_alert_has_first_steps_and_a_runbook_and_links_its_findings_page():
    assert set(FIRST_STEPS) == set(ALERTS.values())
    for alert in RULE_ALERTS:
        assert (ROOT / "docs" / "runbooks" / f"{alert['alert']}.md").exists()
        assert alert["annotations"]["findings_url"] == ("http://{{ $labels.instance }}/ui/?rule={{ $labels.rule "
                                                        "| urlquery }}&tool={{ $labels.tool | urlquery }}")
        assert all(len(step) < 240 for step in FIRST_STEPS[alert["alert"]])


def test_links_fill_the_trace_template_and_the_runbook_base():
    links = UiLinks("https://tempo.example.com/trace/{trace_id}?orgId=1", "https://wiki.example.com/runbooks/")
    assert links.trace("ab/cd") == "https://tempo.example.com/trace/ab%2Fcd?orgId=1"
    assert links.runbook("MCPResumeLoop") == "https://wiki.example.com/runbooks/MCPResumeLoop.md"
    assert UiLinks("javascript:alert(1)//{trace_id}").trace("ab") is None
    assert UiLinks().trace("ab") is None


def _lost_call_detector(**config: object) -> Detector:
    clock = [100 * S]
    detector = Detector(DetectorConfig(rules=RuleConfig(clean_end_grace_s=5), **config),  # type: ignore[arg-type]
                        clock=lambda: clock[0])
    detector.consume([stream(C, "post", "dropped", pending=("3",), first="4", last="6", events=2),
                      stream(C, "resume", "clean", at=1.2, pending=("3",), cursor="6", audience=(SEARCH,),
                             missing=(FETCH,)),
                      replay(sc.REPLAY_TRUNCATED, at=1.3, cursor="6", missing=(FETCH,)),
                      call(C, sc.OUTCOME_CANCELLED, at=3.0)])
    clock[0] += 10 * S
    detector.tick()
    return detector


def test_the_page_needs_the_api_token_as_a_bearer_or_through_its_login_cookie():
    detector = _lost_call_detector()
    client = TestClient(create_app(detector, access=Access(api_token=TOKEN)))
    assert client.get("/ui/").status_code == 401 and "name='token'" in client.get("/ui/").text
    assert client.get("/ui/", headers={"authorization": "Bearer nope"}).status_code == 401
    assert client.post("/ui/login", data={"token": "nope"}, follow_redirects=False).status_code == 401
    ok = client.get("/ui/", headers={"authorization": f"Bearer {TOKEN}"})
    assert ok.status_code == 200 and "clean_end_pending" in ok.text
    assert "script-src 'self'" in ok.headers["content-security-policy"] and ok.headers["cache-control"] == "no-store"

    signed_in = client.post("/ui/login", data={"token": TOKEN}, follow_redirects=False)
    assert signed_in.status_code == 303 and signed_in.headers["location"] == "/ui/"
    cookie = signed_in.cookies[COOKIE]
    assert TOKEN not in cookie and "httponly" in signed_in.headers["set-cookie"].lower()
    browser = TestClient(client.app, cookies={COOKIE: cookie})
    assert browser.get("/ui/").status_code == 200
    assert browser.get("/api/findings").status_code == 401  # the cookie opens the page, not the API


def test_a_sign_in_cookie_or_body_a_client_makes_up_is_a_401_and_costs_no_memory():
    """A cookie of bytes that are not ASCII is a wrong one (401, not a 500), and a sign-in reads no more of its
    body than a token needs: anyone may send one, of any size."""
    import asyncio

    app = create_app(_lost_call_detector(), access=Access(api_token=TOKEN))
    for path in ("/ui/", "/ui/findings/x"):
        assert TestClient(app).get(path, headers=[(b"cookie", COOKIE.encode() + b"=\xff\xfe")]).status_code == 401
    pulled = 0
    sent: list[dict[str, object]] = []

    async def endless() -> dict[str, object]:  # 4 MiB, as far as a reader would read
        nonlocal pulled
        pulled += 1
        return {"type": "http.request", "body": b"token=" + b"x" * 65536, "more_body": pulled < 64}

    async def send(message: dict[str, object]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/ui/login", "raw_path": b"/ui/login", "query_string": b"",
             "headers": [(b"content-type", b"application/x-www-form-urlencoded")], "scheme": "http",
             "server": ("testserver", 80), "client": ("testclient", 1), "http_version": "1.1", "root_path": ""}
    asyncio.run(app(scope, endless, send))  # type: ignore[arg-type]
    assert sent[0]["status"] == 401 and pulled == 1


def test_the_lost_call_s_page_says_the_gap_in_words_and_what_to_do():
    detector = _lost_call_detector()
    client = TestClient(create_app(detector))
    lost = next(f for f in detector.findings if f.rule == "clean_end_pending")
    page = client.get(f"/ui/findings/{lost.id}").text
    assert f"The resume&#x27;s token lacks {FETCH} (it presented {SEARCH}); the pending fetch requires {FETCH}." in page
    assert "no error frame" in page and "runbooks/MCPToolResultSilentlyLost.md" in page
    assert client.get("/ui/findings/does-not-exist").status_code == 404
    rows = client.get("/ui/", params={"rule": "narrowed_resume", "part": "rows"}).text
    assert "narrowed_resume" in rows and "clean_end_pending" not in rows and "<html" not in rows
    assert "No findings match" in client.get("/ui/", params={"session": "another-session"}).text


def test_an_alert_s_links_for_a_tool_counted_as_other_find_its_findings():
    """A tool outside the policy is counted under ``tool="other"``: the alert's evidence and findings links, built
    from its labels, list its findings (by the label or by the tool's own name), never "nothing lost"."""
    detector = _lost_call_detector(tools=("search",))
    assert detector.registry.get_sample_value("mcp_stream_silent_losses_total",
                                              {"rule": "clean_end_pending", "tool": "other"}) == 1
    client = TestClient(create_app(detector))
    for tool in ("other", "fetch"):
        listed = client.get("/api/findings", params={"rule": "clean_end_pending", "tool": tool}).json()
        assert [f["tool"] for f in listed["findings"]] == ["fetch"]
        page = client.get("/ui/", params={"rule": "clean_end_pending", "tool": tool}).text
        assert "No findings match" not in page and "clean_end_pending" in page
    assert client.get("/api/findings", params={"tool": "search"}).json()["total"] == 0


def test_a_flood_of_findings_alike_pages_back_to_the_older_one_it_pushed_off_the_first_page():
    from mcp_stream_exporter.detector.findings import Finding
    from mcp_stream_exporter.detector.ui import LIST_LIMIT

    detector = Detector(DetectorConfig())
    flood = LIST_LIMIT + 51

    def finding(n: int, session: str) -> Finding:
        return Finding(f"f{n}", "clean_end_pending", "critical", "legacy", "fetch", session, str(n), n, "lost")

    detector.findings.add(finding(0, "the-real-one"))
    for n in range(1, flood + 1):
        detector.findings.add(finding(n, f"flood-{n}"))
    client = TestClient(create_app(detector))
    first = client.get("/ui/", params={"rule": "clean_end_pending", "tool": "fetch"}).text
    assert "the-real-one" not in first and f"Showing 1&ndash;{LIST_LIMIT} of {flood + 1}" in first
    older = re.search(r"<a href='/ui/\?([^']+)' rel='next'>", first)
    assert older and "rel='prev'" not in first
    second = client.get("/ui/?" + older.group(1).replace("&amp;", "&")).text
    assert "the-real-one" in second and "flood-1'" in second and f"flood-{flood}'" not in second
    assert "rel='prev'" in second and "rel='next'" not in second and "rule=clean_end_pending" in older.group(1)
    assert "the-real-one" in client.get("/ui/", params={"offset": str(LIST_LIMIT), "part": "rows"}).text
    for bad in ("-1", "x", "9" * 40, "\u00b2", "\u2460", "\u0662"):  # the newest page, never an error
        assert "flood-" in client.get("/ui/", params={"offset": bad}).text
    assert "No findings this far back" in client.get("/ui/", params={"offset": "100000"}).text
