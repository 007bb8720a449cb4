"""The two sides install apart: the hooks (and guard, and instrumentor) need the MCP SDK and OpenTelemetry
only, the detector's dependencies are the `detector` extra, and `serve` loads neither the hooks nor the
MCP server SDK. Each side runs in a fresh interpreter, whose loaded modules are then traced back to the
distributions that installed them."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import sysconfig
from functools import cache
from importlib.metadata import PackageNotFoundError, distribution, distributions
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
PROJECT = "mcp-stream-exporter"

SERVE = """
import contextlib, io, sys
from mcp_stream_exporter.cli import main
with contextlib.redirect_stdout(io.StringIO()):
    assert main(["serve", "--check-config", "--port=0"]) == 0
"""
HOOKS = """
import mcp_stream_exporter.hooks, mcp_stream_exporter.guard, mcp_stream_exporter.instrumentation
from mcp_stream_exporter import instrument_client, instrument_server, ToolPolicy
"""
REPORT = "\nimport json\nprint(json.dumps({m: getattr(v, '__file__', None) for m, v in list(sys.modules.items())}))"


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@cache
def _owners() -> dict[str, str]:
    """Every installed file, relative to site-packages -> the distribution that installed it (its RECORD)."""
    return {str(file): _norm(dist.metadata["Name"]) for dist in distributions() for file in dist.files or ()}


@cache
def _loaded(code: str) -> dict[str, str | None]:
    """The modules (and their files) a fresh interpreter holds after running ``code``."""
    done = subprocess.run([sys.executable, "-c", f"import sys\n{code}{REPORT}"], capture_output=True, text=True,
                          timeout=120, check=False, env={"PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout.splitlines()[-1]))


def _installed_by(modules: dict[str, str | None]) -> set[str]:
    site = {Path(sysconfig.get_paths()[key]).resolve() for key in ("purelib", "platlib")}
    used, unowned = set(), []
    for name, file in modules.items():
        if not file:
            continue
        path = Path(file).resolve()
        base = next((s for s in site if path.is_relative_to(s)), None)
        if base is None:
            continue  # the standard library, or this project (installed editable)
        owner = _owners().get(path.relative_to(base).as_posix())
        if owner is None:
            unowned.append(name)
        else:
            used.add(owner)
    assert unowned == [], "modules no installed distribution owns"
    return used


def _requirements_of(extras: frozenset[str]) -> set[str]:
    """The distributions `pip install mcp-stream-exporter[extras]` brings in (as installed here)."""
    seen: set[tuple[str, frozenset[str]]] = set()
    todo = [(PROJECT, extras)]
    while todo:
        name, wanted = todo.pop()
        if (name, wanted) in seen:
            continue
        seen.add((name, wanted))
        try:
            requires = distribution(name).requires or []
        except PackageNotFoundError:  # for another platform or Python
            continue
        for line in requires:
            req = Requirement(line)
            if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in {"", *wanted}):
                todo.append((_norm(req.name), frozenset(req.extras)))
    return {name for name, _ in seen}


def test_serve_loads_neither_the_hooks_nor_the_mcp_server_sdk():
    modules = _loaded(SERVE)
    assert "mcp_stream_exporter.detector.service" in modules  # the serve path did run
    assert [m for m in modules if m == "mcp" or m.startswith("mcp.")] == []
    observing_side = ("mcp_stream_exporter.hooks", "mcp_stream_exporter.guard", "mcp_stream_exporter.lab",
                      "mcp_stream_exporter.instrumentation")
    assert [m for m in modules if m.startswith(observing_side)] == []


def test_the_hooks_load_none_of_the_detectors_dependencies():
    modules = _loaded(HOOKS)
    detector_side = ("mcp_stream_exporter.detector", "fastapi", "grpc", "prometheus_client", "pydantic_settings",
                     "opentelemetry.proto", "opentelemetry.exporter", "google.protobuf")
    assert [m for m in modules if m.startswith(detector_side)] == []


def test_each_side_needs_only_what_its_requirements_install():
    base = _requirements_of(frozenset())
    detector = _requirements_of(frozenset({"detector"}))
    assert not {"fastapi", "grpcio", "prometheus-client", "pydantic-settings", "opentelemetry-proto"} & base
    startup = _installed_by(_loaded(""))  # what any interpreter here loads (setuptools' .pth hook)
    assert _installed_by(_loaded(HOOKS)) - startup <= base
    assert _installed_by(_loaded(SERVE)) - startup <= detector


def test_dev_installs_the_detector_and_the_image_installs_the_detector_extra():
    assert _requirements_of(frozenset({"detector"})) <= _requirements_of(frozenset({"dev"}))
    install = next(line for line in (ROOT / "Dockerfile").read_text().splitlines() if "pip install" in line)
    assert "'.[detector]'" in install


def test_serve_without_the_detector_extra_says_how_to_install_it():
    done = subprocess.run([sys.executable, "-c", "import sys\nsys.modules['uvicorn'] = None  # not installed\n"
                           "from mcp_stream_exporter.cli import main\nsys.exit(main(['serve']))"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    assert "pip install 'mcp-stream-exporter[detector]'" in done.stderr


def test_the_package_root_loads_its_names_on_first_use():
    import mcp_stream_exporter

    assert {"instrument_client", "instrument_server", "ToolPolicy"} <= set(dir(mcp_stream_exporter))
    assert mcp_stream_exporter.ToolPolicy.__module__ == "mcp_stream_exporter.auth"
    with pytest.raises(AttributeError, match="no_such_name"):
        mcp_stream_exporter.no_such_name  # noqa: B018
