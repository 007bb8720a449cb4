"""A TCP proxy on 127.0.0.1 that really cuts connections: the drop in the incident."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable


class CutProxy:
    """Forwards bytes both ways; once armed, aborts every live connection after the server sends
    ``pattern``. The abort is a TCP reset to both peers, not a clean close; or, armed ``half_open``, to the
    client alone."""

    def __init__(self, upstream_port: int, *, host: str = "127.0.0.1") -> None:
        self.upstream_port = upstream_port
        self.host = host
        self.port = 0
        self.cuts = 0
        self._pattern: bytes | None = None
        self._on_cut: Callable[[], None] | None = None
        self._half_open = False
        self._stall = False
        self._request_pattern: bytes | None = None  # ``arm_request``
        self._live: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = set()
        # connections whose client side was reset while the server's stays open (``arm(half_open=True)``)
        self._client_gone: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = set()
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

    def arm(self, pattern: bytes, on_cut: Callable[[], None] | None = None, *, half_open: bool = False,
            stall: bool = False) -> None:
        """Cut everything right after the first server->client chunk containing ``pattern``. ``half_open``: reset
        only the client's side of that chunk's connection and keep the server's open, reading and dropping what
        it sends after (a load balancer or NAT that lost the client): the server sees no disconnect. ``stall``: as
        ``half_open``, but the client's side is not reset either (packets dropped): its read just stalls."""
        self._pattern = pattern
        self._on_cut = on_cut
        self._half_open = half_open or stall
        self._stall = stall

    def arm_request(self, pattern: bytes) -> None:
        """Reset, both ways, the connection of the first client->server chunk containing ``pattern``, before it
        reaches the server: a request lost before its response began (a load balancer's reset), which the SDK
        client's transport does not survive."""
        self._request_pattern = pattern

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
            await asyncio.gather(self._pump(client_r, up_w, pair, watch=False),
                                 self._pump(up_r, client_w, pair, watch=True))
        finally:
            self._live.discard(pair)
            self._client_gone.discard(pair)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    pair: tuple[asyncio.StreamWriter, asyncio.StreamWriter], *, watch: bool) -> None:
        try:
            while data := await reader.read(65536):
                if pair in self._client_gone:
                    continue  # the server's bytes after its client was lost: read, never delivered
                if not watch and self._request_pattern is not None and self._request_pattern in data:
                    self._request_pattern = None
                    self.cuts += 1
                    pair[0].transport.abort()
                    pair[1].transport.abort()
                    return
                writer.write(data)
                await writer.drain()
                if watch and self._pattern is not None and self._pattern in data:
                    self._pattern = None
                    self.cuts += 1
                    if self._on_cut is not None:
                        self._on_cut()
                    if not self._half_open:
                        self._cut_all()
                        return
                    self._client_gone.add(pair)
                    if not self._stall:
                        writer.transport.abort()
        except (ConnectionError, OSError):
            pass
        finally:
            if watch or pair not in self._client_gone:  # the server's side of a lost client stays open
                with contextlib.suppress(Exception):
                    writer.close()
