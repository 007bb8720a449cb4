"""Content codings undone on a copy as httpx2 undoes them: a compressed answer reads as the SDK reads it."""

from __future__ import annotations

import gzip
import zlib

import httpx2
import pytest

from mcp_stream_exporter.coding import MAX_DECODED_BYTES, decoder_for

BODY = b'event: message\r\ndata: {"jsonrpc":"2.0","id":2,"result":{}}\r\n\r\n' * 50


def _chunks(data: bytes, size: int = 7) -> list[bytes]:
    return [data[i:i + size] for i in range(0, len(data), size)]


def _raw_deflate(data: bytes) -> bytes:
    packer = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    return packer.compress(data) + packer.flush()


def _read_by_httpx2(lines: list[str], encoded: bytes) -> bytes:
    response = httpx2.Response(200, headers=[("content-encoding", line) for line in lines], content=encoded)
    return response.read()


@pytest.mark.parametrize(("lines", "encoded"), [
    (["gzip"], gzip.compress(BODY)), (["GZip"], gzip.compress(BODY)), (["deflate"], zlib.compress(BODY)),
    (["deflate"], _raw_deflate(BODY)), (["deflate, gzip"], gzip.compress(zlib.compress(BODY))),
    (["deflate", "gzip"], gzip.compress(zlib.compress(BODY))), (["identity, gzip"], gzip.compress(BODY))])
def test_an_answer_decodes_chunk_by_chunk_as_httpx2_reads_it(lines, encoded):
    decoder = decoder_for(lines)
    assert decoder is not None
    assert b"".join(decoder(chunk) for chunk in _chunks(encoded)) + decoder.flush() == BODY
    assert _read_by_httpx2(lines, encoded) == BODY


@pytest.mark.parametrize("lines", [["identity"], ["x-gzip"], ["compress"], [""], []])
def test_codings_httpx2_passes_through_are_read_as_they_came(lines):
    assert decoder_for(lines) is None
    if lines:
        assert _read_by_httpx2(lines, BODY) == BODY


def test_an_answer_that_does_not_decode_reads_empty_from_there_on():
    decoder = decoder_for(["gzip"])
    assert decoder is not None
    assert decoder(b"not gzip at all") == b""
    assert decoder(gzip.compress(BODY)) == b"" and decoder.flush() == b""


def test_a_compression_bomb_decodes_to_no_more_than_the_bound():
    bomb = gzip.compress(b"x" * (4 * MAX_DECODED_BYTES), compresslevel=9)  # some 64 KiB
    decoder = decoder_for(["gzip"])
    assert decoder is not None
    decoded = decoder(bomb)
    assert len(decoded) <= MAX_DECODED_BYTES
    assert decoder(b"more") == b"" and decoder.flush() == b""
