"""The dashboards: the committed JSON is the generator's output, and it passes the dashboard-linter's
rules (grafana/dashboard-linter, re-implemented here; it ships only as a Go binary) and promtool's parser."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import yaml
from promtool import check_rules, promtool

from panel_queries import DASHBOARDS, dashboards, panels, queries, substitute

sys.path.insert(0, str(DASHBOARDS))
import generate

BOARDS = dashboards()
ROOT = Path(__file__).resolve().parents[2]
# Grafana unit ids (packages/grafana-data/src/valueFormats/categories.ts) this project may use
UNITS = {"short", "none", "percentunit", "s", "ms", "reqps", "ops", "bytes", "decbytes", "dtdurations"}
DATA_PANELS = {"stat", "singlestat", "graph", "table", "timeseries", "gauge"}
RANGE_FUNCTIONS = re.compile(r"\b(rate|irate|increase)\(")


def _variables(board):
    return {v["name"]: v for v in board["templating"]["list"]}


def test_the_committed_json_is_what_the_generator_writes():
    assert set(BOARDS) == set(generate.DASHBOARDS)
    for name, build in generate.DASHBOARDS.items():
        assert (DASHBOARDS / name).read_text() == generate.render(build), f"run python dashboards/generate.py ({name})"


def test_dashboards_have_titles_stable_unique_uids_tags_and_are_not_editable():
    uids = [b["uid"] for b in BOARDS.values()]
    assert len(set(uids)) == len(uids)
    for board in BOARDS.values():
        assert board["title"] and 8 <= len(board["uid"]) <= 40
        assert board["tags"] == ["mcp-stream-exporter"]
        assert board["editable"] is False, "uneditable-dashboard"


@pytest.mark.parametrize("name", BOARDS)
def test_template_variables_follow_the_linter(name):
    variables = _variables(BOARDS[name])
    datasources = [v for v in variables.values() if v["type"] == "datasource"]
    assert len(datasources) == 1, "template-datasource-rule: exactly one"
    assert datasources[0]["name"] == "datasource" and datasources[0]["label"] == "Data source"
    assert datasources[0]["query"] == "prometheus"
    for var in ("job", "instance"):
        v = variables[var]
        assert v["label"] == var and v["type"] == "query", f"template-{var}-rule"
        assert v["datasource"]["uid"] == "${datasource}" and v["multi"] and v["allValue"] == ".+"
        assert v["refresh"] == 2, "template-on-time-change-reload-rule"


@pytest.mark.parametrize("name", BOARDS)
def test_panels_follow_the_linter(name):
    for panel in panels(BOARDS[name]):
        if panel["type"] == "row":
            continue
        title = panel.get("title")
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, f"panel-datasource-rule {title}"
        if panel["type"] in DATA_PANELS:
            assert title and panel.get("description"), f"panel-title-description-rule {title}"
            assert panel["fieldConfig"]["defaults"].get("unit") in UNITS, f"panel-units-rule {title}"
        assert panel.get("targets"), f"panel-no-targets-rule {title}"


@pytest.mark.parametrize("name", BOARDS)
def test_targets_follow_the_linter(name):
    for title, expr in queries(BOARDS[name]):
        for match in RANGE_FUNCTIONS.finditer(expr):
            window = re.search(r"\[([^\]]+)\]", expr[match.end():])
            assert window and window[1] == "$__rate_interval", f"target-rate-interval-rule {title}: {expr}"
        assert 'job=~"$job"' in expr, f"target-job-rule {title}"
        assert 'instance=~"$instance"' in expr, f"target-instance-rule {title}"
        # but a counter's series born within the interval, at its count (what increase() cannot see): ``_counted``
        rated = re.sub(r"\((\w+_total\{[^}]*\}) unless \1 offset \$__rate_interval\)", "", expr)
        for counter in re.finditer(r"\b\w+_total\b", rated):
            before = rated[:counter.start()]
            assert RANGE_FUNCTIONS.search(before[-40:]), f"target-counter-agg-rule {title}: {counter[0]}"


@pytest.mark.parametrize("name", BOARDS)
def test_panels_sit_on_the_24_column_grid_without_overlapping(name):
    cells: set[tuple[int, int]] = set()
    for panel in panels(BOARDS[name]):
        g = panel["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & mine, f"{panel['title']} overlaps another panel"
        cells |= mine


def test_every_query_and_variable_query_parses_with_promtool(tmp_path):
    exprs = [substitute(e) for b in BOARDS.values() for _, e in queries(b)]
    for board in BOARDS.values():  # template-label-promql-rule: the selector inside label_values()
        for v in _variables(board).values():
            if v["type"] == "query":
                exprs.append(substitute(re.fullmatch(r"label_values\((.+), \w+\)", v["query"])[1]))
    rules = {"groups": [{"name": "dashboards", "rules": [{"record": f"dashboard:query{i}:parse", "expr": e}
                                                         for i, e in enumerate(exprs)]}]}
    check = check_rules(rules, tmp_path)
    assert check.returncode == 0, check.stdout + check.stderr


@pytest.mark.parametrize("name", BOARDS)
def test_every_panel_has_a_stable_id_of_its_own(name):
    """Explicit ids, set in the generator: links to a panel (viewPanel=<id>) survive regeneration."""
    ids = [panel.get("id") for panel in panels(BOARDS[name])]
    assert all(isinstance(i, int) and i > 0 for i in ids), ids
    assert len(set(ids)) == len(ids)


@pytest.mark.parametrize("name", BOARDS)
def test_runbook_links_open_the_runbook_of_an_alert_that_exists(name):
    alerts = {r["alert"]: r["annotations"]["runbook_url"]
              for g in yaml.safe_load((ROOT / "alerts" / "mcp-stream-exporter.yaml").read_text())["groups"]
              for r in g["rules"] if "alert" in r}
    linked = [link for panel in panels(BOARDS[name]) for link in panel.get("links", [])]
    assert linked, "each dashboard links the runbooks of the alerts its panels feed"
    for link in linked:
        alert = link["title"].removeprefix("Runbook: ")
        assert link["url"] == alerts[alert]  # the same URL the alert's annotation carries
        assert (ROOT / "docs" / "runbooks" / f"{alert}.md").is_file()


@pytest.mark.parametrize("name", BOARDS)
def test_thresholds_start_at_the_base_colour_and_rise(name):
    coloured = 0
    for panel in panels(BOARDS[name]):
        steps = panel.get("fieldConfig", {}).get("defaults", {}).get("thresholds", {}).get("steps")
        if not steps:
            continue
        values = [s["value"] for s in steps]
        assert values[0] is None and values[1:] == sorted(values[1:]), panel["title"]
        coloured += len(steps) > 1
    assert coloured, "some panel marks where its values turn bad"


def test_every_dashboard_links_the_findings_page_and_api():
    for board in BOARDS.values():
        urls = {link["url"] for link in board["links"]}
        assert {"${detector_url}/ui/", "${detector_url}/api/findings"} <= urls


def test_the_panels_of_metrics_with_exemplars_draw_them_and_quantiles_aggregate_the_extra_labels_away():
    """Silent losses and the duration histograms' buckets carry trace ids; the latency quantiles sum by
    ``le`` only, so new labels on the histograms (transport, protocol version) never split a quantile."""
    with_exemplars = re.compile(r"\b(mcp_stream_silent_losses_total|mcp_\w+_operation_duration_seconds_bucket)\b")
    drawn = []
    for board in BOARDS.values():
        for panel in panels(board):
            for target in panel.get("targets", []):
                if with_exemplars.search(target["expr"]):
                    drawn.append(target["expr"])
                    assert panel["type"] == "timeseries" and target["exemplar"] is True, panel["title"]
                    if "histogram_quantile" in target["expr"]:
                        assert "sum by (le) (" in target["expr"], target["expr"]
    assert any("operation_duration_seconds_bucket" in expr for expr in drawn)


def _role_metrics() -> set[str]:
    """The metrics the README's reference labels by ``role``: each side counts what it saw."""
    readme = (ROOT / "README.md").read_text()
    return {m[1] for m in re.finditer(r"^\| `(\w+)` \| counter \| ([\w, ]+) \|", readme, re.M)
            if "role" in m[2].split(", ")}


