"""The request ids each session has in flight in this process, and whose they are: what the SDK would hand
to a POST reusing one, and what a POST cancelling or answering for one acts on.

MCP forbids reusing a request id within a session, and the SDK (2.3) keys a request's stream by its id: a
POST that reused the id of a call still running would be handed that call's stream, its progress and its
result, whatever its token. A ``notifications/cancelled`` naming the id ends the call, and the answer to a
request the server sent on the call's stream (an elicitation, a sampling request) feeds it: both act on a
call whose events the token may not be allowed to see. Only the process that holds the session runs its
requests (another replica answers 404), so what is in flight is known here, without the guard's storage:
a storage that is down or full never lets a reuse through.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections import OrderedDict
from collections.abc import Collection, Sequence
from typing import Generic, TypeVar

Owner = TypeVar("Owner")  # whose a call is: what a POST acting on it must hold (the guard's requirement, principal)

_ANSWERED = 1  # its response (or error) was stored
_ENDED = 2  # the POST that carried it ended: its answer sent, or its stream closed (a server that polls)
_FREE = _ANSWERED | _ENDED
_RAN = 4  # something of it other than its answer was stored: its handler ran
_REFUSED = 8  # its answer is the call guard's refusal, and nothing of it was stored before: it never ran
_COUNTED = 16  # counted among its session's owners (``accepted``)


class _Known(Generic[Owner]):
    """What a session's past tells the guard: the server's requests awaiting the client's answer (the call each
    was sent for, or, sent on no call's stream, the owners of the calls in flight then: any of them may have
    sent it), whose its calls have been, and whose calls were in flight when each event of the server's
    standalone stream was stored (what such an event may carry)."""

    __slots__ = ("alone", "asked", "opener", "owners")

    def __init__(self) -> None:
        self.asked: dict[str, str | tuple[Owner, ...]] = {}
        self.owners: dict[Owner, int] = {}  # each owner's calls the SDK took, less those refused before they ran
        self.alone: OrderedDict[str, tuple[Owner, ...]] = OrderedDict()
        self.opener: Owner | None = None


class InFlight(Generic[Owner]):
    """Per session, the ids of the requests this process's SDK is still answering, each with its owner:
    from their POST until both their answer was stored and their POST ended (a server may close a POST's
    stream before the answer, and its events then go on under the same id). Only sessions with an id in
    flight are held, and none is ever dropped to make room (that would free a running call's id): at most
    ``max_sessions`` of them and ``max_per_session`` ids each, past which a POST is refused. An id stays
    taken while something the SDK may still act on names it (``hold``: a resume holding its stream's live
    tail, a cancel being handled). Ids are held as the SDK correlates them (``_key``), so ``"07"`` reuses
    ``7``; one longer than ``max_id`` is held as its digest, so what a POST can pin is bounded whatever its ids.

    Beside them, per session (the ``max_sessions`` most recently active), the server's requests awaiting
    answers (at most ``max_per_session``; an answer to one let go is refused, as unknown), the owners of
    its calls (what ending the session ends) and its opener (whose the session is)."""

    def __init__(self, *, max_sessions: int = 100_000, max_per_session: int = 1_000, max_id: int = 256,
                 max_past: int = 10_000) -> None:
        self._sessions: dict[str, dict[str, tuple[int, Owner]]] = {}  # session -> id -> what is done of it, whose
        self._held: dict[tuple[str, str], int] = {}  # (session, id) -> what still names it
        self._known: OrderedDict[str, _Known[Owner]] = OrderedDict()
        # (session, id) -> whose: the newest ``max_past`` calls no longer in flight (``past``)
        self._past: OrderedDict[tuple[str, str], Owner] = OrderedDict()
        self._max_sessions = max_sessions
        self._max_per_session = max_per_session
        self._max_id = max_id
        self._max_past = max_past

    def claim(self, session_id: str, requests: Sequence[tuple[str, Owner]]) -> str | None:
        """Take a POST's request ids with their owners, all or none: None when taken, else why not (the
        refusal's message)."""
        if not requests:
            return None
        held = self._sessions.get(session_id, {})
        taken: dict[str, tuple[int, Owner]] = {}
        for request_id, owner in requests:  # a batch that repeats an id is a reuse too: the SDK keeps the last
            key = self._key(request_id)
            if key in held or key in taken:
                return f"request id {request_id[:64]!r} is in flight in this session already: ids must not be reused"
            if (session_id, key) in self._held:  # e.g. the SDK would send the new call's events to a resume of it
                return (f"request id {request_id[:64]!r} is named by a resume or a cancel still being handled in this "
                        "session: ids must not be reused")
            taken[key] = (0, owner)
        if len(held) + len(taken) > self._max_per_session:
            return f"more than {self._max_per_session} requests in flight in this session"
        if not held and len(self._sessions) >= self._max_sessions:
            return f"more than {self._max_sessions} sessions with requests in flight"
        self._sessions[session_id] = held
        held.update(taken)
        return None

    def accepted(self, session_id: str, calls: Sequence[tuple[str, Owner]], answers: Collection[str]) -> None:
        """The SDK took a POST (it answered below 400: authenticated, its session this credential's): its calls'
        owners are the session's from now on (not one refused already, ``refused``), and the server's requests it
        answers await nothing more. Never before: a POST the SDK refuses (no token, another user's, a session it
        does not hold) changes nothing the guard knows of the session, nor makes room in it by evicting another
        session's past."""
        known = self._known_of(session_id)
        held = self._sessions.get(session_id, {})
        for request_id, owner in calls:
            key = self._key(request_id)
            call = held.get(key)
            own = call is not None and call[1] == owner  # not another's (observe mode lets a POST reuse its id)
            if call is not None and own and call[0] & (_REFUSED | _COUNTED):
                continue
            if owner in known.owners or len(known.owners) < self._max_per_session:
                known.owners[owner] = known.owners.get(owner, 0) + 1
                if call is not None and own:
                    held[key] = (call[0] | _COUNTED, owner)
        for server_request_id in answers:
            known.asked.pop(self._key(server_request_id), None)

    def opened(self, session_id: str, opener: Owner) -> None:
        """The session was opened by ``opener`` (its initialize, which the SDK took): whose the session is."""
        self._known_of(session_id).opener = opener

    def opener(self, session_id: str) -> Owner | None:
        """Who opened the session; None when not known (opened elsewhere, or not among the ``max_sessions`` most
        recently active)."""
        known = self._known.get(session_id)
        return known.opener if known is not None else None

    def owner(self, session_id: str, request_id: str) -> Owner | None:
        """Whose the request in flight under ``request_id`` is; None when none is."""
        call = self._sessions.get(session_id, {}).get(self._key(request_id))
        return call[1] if call is not None else None

    def past(self, session_id: str, request_id: str) -> Owner | None:
        """Whose the call under ``request_id`` was, no longer in flight (answered, its POST ended): a cancel of it
        after its result is how a client that never got the result tells so, and acts on nothing, but may be let
        through only for a token of its principal. None when not known: never in flight here, or older than the
        newest ``max_past`` (as many as the server's hooks remember results sent)."""
        return self._past.get((session_id, self._key(request_id)))

    def owners(self, session_id: str) -> list[Owner]:
        """Whose the session's calls have been, in flight or not (its stored results outlive them): those the SDK
        took, and those it is still deciding on."""
        known = self._known.get(session_id)
        owners: dict[Owner, None] = {}
        if known is not None:
            if known.opener is not None:
                owners[known.opener] = None
            owners.update(dict.fromkeys(known.owners))
        owners.update(dict.fromkeys(owner for state, owner in self._sessions.get(session_id, {}).values()
                                    if not state & _REFUSED))
        return list(owners)

    def ran(self, session_id: str, request_id: str) -> None:
        """Something of the call in flight under ``request_id`` other than its answer was stored: its handler ran."""
        self._mark(session_id, request_id, _RAN, unless=_RAN)

    def refused(self, session_id: str, request_id: str) -> None:
        """The answer of the call in flight under ``request_id`` is the call guard's refusal: unless something of
        it was stored before (``ran``: a tool's own error shaped as one), it never ran, and ending the session ends
        nothing of it, in flight or past. Told before the SDK's taking of its POST (``accepted``, which then leaves it
        out) or after (which takes back what that counted), as the two race."""
        call = self._mark(session_id, request_id, _REFUSED, unless=_RAN | _REFUSED)
        if call is None:
            return
        known = self._known.get(session_id)
        if call[0] & _COUNTED and known is not None and call[1] in known.owners:  # only what ``accepted`` counted
            left = known.owners[call[1]] - 1
            if left:
                known.owners[call[1]] = left
            else:
                del known.owners[call[1]]

    def _mark(self, session_id: str, request_id: str, flag: int, *, unless: int) -> tuple[int, Owner] | None:
        """Set ``flag`` on the call in flight under ``request_id``, unless it has any of ``unless``: the call as it
        was, or None when nothing was marked."""
        held = self._sessions.get(session_id, {})
        key = self._key(request_id)
        call = held.get(key)
        if call is None or call[0] & unless:
            return None
        held[key] = (call[0] | flag, call[1])
        return call

    def hold(self, session_id: str, request_id: str) -> None:
        """Something the SDK may still act on names the id (a resume takes its stream's live tail, a cancel is
        being handled): a new request may not take it until ``release``."""
        key = (session_id, self._key(request_id))
        self._held[key] = self._held.get(key, 0) + 1

    def release(self, session_id: str, request_id: str) -> None:
        key = (session_id, self._key(request_id))
        left = self._held.get(key, 0) - 1
        if left > 0:
            self._held[key] = left
        else:
            self._held.pop(key, None)

    def asked(self, session_id: str, server_request_id: str, stream_id: str) -> None:
        """The server sent a request on a stream: its answer is awaited, and acts on the call whose stream that
        is; sent on no call's stream (a sampling or roots request the SDK does not tie to its call), on any
        of the calls in flight."""
        asked = self._known_of(session_id).asked
        if len(asked) >= self._max_per_session:
            del asked[next(iter(asked))]
        call = self._key(stream_id)
        asked[self._key(server_request_id)] = (call if call in self._sessions.get(session_id, {})
                                               else self._running(session_id))

    def asker(self, session_id: str, server_request_id: str) -> tuple[Owner, ...] | None:
        """Whose calls the server's request ``server_request_id`` may act on: the owner of the call it was sent
        for, or of those in flight when it was sent on no call's stream (``()``: none); None when the server
        awaits no answer to it in this session."""
        known = self._known.get(session_id)
        key = self._key(server_request_id)
        if known is None or key not in known.asked:
            return None
        of = known.asked[key]
        if not isinstance(of, str):
            return of
        call = self._sessions.get(session_id, {}).get(of)
        return (call[1],) if call is not None else ()

    def stored_alone(self, session_id: str, event_id: str, storer: Owner) -> None:
        """The server stored an event on its standalone stream (no call's): it may carry what any call in flight
        sent there (a sampling request over a document a tool read), or what the session's own tasks send (a tool's
        task that outlives its call, the session's log): it is theirs to see, and ``storer``'s, the owner of the
        request it was stored in (the session's opener)."""
        alone = self._known_of(session_id).alone
        alone[event_id] = tuple(dict.fromkeys((*self._running(session_id), storer)))
        if len(alone) > self._max_per_session:
            alone.popitem(last=False)

    def alone(self, session_id: str, event_id: str) -> tuple[Owner, ...] | None:
        """Whose calls were in flight when standalone event ``event_id`` was stored; None when not known (another
        process stored it, or it is older than the ``max_per_session`` newest)."""
        known = self._known.get(session_id)
        return known.alone.get(event_id) if known is not None else None

    def _running(self, session_id: str) -> tuple[Owner, ...]:
        return tuple(dict.fromkeys(owner for _, owner in self._sessions.get(session_id, {}).values()))

    def answered(self, session_id: str, request_id: str) -> None:
        """Its response or error was stored."""
        self._done(session_id, (request_id,), _ANSWERED)

    def ended(self, session_id: str, ids: Collection[str], *, answered: bool = False) -> None:
        """The POST carrying them ended; ``answered``: and its answers with it (refused, or answered as JSON)."""
        self._done(session_id, ids, _FREE if answered else _ENDED)

    def end(self, session_id: str) -> None:
        """The session ended: nothing of it is in flight any more."""
        self._sessions.pop(session_id, None)
        self._known.pop(session_id, None)

    def _known_of(self, session_id: str) -> _Known[Owner]:
        known = self._known.get(session_id)
        if known is None:
            known = self._known[session_id] = _Known()
            if len(self._known) > self._max_sessions:
                self._known.popitem(last=False)
        else:
            self._known.move_to_end(session_id)
        return known

    def _done(self, session_id: str, ids: Collection[str], done: int) -> None:
        held = self._sessions.get(session_id)
        if held is None:
            return
        known = self._known.get(session_id)
        for request_id in ids:
            key = self._key(request_id)
            call = held.get(key)
            if call is None:
                continue
            state = call[0] | done
            if state & _FREE != _FREE:
                held[key] = (state, call[1])
                continue
            del held[key]
            self._past[(session_id, key)] = call[1]
            self._past.move_to_end((session_id, key))
            if len(self._past) > self._max_past:
                self._past.popitem(last=False)
            if known is not None and key in known.asked.values():  # its requests' answers act on nothing now
                known.asked = {asked: of for asked, of in known.asked.items() if of != key}
        if not held:
            del self._sessions[session_id]

    def _key(self, request_id: str) -> str:
        """One id as the SDK correlates it: a cancel or an answer names its request by ``int()`` of the id
        where that parses (``mcp.shared.dispatcher.coerce_request_id``: ``7``, ``"7"``, ``"07"``, ``" 7"``
        and ``"\\uff17"`` are one id)."""
        with contextlib.suppress(ValueError):  # past Python's 4,300 digits neither reads it as an int
            request_id = str(int(request_id))
        if len(request_id) <= self._max_id:
            return request_id
        return "sha256:" + hashlib.sha256(request_id.encode("utf-8", "surrogatepass")).hexdigest()

    def posting(self, session_id: str, request_id: str) -> bool:
        """Whether the POST that carried the request in flight under ``request_id`` is still open: the SDK sends
        the call's events there, and would not hand a resume its live tail."""
        call = self._sessions.get(session_id, {}).get(self._key(request_id))
        return call is not None and not call[0] & _ENDED

