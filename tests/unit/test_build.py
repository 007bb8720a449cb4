"""The hooks' hot path is compiled (setup.py) all of it or none of it, and an instrumented server is an ASGI 3
app to an ASGI server whichever build runs."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import uvicorn

from mcp_stream_exporter import hooks
from mcp_stream_exporter.lab import TokenIssuer, build_incident_server

ROOT = Path(__file__).resolve().parents[2]


def _hot_path() -> list[str]:
    """``HOT_PATH`` as setup.py lists it, read without running the build."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    value = next(node.value for node in ast.walk(tree) if isinstance(node, ast.Assign)
                 and any(isinstance(t, ast.Name) and t.id == "HOT_PATH" for t in node.targets))
    return [ast.literal_eval(element) for element in value.elts]


def test_the_hot_path_is_compiled_all_or_none():
    modules = ["mcp_stream_exporter." + path.removesuffix(".py").replace("/", ".") for path in _hot_path()]
    assert modules  # the list was found
    compiled = {name: not (importlib.import_module(name).__file__ or "").endswith(".py") for name in modules}
    assert len(set(compiled.values())) == 1, compiled


def _interface(app: object) -> str:
    config = uvicorn.Config(app)
    config.load()
    return config.interface


def test_an_instrumented_server_is_an_asgi3_app_as_uvicorn_tells_one():
    server = build_incident_server(TokenIssuer(), step_delay=0)
    assert _interface(hooks.instrument_server(server)) == "asgi3"
    assert _interface(hooks.ServerInstrumentation().asgi(server.streamable_http_app())) == "asgi3"
