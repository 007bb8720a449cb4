"""The replay guard's storages side by side: store and replay latency per event, in-memory against Redis.

Each round, for each storage: SESSIONS sessions are opened and their calls recorded; every session
stores EVENTS events (a priming event, progress notifications, a result) through
``GuardedEventStore.store_event`` (timed one by one: store latency); then every session resumes from
its first event with a token that covers the call, through ``replay_events_after`` (timed whole,
divided by the events replayed: replay latency per event). Redis is a local redis-server on a Unix
socket, started here (Debian's redis-server), and over TCP on 127.0.0.1 with ``--tcp``.
Reported: median and p99 over every timed operation of every round, and the Redis/in-memory ratio
of the medians. Bounded: ROUNDS x SESSIONS x EVENTS.

    python bench/guard_storage.py [--sessions 200] [--events 20] [--rounds 5] [--tcp]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from mcp_types import JSONRPCNotification, JSONRPCResponse

from mcp_stream_exporter.auth import AuthView, Requirement, ToolPolicy
from mcp_stream_exporter.guard import EventStorage, GuardedEventStore, InMemoryEventStorage
from mcp_stream_exporter.guard.redis_storage import RedisEventStorage
from mcp_stream_exporter.guard.store import _current, _Request

FETCH = "https://mcp.example.com/tools/fetch"
POLICY = ToolPolicy({"fetch": Requirement.of([FETCH])})
AUTH = AuthView(audience=frozenset({FETCH}), fingerprint="b", verification="unverified")


def _message(i: int, last: int) -> JSONRPCNotification | JSONRPCResponse | None:
    if i == 0:
        return None
    if i == last:
        return JSONRPCResponse(jsonrpc="2.0", id=1, result={"content": [{"type": "text", "text": "x" * 200}]})
    return JSONRPCNotification(jsonrpc="2.0", method="notifications/progress",
                               params={"progressToken": 1, "progress": i, "message": f"fetch step {i}"})


async def _round(storage: EventStorage, sessions: int, events: int, tag: str) -> tuple[list[float], list[float]]:
    store = GuardedEventStore(POLICY, storage=storage)
    stores: list[float] = []
    replays: list[float] = []
    firsts: dict[str, str] = {}
    for n in range(sessions):
        session = f"{tag}-{n}"
        await store.open_session(session)
        await store.record_call(session, "1", "fetch")
        token = _current.set(_Request(session, AUTH))
        try:
            for i in range(events):
                started = time.perf_counter()
                event_id = await store.store_event("1", _message(i, events - 1))
                stores.append(time.perf_counter() - started)
                firsts.setdefault(session, event_id)
        finally:
            _current.reset(token)
    sent: list[object] = []

    async def collect(event: object) -> None:
        sent.append(event)

    for session, first in firsts.items():
        token = _current.set(_Request(session, AUTH))
        try:
            sent.clear()
            started = time.perf_counter()
            await store.replay_events_after(first, collect)
            elapsed = time.perf_counter() - started
        finally:
            _current.reset(token)
        assert len(sent) == events - 1, f"replayed {len(sent)} of {events - 1}"
        replays.append(elapsed / len(sent))
    return stores, replays


def _redis(tcp: bool) -> tuple[subprocess.Popen[bytes], str, Path]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed (make system-deps)")
    workdir = Path(tempfile.mkdtemp(prefix="redis-bench-"))
    sock = workdir / "redis.sock"
    port = 0
    if tcp:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--unixsocket", str(sock),
                             "--save", "", "--appendonly", "no", "--dir", str(workdir)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while not sock.exists():
        if time.monotonic() > deadline:
            raise SystemExit("redis-server did not start")
        time.sleep(0.01)
    return proc, (f"redis://127.0.0.1:{port}/0" if tcp else f"unix://{sock}"), workdir


def _summary(samples: list[float]) -> str:
    ordered = sorted(samples)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    return f"median {statistics.median(ordered) * 1e6:8.1f} us   p99 {p99 * 1e6:8.1f} us   (n={len(ordered)})"


async def main(args: argparse.Namespace) -> None:
    proc, url, workdir = _redis(args.tcp)
    try:
        factories: dict[str, Callable[[], EventStorage]] = {
            "in-memory": lambda: InMemoryEventStorage(max_sessions=args.sessions * 2),
            f"redis ({'tcp' if args.tcp else 'unix socket'})": lambda: RedisEventStorage.from_url(url, prefix="bench"),
        }
        results: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in factories}
        for r in range(args.rounds):
            for name, factory in (factories.items() if r % 2 == 0 else reversed(factories.items())):
                storage = factory()
                stores, replays = await _round(storage, args.sessions, args.events, f"r{r}")
                results[name][0].extend(stores)
                results[name][1].extend(replays)
                if isinstance(storage, RedisEventStorage):
                    await storage.aclose()
        print(f"{args.rounds} rounds x {args.sessions} sessions x {args.events} events; alternating order")
        for name, (stores, replays) in results.items():
            print(f"{name:24s} store  {_summary(stores)}")
            print(f"{'':24s} replay {_summary(replays)} per event")
        (mem_s, mem_r), (red_s, red_r) = results.values()
        print(f"redis / in-memory medians: store {statistics.median(red_s) / statistics.median(mem_s):.1f}x, "
              f"replay per event {statistics.median(red_r) / statistics.median(mem_r):.1f}x")
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=200)
    parser.add_argument("--events", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tcp", action="store_true", help="Redis over TCP on 127.0.0.1 instead of a Unix socket")
    asyncio.run(main(parser.parse_args()))
