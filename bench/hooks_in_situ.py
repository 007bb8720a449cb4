"""What the hooks' reading functions cost where they run, against the same call in a hot loop.

The timed bench (``hooks_overhead.py``) finds the hooks' share of a round trip's time two to three times
their share of its instructions. This measures why, function by function: in a worker of that bench
(the three configurations side by side over loopback TCP), each pure function the hooks read the wire
with is timed where the hooks call it, then called again at once with the same arguments, and a call of
an empty function is timed at the same place; after the run, the same call is timed in a hot loop.
Reported: medians in nanoseconds (the timer's own cost, the empty call's, included in all but the hot
loop). A function whose first call costs several times its repeat at once runs cold: its code and data
were out of the caches the round trip's other work (the SDK's, the HTTP stack's) filled, and cutting its
instructions buys little; what would is running less distinct code. ``classify_body`` is listed for
answers off the healthy path (a run of healthy calls never calls it).

``--methods`` times instead the hooks' own steps where they run, each whole (what it calls included; none
of them calls another): per round trip, how often each runs, its median and mean, and its mean times
how often, i.e. what it adds to a round trip, batched work included. Each timing adds its own cost, about
0.7 us in situ.

    python bench/hooks_in_situ.py [--calls 1000] [--mode default] [--methods]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import timeit
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import hooks_overhead  # the bench beside this one

from mcp_stream_exporter.hooks import _observer, _recorder, client

# (module the hooks call it through, name): pure functions, so calling one twice changes nothing
_MEASURED = ((_observer, "pick"), (_observer, "can_ask"), (_observer, "content_of"), (_observer, "classify_body"),
             (client, "_picked"), (client, "can_ask"), (client, "read_message"), (client, "content_of"),
             (client, "classify_body"), (_observer, "result_id"), (client, "result_id"))
# The hooks' steps on the healthy path, none called from another: a round trip's share of each adds up.
_STEPS = ((_observer.WireObserver, "_on_body"), (_observer.WireObserver, "dispatched"),
          (_observer.WireObserver, "_on_response_start"), (_observer.WireObserver, "_on_response_body"),
          (_observer._Exchange, "release"), (_recorder.StoreRecorder, "on_stored"),
          (client, "read_message"), (client.ClientInstrumentation, "_request_calls"), (client, "_picked"),
          (client, "content_of"), (client._TapStream, "_healthy"), (client._TapStream, "_keep"),
          (client._TapStream, "_ended"), (client._TapStream, "hold"), (client._TapStream, "aclose"))


def _nothing(*args: Any, **kwargs: Any) -> None:
    return None


class _Timed:
    """Stands in for one function at its call site: times it, its repeat and an empty call, each time."""

    def __init__(self, function: Callable[..., Any]) -> None:
        self.function = function
        self.first: list[int] = []
        self.again: list[int] = []
        self.empty: list[int] = []
        self.args: tuple[Any, ...] = ()
        self.kwargs: dict[str, Any] = {}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        clock, function = time.perf_counter_ns, self.function
        t0 = clock()
        _nothing(*args, **kwargs)
        t1 = clock()
        result = function(*args, **kwargs)
        t2 = clock()
        function(*args, **kwargs)
        t3 = clock()
        self.empty.append(t1 - t0)
        self.first.append(t2 - t1)
        self.again.append(t3 - t2)
        self.args, self.kwargs = args, kwargs
        return result

    def hot(self) -> float:
        function, args, kwargs = self.function, self.args, self.kwargs
        return min(timeit.repeat(lambda: function(*args, **kwargs), number=2000, repeat=5)) / 2000 * 1e9


def _steps(mode: str, calls: int) -> None:
    """Each step of ``_STEPS`` timed where it runs, in a worker of the timed bench."""
    clock = time.perf_counter_ns
    taken: dict[str, list[int]] = {}

    def timed(function: Callable[..., Any], times: list[int]) -> Callable[..., Any]:
        def step(*args: Any, **kwargs: Any) -> Any:
            started = clock()
            try:
                return function(*args, **kwargs)
            finally:
                times.append(clock() - started)
        return step

    for owner, name in _STEPS:
        times = taken[f"{owner.__name__.rsplit('.', 1)[-1]}.{name}"] = []
        setattr(owner, name, timed(getattr(owner, name), times))
    hooks_overhead._worker(mode, calls, rotate=0, control=False, side="both")
    round_trips = len(taken["WireObserver.dispatched"]) or len(taken["ClientInstrumentation._request_calls"])
    print(f"{mode} era, {round_trips} hooked round trips (warm-up included); ns")
    print(f"{'step':38} {'a round trip':>12} {'median':>7} {'mean':>7} {'adds':>7}")
    total = 0.0
    for name, times in taken.items():
        if times:
            adds = sum(times) / round_trips
            total += adds
            print(f"{name:38} {len(times) / round_trips:12.1f} {statistics.median(times):7.0f} "
                  f"{statistics.fmean(times):7.0f} {adds:7.0f}")
    print(f"{'all steps':38} {'':12} {'':7} {'':7} {total:7.0f}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--mode", default="default")
    parser.add_argument("--methods", action="store_true", help="time the hooks' steps where they run")
    args = parser.parse_args()
    if args.methods:
        _steps(args.mode, args.calls)
        return
    timed: dict[str, _Timed] = {}
    for module, name in _MEASURED:
        timed[f"{module.__name__.rsplit('.', 1)[-1]}.{name}"] = stand_in = _Timed(getattr(module, name))
        setattr(module, name, stand_in)
    hooks_overhead._worker(args.mode, args.calls, rotate=0, control=False, side="both")
    print(f"{args.mode} era, {args.calls} calls a configuration; medians in ns")
    print(f"{'function (where called)':28} {'calls':>6} {'in situ':>8} {'again':>7} {'empty':>6} {'hot':>6} "
          f"{'in situ/hot':>11}")
    for name, t in timed.items():
        if not t.first:
            continue
        first, again, empty, hot = (statistics.median(t.first), statistics.median(t.again),
                                    statistics.median(t.empty), t.hot())
        print(f"{name:28} {len(t.first):6d} {first:8.0f} {again:7.0f} {empty:6.0f} {hot:6.0f} {first / hot:11.1f}")


if __name__ == "__main__":
    main()
