"""The guard's events on Redis: one store for every server replica, that survives their restarts.

Per session, under ``<prefix>:{<session id>}:`` (one hash slot on a cluster): ``open`` (the session exists,
and which process opened it), ``req`` (a hash: stream id -> what its events require), ``events`` (a stream:
one entry per event, its id the SSE event id, and its size) and ``bytes`` (their total). An event's
requirement is copied into its entry by the same Lua script that appends it, so a requirement recorded later
can never change what an event stored earlier requires, and a requirement only ever widens (the script takes
the union). Every key of a session gets the session TTL on each write; the events stream is trimmed to
``max_events_per_session`` and ``max_bytes_per_session``, oldest first (evictions counted): a tool that echoes
what a client sends cannot fill Redis, nor a resume's read. Each process keeps a heartbeat key while it runs,
so a replica answering a resume knows whether the session's owner may still finish the call.

No KEYS or SCAN: every key is named from the session id. TLS and auth come with the URL
(``rediss://user:password@host:6380/0``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Final

import redis.asyncio as aioredis
from mcp_types import JSONRPCMessage
from prometheus_client import Counter, Histogram
from pydantic import ValidationError
from redis.exceptions import RedisError

from mcp_stream_exporter.auth import Requirement
from mcp_stream_exporter.guard.storage import StorageError, StoredEvent, decoded, encoded

# a Redis stream entry id, the only event ids we hand out: two unsigned 64-bit integers, in ASCII digits (``\d``
# would take any script's, and ``int()`` reads them)
_STREAM_ID: Final = re.compile(r"([0-9]{1,20})-([0-9]{1,20})")
_MAX_ID_PART: Final = 2**64 - 1
_MAX_SESSION_ID: Final = 256
_POLLING_READS: Final = 8  # live tails past ``max_blocking_reads`` reading at once, a connection each
_TAIL_BLOCK_S: Final = 1.0  # the longest a wait_after blocks in Redis: the socket timeout allows for it
_OPERATIONS: Final = ("open", "close", "append", "get", "after", "require", "requirement", "is_open", "wait_after",
                      "owner_alive", "heartbeat")

# A process's heartbeat: Redis's own time (no replica's clock is read) and how long the process may go without a
# beat (three of its periods), kept as long as a session's keys, so an eviction policy that takes the shortest TTL
# first (``volatile-ttl``) does not take it before them. A reader gets how far past that the beat is: > 0, the
# process is gone; -1, no beat at all (evicted: one that may live); 0 for a beat of before (``1``, which lived as
# long as its process, three periods)
_BEAT: Final = """
local now = redis.call('TIME')
redis.call('SET', KEYS[1], (now[1] * 1000 + math.floor(now[2] / 1000)) .. ' ' .. ARGV[1], 'PX', ARGV[2])
"""
_BEAT_OVERDUE: Final = """
local beat = redis.call('GET', KEYS[1])
if not beat then return -1 end
local at, window = string.match(beat, '^(%d+) (%d+)$')
if not at then return 0 end
local now = redis.call('TIME')
return now[1] * 1000 + math.floor(now[2] / 1000) - tonumber(at) - tonumber(window)
"""
# what a stream's events require, widened by one given (resources, scopes): written, and returned; nil past the cap of
# streams a session records (``_REQUIRE``'s ARGV[4]), for a stream it has none for yet
_WIDEN: Final = """
local function union(a, b)
  local seen, out = {}, {}
  for _, list in ipairs({a, b}) do
    for _, v in ipairs(list) do
      if not seen[v] then seen[v] = true; table.insert(out, v) end
    end
  end
  table.sort(out)
  return out
end
local function widen(key, stream, resources, scopes, max_streams)
  local current = redis.call('HGET', key, stream)
  if not current and redis.call('HLEN', key) >= max_streams then return nil end
  if current then
    local c = cjson.decode(current)
    resources, scopes = union(c.r, resources), union(c.s, scopes)
  end
  local widened = cjson.encode({r = resources, s = scopes})
  redis.call('HSET', key, stream, widened)
  return widened
