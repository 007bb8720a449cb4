"""Where each stream lost an event to the storage: a resume past such a loss is refused, never answered with a gap.

The SDK sends an event live whether its store kept it or not, so a client holds every event up to its cursor; what
the storage failed to keep after the cursor (a Redis blip between the drop and the resume) is what no replay can
send. A replay that skipped it would end cleanly without it: a lost progress notification, or a lost request of
the server's (an elicitation) that its tool then waits on forever. So each loss is placed after the last event this
process stored on its stream, and a resume from that event or a later one stops before the loss, with an error.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Final

_Stream = tuple[str, str]  # session id, stream id

_MAX_STREAMS: Final = 10_000  # streams with a loss remembered (the newest): an older one's resume is answered as before
_MAX_LOSSES: Final = 64  # placed losses a stream keeps: past them, any resume of it is refused
_MAX_KEPT: Final = 100_000  # streams whose last stored event is known (some 250 B each): the least recently stored go
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
        self._kept: OrderedDict[_Stream, str] = OrderedDict()  # the last event this process stored, by stream
        self._lost: dict[_Stream, _Lost] = {}
        self._answers: OrderedDict[_Stream, str] = OrderedDict()  # the answer this process stored, by stream

    def kept(self, session_id: str, stream_id: str, event_id: str, answer: bool) -> None:
        """``event_id`` was stored; ``answer``: the stream's last (a response or error: no loss can follow it)."""
        key = (session_id, stream_id)
        self._kept.pop(key, None)
        kept = self._answers if answer else self._kept
        kept[key] = event_id
        if len(kept) > (_MAX_ANSWERS if answer else _MAX_KEPT):
            kept.popitem(last=False)

    def answer(self, session_id: str, stream_id: str) -> str | None:
        """The id of the stream's answer, if this process stored it (a storage restored from an older copy may have
        lost it since: a live tail waiting for it would wait forever)."""
        return self._answers.get((session_id, stream_id))

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
            lost.after.append(self._kept.get(key))

    def count(self, session_id: str, stream_id: str) -> tuple[int, bool]:
        """How many events of the stream were not stored, and whether its answer was one."""
        lost = self._lost.get((session_id, stream_id))
        return (0, False) if lost is None else (lost.count, lost.answer)

    def first_after(self, session_id: str, stream_id: str, cursor: str, replayed: Sequence[str]) -> int | None:
        """Of ``replayed`` (the ids of the stream's stored events after ``cursor``, in order), how many come before
        the first loss after ``cursor``: what a resume from it may be sent before it is told; None: no such loss.
        A loss placed before any event stored here, or before ``cursor``, the client got live."""
        lost = self._lost.get((session_id, stream_id))
        if lost is None:
            return None
        if lost.count > len(lost.after):  # some not placed: any resume may be past one
            return 0
        places = {event_id: i for i, event_id in enumerate(replayed, 1)}
        places[cursor] = 0
        found = [places[after] for after in lost.after if after is not None and after in places]
        return min(found) if found else None
