"""The committed dashboards' panel queries, and the variable substitution Grafana would do."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

DASHBOARDS = Path(__file__).resolve().parents[1] / "dashboards"


def dashboards() -> dict[str, dict[str, Any]]:
    return {p.name: json.loads(p.read_text()) for p in sorted(DASHBOARDS.glob("*.json"))}


def panels(board: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in board["panels"]:
        yield panel
        yield from panel.get("panels", [])


def queries(board: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(panel title, expr) for every panel target."""
    for panel in panels(board):
        for target in panel.get("targets", []):
            yield panel["title"], target["expr"]


def substitute(expr: str, job: str = ".+", instance: str = ".+", rate_interval: str = "5m") -> str:
    """What Grafana sends for ``expr`` with these variable values (``All`` is the ``.+`` allValue)."""
    return (expr.replace("$__rate_interval", rate_interval).replace("$job", job)
            .replace("$instance", instance))
