"""promtool (Debian package prometheus, installed by `make test`) for the tests."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml


def promtool(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    binary = shutil.which("promtool")
    assert binary, "promtool is installed by `make test` (Debian package prometheus)"
    return subprocess.run([binary, *args], input=stdin, capture_output=True, text=True, check=False)


def check_rules(groups: dict[str, Any], workdir: Path) -> subprocess.CompletedProcess[str]:
    """``promtool check rules`` on a rule file's content."""
    path = workdir / "rules.yaml"
    path.write_text(yaml.safe_dump(groups))
    return promtool("check", "rules", str(path))
