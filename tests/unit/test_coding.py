"""Content codings undone on a copy: a compressed answer reads as its HTTP stack decodes it, chunk by chunk."""

from __future__ import annotations

import gzip
import zlib

import pytest

from mcp_stream_exporter.coding import decoder_for

BODY = b'event: message\r\ndata: {"jsonrpc":"2.0","id":2,"result":{}}\r\n\r\n' * 50


def _chunks(data: bytes, size: int = 7) -> list[bytes]:
    return [data[i:i + size] for i in range(0, len(data), size)]


def _raw_deflate(data: bytes) -> bytes:
    packer = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    return packer.compress(data) + packer.flush()


@pytest.mark.parametrize(("coding", "encoded"), [
    ("gzip", gzip.compress(BODY)), ("X-GZIP", gzip.compress(BODY)), ("deflate", zlib.compress(BODY)),
    ("deflate", _raw_deflate(BODY)), ("deflate, gzip", gzip.compress(zlib.compress(BODY))), ("identity", BODY)])
def test_a_body_decodes_chunk_by_chunk_to_what_was_encoded(coding, encoded):
    decoder = decoder_for(coding)
    assert decoder is not None
    assert b"".join(decoder(chunk) for chunk in _chunks(encoded)) + decoder.flush() == BODY


@pytest.mark.parametrize("coding", ["br", "zstd", "gzip, br", "compress", ""])
def test_a_coding_the_hooks_cannot_undo_has_no_decoder(coding):
    assert decoder_for(coding) is None


def test_a_body_that_does_not_decode_reads_empty_from_there_on():
    decoder = decoder_for("gzip")
    assert decoder is not None
    assert decoder(b"not gzip at all") == b""
    assert decoder(gzip.compress(BODY)) == b"" and decoder.flush() == b""