end
"""
_REQUIRE: Final = _WIDEN + """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
if not widen(KEYS[2], ARGV[1], cjson.decode(ARGV[2]), cjson.decode(ARGV[3]), tonumber(ARGV[4])) then return -2 end
for i = 1, #KEYS do redis.call('PEXPIRE', KEYS[i], ARGV[5]) end
return 0
"""

# the oldest events go while the session holds more than ARGV[4] of them or ARGV[6] bytes (its newest always stays);
# each entry keeps its size ('z'), the session's total is KEYS[4]
# (ARGV[9] streams at most, as ``_REQUIRE``); ARGV[7], ARGV[8]: the event's call's requirement, resources and scopes
# ('' when not known), which widens the stream's before it is copied into the event
_APPEND: Final = _WIDEN + """
if redis.call('EXISTS', KEYS[1]) == 0 then return false end
if redis.call('EXISTS', KEYS[3]) == 0 then redis.call('DEL', KEYS[4]) end  -- its events evicted, its total with them
local requirement = redis.call('HGET', KEYS[2], ARGV[1])
if ARGV[7] ~= '' then
  requirement = widen(KEYS[2], ARGV[1], cjson.decode(ARGV[7]), cjson.decode(ARGV[8]), tonumber(ARGV[9])) or requirement
end
requirement = requirement or ''
local size = string.len(ARGV[2])
local id = redis.call('XADD', KEYS[3], '*', 's', ARGV[1], 'm', ARGV[2], 'r', requirement, 'u', ARGV[3], 'z', size)
local total = redis.call('INCRBY', KEYS[4], size)
local count = redis.call('XLEN', KEYS[3])
local trimmed = 0
while count > 1 and (count > tonumber(ARGV[4]) or total > tonumber(ARGV[6])) do
  local oldest = redis.call('XRANGE', KEYS[3], '-', '+', 'COUNT', 1)[1]
  local fields, gone = oldest[2], 0
  for i = 1, #fields, 2 do
    if fields[i] == 'z' then gone = tonumber(fields[i + 1]) end
  end
  redis.call('XDEL', KEYS[3], oldest[1])
  total = redis.call('DECRBY', KEYS[4], gone)
  count = count - 1
  trimmed = trimmed + 1
