"""The detector's state in SQLite: written periodically and at shutdown, read back at start.

A call pending across a restart is still flagged when its grace period runs out: the ledger (calls,
resumes, grace-period timers, look-ups) and the findings are the snapshot; not after a crash, or a downtime longer
than the span senders retry, when spans of those calls may be lost for good (``_unjudged``). Counters are not:
Prometheus handles a counter reset, but a finding counted after the last scrape is counted again
(``_count_unscraped``). JSON, never pickle: a snapshot file is data, not code. Tokens never reach
the ledger (and token-shaped values are redacted at ingest), so they never reach the file.

It scales with the ledger and never stalls ingest: the state is written as many rows of at most about
a MiB, each taken under the detector's lock for one chunk of sessions (or findings, timers, look-ups)
and serialised outside it. The retry window is taken before the sessions, the rest after them: a
session is never newer than the timers, look-ups and findings restored with it, nor older than the
retry window. All rows of a snapshot are replaced in one transaction, so a crash mid-write leaves the
previous snapshot whole; a crash (SIGKILL) between snapshots loses at most the interval's spans. A
failed write is logged with its cause and counted (``mcp_stream_detector_errors_total{where="snapshot"}``),
and the next interval tries again.

At start: a file that is not a readable snapshot is moved aside (``<path>.corrupt-<time>``) and the
detector starts empty, saying so; a file of a newer format is left untouched and never overwritten;
a file another detector holds (an exclusive ``flock`` on ``<path>.lock``) is refused.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import closing
from dataclasses import asdict
from pathlib import Path
from typing import Any

from mcp_stream_exporter.detector.detector import Detector

log = logging.getLogger("mcp_stream_exporter.detector")
# 1: one row holding everything; 2: rows of chunks; 3: each re-issue look-up holds its issues; 4: a call's give-ups
# and the server's word on its tool under ``flags`` (1 to 3: read; a detector of before refuses a snapshot of 4).
# A call's ``resumed`` keeps its shape since, but its refusals' times are their starts and its other resumes' their
# ends (they were the other way round): a row of before is read as it is, a close approximation of a rare case
_FORMAT = 4
_CHUNK_BYTES = 1024 * 1024  # a row's JSON, about
_ALERT_WINDOW_NS = 600 * 10**9  # what alerts/mcp-stream-exporter.yaml's recording rules count a finding over
_SESSIONS_PER_LOCK = 256  # sessions copied per hold of the detector's lock
_FINDINGS_PER_LOCK = 512
_SCHEMA = ("CREATE TABLE IF NOT EXISTS meta (id INTEGER PRIMARY KEY CHECK (id = 1), format INTEGER NOT NULL, "
           "taken_ns INTEGER NOT NULL)",
           "CREATE TABLE IF NOT EXISTS rows (seq INTEGER PRIMARY KEY, kind TEXT NOT NULL, data TEXT NOT NULL)")
_UNREADABLE = (sqlite3.DatabaseError, ValueError, KeyError, TypeError, IndexError, AttributeError, OverflowError)


class SnapshotLocked(RuntimeError):
    """Another detector process writes to the same snapshot file."""


class Snapshots:
    """Save ``detector``'s state to ``path`` every ``interval_s`` seconds and at :meth:`close`. ``senders_retry_s``:
    how long the span senders retry a batch the detector did not take (an OTel SDK's OTLP exporter 10 s by default,
    a Collector's 300 s): a downtime longer than that loses spans for good."""

    def __init__(self, detector: Detector, path: str | Path, interval_s: float = 30.0,
                 senders_retry_s: float = 10.0) -> None:
        self.detector = detector
        self.path = Path(path)
        self.interval_s = interval_s
        self.senders_retry_s = senders_retry_s
        self._final = False  # the snapshot read was written at a shutdown, nothing taken in after it
        self._scraped_ns: int | None = None  # when the detector that wrote it was last scraped (None: not said)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock_file: int | None = None
        self._refused = False  # a newer format: never overwritten

    # --- the file lock: one writer per path ---

    def _hold_lock(self) -> None:
        if self._lock_file is not None:
            return
        fd = os.open(f"{self.path}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip()
            os.close(fd)
            raise SnapshotLocked(f"{self.path} is in use by another detector (pid {holder or 'unknown'}); "
                                 "give each detector its own --snapshot-path") from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._lock_file = fd

    def _connect(self) -> sqlite3.Connection:
        return sqlite3.connect(self.path, timeout=10, isolation_level=None)

    # --- restore ---

    def restore(self) -> bool:
        """Load the last snapshot into the (fresh) detector; False when there is none to load. Never
        raises for the file's content; raises :class:`SnapshotLocked` if another detector holds it."""
        try:
            self._hold_lock()
        except OSError as exc:
            self._failed("snapshot unavailable: starting empty, writes will be retried", exc)
            return False
        if not self.path.exists():
            return False
        try:
            taken_ns = self._read()
        except (OSError, sqlite3.OperationalError) as exc:  # cannot open or read it: not known to be corrupt
            self._failed("snapshot unavailable: starting empty, writes will be retried", exc)
            return False
        except _UNREADABLE as exc:
            self._set_aside(exc)
            return False
        if taken_ns is None:
            return False
        with self.detector.lock:  # its graces resume where they were: what came in the downtime comes now
            downtime = self.detector.clock() - taken_ns
            self.detector.ledger.postpone(downtime)
            if not self._final or downtime > self.senders_retry_s * 1e9:
                self._unjudged(downtime)
            if self._scraped_ns is not None:
                self._count_unscraped(self._scraped_ns)
        self.detector.metrics.snapshot_time.set(taken_ns / 1e9)
        log.info("snapshot restored", extra={"path": str(self.path), "taken_at": taken_ns / 1e9,
                                             "sessions": self.detector.ledger.sessions,
                                             "calls": self.detector.ledger.calls})
        return True

    def _count_unscraped(self, scraped_ns: int) -> None:
        """Count again the findings the detector that wrote the snapshot counted after it was last scraped: no
        Prometheus saw them, and this process's counters start at 0, so they would page nowhere. Only those of the
        alert rules' window (10 minutes): an older one would page as new. One Prometheus saw, counted again, pages
        as it would have: its count was there already."""
        detector = self.detector
        detector.scraped_ns = scraped_ns
        since = max(scraped_ns, detector.clock() - _ALERT_WINDOW_NS)
        for finding in detector.findings:
            if finding.detected_ns > since:
                detector.metrics.finding(finding)
        detector.metrics.flush()

    def _unjudged(self, downtime_ns: int) -> None:
        """Spans of the calls owed a result as the snapshot was taken may be lost for good: taken in after it and
        before a crash, or sent in a downtime their senders gave up retrying. Judged, those calls would page as lost
        if their result came then: none is, as none would be without a snapshot. Counted and logged."""
        unjudged = self.detector.ledger.unjudge()
        self.detector.metrics.unjudged_calls.inc(unjudged)
        log.warning("snapshot restored after a crash or a downtime past the senders' retry: the calls it held owed "
                    "a result are not judged (their spans may be lost)",
                    extra={"calls": unjudged, "final": self._final, "downtime_s": round(downtime_ns / 1e9, 1),
                           "senders_retry_s": self.senders_retry_s})

    def _read(self) -> int | None:
        with closing(self._connect()) as db:
            tables = {name for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            if "meta" in tables:
                meta = db.execute("SELECT format, taken_ns FROM meta WHERE id = 1").fetchone()
            elif "snapshot" in tables:
                meta = db.execute("SELECT format, taken_ns FROM snapshot WHERE id = 1").fetchone()
            else:
                meta = None
            if meta is None:
                if tables - {"meta", "rows", "snapshot"}:
                    raise ValueError(f"not a snapshot: tables {sorted(tables)[:5]}")
                return None
            fmt, taken_ns = int(meta[0]), int(meta[1])
            if fmt > _FORMAT:
                self._refused = True
                self.detector.metrics.errors.labels("snapshot").inc()
                log.error("snapshot of a newer format: starting empty, and it will not be overwritten; run the "
                          "newer version or move the file", extra={"format": fmt, "path": str(self.path)})
                return None
            with self.detector.lock:
                try:
                    if fmt == 1:
                        self._final = True  # it says not: judged, as it was then
                        ledger, findings = db.execute("SELECT ledger, findings FROM snapshot WHERE id = 1").fetchone()
                        self.detector.ledger.load(json.loads(ledger))
                        self.detector.findings.load(json.loads(findings))
                    else:
                        self._load_rows(db)
                except BaseException:
                    self._empty()  # nothing half-loaded
                    raise
        return taken_ns

    def _load_rows(self, db: sqlite3.Connection) -> None:
        ledger = self.detector.ledger
        rest: dict[str, Any] = {"sdk_spans": [], "issued": [], "timers": []}
        found: list[dict[str, Any]] = []
        self._empty()
        for kind, data in db.execute("SELECT kind, data FROM rows ORDER BY seq"):
            items = json.loads(data)
            if kind == "sessions":
                for session in items:
                    ledger.load_session(session)
            elif kind == "findings":
                found.extend(items)
            elif kind == "rest":
                for item in items:
                    rest.update(item)
            elif kind in ("sdk_spans", "issued", "timers"):
                rest[kind].extend(items)
            else:
                raise ValueError(f"unknown row kind {kind[:40]!r}")
        self._final = rest.get("final", True) is True  # a snapshot of before says not: judged, as it was then
        scraped_ns = rest.get("scraped_ns")
        self._scraped_ns = scraped_ns if isinstance(scraped_ns, int) else None
        ledger.load_rest(rest)  # after the sessions: timers are checked against them
        self.detector.findings.load(found)

    def _empty(self) -> None:
        self.detector.ledger.load({"sessions": [], "evictions": {}, "sdk_spans": [], "issued": [], "timers": [],
                                   "seq": 0})
        self.detector.findings.load([])

    def _set_aside(self, exc: BaseException) -> None:
        aside = self.path.with_name(f"{self.path.name}.corrupt-{time.strftime('%Y%m%dT%H%M%S')}")
        try:
            self.path.rename(aside)
        except OSError as move:
            self._failed("snapshot unreadable and not moved aside: starting empty", move)
            self._refused = True  # never overwrite what could not be kept
            return
        self._failed("snapshot unreadable: moved aside, starting empty", exc, aside=str(aside))

    def _failed(self, message: str, exc: BaseException, **extra: str) -> None:
        self.detector.metrics.errors.labels("snapshot").inc()
        log.error(message, extra={"path": str(self.path), "error": f"{type(exc).__name__}: {exc}"[:500], **extra})

    # --- save ---

    def save(self, final: bool = False) -> int:
        """Write the detector's state now (``final``: at shutdown, ingest drained); returns the snapshot's size in
        bytes (0 if refused)."""
        if self._refused:
            return 0
        self._hold_lock()
        detector = self.detector
        with detector.lock:  # cheap copies only; serialising happens outside the lock
            scopes = detector.ledger.session_scopes()
            # the retry window as the sessions begin to be copied, never newer than they are: a batch that comes
            # again after a crash, applied while they were copied, is applied again rather than taken as seen
            seen = detector.ledger.dump_seen()
        size = 0
        with closing(self._connect()) as db:
            for statement in _SCHEMA:
                db.execute(statement)
            db.execute("BEGIN IMMEDIATE")
            try:
                db.execute("DELETE FROM rows")
                rows = _Rows(db)
                rows.add_all("sessions", self._chunks(scopes, _SESSIONS_PER_LOCK, self._sessions))
                # Ingest goes on between the chunks: what a session's calls are owed (their timers), their look-ups
                # and the findings they name are taken after the last of them, so that none of it predates a session
                # copied with it (a clean end copied without its grace timer is never judged)
                with detector.lock:
                    taken_ns = detector.clock()
                    finding_ids = [f.id for f in detector.findings]
                    rest = {**detector.ledger.dump_rest(), "seen": seen, "final": final,
                            "scraped_ns": detector.scraped_ns}
                rows.add_all("findings", self._chunks(finding_ids, _FINDINGS_PER_LOCK, self._findings))
                for kind in ("sdk_spans", "issued", "timers"):
                    rows.add_all(kind, iter([rest.pop(kind)]))
                rows.add_all("rest", iter([[rest]]))
                db.execute("INSERT OR REPLACE INTO meta (id, format, taken_ns) VALUES (1, ?, ?)", (_FORMAT, taken_ns))
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
            size = rows.bytes
        detector.metrics.snapshot_time.set(taken_ns / 1e9)
        return size

    def _chunks(self, keys: list[str], per_lock: int,
                read: Callable[[list[str]], list[Any]]) -> Iterator[list[Any]]:
        for start in range(0, len(keys), per_lock):
            with self.detector.lock:
                chunk = read(keys[start:start + per_lock])
            yield chunk

    def _sessions(self, scopes: list[str]) -> list[Any]:
        dumped = (self.detector.ledger.dump_session(scope) for scope in scopes)
        return [s for s in dumped if s is not None]

    def _findings(self, ids: list[str]) -> list[Any]:
        found = (self.detector.findings.get(fid) for fid in ids)
        return [asdict(f) for f in found if f is not None]

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="mcp-stream-detector-snapshot", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._save_logged()

    def _save_logged(self, final: bool = False) -> None:
        try:
            started = time.monotonic()
            size = self.save(final)
            log.debug("snapshot written", extra={"bytes": size, "seconds": time.monotonic() - started})
        except Exception as exc:  # keep serving; the timestamp metric goes stale and the error is counted
            self._failed("snapshot failed", exc)

    def close(self, drained: bool = True) -> None:
        """Stop the periodic writes and write the last snapshot: final when ``drained`` (every span accepted applied;
        else what was left is lost, as at a crash)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)
        self._save_logged(final=drained)
        if self._lock_file is not None:
            os.close(self._lock_file)  # releases the flock
            self._lock_file = None


class _Rows:
    """Items of one kind written as rows of about ``_CHUNK_BYTES`` of JSON each."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db
        self.bytes = 0

    def add_all(self, kind: str, chunks: Iterator[list[Any]]) -> None:
        pending: list[str] = []
        held = 0
        for chunk in chunks:
            for item in chunk:
                text = json.dumps(item, separators=(",", ":"))
                pending.append(text)
                held += len(text)
                if held >= _CHUNK_BYTES:
                    self._write(kind, pending)
                    pending, held = [], 0
        if pending:
            self._write(kind, pending)

    def _write(self, kind: str, items: list[str]) -> None:
        data = "[" + ",".join(items) + "]"
        self._db.execute("INSERT INTO rows (kind, data) VALUES (?, ?)", (kind, data))
        self.bytes += len(data)
