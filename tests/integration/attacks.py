"""Hostile OTLP bodies, and a child process that sends one to the real app and reports its peak memory.

    python tests/integration/attacks.py <attack>   # prints {"status": ..., "peak_growth_mib": ...}

Peak memory is the process's high-water RSS (``ru_maxrss``) after the request, less the one before it
(after imports and a warm-up request): what decoding that body cost, native allocations included.
"""

from __future__ import annotations

import gzip
import json
import resource
import sys
from collections.abc import Callable

from mcp_stream_exporter.detector.ingest import JSON, PROTOBUF


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def empty_spans_bomb(decompressed: int = 16 * 1024 * 1024) -> bytes:
    """Millions of empty spans (2 bytes each): a few KiB gzipped, 16 MiB inflated."""
    spans = b"\x12\x00" * ((decompressed - 16) // 2)
    return gzip.compress(_field(1, _field(2, spans)), 9)


def tiny_attributes_span(size: int) -> bytes:
    """One span made of ``size`` bytes of empty attributes: the densest message tree per byte."""
    return _field(1, _field(2, _field(2, b"\x4a\x00" * (size // 2))))


def unknown_fields_flood(decompressed: int = 16 * 1024 * 1024) -> bytes:
    """Millions of unknown varint fields around the spans."""
    return gzip.compress(b"\x10\x00" * (decompressed // 2), 9)


def json_objects_bomb(decompressed: int = 16 * 1024 * 1024) -> bytes:
    """Millions of empty JSON spans: a few KiB gzipped."""
    spans = b"{}," * ((decompressed - 64) // 3)
    return gzip.compress(b'{"resourceSpans":[{"scopeSpans":[{"spans":[' + spans + b'{}]}]}]}', 9)


def small_scope(message: bytes, size: int = 256 * 1024 - 16) -> bytes:
    """Within one decoding's bound, so counted by upb rather than walked: ``message`` repeated to fill it."""
    return message * (size // len(message))


ATTACKS: dict[str, tuple[Callable[[], bytes], str]] = {
    "protobuf scope of 256 KiB of empty spans": (lambda: gzip.compress(_field(1, _field(2, small_scope(b"\x12\x00")))),
                                                 PROTOBUF),
    "protobuf gzip bomb (empty spans)": (empty_spans_bomb, PROTOBUF),
    "protobuf gzip bomb (unknown fields)": (unknown_fields_flood, PROTOBUF),
    "json gzip bomb (empty objects)": (json_objects_bomb, JSON),
    "protobuf span of 4 MiB of empty attributes": (lambda: gzip.compress(tiny_attributes_span(4 << 20)), PROTOBUF),
}


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main(attack: str) -> None:
    from fastapi.testclient import TestClient

    from mcp_stream_exporter.detector import Detector
    from mcp_stream_exporter.detector.app import create_app
    from mcp_stream_exporter.detector.ingest import IngestLimits, IngestQueue

    build, media = ATTACKS[attack]
    body = build()
    detector = Detector()
    queue = IngestQueue(detector, IngestLimits())
    headers = {"content-type": media, "content-encoding": "gzip"}
    with TestClient(create_app(detector, queue)) as client:
        client.post("/v1/traces", content=gzip.compress(b""), headers=headers)  # warm-up
        before = _peak_mib()
        answer = client.post("/v1/traces", content=body, headers=headers)
        after = _peak_mib()
    queue.close()
    print(json.dumps({"status": answer.status_code, "body_bytes": len(body), "peak_growth_mib": after - before,
                      "error": answer.json().get("error") if answer.status_code != 200 else None}))


if __name__ == "__main__":
    main(sys.argv[1])
