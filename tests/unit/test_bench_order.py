"""The timed hooks bench (``bench/hooks_overhead.py``) favours no configuration and claims no more than it
measured: what ran before a call, and how long ago its own configuration last ran, fall alike on all
three; a median over workers comes with an interval that holds it as often as it says, and a target is
decided only when that interval falls on one side of it."""

from __future__ import annotations

import importlib.util
import itertools
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path
from types import ModuleType

import pytest

_BENCH = Path(__file__).resolve().parents[2] / "bench" / "hooks_overhead.py"


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("hooks_overhead", _BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_configuration_comes_after_every_pair_of_calls_once_a_round() -> None:
    bench = _bench()
    order, n = bench._ORDER, len(bench._ORDER)
    triples = Counter(tuple(order[(i + k) % n] for k in range(3)) for i in range(n))
    assert set(triples) == set(itertools.product(bench.CONFIGURATIONS, repeat=3))
    assert set(triples.values()) == {1}


def test_every_configuration_waits_as_long_since_its_own_last_call() -> None:
    bench = _bench()
    order, n = bench._ORDER, len(bench._ORDER)

    def gaps(configuration: str) -> list[int]:
        at = [i for i, c in enumerate(order) if c == configuration]
        return sorted((at[(k + 1) % len(at)] - at[k]) % n or n for k in range(len(at)))

    assert gaps("A") == gaps("S") == gaps("H")


def test_median_interval_takes_the_order_statistics_a_fair_coin_allows() -> None:
    bench = _bench()
    # 24 workers: fewer than 7 heads in 24 tosses has a chance of 1.1 %, fewer than 8 of 3.2 %
    assert bench.median_interval([float(i) for i in range(24, 0, -1)]) == (7.0, 18.0)
    # 6 workers: no heads at all already has a chance of 1.6 %, fewer than 2 of 10.9 %
    assert bench.median_interval([6.0, 1.0, 5.0, 2.0, 4.0, 3.0]) == (1.0, 6.0)


def test_median_interval_holds_the_median_at_least_as_often_as_it_claims() -> None:
    bench = _bench()
    rng = random.Random(16)
    trials, held = 2000, 0
    for _ in range(trials):
        low, high = bench.median_interval([rng.lognormvariate(0.0, 0.5) for _ in range(24)])
        held += low <= 1.0 <= high  # the lognormal's median is exp(0)
    assert held / trials >= 0.96  # it claims 97.7 % for 24 workers; 2,000 trials sway by about 0.3 %


def test_median_interval_refuses_too_few_workers() -> None:
    with pytest.raises(ValueError, match="too few"):
        _bench().median_interval([1.0, 2.0, 3.0, 4.0, 5.0])


def test_a_target_is_decided_only_when_the_whole_interval_falls_on_one_side() -> None:
    verdict = _bench().verdict
    assert verdict(1.01, 1.03, 1.03) == "met"
    assert verdict(1.031, 1.05, 1.03) == "missed"
    assert verdict(1.02, 1.04, 1.03) == "undecided"


def test_apart_cpu_figures_read_the_servers_process_not_the_workers() -> None:
    """``--apart`` adds the servers' CPU time to the client's: the other process's clock, read from here."""
    busy = ("import sys, time\n"
            "n = 0\n"
            "while time.process_time() < 0.2: n += 1\n"
            "print(time.process_time(), flush=True)\n"
            "sys.stdin.read()\n")
    with subprocess.Popen([sys.executable, "-c", busy], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          text=True) as child:
        assert child.stdout is not None and child.stdin is not None
        own = float(child.stdout.readline())  # what the child had used when it said so; it then blocks reading
        read = _bench()._cpu_clock(child.pid)()
        child.stdin.close()
    assert own <= read < own + 0.15  # the child's clock, which this process's own would not follow
