"""A session POST as the SDK will read it, read by the guard before the SDK sees it: its body, what it asks
(requests, cancels, answers to the server's requests), and a refusal sent in the SDK's stead."""

from __future__ import annotations

import json
from typing import Final, NamedTuple

import anyio
import pydantic_core
from mcp.shared.dispatcher import as_request_id
from mcp_types import JSONRPCNotification, JSONRPCRequest, jsonrpc_message_adapter

from mcp_stream_exporter.asgi import Message, Receive, Send
from mcp_stream_exporter.wire import CANCELLED, MAX_PARSED_BODY, WireMessage, request_message

MAX_REQUESTS: Final = 100  # in one POST (a 2025-03-26 batch): more is refused, the guard's work a POST bounded


class Asked(NamedTuple):
    """What a session POST asks of the SDK, as the SDK reads it (``as_the_sdk_reads``)."""

    requests: tuple[WireMessage, ...] = ()  # every request with an id
    cancelled: tuple[str, ...] = ()  # the ids its notifications/cancelled name
    answers: tuple[str, ...] = ()  # the ids of its responses and errors: the server's requests it answers
    too_many: bool = False  # a batch longer than one POST may carry (``MAX_REQUESTS``), left unread


NOTHING_ASKED: Final = Asked()


class Posted(NamedTuple):
    """A POST's body as the guard read it before the app runs (``read_post``)."""

    messages: list[Message]  # what the app is handed first (``replaying``), the rest streaming after it
    body: bytes | None  # the whole body; None when it is not read whole (too large, or too slow)
    late: bool = False  # not whole within the time the guard waits for it


async def read_post(receive: Receive, timeout_s: float) -> Posted:
    """A POST's body, read before the app runs and kept as one message (a body in a thousand one-byte pieces costs
    its bytes, not a thousand messages), within ``timeout_s``: a client that never finishes its body holds no more
    than it sent, and no longer. Past ``MAX_PARSED_BODY`` or the time, what was read is handed on, the rest streams."""
    body = bytearray()
    with anyio.move_on_after(timeout_s):
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away first: nothing to read
                return Posted([_unfinished(body), message] if body else [message], b"")
            body += message.get("body", b"")
            if len(body) > MAX_PARSED_BODY:
                return Posted([_unfinished(body)], None)
            if not message.get("more_body", False):
                whole = bytes(body)
                return Posted([{"type": "http.request", "body": whole, "more_body": False}], whole)
    return Posted([_unfinished(body)], None, late=True)


def _unfinished(body: bytearray) -> Message:
    return {"type": "http.request", "body": bytes(body), "more_body": True}


def as_the_sdk_reads(body: bytes) -> Asked:
    """What a POST body asks of the SDK, read exactly as the SDK reads it (``pydantic_core.from_json``, then
    ``jsonrpc_message_adapter``, as ``StreamableHTTPServerTransport`` does; each element of a batch alike): a
    message the guard took for another kind than the SDK does (``"id": null`` on a cancel, ``"method"`` on an
    answer) would be checked as what it is not. What the SDK would refuse (400) asks nothing; a batch longer
    than one POST may carry is not validated element by element (a 4 MiB body holds a million of them)."""
    try:
        raw = pydantic_core.from_json(body)
    except ValueError:
        return NOTHING_ASKED
    if isinstance(raw, list) and len(raw) > MAX_REQUESTS:
        return Asked(too_many=True)
    requests: list[WireMessage] = []
    cancelled: list[str] = []
    answers: list[str] = []
    for item in raw if isinstance(raw, list) else (raw,):
        try:
            message = jsonrpc_message_adapter.validate_python(item, by_name=False)
        except ValueError:  # pydantic's ValidationError: refused, or dropped, by the SDK
            continue
        if isinstance(message, JSONRPCRequest):
            requests.append(request_message(message.id, message.method, message.params))
        elif isinstance(message, JSONRPCNotification):
            if message.method == CANCELLED and isinstance(message.params, dict):
                cancelled_id = as_request_id(message.params.get("requestId"))  # as the SDK's dispatcher reads it
                if cancelled_id is not None:
                    cancelled.append(str(cancelled_id))
        elif message.id is not None:
            answers.append(str(message.id))
    return Asked(tuple(requests), tuple(cancelled), tuple(answers))


def replaying(read: list[Message], receive: Receive) -> Receive:
    """``receive`` for the app: the messages already read, then the rest as they come."""
    queued = iter(read)

    async def replayed() -> Message:
        message = next(queued, None)
        return message if message is not None else await receive()

    return replayed


async def refuse_request(send: Send, status: int, message: str) -> None:
    """Answer a request in the SDK's stead, as it answers one it refuses: a JSON-RPC error, no id."""
    body = json.dumps({"jsonrpc": "2.0", "id": None, "error": {"code": -32600, "message": message}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
