"""Where the replay guard keeps events and what each stream's call requires: the ``EventStorage`` seam
and its in-process implementation.

A requirement lives with the events it protects, and a session exists only from ``open`` (its
initialize response) until it is evicted: an evicted session is never re-created by a later write,
so what its streams required can never be recorded anew, lower.

A storage the guard can wait on (``TailableEventStorage``) lets it serve a resume's live tail itself, from
the storage, rather than hand it to the SDK, which drops what a call stores between the replay and its
taking the stream (docs/guard.md, "What it relies on in the SDK").
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final, Protocol, runtime_checkable

import anyio
from mcp_types import JSONRPCMessage
from pydantic import TypeAdapter, ValidationError

from mcp_stream_exporter.auth import Requirement


@dataclass(frozen=True, slots=True)
class StoredEvent:
    event_id: str
    stream_id: str
    message: JSONRPCMessage | None  # None: a priming event
    requirement: Requirement | None  # what the stream required when the event was stored; None: unknown
    subject: str | None = None  # the subject hash of the token the session was opened with


_MESSAGE: Final = TypeAdapter(JSONRPCMessage)


def encoded(message: JSONRPCMessage | None) -> bytes:
    """A message as a storage keeps it: its JSON, as the SDK sends it; nothing for a priming event."""
    return _MESSAGE.dump_json(message, by_alias=True, exclude_unset=True) if message is not None else b""


class StorageError(Exception):
    """The storage could not be reached or answered nonsense: the guard refuses, never guesses."""


def decoded(data: bytes) -> JSONRPCMessage | None:
    """A kept message read back (``encoded``). One that does not read back (a message built without validation
    can be sent and stored, yet not parsed) is a ``StorageError``: the guard answers it with an error frame."""
    try:
        return _MESSAGE.validate_json(data) if data else None
    except ValidationError as error:
        raise StorageError(f"a stored message does not read back: {error.error_count()} errors") from None


class EventStorage(Protocol):
    """Per session, in order, bounded per session; everything dropped is counted."""

    async def open(self, session_id: str) -> None:
        """A session is born (its initialize response named it)."""
        ...

    async def close(self, session_id: str) -> None:
        """The session ended (its client deleted it): its events and requirements go with it, so that no
        resume of it is answered from them, here or on another replica."""
        ...

    async def append(self, session_id: str | None, stream_id: str, message: JSONRPCMessage | None,
                     subject: str | None, requirement: Requirement | None = None) -> str | None:
        """Keep an event with the requirement its stream has now, widened by ``requirement`` (its call's, as ``require``
        widens it, within the same cap), atomically: an event is never kept with less than its call requires, even
        when recording that failed before (a request id used again still has its earlier call's). Its event id, or
        None when the session is not open (the event is dropped, and counted)."""
        ...

    async def get(self, session_id: str, event_id: str) -> StoredEvent | None: ...

    async def after(self, session_id: str, event: StoredEvent) -> list[StoredEvent] | None:
        """The session's events stored after ``event``, in order; None once ``event`` itself is no longer stored
        (evicted since it was read: what came right after it may be gone too, and a replay would skip it)."""
        ...

    async def require(self, session_id: str, stream_id: str, requirement: Requirement) -> None:
        """Record that ``stream_id``'s events require ``requirement``, on top of (never instead of)
        what was recorded for it before; dropped (and counted) when the session is not open or holds
        its maximum of streams already, so the stream's events are never replayed."""
        ...

    async def requirement(self, session_id: str, stream_id: str) -> Requirement | None: ...


@runtime_checkable
class TailableEventStorage(EventStorage, Protocol):
    """A storage the guard can wait on for a session's next events: it then sends a resume's live tail
    itself, every event stored after the last one replayed, none lost to the SDK's hand-over."""

    async def is_open(self, session_id: str) -> bool: ...

    async def wait_after(self, session_id: str, event_id: str, timeout_s: float) -> list[StoredEvent]:
        """The session's events after ``event_id`` (one it handed out), in order, waiting up to ``timeout_s``
        for one to arrive; an event appended at any time after ``event_id`` is in this answer or the next."""
        ...


@runtime_checkable
class SharedEventStorage(TailableEventStorage, Protocol):
    """A storage every server process of a deployment sees: a resume that reaches a process which
    does not hold the session (another replica, or the same one restarted) is answered from it."""

    async def owner_alive(self, session_id: str) -> bool:
        """Whether the process that opened the session is still running (so its calls may still end)."""
        ...


# what an event costs held in memory besides its JSON: its entry, id, sequence number and the tuple of its fields
# (measured with tracemalloc: tests/unit/test_guard.py), charged with every event, a priming event's too
_EVENT_BYTES: Final = 310
# an event as a session keeps it: its sequence number, stream, JSON (``encoded``), requirement and subject; its
# message is read back only when a resume needs it (a parsed message holds some ten times its JSON)
_Kept = tuple[int, str, bytes, Requirement | None, str | None]


def _stored(event_id: str, kept: _Kept) -> StoredEvent:
    return StoredEvent(event_id, kept[1], decoded(kept[2]), kept[3], kept[4])


def _size(kept: _Kept) -> int:
    return len(kept[2]) + _EVENT_BYTES


@dataclass(slots=True)
class _Session:
    events: OrderedDict[str, _Kept] = field(default_factory=OrderedDict)
    requirements: dict[str, Requirement] = field(default_factory=dict)
    touched: float = 0.0
    size: int = 0  # its events' bytes (``_size``)
    subject: str | None = None  # whose its events are (the principal's hash), charged its size
    key: str = ""  # its session id: what it is charged to while its events name no principal
    # what its tails wait on: set, and replaced, by the next append or the session's end; one per session
    # however many wait, made only when one does
    changed: anyio.Event | None = None

    @property
    def owner(self) -> tuple[str, str]:
        """Who its bytes are charged to: its principal, or, naming none (an opaque token), itself alone."""
        return ("principal", self.subject) if self.subject is not None else ("session", self.key)

    def wake(self) -> None:
        if self.changed is not None:
            self.changed.set()
            self.changed = None

    def newer(self, seq: int) -> list[StoredEvent]:
        """Its events after sequence number ``seq``, in order (read from the newest end: a tail is near it)."""
        newer = itertools.takewhile(lambda item: item[1][0] > seq, reversed(self.events.items()))
        return [_stored(event_id, kept) for event_id, kept in reversed(list(newer))]


class InMemoryEventStorage:
    """Bounded in-process storage: at most ``max_events_per_session`` events and ``max_bytes_per_session``
    bytes of them (``_size``: what holding each costs) a session (oldest go first), ``max_calls_per_session``
    stream requirements a session (later ones are not recorded), ``max_sessions`` sessions (least recently used
    go first) and ``max_bytes`` bytes of events in all (the heaviest principal's sessions go first, ``_shed``),
    and a session untouched for ``ttl`` seconds is dropped. Everything dropped is counted in ``evictions``: an
    evicted event's id reads as an unknown cursor, and an event without a recorded requirement is never replayed.

    A ``TailableEventStorage`` (the guard serves live tails from it), not a ``SharedEventStorage``: no
    other process sees it."""

    def __init__(self, *, max_events_per_session: int = 1000, max_calls_per_session: int = 1000,
                 max_sessions: int = 10_000, ttl: float = 3600.0, max_bytes_per_session: int = 16 << 20,
                 max_bytes: int = 256 << 20, clock: Callable[[], float] = time.monotonic) -> None:
        self._sessions: OrderedDict[str, _Session] = OrderedDict()
        self._seq = itertools.count(1)
        self._max_events = max_events_per_session
        self._max_session_bytes = max_bytes_per_session
        self._max_bytes = max_bytes
        self._bytes = 0  # every session's events'
        self._owner_bytes: dict[tuple[str, str], int] = {}  # the same, by whose sessions they are in (``owner``)
        self._max_calls = max_calls_per_session
        self._max_sessions = max_sessions
        self._ttl = ttl
        self._clock = clock
        self.evictions = 0

    def _expire(self, now: float) -> None:
        while self._sessions:
            key, oldest = next(iter(self._sessions.items()))
            if now - oldest.touched <= self._ttl and len(self._sessions) <= self._max_sessions:
                break
            self.evictions += len(oldest.events) + len(oldest.requirements)
            self._drop(key)
        while self._bytes > self._max_bytes:
            self._shed()

    def _shed(self) -> None:
        """Past ``max_bytes``: the least recently used session of the principal whose sessions hold the most goes
        (not whoever's was used longest ago: one user making a tool echo megabytes would push out everyone's); a
        session whose events name no principal is one of its own (opaque tokens are not one user)."""
        heaviest = max(self._owner_bytes, key=self._owner_bytes.__getitem__)
        key, session = next((k, v) for k, v in self._sessions.items() if v.owner == heaviest)
        self.evictions += len(session.events) + len(session.requirements)
        self._drop(key)

    def _touch(self, session_id: str | None) -> _Session | None:
        now = self._clock()
        self._expire(now)
        session = self._sessions.get(session_id) if session_id is not None else None
        if session is not None and session_id is not None:
            session.touched = now
            self._sessions.move_to_end(session_id)  # most recently touched last
        return session

    async def open(self, session_id: str) -> None:
        if session_id not in self._sessions:
            self._sessions[session_id] = _Session(touched=self._clock(), key=session_id)
            self._expire(self._clock())

    async def close(self, session_id: str) -> None:
        self._drop(session_id)

    def _drop(self, session_id: str) -> None:
        session = self._sessions.pop(session_id, None)
        if session is not None:
            self._charge(session, -session.size)
            session.wake()

    def _charge(self, session: _Session, size: int) -> None:
        session.size += size
        self._bytes += size
        owner = session.owner
        left = self._owner_bytes.get(owner, 0) + size
        if left:
            self._owner_bytes[owner] = left
        else:
            self._owner_bytes.pop(owner, None)

    async def append(self, session_id: str | None, stream_id: str, message: JSONRPCMessage | None,
                     subject: str | None, requirement: Requirement | None = None) -> str | None:
        session = self._touch(session_id)
        if session is None:
            self.evictions += session_id is not None  # no session at all (initialize's priming) drops nothing
            return None
        seq = next(self._seq)
        event_id = str(seq)
        recorded = session.requirements.get(stream_id)
        if requirement is not None and (recorded is not None or len(session.requirements) < self._max_calls):
            recorded = session.requirements[stream_id] = requirement if recorded is None else recorded | requirement
        kept = (seq, stream_id, encoded(message), recorded, subject)
        size = _size(kept)
        if session.subject is None and subject is not None:  # its first event a principal's: its bytes are theirs
            held = session.size
            self._charge(session, -held)
            session.subject = subject
            self._charge(session, held)
        session.events[event_id] = kept
        self._charge(session, size)
        while len(session.events) > 1 and (len(session.events) > self._max_events
                                           or session.size > self._max_session_bytes):
            self._charge(session, -_size(session.events.popitem(last=False)[1]))
            self.evictions += 1
        session.wake()
        self._expire(self._clock())  # past ``max_bytes``: the heaviest principal's oldest sessions go
        return event_id

    async def get(self, session_id: str, event_id: str) -> StoredEvent | None:
        self._expire(self._clock())
        session = self._sessions.get(session_id)
        found = session.events.get(event_id) if session is not None else None
        return _stored(event_id, found) if found is not None else None

    async def after(self, session_id: str, event: StoredEvent) -> list[StoredEvent] | None:
        session = self._sessions.get(session_id)
        cursor = session.events.get(event.event_id) if session is not None else None
        if session is None or cursor is None:
            return None
        return [_stored(event_id, kept) for event_id, kept in session.events.items() if kept[0] > cursor[0]]

    async def require(self, session_id: str, stream_id: str, requirement: Requirement) -> None:
        session = self._touch(session_id)
        before = session.requirements.get(stream_id) if session is not None else None
        if session is None or (before is None and len(session.requirements) >= self._max_calls):
            self.evictions += 1
            return
        session.requirements[stream_id] = requirement if before is None else before | requirement

    async def requirement(self, session_id: str, stream_id: str) -> Requirement | None:
        session = self._sessions.get(session_id)
        return session.requirements.get(stream_id) if session is not None else None

    # --- TailableEventStorage ---

    async def is_open(self, session_id: str) -> bool:
        self._expire(self._clock())
        return session_id in self._sessions

    async def wait_after(self, session_id: str, event_id: str, timeout_s: float) -> list[StoredEvent]:
        seq = int(event_id)  # the ids handed out are sequence numbers: the one given may have been evicted since
        session = self._sessions.get(session_id)
        if session is None:
            return []
        newer = session.newer(seq)
        if newer:
            return newer
        if session.changed is None:
            session.changed = anyio.Event()
        changed = session.changed  # taken with no await since the read: an append after it sets it
        with anyio.move_on_after(timeout_s):
            await changed.wait()
        session = self._sessions.get(session_id)  # it may have ended meanwhile
        return session.newer(seq) if session is not None else []
