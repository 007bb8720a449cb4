"""Hooks observe: they turn what MCP servers and clients do on the wire into spans (docs/span-model.md)."""

from mcp_stream_exporter.hooks.client import ClientInstrumentation, ClientTap, instrument_client
from mcp_stream_exporter.hooks.server import ServerInstrumentation, instrument_server

__all__ = ["ClientInstrumentation", "ClientTap", "ServerInstrumentation", "instrument_client",
           "instrument_server"]
