"""The timed hooks bench's call order favours no configuration: what ran before a call, and how long ago
its own configuration last ran, fall alike on all three (``bench/hooks_overhead.py``)."""

from __future__ import annotations

import importlib.util
import itertools
from collections import Counter
from pathlib import Path
from types import ModuleType

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
