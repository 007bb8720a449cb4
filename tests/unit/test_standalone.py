"""A fresh clone stands alone: nothing it tracks points outside it, and its documents' links resolve inside it."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# spelled in pieces so that this file does not match itself
OUTSIDE = ("../" + "shared", "/work/" + "shared")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def _tracked() -> list[Path]:
    git = shutil.which("git")
    assert git, "the standalone checks read the tracked files with git"
    listing = subprocess.run([git, "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return [ROOT / name for name in listing.decode().split("\0") if name]


def test_no_tracked_file_points_outside_the_repository():
    offenders = []
    for path in _tracked():
        if not path.is_file():  # deleted in the work tree, not yet committed
            continue
        text = path.read_bytes().decode("utf-8", errors="replace")
        offenders += [f"{path.relative_to(ROOT)}: {needle}" for needle in OUTSIDE if needle in text]
    assert offenders == []


def test_every_relative_link_in_the_documents_resolves_inside_the_repository():
    broken = []
    for doc in (p for p in _tracked() if p.suffix == ".md" and p.is_file()):
        for target in LINK.findall(doc.read_text()):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                continue
            resolved = (doc.parent / target).resolve()
            if not resolved.is_relative_to(ROOT) or not resolved.exists():
                broken.append(f"{doc.relative_to(ROOT)} -> {target}")
    assert broken == []


def test_the_incident_page_defines_the_three_legs_the_code_refers_to():
    incident = (ROOT / "docs" / "incident.md").read_text()
    legs = re.findall(r"^([123])\. \*\*(.+?)\.\*\*", incident, re.M)
    assert [number for number, _ in legs] == ["1", "2", "3"]
