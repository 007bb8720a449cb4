"""The README's metrics reference names exactly the metrics the detector exports."""

from __future__ import annotations

import re
from pathlib import Path

from mcp_stream_exporter.detector import Detector

README = Path(__file__).resolve().parents[2] / "README.md"


def test_the_readme_metrics_reference_matches_the_exported_metrics():
    documented = set(re.findall(r"^\| `([a-z_]+)` \| (?:counter|gauge|histogram) \|", README.read_text(), re.M))
    exported = set()
    for family in Detector().registry.collect():
        exported.add(f"{family.name}_total" if family.type == "counter" else family.name)
    assert documented == exported
