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


class InFlight(Generic[Owner]):
    """Per session, the ids of the requests this process's SDK is still answering, each with its owner:
    from their POST until both their answer was stored and their POST ended (a server may close a POST's
    stream before the answer, and its events then go on under the same id). Only sessions with an id in
    flight are held, and none is ever dropped to make room (that would free a running call's id): at most
    ``max_sessions`` of them and ``max_per_session`` ids each, past which a POST is refused. Ids are held
    as the SDK correlates them (``_key``), so ``"07"`` reuses ``7``; one longer than ``max_id`` is held as
    its digest, so what a POST can pin is bounded whatever its ids.

    Beside them, the requests the server sent that await the client's answer, and the call each was sent
    for, if any: the latest ``max_asked`` of them (an answer to one let go is refused, as unknown)."""

    def __init__(self, *, max_sessions: int = 100_000, max_per_session: int = 1_000, max_id: int = 256,
                 max_asked: int = 100_000) -> None:
        self._sessions: dict[str, dict[str, tuple[int, Owner]]] = {}  # session -> id -> what is done of it, whose
        self._asked: OrderedDict[tuple[str, str], str | None] = OrderedDict()  # (session, server's id) -> its call
        self._resuming: dict[tuple[str, str], int] = {}  # (session, stream) -> resumes holding its live tail
        self._max_sessions = max_sessions
        self._max_per_session = max_per_session
        self._max_id = max_id
        self._max_asked = max_asked

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
            if (session_id, key) in self._resuming:  # the SDK would send the new call's events to that resume
                return f"request id {request_id[:64]!r} has its stream resumed in this session: ids must not be reused"
            taken[key] = (0, owner)
        if len(held) + len(taken) > self._max_per_session:
            return f"more than {self._max_per_session} requests in flight in this session"
        if not held and len(self._sessions) >= self._max_sessions:
            return f"more than {self._max_sessions} sessions with requests in flight"
        self._sessions[session_id] = held
        held.update(taken)
        return None

    def owner(self, session_id: str, request_id: str) -> Owner | None:
        """Whose the request in flight under ``request_id`` is; None when none is."""
        call = self._sessions.get(session_id, {}).get(self._key(request_id))
        return call[1] if call is not None else None

    def resuming(self, session_id: str, stream_id: str) -> None:
        """A resume (GET) takes the live tail of a request's stream: a new request with that id would be its."""
        key = (session_id, self._key(stream_id))
        self._resuming[key] = self._resuming.get(key, 0) + 1

    def resume_ended(self, session_id: str, stream_id: str) -> None:
        key = (session_id, self._key(stream_id))
        left = self._resuming.get(key, 0) - 1
        if left > 0:
            self._resuming[key] = left
        else:
            self._resuming.pop(key, None)

    def owners(self, session_id: str) -> list[Owner]:
        """Whose the requests in flight in the session are."""
        return [owner for _, owner in self._sessions.get(session_id, {}).values()]

    def asked(self, session_id: str, server_request_id: str, stream_id: str) -> None:
        """The server sent a request on a stream: its answer is awaited, and when that stream is a call in
        flight, the answer acts on the call."""
        key = (session_id, self._key(server_request_id))
        call = self._key(stream_id)
        self._asked[key] = call if call in self._sessions.get(session_id, {}) else None
        self._asked.move_to_end(key)
        if len(self._asked) > self._max_asked:
            self._asked.popitem(last=False)

    def asker(self, session_id: str, server_request_id: str) -> tuple[Owner, ...] | None:
        """Whose call the server's request ``server_request_id`` was sent for: ``(owner,)``, or ``()`` when it
        was sent for no call still in flight; None when the server awaits no answer to it in this session."""
        key = (session_id, self._key(server_request_id))
        if key not in self._asked:
            return None
        of = self._asked[key]
        call = self._sessions.get(session_id, {}).get(of) if of is not None else None
        return (call[1],) if call is not None else ()

    def replied(self, session_id: str, server_request_ids: Collection[str]) -> None:
        """The client answered these requests of the server."""
        for server_request_id in server_request_ids:
            self._asked.pop((session_id, self._key(server_request_id)), None)

    def answered(self, session_id: str, request_id: str) -> None:
        """Its response or error was stored."""
        self._done(session_id, (request_id,), _ANSWERED)

    def ended(self, session_id: str, ids: Collection[str], *, answered: bool = False) -> None:
        """The POST carrying them ended; ``answered``: and its answers with it (refused, or answered as JSON)."""
        self._done(session_id, ids, _FREE if answered else _ENDED)

    def end(self, session_id: str) -> None:
        """The session ended: nothing of it is in flight any more (the server's requests age out)."""
        self._sessions.pop(session_id, None)

    def _done(self, session_id: str, ids: Collection[str], done: int) -> None:
        held = self._sessions.get(session_id)
        if held is None:
            return
        for request_id in ids:
            key = self._key(request_id)
            call = held.get(key)
            if call is None:
                continue
            if call[0] | done == _FREE:
                del held[key]
            else:
                held[key] = (call[0] | done, call[1])
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
