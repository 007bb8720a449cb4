"""A TCP proxy on 127.0.0.1 that really cuts connections: the drop in the incident."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable


class CutProxy:
    """Forwards bytes both ways; once armed, aborts every live connection after the server sends
    ``pattern``. The abort is a TCP reset to both peers, not a clean close."""

    def __init__(self, upstream_port: int, *, host: str = "127.0.0.1") -> None:
        self.upstream_port = upstream_port
        self.host = host
        self.port = 0
        self.cuts = 0
        self._pattern: bytes | None = None
        self._on_cut: Callable[[], None] | None = None
        self._live: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = set()
        self._server: asyncio.Server | None = None
        self._open = asyncio.Event()
        self._open.set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, self.host, 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            self._cut_all()
            await self._server.wait_closed()

    def arm(self, pattern: bytes, on_cut: Callable[[], None] | None = None) -> None:
        """Cut everything right after the first server->client chunk containing ``pattern``."""
        self._pattern = pattern
        self._on_cut = on_cut

    def hold(self) -> None:
        """New connections wait at the proxy until :meth:`release`: a test orders another client's work
        between a cut and the reconnect that follows it, on state rather than on a sleep."""
        self._open.clear()

    def release(self) -> None:
        self._open.set()

    def _cut_all(self) -> None:
        for client, upstream in list(self._live):
            client.transport.abort()
            upstream.transport.abort()
        self._live.clear()

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        await self._open.wait()
        try:
            up_r, up_w = await asyncio.open_connection(self.host, self.upstream_port)
        except OSError:
            client_w.close()
            return
        pair = (client_w, up_w)
        self._live.add(pair)
        try:
            await asyncio.gather(self._pump(client_r, up_w, watch=False),
                                 self._pump(up_r, client_w, watch=True))
        finally:
            self._live.discard(pair)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, watch: bool) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
                if watch and self._pattern is not None and self._pattern in data:
                    self._pattern = None
                    self.cuts += 1
                    if self._on_cut is not None:
                        self._on_cut()
                    self._cut_all()
                    return
        except (ConnectionError, OSError):
            pass
        finally:
            with contextlib.suppress(Exception):
                writer.close()
