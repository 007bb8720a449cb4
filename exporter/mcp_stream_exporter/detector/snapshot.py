"""The detector's state in SQLite: written periodically and at shutdown, read back at start.

A call pending across a restart is still flagged when its grace period runs out: the ledger (calls,
resumes, grace-period timers, look-ups) and the findings are the snapshot. Counters are not: Prometheus
handles a counter reset. One row, replaced in one transaction, so a crash mid-write leaves the previous
snapshot whole; a crash (SIGKILL) between snapshots loses at most the interval's spans. JSON, never
pickle: a snapshot file is data, not code. Tokens never reach the ledger, so they never reach the file.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
import time
from contextlib import closing
from pathlib import Path

from mcp_stream_exporter.detector.detector import Detector

log = logging.getLogger("mcp_stream_exporter.detector")
_FORMAT = 1
_SCHEMA = """CREATE TABLE IF NOT EXISTS snapshot (
    id INTEGER PRIMARY KEY CHECK (id = 1), format INTEGER NOT NULL, taken_ns INTEGER NOT NULL,
    ledger TEXT NOT NULL, findings TEXT NOT NULL)"""


class Snapshots:
    """Save ``detector``'s state to ``path`` every ``interval_s`` seconds and at :meth:`close`."""

    def __init__(self, detector: Detector, path: str | Path, interval_s: float = 30.0) -> None:
        self.detector = detector
        self.path = Path(path)
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        with closing(self._connect()) as db:
            db.execute(_SCHEMA)

    def _connect(self) -> sqlite3.Connection:
        return sqlite3.connect(self.path, timeout=10, isolation_level=None)

    def restore(self) -> bool:
        """Load the last snapshot into the (fresh) detector; False when there is none to load."""
        with closing(self._connect()) as db:
            row = db.execute("SELECT format, taken_ns, ledger, findings FROM snapshot WHERE id = 1").fetchone()
        if row is None:
            return False
        fmt, taken_ns, ledger, findings = row
        if fmt != _FORMAT:
            log.warning("snapshot ignored: unknown format", extra={"format": fmt, "path": str(self.path)})
            return False
        with self.detector.lock:
            self.detector.ledger.load(json.loads(ledger))
            self.detector.findings.load(json.loads(findings))
        self.detector.metrics.snapshot_time.set(taken_ns / 1e9)
        log.info("snapshot restored", extra={"path": str(self.path), "taken_at": taken_ns / 1e9,
                                             "sessions": self.detector.ledger.sessions,
                                             "calls": self.detector.ledger.calls})
        return True

    def save(self) -> int:
        """Write the detector's state now; returns the snapshot's size in bytes."""
        with self.detector.lock:
            taken_ns = self.detector.clock()
            ledger = json.dumps(self.detector.ledger.dump(), separators=(",", ":"))
            findings = json.dumps(self.detector.findings.dump(), separators=(",", ":"))
        with closing(self._connect()) as db:
            db.execute("BEGIN IMMEDIATE")
            db.execute("INSERT OR REPLACE INTO snapshot (id, format, taken_ns, ledger, findings) "
                       "VALUES (1, ?, ?, ?, ?)", (_FORMAT, taken_ns, ledger, findings))
            db.execute("COMMIT")
        self.detector.metrics.snapshot_time.set(taken_ns / 1e9)
        return len(ledger) + len(findings)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="mcp-stream-detector-snapshot", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                started = time.monotonic()
                size = self.save()
                log.debug("snapshot written", extra={"bytes": size, "seconds": time.monotonic() - started})
            except (sqlite3.Error, OSError) as exc:  # keep serving; the timestamp metric goes stale
                log.error("snapshot failed", extra={"error": str(exc), "path": str(self.path)})

    def close(self) -> None:
        """Stop the periodic writes and write the final snapshot (after ingest has drained)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.save()
