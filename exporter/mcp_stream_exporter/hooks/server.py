"""Server hooks: what an MCP server on the SDK sends, stores and replays, as spans.

Three seams, all public API of the SDK, around one tracker: an ASGI observer around the app from
``streamable_http_app()`` (``_observer.WireObserver``), a delegating ``EventStore``
(``_recorder.StoreRecorder``: event-id assignment and what a replay sent against what was stored), and a
``ServerMiddleware`` that links each call to the SDK's own request span and, in the stateless era, hands
the observer each call as the SDK parsed it (so the observer need not read the body again). They observe
and change nothing; refusing calls is the guard's (``guard.CallGuard``). ``instrument_server`` installs
all three.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from typing import Any, cast

from mcp.server.context import CallNext, HandlerResult, ServerMiddleware, ServerRequestContext
from mcp.server.lowlevel import Server
from mcp.server.mcpserver import MCPServer
from mcp.server.streamable_http import EventStore
from opentelemetry import trace
from opentelemetry.context import get_current
from starlette.applications import Starlette

from mcp_stream_exporter import scope as request_scope
from mcp_stream_exporter import semconv as sc
from mcp_stream_exporter.asgi import ASGIApp
from mcp_stream_exporter.auth import TokenReader, ToolPolicy, checked_policy
from mcp_stream_exporter.hooks import _defects
from mcp_stream_exporter.hooks._observer import WireObserver
from mcp_stream_exporter.hooks._recorder import StoreRecorder
from mcp_stream_exporter.hooks._spans import DeviationTracer
from mcp_stream_exporter.hooks._tracking import Requirements, Tracker
from mcp_stream_exporter.wire import TOOLS_CALL


class ServerInstrumentation:
    """The server side of the span model: one tracker, fed by the wire observer and the store recorder.
    Build one per app; ``instrument_server`` does it for you."""

    def __init__(
        self,
        *,
        policy: ToolPolicy | None = None,
        token_reader: TokenReader | None = None,
        tracer_provider: trace.TracerProvider | None = None,
        path: str = "/mcp",
        max_calls: int = 10_000,
        max_events_per_stream: int = 1_000,
        max_streams: int = 10_000,
    ) -> None:
        tracer = DeviationTracer(tracer_provider)
        self.tracker = Tracker(tracer, sc.ROLE_SERVER, max_calls=max_calls)
        requirements = Requirements(max_calls)
        policy = ToolPolicy() if policy is None else checked_policy(policy)
        self.observer = WireObserver(self.tracker, requirements, policy, token_reader or TokenReader(), path)
        self.recorder = StoreRecorder(self.tracker, tracer, requirements,
                                      max_events_per_stream=max_events_per_stream, max_streams=max_streams)

    def asgi(self, app: ASGIApp) -> ASGIApp:
        """Wrap the ASGI app: every exchange on the MCP endpoint becomes tracker input."""
        return self.observer.asgi(app)

    def event_store(self, inner: EventStore) -> EventStore:
        """Wrap the author's ``EventStore``: what it stores and replays is recorded."""
        return self.recorder.event_store(inner)

    def middleware(self, ctx: ServerRequestContext[Any, Any], call_next: CallNext) -> Awaitable[HandlerResult]:
        """Hands each ``tools/call`` to the observer, already parsed, and links it to the SDK's own span.

        Not a coroutine: it does its part before the handler runs and returns the rest of the chain's
        awaitable, which the SDK awaits (pinned by tests/integration/test_sdk_contract.py), so every
        message the server receives is spared a coroutine of ours around its handler."""
        if ctx.method == TOOLS_CALL and ctx.request_id is not None:  # the SDK's own tools/call span is current
            try:
                self.observer.dispatched(ctx.request, ctx.request_id, ctx.params, get_current())
            except Exception:  # the hooks' reading never fails the application's
                _defects.report("a call")
        return call_next(ctx)


# the SDK's servers whose Streamable HTTP app ``instrument_server`` builds: an ``MCPServer`` builds its app with its
# low-level ``Server``'s ``streamable_http_app``, which an author may use directly (``on_call_tool=...``)
_AnyServer = MCPServer[Any] | Server[Any]
_SERVERS = (MCPServer, Server)
# the servers ``instrument_server`` is building an app of now (an ``MCPServer`` and its low-level server): the
# instrumentor leaves those builds to it, and instruments any other made meanwhile (a gateway that mounts another's)
_building: ContextVar[tuple[object, ...]] = ContextVar("mcp_stream_building", default=())
_observed: weakref.WeakSet[Starlette] = weakref.WeakSet()  # the apps it built: observed whole already


def builds(server: object) -> bool:
    """Whether ``instrument_server`` is building ``server``'s app now (its ``streamable_http_app`` call, and the
    low-level server's an ``MCPServer``'s makes in it)."""
    return any(building is server for building in _building.get())


