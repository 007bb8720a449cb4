"""A body's content codings, undone on a copy as the SDK's HTTP stack undoes them: what a side reads of a
compressed answer.

A proxy or a middleware may compress an MCP answer (``Content-Encoding: gzip``): the client's ``httpx2`` decodes
it before the SDK reads it, and the server's middleware encodes it after the SDK wrote it. The hooks read the bytes
on the wire, so they decode a copy with ``httpx2``'s own decoders (pinned by tests/integration/test_sdk_contract.py):
the same codings (``br`` and ``zstd`` only where their packages are installed), the same header lines joined, the
same unknown codings passed through as they are. Read as they come, compressed bytes would be no frame and no
result, and a healthy answer would look empty.

Bounded: a raw chunk decodes to at most ``MAX_DECODED_BYTES`` (a ratio no real answer has in one network read; a
compression bomb's rest reads as empty), so a small hostile answer cannot make the hooks hold what it inflates to.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from httpx2 import DecodingError
from httpx2._decoders import MultiDecoder

MAX_DECODED_BYTES = 16 * 1024 * 1024


class Decoder:
    """Undoes an answer's codings chunk by chunk. An answer that does not decode, or inflates past the bound, reads
    as empty from there on: the HTTP stack fails the first too, and its reader is told."""

    __slots__ = ("_broken", "_codings")

    def __init__(self, codings: MultiDecoder) -> None:
        self._codings = codings
        self._broken = False

    def __call__(self, chunk: bytes) -> bytes:
        return b"" if self._broken else self._joined(self._codings.decode(chunk))

    def flush(self) -> bytes:
        """What the decoders still hold at the answer's end."""
        return b"" if self._broken else self._joined(self._codings.flush())

    def _joined(self, decoded: Iterator[bytes]) -> bytes:
        """The pieces the decoders yield (they decode as they are drawn), up to the bound."""
        pieces: list[bytes] = []
        size = 0
        try:
            for piece in decoded:
                size += len(piece)
                if size > MAX_DECODED_BYTES:
                    self._broken = True
                    break
                pieces.append(piece)
        except DecodingError:
            self._broken = True
        return b"".join(pieces)


def codings(content_encoding: Iterable[str]) -> list[str]:
    """The codings a response's ``Content-Encoding`` lines name, in the order applied, ``identity`` left out."""
    named = (coding.strip().lower() for line in content_encoding for coding in line.split(","))
    return [coding for coding in named if coding and coding != "identity"]


def decoder_for(content_encoding: Iterable[str]) -> Decoder | None:
    """The decoder of a response's ``Content-Encoding`` lines, as ``httpx2.Response`` builds it; None when they name
    nothing it decodes (``identity``, or a coding whose package is missing: ``httpx2`` passes those through)."""
    try:
        decoder = MultiDecoder(codings(content_encoding))
    except DecodingError:  # more codings than it applies: httpx2 fails the answer, which the SDK then reports
        return None
    return Decoder(decoder) if decoder.children else None
