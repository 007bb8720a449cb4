"""The guard enforces: the replay guard, a session-scoped ``EventStore`` that enforces the
superset-audience invariant (``store``; its refusal frame in ``error_frame``, the POSTs it reads first in
``posts``) over a storage seam with an in-process and a Redis implementation; the call guard, a
``ServerMiddleware`` that refuses a ``tools/call`` whose token lacks what the tool requires (``calls``); and
on the client, refused resumes resolved at once (``refusals``)."""

from mcp_stream_exporter.guard.calls import CallGuard
from mcp_stream_exporter.guard.error_frame import REFUSAL_METHOD
from mcp_stream_exporter.guard.refusals import RefusalResolver, resolve_refusals
from mcp_stream_exporter.guard.storage import (
    EventStorage,
    InMemoryEventStorage,
    SharedEventStorage,
    StorageError,
    StoredEvent,
    TailableEventStorage,
)
from mcp_stream_exporter.guard.store import GuardedEventStore

__all__ = [
    "REFUSAL_METHOD",
    "CallGuard",
    "EventStorage",
    "GuardedEventStore",
    "InMemoryEventStorage",
    "RefusalResolver",
    "SharedEventStorage",
    "StorageError",
    "StoredEvent",
    "TailableEventStorage",
    "resolve_refusals",
]