def instrument_server(
    target: _AnyServer | ASGIApp,
    *,
    policy: ToolPolicy | None = None,
    event_store: EventStore | None = None,
    token_reader: TokenReader | None = None,
    tracer_provider: trace.TracerProvider | None = None,
    streamable_http_path: str = "/mcp",
    **app_options: Any,
) -> ASGIApp:
    """The one call a server author adds: returns the instrumented ASGI app to serve.

    Given an ``MCPServer`` (or the SDK's low-level ``Server``), builds its Streamable HTTP app (``app_options`` go to
    ``streamable_http_app``) with the event store wrapped and the linking middleware installed, and returns
    that Starlette app, observed around its whole middleware stack (``add_middleware``, ``state``, ``routes``
    and its lifespan are the app's as without the hooks). Given an ASGI app already built, only the wire is
    observed: pass the server to get the rest; one it built already (under the instrumentor, an app the SDK's
    ``streamable_http_app`` returned) is returned as it is, so that no exchange is observed twice.
    """
    _refuse_misuse(target, event_store)
    if isinstance(target, Starlette) and target in _observed:  # (any other app may be unhashable: a dataclass's)
        return target
    if not isinstance(target, _SERVERS):
        return ServerInstrumentation(policy=policy, token_reader=token_reader, tracer_provider=tracer_provider,
                                     path=streamable_http_path).asgi(target)
    return instrumented_app(target, target.streamable_http_app, policy=policy, event_store=event_store,
                            token_reader=token_reader, tracer_provider=tracer_provider,
                            streamable_http_path=streamable_http_path, **app_options)


def instrumented_app(
    server: _AnyServer,
    build: Callable[..., Starlette],
    *,
    policy: ToolPolicy | None = None,
    event_store: EventStore | None = None,
    token_reader: TokenReader | None = None,
    tracer_provider: trace.TracerProvider | None = None,
    streamable_http_path: str = "/mcp",
    **app_options: Any,
) -> Starlette:
    """``server``'s app as ``instrument_server`` makes it, built with ``build``: its ``streamable_http_app``; the
    instrumentor's, the SDK's own (a subclass that overrides it calls it once, with what it builds around it)."""
    _refuse_misuse(server, event_store)
    instr = ServerInstrumentation(policy=policy, token_reader=token_reader, tracer_provider=tracer_provider,
                                  path=streamable_http_path)
    server.middleware.append(cast(ServerMiddleware[Any], instr.middleware))  # the SDK awaits what it returns
    store = instr.event_store(event_store) if event_store is not None else None
    low_level = getattr(server, "_lowlevel_server", None)  # an MCPServer's, which builds its app (test_sdk_contract)
    build_token = _building.set((*_building.get(), server, low_level))
    try:
        app = build(event_store=store, streamable_http_path=streamable_http_path, **app_options)
    finally:
        _building.reset(build_token)
    build_stack = app.build_middleware_stack

    def observed_stack() -> ASGIApp:
        """What Starlette serves, built at the app's first call (after any ``add_middleware``), observed whole."""
        stack: ASGIApp = build_stack()
        if isinstance(event_store, request_scope.ExchangeAware):
            # e.g. the guard: inside the observer, so the wire we see is theirs
            stack = event_store.asgi(stack, streamable_http_path)
        return instr.asgi(stack)

    app.build_middleware_stack = observed_stack  # type: ignore[method-assign]  # as OTel's FastAPI instrumentor
    _observed.add(app)
    instr.observer.holds = _holds(server)
    instr.recorder.routes = _routes(server)
    return app


def _refuse_misuse(target: object, event_store: object) -> None:
    """What is no server, no ASGI app or no event store, refused at once: taken for one, it would fail at the app's
    first request or first store, where nothing points back to this call."""
    if inspect.ismethod(target) and isinstance(target.__self__, _SERVERS):
        raise TypeError("instrument_server takes the server itself, or the app its streamable_http_app() returned, "
                        "not the method")
    if not isinstance(target, _SERVERS) and not callable(target):
        raise TypeError(f"instrument_server takes an MCPServer, a Server or an ASGI app, not {type(target).__name__}")
    if event_store is not None and (isinstance(event_store, type) or not all(
            callable(getattr(event_store, method, None)) for method in ("store_event", "replay_events_after"))):
        what = f"the class {event_store.__name__}" if isinstance(event_store, type) else type(event_store).__name__
        raise TypeError(f"event_store must be an EventStore instance, not {what}")


def _routes(server: _AnyServer) -> Callable[[str | None, object], bool | None] | None:
    """Whether the SDK sends what a session stores on ``stream_id`` now: its message router, right after the store,
    sends a message on the stream registered for it, and drops it if none is (a resume's replay returned and its
    live tail not registered yet; no stream open). None: not known (pinned by
    tests/integration/test_sdk_contract.py)."""
    sessions = _sessions(server)
    if sessions is None:
        return None

    def routes(session_id: str | None, stream_id: object) -> bool | None:
        streams = getattr(sessions.get(session_id) if session_id is not None else None, "_request_streams", None)
        return stream_id in streams if isinstance(streams, dict) else None

    return routes


def _holds(server: _AnyServer) -> Callable[[str], bool] | None:
    """Whether the server's session manager holds a session still: the SDK answers another principal 404 for a
    live session and for one it dropped alike (pinned by tests/integration/test_sdk_contract.py)."""
    sessions = _sessions(server)
    return sessions.__contains__ if sessions is not None else None


def _sessions(server: _AnyServer) -> dict[str, object] | None:
    """The session manager's transports by session id, where the SDK keeps them (as the contract test pins)."""
    sessions = getattr(server.session_manager, "_server_instances", None)
    return sessions if isinstance(sessions, dict) else None
