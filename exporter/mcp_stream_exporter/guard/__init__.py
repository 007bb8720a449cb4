"""The replay guard: a session-scoped ``EventStore`` that enforces the superset-audience invariant
(``store``), over a storage seam with an in-process and a Redis implementation."""

from mcp_stream_exporter.guard.storage import (
    EventStorage,
    InMemoryEventStorage,
    SharedEventStorage,
    StorageError,
    StoredEvent,
)
from mcp_stream_exporter.guard.store import REFUSAL_METHOD, GuardedEventStore

__all__ = [
    "REFUSAL_METHOD",
    "EventStorage",
    "GuardedEventStore",
    "InMemoryEventStorage",
    "SharedEventStorage",
    "StorageError",
    "StoredEvent",
]
