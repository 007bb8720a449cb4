"""Where each stream lost an event to the storage: a resume past such a loss is refused, never answered with a gap.

The SDK sends an event live whether its store kept it or not, so a client holds every event up to its cursor; what
the storage failed to keep after the cursor (a Redis blip between the drop and the resume) is what no replay can
send. A replay that skipped it would end cleanly without it: a lost progress notification, or a lost request of
the server's (an elicitation) that its tool then waits on forever. So each loss is placed after the newest event
this process stored in its session, and a resume (its replay, then its live tail) from that event or one before it
stops before the loss, with an error.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Final

_Stream = tuple[str, str]  # session id, stream id

_MAX_STREAMS: Final = 10_000  # streams with a loss remembered (the newest): an older one's resume is answered as before
_MAX_LOSSES: Final = 64  # placed losses a stream keeps: past them, any resume of it is refused
# sessions whose newest stored event is known (some 200 B each), the most recently stored: a loss in one no longer
# known is placed before every event (as the client got it live)
_MAX_SESSIONS: Final = 100_000
_MAX_LATEST: Final = 10_000  # streams whose newest event this process stored, the newest (some 250 B each)


def _order(event_id: str) -> tuple[int, ...]:
    """Where an event id falls among its session's: both storages hand out ids in order (a count in memory, Redis's
    ``<ms>-<seq>``); () for an id of neither form, which only the ids read after a cursor can place."""
    try:
        return tuple(int(part) for part in event_id.split("-", 1))
    except ValueError:
        return ()


def _newer(kept: str | None, event_id: str) -> str:
    return kept if kept is not None and _order(kept) > _order(event_id) else event_id


class _Lost:
    """A stream's losses: how many, and after which stored event each came (None: before any)."""

    __slots__ = ("after", "count")

    def __init__(self) -> None:
        self.after: list[str | None] = []
        self.count = 0


class StoreLosses:
    """The events of each stream this process's storage did not keep, placed among those it did."""

    def __init__(self) -> None:
        self._newest: OrderedDict[str, str] = OrderedDict()  # the newest event this process stored, by session
        self._lost: dict[_Stream, _Lost] = {}
        self._latest: OrderedDict[_Stream, str] = OrderedDict()  # the newest event this process stored, by stream

    def kept(self, session_id: str, stream_id: str, event_id: str) -> None:
        """``event_id`` of ``stream_id`` was stored. Stores resolve in any order (a Redis reply read after a later
        one's): the newest by the storage's order is kept, of the session and of the stream."""
        self._newest[session_id] = _newer(self._newest.pop(session_id, None), event_id)
        if len(self._newest) > _MAX_SESSIONS:
            self._newest.popitem(last=False)
        key = (session_id, stream_id)
        self._latest[key] = _newer(self._latest.pop(key, None), event_id)
        if len(self._latest) > _MAX_LATEST:
            self._latest.popitem(last=False)

    def lost(self, session_id: str, stream_id: str) -> None:
        """An event of the stream was not stored."""
        key = (session_id, stream_id)
        lost = self._lost.pop(key, None) or _Lost()
        self._lost[key] = lost  # the newest last
        if len(self._lost) > _MAX_STREAMS:
            del self._lost[next(iter(self._lost))]
        lost.count += 1
        if len(lost.after) < _MAX_LOSSES:
            lost.after.append(self._newest.get(session_id))

    def reused(self, session_id: str, stream_id: str) -> None:
        """A new call takes the stream's id (its request, accepted): what an earlier call of the id lost or stored is
        not its."""
        key = (session_id, stream_id)
        self._lost.pop(key, None)
        self._latest.pop(key, None)

    def stored_after(self, session_id: str, stream_id: str, cursor: str) -> str | None:
        """The id of the stream's newest event, if this process stored it after ``cursor`` (a storage restored from an
        older copy may have lost it since: a live tail waiting for it, or for what comes after it, would wait
        forever)."""
        latest = self._latest.get((session_id, stream_id))
        return latest if latest is not None and _order(latest) > _order(cursor) else None

    def first_after(self, session_id: str, stream_id: str | None, cursor: str, stored: Sequence[str]) -> int | None:
        """Of ``stored`` (the ids of every event stored after ``cursor`` in the session, in order, priming events
        and other streams' too), how many come before the first loss after ``cursor`` of ``stream_id`` (None: of
        any stream of the session, for a resume that sends them all): what a resume from it may be sent before it is
        told; None: no such loss. A loss placed before any event stored here, or before ``cursor``, the client got
        live; one placed after an event the storage no longer has (restored from an older copy) is still placed."""
        if stream_id is not None:
            lost = self._lost.get((session_id, stream_id))
            losses = [] if lost is None else [lost]
        else:
            losses = [lost for (session, _), lost in self._lost.items() if session == session_id]
        if not losses:
            return None
        if any(lost.count > len(lost.after) for lost in losses):  # some not placed: any resume may be past one
            return 0
        places = {event_id: i for i, event_id in enumerate(stored, 1)}
        places[cursor] = 0
        since = _order(cursor)
        found = []
        for lost in losses:
            for after in lost.after:
                if after is None:
                    continue
                place = places.get(after)
                if place is None and since and _order(after) > since:  # after the cursor, gone from the storage
                    place = sum(1 for event_id in stored if _order(event_id) <= _order(after))
                if place is not None:
                    found.append(place)
        return min(found) if found else None
