"""The build: the hooks' hot path compiled with mypyc where the machine can, pure Python where it cannot.

The hooks run inside every MCP round trip of the application they observe. Compiled, the modules
below cost them some 40 % fewer instructions a round trip (README, "Performance"); the source is the
same typed Python either way, and behaves the same. ``MCP_STREAM_EXPORTER_PURE=1`` installs it
uncompiled; so does an editable install, and a machine without a C compiler or the Python headers, with
a warning that says so.
Everything else (``pyproject.toml``) is declarative.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

# What the hooks run on every round trip. What other libraries inspect stays Python (hooks/server.py): the
# ASGI entry point an ASGI server tells the ASGI version of, the middleware the SDK calls.
HOT_PATH = (
    "sse.py",
    "wire.py",
    "exchange.py",
    "headers.py",
    "hooks/_tracking.py",
    "hooks/_observer.py",
    "hooks/_recorder.py",
    "hooks/client.py",
)
_PACKAGE = Path("exporter") / "mcp_stream_exporter"


def _compiled() -> list[Extension]:
    if os.environ.get("MCP_STREAM_EXPORTER_PURE") == "1":
        return []
    try:
        from mypyc.build import mypycify
    except ImportError:  # a build without its build requirements (--no-build-isolation): pure Python
        return []
    # mypyc must know the other libraries' classes the hooks subclass (pyproject.toml gives the build the
    # package's dependencies): a base it cannot find fails the type check, and the build goes pure Python
    try:
        return list(mypycify([str(_PACKAGE / module) for module in HOT_PATH]))
    except (Exception, SystemExit) as exc:  # mypy's errors end it with SystemExit
        print(f"mcp-stream-exporter: the hooks were not compiled ({exc!r}); they run as pure Python", file=sys.stderr)
        return []


class _OptionalBuildExt(build_ext):
    """Builds the compiled modules, or none of them: a failed compile leaves the pure-Python package. An
    editable install (a checkout being worked on) stays pure Python: modules built beside the sources
    would shadow them, and an edit would not take effect until the next build."""

    def run(self) -> None:
        if self.editable_mode or self.inplace:
            return
        try:
            super().run()
        except Exception as exc:  # a compiler's or linker's failure, of whatever kind
            for built in self.get_outputs():
                Path(built).unlink(missing_ok=True)
            print(f"mcp-stream-exporter: the hooks were not compiled ({exc}); they run as pure Python", file=sys.stderr)


setup(ext_modules=_compiled(), cmdclass={"build_ext": _OptionalBuildExt})