end
for i = 1, #KEYS do redis.call('PEXPIRE', KEYS[i], ARGV[5]) end
return {id, trimmed}
"""


_SECONDS: Final = Histogram(
    "mcp_stream_guard_store_operation_seconds",
    "Latency of the replay guard's Redis operations; a slow store delays every SSE event and resume.",
    ["operation"], buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5))
_ERRORS: Final = Counter(
    "mcp_stream_guard_store_errors_total",
    "Replay guard Redis operations that failed; while it rises resumes are refused with store_unavailable "
    "and events go unstored: check Redis (docs/runbooks/MCPGuardStoreErrors.md).",
    ["operation"])
_EVICTIONS: Final = Counter(
    "mcp_stream_guard_store_evictions_total",
    "Events and requirements the replay guard's Redis storage dropped; resumes from them are refused. reason=cap: "
    "a session past its caps (raise them if honest sessions reach them); reason=session_gone: its session's keys "
    "are not in Redis (expired, evicted by Redis, or lost with Redis's data: check its maxmemory-policy and "
    "restarts); reason=id_too_long: a session id no honest client sends.",
    ["reason"])
for _operation in _OPERATIONS:
    _SECONDS.labels(_operation)
    _ERRORS.labels(_operation)
for _reason in ("cap", "session_gone", "id_too_long"):
    _EVICTIONS.labels(_reason)


class RedisEventStorage:
    """A ``SharedEventStorage`` on Redis (redis-py, asyncio). ``prefix`` separates deployments that share a
    Redis; ``ttl_s`` bounds an idle session's life; ``max_events_per_session``, ``max_bytes_per_session`` and
    ``max_calls_per_session`` bound one session's keys. ``max_blocking_reads`` bounds the live tails waiting
    in Redis at once, each on a connection of its own: past it a tail polls, a few at a time, holding none
    between reads (a client resuming one stream hundreds of times at once would otherwise take Redis's every
    connection, and every replica's events with them). Every Redis error becomes ``StorageError``: the guard
    then refuses, never replays on a guess."""

    def __init__(self, client: aioredis.Redis, *, prefix: str = "mcp-stream", ttl_s: float = 3600.0,
                 max_events_per_session: int = 1000, max_calls_per_session: int = 1000,
                 max_bytes_per_session: int = 16 << 20, heartbeat_s: float = 5.0,
                 max_blocking_reads: int = 64) -> None:
        self._redis = client
        self._prefix = prefix
        self._ttl_ms = int(ttl_s * 1000)
        self._max_events = max_events_per_session
        self._max_calls = max_calls_per_session
        self._max_bytes = max_bytes_per_session
        self._heartbeat_s = heartbeat_s
        self._instance = uuid.uuid4().hex
        self._pid = os.getpid()
        self._beating: asyncio.Task[None] | None = None
        self._blocking = asyncio.Semaphore(max_blocking_reads)
        self._polling = asyncio.Semaphore(_POLLING_READS)
        self._require = client.register_script(_REQUIRE)
        self._beat_script = client.register_script(_BEAT)
        self._beat_overdue = client.register_script(_BEAT_OVERDUE)
        self._append = client.register_script(_APPEND)
        self.evictions = 0

    @classmethod
    def from_url(cls, url: str, *, timeout_s: float = 2.0, max_connections: int = 128,
                 **options: Any) -> RedisEventStorage:
        """``redis://``, ``rediss://`` (TLS) or ``unix://`` URL, credentials included. ``timeout_s``, plus the
        second a live tail's read may block, bounds every operation, so an unreachable Redis refuses a resume
        instead of hanging it.
        ``max_connections`` bounds this process's connections: a burst of requests waits for one (up to
        ``timeout_s``) rather than open Redis's last (redis-py's own pool has no bound)."""
        options.setdefault("max_blocking_reads", max(1, max_connections // 2))  # half left for the rest
        pool = aioredis.BlockingConnectionPool.from_url(
            url, max_connections=max_connections, timeout=timeout_s,
            socket_timeout=timeout_s + _TAIL_BLOCK_S, socket_connect_timeout=timeout_s)
        return cls(aioredis.Redis.from_pool(pool), **options)

    async def aclose(self) -> None:
        if self._beating is not None:
            self._beating.cancel()
            # gone at once: a beat at time 0 (deleting it would read as evicted, a process that may live)
            with contextlib.suppress(aioredis.RedisError, OSError):
                await self._redis.set(self._owner_key(self._me()), "0 0", px=self._ttl_ms)
        await self._redis.aclose()

    # --- keys ---

    def _keys(self, session_id: str) -> list[str]:
        base = f"{self._prefix}:{{{session_id}}}"
        return [f"{base}:open", f"{base}:req", f"{base}:events", f"{base}:bytes"]

    def _owner_key(self, instance: str) -> str:
        return f"{self._prefix}:owner:{instance}"

    # --- EventStorage ---

    async def open(self, session_id: str) -> None:
        async with self._op("open"):
            me = self._me()
            self._start_heartbeat()
            await self._beat()
            await self._redis.set(self._keys(session_id)[0], me, px=self._ttl_ms, nx=True)

    async def close(self, session_id: str) -> None:
        if len(session_id) > _MAX_SESSION_ID:
            return
        async with self._op("close"):
            await self._redis.delete(*self._keys(session_id))

    async def append(self, session_id: str | None, stream_id: str, message: JSONRPCMessage | None,
                     subject: str | None, requirement: Requirement | None = None) -> str | None:
        if session_id is None:  # no session at all (initialize's priming event): nothing to keep
            return None
        if len(session_id) > _MAX_SESSION_ID:
            self._evicted(1, "id_too_long")
            return None
        body = encoded(message)
        async with self._op("append"):
            stored = await self._append(keys=self._keys(session_id),
                                        args=[stream_id, body, subject or "", self._max_events, self._ttl_ms,
                                              self._max_bytes, *_requirement_args(requirement), self._max_calls])
        if not stored:
            self._evicted(1, "session_gone")
            return None
        event_id, trimmed = stored
        self._evicted(int(trimmed), "cap")
        return _text(event_id)

    async def get(self, session_id: str, event_id: str) -> StoredEvent | None:
        if not _holds(event_id) or len(session_id) > _MAX_SESSION_ID:
            return None  # a cursor Redis could not even parse is unknown here, never a Redis error (nor a page)
        async with self._op("get"):
            found = _events(await self._redis.xrange(self._keys(session_id)[2], event_id, event_id, count=1))
        return found[0] if found else None

    async def after(self, session_id: str, event: StoredEvent) -> list[StoredEvent] | None:
        # from the cursor itself, in one read: a session's other calls may trim it (and what follows it) between the
        # read that found it and this one, and a read from just past it would then start at the oldest left
        async with self._op("after"):
            found = _events(await self._redis.xrange(self._keys(session_id)[2], event.event_id, "+"))
        return found[1:] if found and found[0].event_id == event.event_id else None

    async def require(self, session_id: str, stream_id: str, requirement: Requirement) -> None:
        if len(session_id) > _MAX_SESSION_ID:
            self._evicted(1, "id_too_long")
            return
        async with self._op("require"):
            done = await self._require(keys=self._keys(session_id),
                                       args=[stream_id, *_requirement_args(requirement), self._max_calls, self._ttl_ms])
        if int(done) != 0:
            self._evicted(1, "session_gone" if int(done) == -1 else "cap")

    async def requirement(self, session_id: str, stream_id: str) -> Requirement | None:
        async with self._op("requirement"):
            return _requirement(await self._redis.hget(self._keys(session_id)[1], stream_id))

    # --- SharedEventStorage ---

    async def is_open(self, session_id: str) -> bool:
        if len(session_id) > _MAX_SESSION_ID:
            return False
        async with self._op("is_open"):
            return bool(await self._redis.exists(self._keys(session_id)[0]))

    async def wait_after(self, session_id: str, event_id: str, timeout_s: float) -> list[StoredEvent]:
        wait_s = min(timeout_s, _TAIL_BLOCK_S)
        polled = self._blocking.locked()  # every blocking read taken: read now, wait with no connection held
        async with self._op("wait_after"):
            if polled:
                async with self._polling:  # waited for with no connection held: the polls take a few at most
                    found: Any = await self._redis.xread({self._keys(session_id)[2]: event_id}, count=100)
            else:
                async with self._blocking:
                    found = await self._redis.xread({self._keys(session_id)[2]: event_id}, count=100,
                                                    block=max(1, int(wait_s * 1000)))
            streams = found.values() if isinstance(found, dict) else (entries for _, entries in found or [])
            events = [event for entries in streams for event in _events(entries)]
        if polled and not events:
            await asyncio.sleep(wait_s)
        return events

    async def owner_alive(self, session_id: str) -> bool:
        """Whether the process that opened the session may still run its calls: its last beat is recent, or its
        beat is gone while the session is not (evicted, not expired: it lives as long as the session's keys)."""
        async with self._op("owner_alive"):
            owner = await self._redis.get(self._keys(session_id)[0])
            if owner is None:
                return False
            beat = self._owner_key(_text(owner))
            if int(await self._beat_overdue(keys=[beat])) <= 0:
                return True
            # a Redis that takes no writes (read-only, out of memory; on a cluster, the node the beat is on) stops
            # every beat: that is the storage failing (raised here), not the owner gone. The probe's hash tag is the
            # beat's whole name: the same slot
            await self._redis.set(f"{{{beat}}}:probe", 1, px=1000)
            return False

    # --- internals ---

    def _me(self) -> str:
        """This process's instance: a worker forked from the process that built the storage (a server that loads its
        app before it forks) is a process of its own, with sessions and a heartbeat of its own."""
        if self._pid != os.getpid():
            self._pid, self._instance, self._beating = os.getpid(), uuid.uuid4().hex, None
        return self._instance

    def _start_heartbeat(self) -> None:
        if self._beating is None or self._beating.done():
            self._beating = asyncio.get_running_loop().create_task(self._heartbeat())

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self._heartbeat_s)
            try:
                async with self._op("heartbeat"):
                    await self._beat()
            except StorageError:
                continue  # counted; the next beat may reach Redis again

    async def _beat(self) -> None:
        window = int(self._heartbeat_s * 3000)
        await self._beat_script(keys=[self._owner_key(self._me())], args=[window, max(self._ttl_ms, window)])

    def _evicted(self, n: int, reason: str) -> None:
        if n > 0:
            self.evictions += n
            _EVICTIONS.labels(reason).inc(n)

    @asynccontextmanager
    async def _op(self, operation: str) -> AsyncIterator[None]:
        started = time.perf_counter()
        try:
            yield
        except (RedisError, OSError, ValidationError, ValueError, KeyError) as exc:
            _ERRORS.labels(operation).inc()
            raise StorageError(f"redis {operation}: {type(exc).__name__}") from exc
        finally:
            _SECONDS.labels(operation).observe(time.perf_counter() - started)


