"""Real Prometheus and Alertmanager (Debian's packages) on 127.0.0.1, loading the project's alert rules,
with a webhook receiver that records what Alertmanager sends."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import yaml

from harness import answers, wait_for

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "alerts" / "mcp-stream-exporter.yaml"
JOB = "mcp-stream-exporter"
# both log the address they bound, port 0 resolved (exporter-toolkit's web listener)
_LISTENING = re.compile(r'msg="Listening on" address=127\.0\.0\.1:(\d+)')


def _binary(*names: str) -> str:
    for name in names:
        if found := shutil.which(name):
            return found
    raise AssertionError(f"{names[0]} is installed by `make test` (Debian packages prometheus, "
                         "prometheus-alertmanager)")


class Webhook:
    """Alertmanager's webhook receiver: every notification's alerts, as posted."""

    def __init__(self) -> None:
        self.alerts: list[dict[str, Any]] = []
        received = self.alerts

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                received.extend(json.loads(body)["alerts"])
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/alerts"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class Stack:
    def __init__(self, workdir: Path, prometheus_url: str, targets_file: Path, webhook: Webhook,
                 other_instance: str) -> None:
        self.workdir = workdir
        self.other_instance = other_instance  # Alertmanager, scraped as a cluster's Prometheus scrapes much else
        self.url = prometheus_url
        self._targets_file = targets_file
        self._targets: dict[str, str] = {}
        self.webhook = webhook
        self.http = httpx.Client(base_url=prometheus_url, timeout=10)

    def scrape(self, run: str, port: int) -> str:
        """Add a detector target (file service discovery); returns its ``instance`` label."""
        self._targets[run] = f"127.0.0.1:{port}"
        self._write_targets()
        instance = self._targets[run]
        wait_for(lambda: self.query(f'up{{instance="{instance}"}} == 1'), 30, f"Prometheus scraping {instance}")
        return instance

    def forget(self, run: str) -> None:
        self._targets.pop(run, None)
        self._write_targets()

    def _write_targets(self) -> None:
        groups = [{"targets": list(self._targets.values())}]
        tmp = self._targets_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(groups))
        tmp.replace(self._targets_file)

    def query(self, expr: str) -> list[dict[str, Any]]:
        answer = self.http.get("/api/v1/query", params={"query": expr}).json()
        assert answer["status"] == "success", answer
        return list(answer["data"]["result"])

    def exemplars(self, expr: str, since_s: float = 600) -> list[dict[str, Any]]:
        """The exemplars Prometheus stored for the series ``expr`` selects, as Grafana asks for them."""
        now = time.time()
        answer = self.http.get("/api/v1/query_exemplars", params={"query": expr, "start": now - since_s,
                                                                  "end": now + 60}).json()
        assert answer["status"] == "success", answer
        return [e for series in answer["data"] for e in series["exemplars"]]

    def alerts(self) -> list[dict[str, Any]]:
        """Prometheus' active alerts, pending and firing."""
        return list(self.http.get("/api/v1/alerts").json()["data"]["alerts"])

    def last_rule_evaluation(self) -> float:
        groups = self.http.get("/api/v1/rules").json()["data"]["groups"]
        return min(_epoch(g["lastEvaluation"]) for g in groups)


def _bound_port(log: Path, process: subprocess.Popen[bytes]) -> int:
    """The port a Prometheus-family server started with ``--web.listen-address=127.0.0.1:0`` bound."""
    def bound() -> int | bool:
        if process.poll() is not None:
            raise AssertionError(f"{process.args[0]} exited: {log.read_text()[-2000:]}")
        found = _LISTENING.search(log.read_text())
        return int(found[1]) if found else False

    return int(wait_for(bound, 60, f"{log.stem} to bind its port", every_s=0.05))


def _epoch(rfc3339: str) -> float:
    """Whole seconds of Prometheus' nanosecond RFC 3339 times (enough to order evaluations)."""
    return datetime.strptime(rfc3339[:19], "%Y-%m-%dT%H:%M:%S").replace(tzinfo=UTC).timestamp()


@contextmanager
def prometheus_stack(workdir: Path) -> Iterator[Stack]:
    """Alertmanager (1 s group wait) and Prometheus (1 s scrape and evaluation) with the project's rules."""
    webhook = Webhook()
    (workdir / "alertmanager.yml").write_text(yaml.safe_dump({
        "route": {"receiver": "webhook", "group_by": ["alertname", "instance"], "group_wait": "1s",
                  "group_interval": "1s", "repeat_interval": "1h"},
        "receivers": [{"name": "webhook", "webhook_configs": [{"url": webhook.url, "send_resolved": False}]}],
    }))
    logs = (workdir / "alertmanager.log").open("w"), (workdir / "prometheus.log").open("w")
    alertmanager = subprocess.Popen(
        [_binary("prometheus-alertmanager", "alertmanager"), f"--config.file={workdir / 'alertmanager.yml'}",
         f"--storage.path={workdir / 'am-data'}", "--web.listen-address=127.0.0.1:0",
         "--cluster.listen-address="], stdout=logs[0], stderr=subprocess.STDOUT)
    processes = [alertmanager]
    stack = None
    try:
        am_port = _bound_port(workdir / "alertmanager.log", alertmanager)
        targets = workdir / "targets.json"
        targets.write_text("[]")
        (workdir / "prometheus.yml").write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
            "rule_files": [str(RULES)],
            "alerting": {"alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{am_port}"]}]}]},
            "scrape_configs": [{"job_name": JOB, "file_sd_configs": [{"files": [str(targets)],
                                                                      "refresh_interval": "1s"}]},
                               # another job's target, exporting the client libraries' ``up`` and ``process_*`` too
                               {"job_name": "alertmanager", "static_configs": [{"targets": [f"127.0.0.1:{am_port}"]}]}],
        }))
        prometheus = subprocess.Popen(
            [_binary("prometheus"), f"--config.file={workdir / 'prometheus.yml'}",
             f"--storage.tsdb.path={workdir / 'prom-data'}", "--web.listen-address=127.0.0.1:0",
             "--enable-feature=exemplar-storage"],
            stdout=logs[1], stderr=subprocess.STDOUT)
        processes.insert(0, prometheus)
        stack = Stack(workdir, f"http://127.0.0.1:{_bound_port(workdir / 'prometheus.log', prometheus)}", targets,
                      webhook, f"127.0.0.1:{am_port}")
        ready = stack.url
        wait_for(lambda: answers(f"http://127.0.0.1:{am_port}/-/ready") and answers(f"{ready}/-/ready"), 60,
                 "Prometheus and Alertmanager to be ready")
        yield stack
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
        for log in logs:
            log.close()
        if stack is not None:
            stack.http.close()
        webhook.close()
