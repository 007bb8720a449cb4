"""``McpStreamInstrumentor``: the hooks installed the way OpenTelemetry instrumentations are.

``opentelemetry-instrument python app.py`` finds it through the ``opentelemetry_instrumentor`` entry point;
in code, ``McpStreamInstrumentor().instrument()``. Once instrumented, every server app built with
``streamable_http_app()``, an ``MCPServer``'s (``run(transport="streamable-http")`` included) or a low-level
``Server``'s, is served through
``instrument_server``, and every ``httpx2`` client the SDK's Streamable HTTP transport sends with is tapped
as by ``instrument_client``. Servers and clients instrumented by hand are left as they are: nothing is
observed twice. ``uninstrument()`` stops instrumenting what is built afterwards; apps and clients already
instrumented stay so (as OpenTelemetry's HTTP client instrumentations do).

Configuration without code, for ``opentelemetry-instrument``: ``MCP_STREAM_POLICY`` names a tool-policy
TOML file (the same setting as ``mcp-stream-exporter serve``'s); ``MCP_STREAM_EXPORTER_DISABLED=true`` turns
the instrumentor off whatever else says on (as does ``OTEL_PYTHON_DISABLED_INSTRUMENTATIONS`` naming
``mcp_stream_exporter``, the entry point).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Collection
from typing import Any

import httpx2
import wrapt
from mcp.client.streamable_http import StreamableHTTPTransport
from mcp.server.lowlevel import Server
from opentelemetry import trace
from opentelemetry.instrumentation.instrumentor import BaseInstrumentor  # type: ignore[attr-defined]
from opentelemetry.instrumentation.utils import unwrap

from mcp_stream_exporter.auth import TokenReader, ToolPolicy, checked_policy
from mcp_stream_exporter.guard.refusals import RefusalResolver
from mcp_stream_exporter.hooks import ClientInstrumentation, ClientTap
from mcp_stream_exporter.hooks.client import reads_messages
from mcp_stream_exporter.hooks.server import builds, instrumented_app

# the MCP SDK versions the hooks are written against (tests/integration/test_sdk_contract.py pins them)
_instruments = ("mcp >= 2.3, < 3",)
DISABLED_ENV = "MCP_STREAM_EXPORTER_DISABLED"
POLICY_ENV = "MCP_STREAM_POLICY"
log = logging.getLogger(__name__)


class McpStreamInstrumentor(BaseInstrumentor):  # type: ignore[misc]
    """Instruments the MCP SDK's Streamable HTTP servers and clients with the span model's hooks.

    ``instrument()`` takes, all optional: ``tracer_provider`` (else the global one), ``policy`` (a
    ``ToolPolicy``; else the file ``MCP_STREAM_POLICY`` names, else none) and ``token_reader`` (a
    ``TokenReader`` that verifies signatures; else claims are read for observation only)."""

    def instrumentation_dependencies(self) -> Collection[str]:
        return _instruments

    def _instrument(self, **kwargs: Any) -> None:
        if os.environ.get(DISABLED_ENV, "").strip().lower() in {"1", "true", "yes", "on"}:
            log.info("mcp-stream-exporter instrumentation disabled by %s", DISABLED_ENV)
            return
        options = _Options(kwargs.get("tracer_provider"), _policy(kwargs.get("policy")), kwargs.get("token_reader"))
        # the low-level server's: an MCPServer builds its app with it, so both kinds of server are covered
        wrapt.wrap_function_wrapper(Server, "streamable_http_app", options.server_app)
        wrapt.wrap_function_wrapper(StreamableHTTPTransport, "post_writer", options.client_transport)

    def _uninstrument(self, **kwargs: Any) -> None:
        unwrap(Server, "streamable_http_app")  # a no-op where the kill switch left it unwrapped
        unwrap(StreamableHTTPTransport, "post_writer")


def _policy(given: ToolPolicy | None) -> ToolPolicy | None:
    """The policy given, else the file ``MCP_STREAM_POLICY`` names. A file that does not load is said (an error) and
    the hooks go on without it: raised, it would stop ``opentelemetry-instrument`` setting up every instrumentation."""
    if given is not None:
        return checked_policy(given)
    path = os.environ.get(POLICY_ENV)
    if not path:
        return None
    try:
        return ToolPolicy.from_file(path)
    except (OSError, ValueError, RecursionError) as refused:  # tomllib's and json's errors are ValueErrors
        log.error("%s=%s not loaded, the hooks run without a policy (no call's requirement, no audience gap): %s",
                  POLICY_ENV, path, refused)
        return None


class _Options:
    """What ``instrument()`` was given, and the two wrappers that apply it."""

    def __init__(self, tracer_provider: trace.TracerProvider | None, policy: ToolPolicy | None,
                 token_reader: TokenReader | None) -> None:
        self.tracer_provider = tracer_provider
        self.policy = policy
        self.token_reader = token_reader

    def server_app(self, wrapped: Callable[..., Any], instance: Server[Any], args: tuple[Any, ...],
                   kwargs: dict[str, Any]) -> Any:
        """``Server.streamable_http_app`` (an ``MCPServer``'s calls it with every option it has): the app
        ``instrument_server`` makes, built with the SDK's own method (once, under a subclass's override that calls
        it), unless this is ``instrument_server`` building this server's app (by hand, or for this wrapper). Each
        app built is instrumented: one built again from the same server is served on its own."""
        if builds(instance):
            return wrapped(*args, **kwargs)
        return instrumented_app(instance, wrapped, policy=self.policy, token_reader=self.token_reader,
                                tracer_provider=self.tracer_provider, **kwargs)

    def client_transport(self, wrapped: Callable[..., Any], instance: StreamableHTTPTransport,
                         args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``StreamableHTTPTransport.post_writer(client, ...)``, the first use of the client the SDK sends
        with: tap it in place, once; beneath the guard's ``RefusalResolver`` when it has one, so the tap
        sees the wire and not the errors the resolver adds."""
        client = args[0] if args else kwargs.get("client")
        if isinstance(client, httpx2.AsyncClient) and not _tapped(client._transport):
            instr = ClientInstrumentation(policy=self.policy, token_reader=self.token_reader,
                                          tracer_provider=self.tracer_provider)
            reads_messages(client)
            client._transport = _tap(client._transport, instr)
            client._mounts = {pattern: None if transport is None else _tap(transport, instr)
                              for pattern, transport in client._mounts.items()}  # a proxy's: routed through too
        return wrapped(*args, **kwargs)


def _tapped(transport: httpx2.AsyncBaseTransport) -> bool:
    """Whether a client's transport is tapped already (by hand, or by this instrumentor), beneath a resolver or not."""
    return isinstance(transport.inner if isinstance(transport, RefusalResolver) else transport, ClientTap)


def _tap(transport: httpx2.AsyncBaseTransport, instr: ClientInstrumentation) -> httpx2.AsyncBaseTransport:
    """``transport`` tapped, beneath the guard's resolver where it has one."""
    if isinstance(transport, RefusalResolver):
        transport.inner = _tap(transport.inner, instr)
        return transport
    return transport if isinstance(transport, ClientTap) else ClientTap(transport, instr)
