"""The request ids each session has in flight in this process: what the SDK would hand to a POST reusing one.

MCP forbids reusing a request id within a session, and the SDK (2.3) keys a request's stream by its id: a
POST that reused the id of a call still running would be handed that call's stream, its progress and its
result, whatever its token. Only the process that holds the session runs its requests (another replica
answers 404), so what is in flight is known here, without the guard's storage: a storage that is down or
full never lets a reuse through.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection

_ANSWERED = 1  # its response (or error) was stored
_ENDED = 2  # the POST that carried it ended: its answer sent, or its stream closed (a server that polls)
_FREE = _ANSWERED | _ENDED


class InFlight:
    """Per session, the ids of the requests this process's SDK is still answering: from their POST until
    both their answer was stored and their POST ended (a server may close a POST's stream before the answer,
    and its events then go on under the same id). Only sessions with an id in flight are held, and none is
    ever dropped to make room (that would free a running call's id): at most ``max_sessions`` of them and
    ``max_per_session`` ids each, past which a POST is refused. An id longer than ``max_id`` is held as its
    digest, so what a POST can pin is bounded whatever its ids."""

    def __init__(self, *, max_sessions: int = 100_000, max_per_session: int = 1_000, max_id: int = 256) -> None:
        self._sessions: dict[str, dict[str, int]] = {}  # session -> request id -> what is done of it
        self._max_sessions = max_sessions
        self._max_per_session = max_per_session
        self._max_id = max_id

    def claim(self, session_id: str, ids: Collection[str]) -> str | None:
        """Take a POST's request ids, all or none: None when taken, else why not (the refusal's message)."""
        if not ids:
            return None
        held = self._sessions.get(session_id, {})
        taken: set[str] = set()
        for request_id in ids:  # a batch that repeats an id is a reuse too: the SDK keeps the last
            key = self._key(request_id)
            if key in held or key in taken:
                return f"request id {request_id[:64]!r} is in flight in this session already: ids must not be reused"
            taken.add(key)
        if len(held) + len(taken) > self._max_per_session:
            return f"more than {self._max_per_session} requests in flight in this session"
        if not held and len(self._sessions) >= self._max_sessions:
            return f"more than {self._max_sessions} sessions with requests in flight"
        self._sessions[session_id] = held
        held.update(dict.fromkeys(taken, 0))
        return None

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
        for request_id in ids:
            key = self._key(request_id)
            state = held.get(key)
            if state is not None:
                if state | done == _FREE:
                    del held[key]
                else:
                    held[key] = state | done
        if not held:
            del self._sessions[session_id]

    def _key(self, request_id: str) -> str:
        if len(request_id) <= self._max_id:
            return request_id
        return "sha256:" + hashlib.sha256(request_id.encode("utf-8", "surrogatepass")).hexdigest()
