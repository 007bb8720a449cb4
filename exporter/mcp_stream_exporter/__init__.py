"""mcp-stream-exporter: catch MCP tool results lost on resumable SSE streams."""

from mcp_stream_exporter.auth import AuthView, Requirement, TokenReader, ToolPolicy, canonical_resource
from mcp_stream_exporter.hooks import instrument_client, instrument_server

__version__ = "0.1.0"

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
