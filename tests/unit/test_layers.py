"""The layers README draws are the ones the code has: every import of the package points down a layer
or stays in its own role; hooks, guard, detector and resume never import one another."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "exporter" / "mcp_stream_exporter"
LAYERS = {  # top-level module or sub-package -> layer, lowest first
    "semconv": 0, "auth": 0, "redaction": 0,
    "wire": 1, "sse": 1, "coding": 1, "headers": 1, "scope": 1, "asgi": 1,
    "exchange": 2,
    "hooks": 3, "guard": 3, "detector": 3, "resume": 3,
    "instrumentation": 4, "lab": 4, "demo": 4, "cli": 4, "__init__": 4,
}
ROLES = 3


def _unit(path: Path) -> str:
    """The top-level module or sub-package a file belongs to."""
    return path.relative_to(PACKAGE).parts[0].removesuffix(".py")


def _imports(path: Path) -> set[str]:
    """The package's top-level modules and sub-packages a file imports."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("mcp_stream_exporter"):
            parts = node.module.split(".")
            names = {a.name if a.name in LAYERS else "__init__" for a in node.names}  # a module, or the root's
            found |= {parts[1]} if len(parts) > 1 else names
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("mcp_stream_exporter.")}
    return found


def test_every_module_of_the_package_has_a_layer():
    assert {_unit(p) for p in PACKAGE.rglob("*.py")} <= set(LAYERS)


def test_imports_point_down_and_roles_never_import_one_another():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        unit = _unit(path)
        for imported in _imports(path) - {unit}:
            upward = LAYERS[imported] > LAYERS[unit]
            across_roles = LAYERS[imported] == LAYERS[unit] == ROLES
            if upward or across_roles:
                wrong.append(f"{path.relative_to(PACKAGE)} imports {imported}")
    assert wrong == []
