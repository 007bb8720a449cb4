"""A body's content coding, undone on a copy: what a side reads of a compressed answer.

A proxy or a middleware may compress an MCP answer (``Content-Encoding: gzip``): the client's HTTP stack
decodes it before the SDK reads it, and the server's middleware encodes it after the SDK wrote it. The hooks
read the bytes on the wire, so they decode a copy, chunk by chunk, as the HTTP stack does; read as they come,
compressed bytes would be no frame and no result, and a healthy answer would look empty. gzip and deflate are
the codings ``httpx2`` accepts without optional packages; any other the hooks cannot read (``decoder_for``).
"""

from __future__ import annotations

import zlib

_GZIP = frozenset({"gzip", "x-gzip"})
_ALL = _GZIP | {"deflate", "identity"}


class Decoder:
    """Undoes a body's codings (gzip, deflate; several in the order they were applied), chunk by chunk. A body
    that does not decode reads as empty from there on: the HTTP stack fails it too, and its reader is told."""

    __slots__ = ("_broken", "_layers")

    def __init__(self, codings: list[str]) -> None:
        # undone in the reverse of the order they were applied; deflate is zlib-wrapped, or raw from some servers
        self._layers: list[_Layer] = [_Layer(coding) for coding in reversed(codings) if coding != "identity"]
        self._broken = False

    def __call__(self, chunk: bytes) -> bytes:
        if self._broken:
            return b""
        try:
            for layer in self._layers:
                chunk = layer.decode(chunk)
        except zlib.error:
            self._broken = True
            return b""
        return chunk

    def flush(self) -> bytes:
        """What the decoders still hold at the body's end."""
        if self._broken:
            return b""
        tail = b""
        try:
            for layer in self._layers:
                tail = layer.decode(tail) + layer.flush()
        except zlib.error:
            self._broken = True
            return b""
        return tail


class _Layer:
    __slots__ = ("_deflate", "_inflater", "_started")

    def __init__(self, coding: str) -> None:
        self._deflate = coding == "deflate"
        self._inflater = zlib.decompressobj(zlib.MAX_WBITS | 16 if coding in _GZIP else zlib.MAX_WBITS)
        self._started = False

    def decode(self, data: bytes) -> bytes:
        if self._deflate and not self._started and data:
            self._started = True
            try:
                return self._inflater.decompress(data)
            except zlib.error:  # raw deflate, with no zlib header
                self._inflater = zlib.decompressobj(-zlib.MAX_WBITS)
        return self._inflater.decompress(data)

    def flush(self) -> bytes:
        return self._inflater.flush()


def decoder_for(content_encoding: str) -> Decoder | None:
    """The decoder of a ``Content-Encoding`` value; None for a coding the hooks cannot undo (``br``, ``zstd``)."""
    codings = [coding.strip().lower() for coding in content_encoding.split(",") if coding.strip()]
    if not codings or any(coding not in _ALL for coding in codings):
        return None
    return Decoder(codings)
