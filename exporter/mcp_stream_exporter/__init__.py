"""mcp-stream-exporter: catch MCP tool results lost on resumable SSE streams.

The names below load on first use (PEP 562), so that ``mcp-stream-exporter serve`` (the detector) does
not import the hooks or the MCP server SDK, and the hooks do not import the detector's dependencies.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from mcp_stream_exporter.semconv import INSTRUMENTATION_VERSION

__version__ = INSTRUMENTATION_VERSION  # the installed distribution's, one source

_LAZY = {
    "AuthView": "mcp_stream_exporter.auth",
    "Requirement": "mcp_stream_exporter.auth",
    "TokenReader": "mcp_stream_exporter.auth",
    "ToolPolicy": "mcp_stream_exporter.auth",
    "canonical_resource": "mcp_stream_exporter.auth",
    "instrument_client": "mcp_stream_exporter.hooks",
    "instrument_server": "mcp_stream_exporter.hooks",
}

if TYPE_CHECKING:
    from mcp_stream_exporter.auth import AuthView, Requirement, TokenReader, ToolPolicy, canonical_resource
    from mcp_stream_exporter.hooks import instrument_client, instrument_server


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(_LAZY[name]), name)
    globals()[name] = value  # once loaded, an ordinary attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = [
    "AuthView",
    "Requirement",
    "TokenReader",
    "ToolPolicy",
    "__version__",
    "canonical_resource",
    "instrument_client",
    "instrument_server",
]
