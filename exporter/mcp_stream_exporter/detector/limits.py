"""What ingest accepts, and how it refuses the rest: limits on bodies, spans, decoding and the queue,
and the error that carries a refusal's HTTP status and reason."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class IngestLimits:
    max_body_bytes: int = 4 * 1024 * 1024  # as received (compressed or not)
    max_decompressed_bytes: int = 16 * 1024 * 1024
    max_spans_per_request: int = 10_000
    max_queued_spans: int = 200_000
    retry_after_s: int = 2
    max_queued_bytes: int = 32 * 1024 * 1024  # an estimate of the events waiting (sizes.event)
    max_span_bytes: int = 256 * 1024  # one encoded span (or resource): what decoding it may cost
    max_json_values: int = 200_000  # values in a JSON body, counted before it is parsed
    max_decoding: int = 2  # requests decoded at once (HTTP and gRPC together); others wait their turn
    decoding_wait_s: float = 5.0  # then 429 with Retry-After
    max_buffered_bytes: int = 32 * 1024 * 1024  # request bodies held at once, received or waiting
    body_timeout_s: float = 30.0  # to receive a whole body; then 408
    # a body still coming after this long makes way (429, retryable) for a new one when the bodies held fill
    # ``max_buffered_bytes``: slow senders cannot hold the buffer, and every sender with it, for ``body_timeout_s``
    body_grace_s: float = 1.0


class IngestError(Exception):
    """A request refused whole: the HTTP status and a reason the sender can act on."""

    def __init__(self, status: int, reason: str, metric_reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason
        self.metric_reason = metric_reason


def busy() -> IngestError:
    """No decoding slot freed up within ``decoding_wait_s``: 429, the sender retries later."""
    return IngestError(429, "every decoding slot is busy; retry after the given delay", "busy")
