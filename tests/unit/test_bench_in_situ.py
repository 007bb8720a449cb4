"""The in-situ hooks bench (``bench/hooks_in_situ.py``) still runs against the hooks as they are: it
stands in for functions by module and name, which a refactor of the hooks can move from under it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

_BENCH = Path(__file__).resolve().parents[2] / "bench" / "hooks_in_situ.py"


@pytest.mark.parametrize("flags", [(), ("--methods",)], ids=["functions", "methods"])
def test_in_situ_bench_finds_every_function_it_times_and_reports(flags: tuple[str, ...]) -> None:
    done = subprocess.run([sys.executable, str(_BENCH), "--calls", "3", "--mode", "legacy", *flags],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("legacy era")
    if flags:
        assert lines[-1].startswith("all steps") and float(lines[-1].split()[-1]) > 0
    else:
        assert any(line.startswith("client.read_message") for line in lines)
