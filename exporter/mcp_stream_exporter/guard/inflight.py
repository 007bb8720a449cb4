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
from collections.abc import Collection, Sequence
from typing import Generic, TypeVar

Owner = TypeVar("Owner")  # whose a call is: what a POST acting on it must hold (the guard's requirement, principal)

_ANSWERED = 1  # its response (or error) was stored
_ENDED = 2  # the POST that carried it ended: its answer sent, or its stream closed (a server that polls)
_FREE = _ANSWERED | _ENDED


class _Session(Generic[Owner]):
    __slots__ = ("asked", "calls")

    def __init__(self) -> None:
        self.calls: dict[str, tuple[int, Owner]] = {}  # request id -> what is done of it, whose it is
        self.asked: dict[str, str] = {}  # the server's request id -> the call whose stream carried it


class InFlight(Generic[Owner]):
    """Per session, the ids of the requests this process's SDK is still answering, each with its owner:
    from their POST until both their answer was stored and their POST ended (a server may close a POST's
    stream before the answer, and its events then go on under the same id); and the requests the server
    sent on their streams, until the client answers them or their call is done. Only sessions with an id in
    flight are held, and none is ever dropped to make room (that would free a running call's id): at most
    ``max_sessions`` of them and ``max_per_session`` ids each, past which a POST is refused. Ids are held
    as the SDK correlates them (``_key``), so ``"07"`` reuses ``7``; one longer than ``max_id`` is held as
    its digest, so what a POST can pin is bounded whatever its ids."""

    def __init__(self, *, max_sessions: int = 100_000, max_per_session: int = 1_000, max_id: int = 256) -> None:
        self._sessions: dict[str, _Session[Owner]] = {}
        self._max_sessions = max_sessions
        self._max_per_session = max_per_session
        self._max_id = max_id

    def claim(self, session_id: str, requests: Sequence[tuple[str, Owner]]) -> str | None:
        """Take a POST's request ids with their owners, all or none: None when taken, else why not (the
        refusal's message)."""
        if not requests:
            return None
        held = self._sessions.get(session_id)
        calls = held.calls if held is not None else {}
        taken: dict[str, tuple[int, Owner]] = {}
        for request_id, owner in requests:  # a batch that repeats an id is a reuse too: the SDK keeps the last
            key = self._key(request_id)
            if key in calls or key in taken:
                return f"request id {request_id[:64]!r} is in flight in this session already: ids must not be reused"
            taken[key] = (0, owner)
        if len(calls) + len(taken) > self._max_per_session:
            return f"more than {self._max_per_session} requests in flight in this session"
        if held is None:
            if len(self._sessions) >= self._max_sessions:
                return f"more than {self._max_sessions} sessions with requests in flight"
            held = self._sessions[session_id] = _Session()
        held.calls.update(taken)
        return None

    def owner(self, session_id: str, request_id: str) -> Owner | None:
        """Whose the request in flight under ``request_id`` is; None when none is."""
        held = self._sessions.get(session_id)
        call = held.calls.get(self._key(request_id)) if held is not None else None
        return call[1] if call is not None else None

    def asked(self, session_id: str, server_request_id: str, stream_id: str) -> None:
        """The server sent a request on a stream: when that stream is a call in flight, its answer acts on
        the call. Past ``max_per_session`` such requests outstanding in the session, the oldest is let go."""
        held = self._sessions.get(session_id)
        key = self._key(stream_id)
        if held is None or key not in held.calls:
            return
        if len(held.asked) >= self._max_per_session:
            del held.asked[next(iter(held.asked))]
        held.asked[self._key(server_request_id)] = key

    def asker(self, session_id: str, server_request_id: str) -> Owner | None:
        """Whose call the server's request ``server_request_id`` was sent for; None when no call in flight's."""
        held = self._sessions.get(session_id)
        of = held.asked.get(self._key(server_request_id)) if held is not None else None
        call = held.calls.get(of) if held is not None and of is not None else None
        return call[1] if call is not None else None

    def replied(self, session_id: str, server_request_ids: Collection[str]) -> None:
        """The client answered these requests of the server."""
        held = self._sessions.get(session_id)
        if held is not None:
            for server_request_id in server_request_ids:
                held.asked.pop(self._key(server_request_id), None)

    def answered(self, session_id: str, request_id: str) -> None:
        """Its response or error was stored."""
        self._done(session_id, (request_id,), _ANSWERED)

    def ended(self, session_id: str, ids: Collection[str], *, answered: bool = False) -> None:
        """The POST carrying them ended; ``answered``: and its answers with it (refused, or answered as JSON)."""
        self._done(session_id, ids, _FREE if answered else _ENDED)

    def end(self, session_id: str) -> None:
        """The session ended: nothing of it is in flight any more."""
        self._sessions.pop(session_id, None)

    def _done(self, session_id: str, ids: Collection[str], done: int) -> None:
        held = self._sessions.get(session_id)
        if held is None:
            return
        calls = held.calls
        for request_id in ids:
            key = self._key(request_id)
            call = calls.get(key)
            if call is None:
                continue
            if call[0] | done != _FREE:
                calls[key] = (call[0] | done, call[1])
                continue
            del calls[key]
            if held.asked:  # its stream's requests to the client: nothing acts on the call any more
                held.asked = {asked: of for asked, of in held.asked.items() if of != key}
        if not calls:
            del self._sessions[session_id]

    def _key(self, request_id: str) -> str:
        """One id as the SDK correlates it: a cancel or an answer names its request by ``int()`` of the id
        where that parses (``mcp.shared.dispatcher.coerce_request_id``: ``7``, ``"7"``, ``"07"``, ``" 7"``
        and ``"\uff17"`` are one id)."""
        with contextlib.suppress(ValueError):  # past Python's 4,300 digits neither reads it as an int
            request_id = str(int(request_id))
        if len(request_id) <= self._max_id:
            return request_id
        return "sha256:" + hashlib.sha256(request_id.encode("utf-8", "surrogatepass")).hexdigest()
