"""Findings: what a rule concluded, with the evidence an on-call engineer needs to confirm it.

A finding's id is a hash of (rule, session, subject): the client's and the server's spans of one
loss make the same id, so one loss is one finding, and replicas and restarts agree on it.

Bounded in bytes: a finding's evidence is cut to a few KiB (lists and strings shortened, marked
``truncated``), its trace, span and role lists to a few entries, and the store drops its oldest
findings past a count or an estimate of its size.
"""

from __future__ import annotations

import hashlib
from _json import encode_basestring_ascii, make_encoder
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

MAX_EVIDENCE_BYTES = 4096  # as JSON
_MAX_ITEMS = 16  # items kept of a list in cut evidence
_MAX_CHARS = 256  # characters kept of a string in cut evidence
_MAX_REFS = 8  # trace ids, span ids, roles kept on a finding
_FINDING_BYTES = 1000  # a finding beyond its evidence and lists (measured with tracemalloc, rounded up)
_BYTES_PER_JSON_BYTE = 8  # evidence and lists as Python objects, per byte of their JSON (ids: ~2, numbers: ~10)


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

    def merge(self, other: Finding) -> int:
        """The other side's view of the same finding: more roles and evidence, never a second one;
        returns the finding's new size estimate."""
        for role in other.roles:
            if role not in self.roles:
                self.roles.append(role)
        for key, value in other.evidence.items():
            self.evidence.setdefault(key, value)
        self.trace_ids.extend(t for t in other.trace_ids if t not in self.trace_ids)
        self.span_ids.extend(s for s in other.span_ids if s not in self.span_ids)
        return self.bound()

    def bound(self) -> int:
        """Cut the evidence and the lists to their bounds; returns an estimate of what the finding then
        holds, in bytes (the evidence is serialised once, for both)."""
        self.evidence, evidence_json = _bounded(self.evidence)
        del self.roles[_MAX_REFS:], self.trace_ids[_MAX_REFS:], self.span_ids[_MAX_REFS:]
        refs = (*self.roles, *self.trace_ids, *self.span_ids)
        refs_json = len("".join(refs)) + 3 * len(refs)
        return _FINDING_BYTES + _BYTES_PER_JSON_BYTE * (evidence_json + refs_json)

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

    def matches(self, f: Finding, tool_label: Callable[[str | None], str]) -> bool:
        """``tool`` matches a finding's tool by its name, or by the metrics' label it was counted under (``other``
        past the policy's or the first tools seen): an alert's link by its labels finds what it counted."""
        return ((self.rule is None or f.rule == self.rule)
                and (self.tool is None or f.tool == self.tool or tool_label(f.tool) == self.tool)
                and (self.severity is None or f.severity == self.severity)
                and (self.since_ns is None or f.detected_ns >= self.since_ns)
                and (self.until_ns is None or f.detected_ns < self.until_ns))


def _bounded(evidence: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """``evidence`` if it fits ``MAX_EVIDENCE_BYTES`` as JSON, else cut to fit and marked ``truncated``;
    and its size as JSON."""
    size = _json_size(evidence)
    if size <= MAX_EVIDENCE_BYTES:
        return evidence, size
    cut = {str(key)[:64]: _cut(value) for key, value in list(evidence.items())[:_MAX_ITEMS]}
    cut["truncated"] = True
    size = _json_size(cut)
    if size <= MAX_EVIDENCE_BYTES:
        return cut, size
    short = {"truncated": True, "keys": [str(key)[:64] for key in list(evidence)[:_MAX_ITEMS]]}
    return short, _json_size(short)


def _cut(value: Any) -> Any:
    if isinstance(value, str):
        return value[:_MAX_CHARS]
    if isinstance(value, (list, tuple)):
        return [_cut(v) for v in value[:_MAX_ITEMS]]
    if isinstance(value, dict):
        return {str(k)[:64]: _cut(v) for k, v in list(value.items())[:_MAX_ITEMS]}
    return value


# the C encoder json.dumps(value, default=str, separators=(",", ":")) runs, made once: JSONEncoder.encode
# builds one (and its closures) per call, which cost more than encoding a finding's evidence
_ENCODE = make_encoder(None, str, encode_basestring_ascii, None, ":", ",", False, False, True)


def _json_size(value: Any) -> int:
    return len("".join(_ENCODE(value, 0)))


class FindingStore:
    """The most recent findings, bounded in count and in estimated bytes; the oldest are dropped first
    (and counted)."""

    def __init__(self, capacity: int, max_bytes: int, tool_label: Callable[[str | None], str]) -> None:
        self._capacity = capacity
        self._tool_label = tool_label  # the metrics' tool label of a finding's tool (``Query.matches``)
        self._max_bytes = max_bytes
        self._findings: OrderedDict[str, Finding] = OrderedDict()
        # the finding of an id, if held: the map's own look-up (the rules ask for every event that repeats one)
        self.get: Callable[[str], Finding | None] = self._findings.get
        self._charged: dict[str, int] = {}
        self.bytes = 0
        self.dropped = 0

    def add(self, finding: Finding) -> bool:
        """True when the finding is new; an existing one absorbs the new view."""
        existing = self._findings.get(finding.id)
        if existing is not None:
            self._charge(existing.id, existing.merge(finding))
            return False
        self._findings[finding.id] = finding
        self._charge(finding.id, finding.bound())
        while len(self._findings) > self._capacity or (self.bytes > self._max_bytes and len(self._findings) > 1):
            self.bytes -= self._charged.pop(self._findings.popitem(last=False)[0])
            self.dropped += 1
        return True

    def _charge(self, fid: str, charge: int) -> None:
        self.bytes += charge - self._charged.get(fid, 0)
        self._charged[fid] = charge

    def query(self, q: Query) -> tuple[list[Finding], int]:
        """A page, newest first, and the number of matches."""
        matching = [f for f in reversed(self._findings.values()) if q.matches(f, self._tool_label)]
        return matching[q.offset:q.offset + q.limit], len(matching)

    def __iter__(self) -> Iterator[Finding]:
        return iter(list(self._findings.values()))

    def __len__(self) -> int:
        return len(self._findings)

    def dump(self) -> list[dict[str, Any]]:
        """Oldest first, as JSON-able data (snapshot.py)."""
        return [asdict(f) for f in self._findings.values()]

    def load(self, rows: list[dict[str, Any]]) -> None:
        self._findings.clear()
        self._charged.clear()
        self.bytes = 0
        for row in rows:
            self.add(Finding(**row))
