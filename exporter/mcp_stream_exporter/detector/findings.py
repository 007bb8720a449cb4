"""Findings: what a rule concluded, with the evidence an on-call engineer needs to confirm it.

A finding's id is a hash of (rule, session, subject): the client's and the server's spans of one
loss make the same id, so one loss is one finding, and replicas and restarts agree on it.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any


def finding_id(rule: str, scope: str, subject: str) -> str:
    return hashlib.sha256(f"{rule}\x00{scope}\x00{subject}".encode()).hexdigest()[:20]


@dataclass(slots=True)
class Finding:
    id: str
    rule: str
    severity: str
    era: str
    tool: str | None
    session_id: str | None
    request_id: str | None
    detected_ns: int
    summary: str
    roles: list[str] = field(default_factory=list)
    evidence: dict[str, Any] = field(default_factory=dict)
    trace_ids: list[str] = field(default_factory=list)
    span_ids: list[str] = field(default_factory=list)
    caused_by: str | None = None

    def merge(self, other: Finding) -> None:
        """The other side's view of the same finding: more roles and evidence, never a second one."""
        for role in other.roles:
            if role not in self.roles:
                self.roles.append(role)
        for key, value in other.evidence.items():
            self.evidence.setdefault(key, value)
        self.trace_ids.extend(t for t in other.trace_ids if t not in self.trace_ids)
        self.span_ids.extend(s for s in other.span_ids if s not in self.span_ids)

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id, "rule": self.rule, "severity": self.severity, "era": self.era, "tool": self.tool,
            "session_id": self.session_id, "request_id": self.request_id,
            "detected_at": self.detected_ns / 1e9, "summary": self.summary, "roles": self.roles,
            "evidence": self.evidence, "trace_ids": self.trace_ids, "span_ids": self.span_ids,
            "caused_by": self.caused_by,
        }


@dataclass(frozen=True, slots=True)
class Query:
    rule: str | None = None
    tool: str | None = None
    severity: str | None = None
    since_ns: int | None = None
    until_ns: int | None = None
    offset: int = 0
    limit: int = 50

    def matches(self, f: Finding) -> bool:
        return ((self.rule is None or f.rule == self.rule) and (self.tool is None or f.tool == self.tool)
                and (self.severity is None or f.severity == self.severity)
                and (self.since_ns is None or f.detected_ns >= self.since_ns)
                and (self.until_ns is None or f.detected_ns < self.until_ns))


class FindingStore:
    """The most recent findings, bounded; older ones are dropped first (and counted)."""

    def __init__(self, capacity: int = 10_000) -> None:
        self._capacity = capacity
        self._findings: OrderedDict[str, Finding] = OrderedDict()
        self.dropped = 0

    def add(self, finding: Finding) -> bool:
        """True when the finding is new; an existing one absorbs the new view."""
        existing = self._findings.get(finding.id)
        if existing is not None:
            existing.merge(finding)
            return False
        self._findings[finding.id] = finding
        while len(self._findings) > self._capacity:
            self._findings.popitem(last=False)
            self.dropped += 1
        return True

    def get(self, fid: str) -> Finding | None:
        return self._findings.get(fid)

    def query(self, q: Query) -> tuple[list[Finding], int]:
        """A page, newest first, and the number of matches."""
        matching = [f for f in reversed(self._findings.values()) if q.matches(f)]
        return matching[q.offset:q.offset + q.limit], len(matching)

    def __iter__(self) -> Iterator[Finding]:
        return iter(list(self._findings.values()))

    def __len__(self) -> int:
        return len(self._findings)

    def dump(self) -> list[dict[str, Any]]:
        """Oldest first, as JSON-able data (snapshot.py)."""
        return [asdict(f) for f in self._findings.values()]

    def load(self, rows: list[dict[str, Any]]) -> None:
        self._findings = OrderedDict((row["id"], Finding(**row)) for row in rows[-self._capacity:])
