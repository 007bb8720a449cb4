"""Where each stream lost an event to the storage: a resume past such a loss is refused, never answered with a gap.

The SDK sends an event live whether its store kept it or not, so a client holds every event up to its cursor; what
the storage failed to keep after the cursor (a Redis blip between the drop and the resume) is what no replay can
send. A replay that skipped it would end cleanly without it: a lost progress notification, or a lost request of
the server's (an elicitation) that its tool then waits on forever. So each loss is placed after the last event this
process stored in its session, and a resume from that event or a later one stops before the loss, with an error.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Final

_Stream = tuple[str, str]  # session id, stream id

_MAX_STREAMS: Final = 10_000  # streams with a loss remembered (the newest): an older one's resume is answered as before
_MAX_LOSSES: Final = 64  # placed losses a stream keeps: past them, any resume of it is refused
# sessions whose last stored event is known (some 200 B each), the most recently stored: a loss in one no longer
# known is placed before every event (as the client got it live)
_MAX_SESSIONS: Final = 100_000
_MAX_ANSWERS: Final = 10_000  # streams whose answer this process stored, the newest (some 250 B each)


class _Lost:
    """A stream's losses: after which stored event each came (None: before any), and whether its answer was one."""

    __slots__ = ("after", "answer", "count")

    def __init__(self) -> None:
        self.after: list[str | None] = []
        self.answer = False
        self.count = 0


class StoreLosses:
    """The events of each stream this process's storage did not keep, placed among those it did."""

    def __init__(self) -> None:
        self._kept: OrderedDict[str, str] = OrderedDict()  # the last event this process stored, by session
        self._lost: dict[_Stream, _Lost] = {}
        self._answers: OrderedDict[_Stream, str] = OrderedDict()  # the answer this process stored, by stream

    def kept(self, session_id: str, stream_id: str, event_id: str, answer: bool) -> None:
        """``event_id`` was stored; ``answer``: the stream's last (a response or error)."""
        self._kept.pop(session_id, None)
        self._kept[session_id] = event_id
        if len(self._kept) > _MAX_SESSIONS:
            self._kept.popitem(last=False)
        key = (session_id, stream_id)
        if answer:
            self._answers[key] = event_id
            if len(self._answers) > _MAX_ANSWERS:
                self._answers.popitem(last=False)
        elif self._answers:
            self._answers.pop(key, None)  # a new call reusing the id: that answer is not this stream's any more

    def lost(self, session_id: str, stream_id: str, answer: bool) -> None:
        """An event of the stream was not stored (``answer``: its response or error)."""
        key = (session_id, stream_id)
        lost = self._lost.pop(key, None) or _Lost()
        self._lost[key] = lost  # the newest last
        if len(self._lost) > _MAX_STREAMS:
            del self._lost[next(iter(self._lost))]
        lost.count += 1
        lost.answer = lost.answer or answer
        if len(lost.after) < _MAX_LOSSES:
            lost.after.append(self._kept.get(session_id))

    def answer(self, session_id: str, stream_id: str) -> str | None:
        """The id of the stream's answer, if this process stored it (a storage restored from an older copy may have
        lost it since: a live tail waiting for it would wait forever)."""
        return self._answers.get((session_id, stream_id))

    def count(self, session_id: str, stream_id: str) -> tuple[int, bool]:
        """How many events of the stream were not stored, and whether its answer was one."""
        lost = self._lost.get((session_id, stream_id))
        return (0, False) if lost is None else (lost.count, lost.answer)

    def first_after(self, session_id: str, stream_id: str | None, cursor: str, stored: Sequence[str]) -> int | None:
        """Of ``stored`` (the ids of every event stored after ``cursor`` in the session, in order, priming events
        and other streams' too), how many come before the first loss after ``cursor`` of ``stream_id`` (None: of
        any stream of the session, for a resume that replays them all): what a resume from it may be sent before it
        is told; None: no such loss. A loss placed before any event stored here, or before ``cursor``, the client
        got live."""
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
        found = [places[after] for lost in losses for after in lost.after if after is not None and after in places]
        return min(found) if found else None