@pytest.mark.parametrize("name", BOARDS)
def test_no_panel_adds_the_client_and_server_counts_of_one_thing(name):
    """With both sides instrumented, as recommended, each side counts the same resume or call: a sum across ``role``
    showed the overview's audience gaps, refused resumes and tool calls twice over."""
    role_metrics = _role_metrics()
    assert {"mcp_stream_audience_gaps_total", "mcp_stream_resumes_total", "mcp_stream_calls_total"} <= role_metrics
    for title, expr in queries(BOARDS[name]):
        for metric in role_metrics & set(re.findall(r"\b\w+_total\b", expr)):
            inner = re.search(r"sum(?: by \(([^)]*)\))? \(rate\(" + metric, expr)
            assert inner and "role" in (inner[1] or ""), f"{title}: {expr}"


def test_every_query_steps_at_least_the_charts_scrape_interval_so_a_rate_spans_four_scrapes():
    values = yaml.safe_load((ROOT / "helm" / "mcp-stream-exporter" / "values.yaml").read_text())
    assert values["serviceMonitor"]["interval"] == generate.SCRAPE_INTERVAL
    for board in BOARDS.values():
        for panel in panels(board):
            for target in panel.get("targets", ()):
                assert target.get("interval") == generate.SCRAPE_INTERVAL, panel.get("title")


