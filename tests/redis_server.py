"""A real Redis (Debian's redis-server, installed by `make test`) for the tests, on a Unix socket in a
fresh directory: no port to race for, no persistence, stopped and started again on the same socket."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest


class RedisServer:
    def __init__(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.skip("SKIPPED: redis-server is not installed (`make system-deps` installs Debian's redis-server)")
        self._binary = binary
        self._dir = Path(tempfile.mkdtemp(prefix="redis-"))
        self.socket = self._dir / "redis.sock"
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"unix://{self.socket}"

    def start(self) -> None:
        self._proc = subprocess.Popen([self._binary, "--port", "0", "--unixsocket", str(self.socket),
                                       "--unixsocketperm", "700", "--save", "", "--appendonly", "no",
                                       "--dir", str(self._dir)],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while not self.socket.exists():
            if self._proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("redis-server did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            self._proc.wait(timeout=10)
        self.socket.unlink(missing_ok=True)

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self._dir, ignore_errors=True)