def _holds(event_id: str) -> bool:
    """Whether ``event_id`` is one Redis can hold as a stream entry id (a client's ``Last-Event-ID`` is anything)."""
    parts = _STREAM_ID.fullmatch(event_id)
    return parts is not None and all(int(part) <= _MAX_ID_PART for part in parts.groups())


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _requirement_args(requirement: Requirement | None) -> tuple[str, str]:
    """A requirement as the scripts take it: its resources and its scopes, each a JSON list ('' and '': none)."""
    if requirement is None:
        return "", ""
    return json.dumps(sorted(requirement.resources)), json.dumps(sorted(requirement.scopes))


def _requirement(raw: Any) -> Requirement | None:
    if not raw:
        return None
    data = json.loads(raw)
    resources, scopes = data.get("r"), data.get("s")  # cjson writes an empty list as {}
    return Requirement(frozenset(resources if isinstance(resources, list) else ()),
                       frozenset(scopes if isinstance(scopes, list) else ()))


def _events(entries: Any) -> list[StoredEvent]:
    """Stream entries read back; a malformed one raises (and the operation becomes a StorageError)."""
    out = []
    for entry_id, fields in entries:
        message = fields[b"m"]
        out.append(StoredEvent(_text(entry_id), _text(fields[b"s"]),
                               decoded(message),
                               _requirement(fields[b"r"]), _text(fields[b"u"]) or None))
    return out
