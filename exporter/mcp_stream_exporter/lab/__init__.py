"""Real parts to reproduce the incident on 127.0.0.1: a TCP proxy that cuts connections, an RS256
token issuer, and the incident's MCP server with its audience-checking replay store.

Tests, benchmarks and the demo use these; none of them is a mock: the proxy cuts real TCP
connections, tokens are real signed JWTs, the server is the real SDK.
"""

from mcp_stream_exporter.lab.incident import (
    BASE_RESOURCE,
    FETCH_RESOURCE,
    SEARCH_RESOURCE,
    IncidentEventStore,
    build_incident_server,
    incident_policy,
)
from mcp_stream_exporter.lab.proxy import CutProxy
from mcp_stream_exporter.lab.scenario import Incident, incident, serve
from mcp_stream_exporter.lab.tokens import BearerAuth, TokenIssuer

__all__ = [
    "BASE_RESOURCE",
    "FETCH_RESOURCE",
    "SEARCH_RESOURCE",
    "BearerAuth",
    "CutProxy",
    "Incident",
    "IncidentEventStore",
    "TokenIssuer",
    "build_incident_server",
    "incident",
    "incident_policy",
    "serve",
]