@pytest.mark.parametrize(("title", "counter", "by"), [
    ("Silent losses by tool and rule", "mcp_stream_silent_losses_total", ("tool", "rule")),
    ("Findings by rule", "mcp_stream_findings_total", ("rule", "severity"))])
def test_a_counter_born_at_its_first_count_shows_on_its_panel_as_the_alert_it_pages_counts_it(tmp_path, title,
                                                                                              counter, by):
    """A tool first seen with a finding raised at once, or a restarted detector's first finding of a rule: the
    series' first sample is already 1, which increase() never sees; the page fired and the panel showed nothing."""
    (expr,) = [e for t, e in queries(BOARDS["mcp-stream-overview.json"]) if t == title]
    born = {"job": "d", "instance": "i:9464", "tool": "other", "rule": "replay_truncated", "severity": "critical"}
    counted = {**born, "tool": "fetch", "rule": "clean_end_pending"}  # from 0, as increase() sees it

    def written(labels: dict[str, str], keep=None) -> str:
        return "{" + ", ".join(f'{k}="{v}"' for k, v in labels.items() if keep is None or k in keep) + "}"

    def samples(value: int) -> list[dict[str, object]]:
        return [{"labels": written(labels, by), "value": value} for labels in (born, counted)]

    tests = {"rule_files": [], "evaluation_interval": "1m", "tests": [{
        "interval": "1m",
        "input_series": [{"series": counter + written(born), "values": "_ _ _ 1 1 1 1 1"},
                         {"series": counter + written(counted), "values": "0 0 0 1 1 1 1 1"}],
        "promql_expr_test": [{"expr": substitute(expr, rate_interval="2m"), "eval_time": at, "exp_samples": samples(n)}
                             for at, n in (("3m", 1), ("7m", 0))],
    }]}
    path = tmp_path / "panel_test.yaml"
    path.write_text(yaml.safe_dump(tests))
    run = promtool("test", "rules", str(path))
    assert run.returncode == 0, run.stdout + run.stderr
