"""Coverage-guided fuzzing (atheris, libFuzzer) of what OTLP/HTTP ingest does with a body: decompress,
decode (protobuf or JSON), read every span into the model, apply to the ledger and rules.

    python tests/fuzz/otlp_ingest.py -runs=20000 -max_total_time=30

Anything but a clean answer (an ``IngestError`` the service turns into a 4xx, or an outcome whose
refusals carry reasons) is a crash that libFuzzer reports with its input.
"""

from __future__ import annotations

import sys

import atheris

with atheris.instrument_imports():
    from mcp_stream_exporter.detector import Detector
    from mcp_stream_exporter.detector.ingest import (
        JSON,
        PROTOBUF,
        IngestError,
        IngestLimits,
        decode,
        decompress,
    )

LIMITS = IngestLimits(max_body_bytes=64 * 1024, max_decompressed_bytes=256 * 1024)
DETECTOR = Detector()
_MEDIA = (PROTOBUF, JSON, "text/plain")
_ENCODINGS = (None, "gzip", "identity")


def one_input(data: bytes) -> None:
    if len(data) < 2:
        return
    media, encoding, body = _MEDIA[data[0] % 3], _ENCODINGS[data[1] % 3], data[2:]
    try:
        batch = decode(decompress(body, encoding, LIMITS), media, LIMITS)
        events, outcome = DETECTOR.read(batch.spans, "otlp_http")  # protobuf: spans decode one by one here
    except IngestError as refused:
        if not (400 <= refused.status < 500 and refused.reason):
            raise AssertionError(f"an unclear refusal: {refused.status} {refused.reason!r}") from refused
        return
    assert outcome.accepted + outcome.rejected_count == batch.count
    assert not outcome.rejected or outcome.message()
    DETECTOR.apply(events)
    DETECTOR.tick()


if __name__ == "__main__":
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()
