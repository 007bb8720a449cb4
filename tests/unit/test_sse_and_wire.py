"""SSE frames parse the same however the bytes are split; JSON-RPC payloads classify by kind."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from mcp_stream_exporter import semconv as sc
from mcp_stream_exporter.sse import SSEFrame, SSEParser, empty_frames, message_frame, render, whole_frame
from mcp_stream_exporter.wire import classify, classify_frame, result_id

WIRE = (b"id: ev-3\r\ndata: \r\nretry: 750\r\n\r\n"
        b": ping - 2026-11-30\r\n\r\n"
        b'id: ev-4\r\nevent: message\r\ndata: {"jsonrpc":"2.0","id":2,"result":{}}\r\n\r\n'
        b'event: error\ndata: {"error":"insufficient_audience"}\n\n'
        b"data: a\rdata: b\r\r")


def _parse(chunks):
    parser = SSEParser()
    frames = [f for c in chunks for f in parser.feed(c)]
    frames.extend(parser.close())
    return frames, parser.comments


def test_parses_priming_message_error_and_cr_only_frames():
    frames, comments = _parse([WIRE])
    assert frames == [
        SSEFrame("", None, "ev-3", 750),
        SSEFrame('{"jsonrpc":"2.0","id":2,"result":{}}', "message", "ev-4"),
        SSEFrame('{"error":"insufficient_audience"}', "error"),
        SSEFrame("a\nb"),
    ]
    assert comments == 1
    assert frames[0].type == "message" and frames[2].type == "error"


@given(st.lists(st.integers(min_value=0, max_value=len(WIRE)), max_size=12))
def test_any_split_of_the_bytes_gives_the_same_frames(cuts):
    points = sorted(set(cuts))
    chunks = [WIRE[a:b] for a, b in zip([0, *points], [*points, len(WIRE)], strict=True)]
    assert _parse(chunks) == _parse([WIRE])


_LINES = st.sampled_from([b"data: x", b"data:y", b"data", b"id: 7", b"id: a\0b", b"event: error", b"retry: 9",
                          b"retry: 1x", b": ping", b"", b"other: z", "data: \u00e9\u2028".encode()])
_ENDS = st.sampled_from([b"\r\n", b"\n", b"\r"])


@given(st.lists(st.tuples(_LINES, _ENDS), max_size=30), st.lists(st.integers(min_value=0, max_value=400), max_size=8))
def test_any_stream_of_lines_parses_the_same_however_it_is_split(lines, cuts):
    wire = b"".join(line + end for line, end in lines)
    points = sorted({c for c in cuts if c <= len(wire)})
    chunks = [wire[a:b] for a, b in zip([0, *points], [*points, len(wire)], strict=True)]
    assert _parse(chunks) == _parse([wire])
    byte_at_a_time = [wire[i:i + 1] for i in range(len(wire))]
    assert _parse(byte_at_a_time) == _parse([wire])


_DATA = st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\r\n"), max_size=30)
_SDK_FRAMES = st.lists(st.builds(SSEFrame, _DATA, st.sampled_from([None, "message", "error"]),
                                  st.one_of(st.none(), st.from_regex(r"[0-9a-z_-]{1,6}", fullmatch=True)),
                                  st.none()),
                       max_size=6)


@given(_SDK_FRAMES, st.lists(st.integers(min_value=0, max_value=600), max_size=6))
def test_frames_in_the_sdks_form_parse_the_same_by_the_whole_frame_path_as_line_by_line(frames, cuts):
    wire = b"".join(render(f) for f in frames)  # id, event, one data line, CRLF: the SDK's form
    whole, _ = _parse([wire])
    assert whole == frames
    points = sorted({c for c in cuts if c <= len(wire)})
    chunks = [wire[a:b] for a, b in zip([0, *points], [*points, len(wire)], strict=True)]
    assert _parse(chunks)[0] == whole == _parse([wire[i:i + 1] for i in range(len(wire))])[0]


def test_render_round_trips():
    frame = SSEFrame('{"a":1}\n{"b":2}', "error", None, None)
    assert _parse([render(frame)])[0] == [frame]
    assert b"id:" not in render(frame)


def test_classify_by_kind():
    (req,) = classify(b'{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"fetch",'
                      b'"_meta":{"traceparent":"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}}}')
    assert (req.kind, req.id, req.method, req.tool) == (sc.FRAME_REQUEST, "7", "tools/call", "fetch")
    assert req.traceparent is not None and not req.is_terminal
    (init,) = classify('{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-11-25"}}')
    assert (init.protocol_version, init.arguments, init.is_tool_error) == ("2025-11-25", None, False)
    assert init.error_code is None
    (args,) = classify('{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":"a","arguments":{"q":1}}}')
    assert (args.arguments, args.cancelled_id, args.protocol_version) == ({"q": 1}, None, None)
    (res,) = classify('{"jsonrpc":"2.0","id":7,"result":{"isError":true}}')
    assert res.kind == sc.FRAME_RESPONSE and res.is_tool_error and res.is_terminal
    (err,) = classify('{"jsonrpc":"2.0","id":"a","error":{"code":-32003,"message":"no"}}')
    assert err.kind == sc.FRAME_ERROR and err.id == "a" and err.is_terminal
    (cancel,) = classify('{"jsonrpc":"2.0","method":"notifications/cancelled","params":{"requestId":7}}')
    assert cancel.kind == sc.FRAME_NOTIFICATION and cancel.cancelled_id == "7"
    batch = classify('[{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"a"}},'
                     '{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":"b"}}]')
    assert [m.tool for m in batch] == ["a", "b"]
    assert classify(b"\xff\xfe not json") == []
    assert classify("[1, true]")[0].kind == sc.FRAME_OTHER


_ids = st.one_of(st.integers(-10**6, 10**6), st.text(max_size=8))
_messages = st.one_of(
    st.builds(lambda i, r: {"jsonrpc": "2.0", "id": i, "result": r}, _ids,
              st.fixed_dictionaries({"content": st.lists(st.fixed_dictionaries({"text": st.text(max_size=20)}),
                                                         max_size=2)},
                                    optional={"isError": st.booleans()})),
    st.builds(lambda i, c: {"jsonrpc": "2.0", "id": i, "error": {"code": c, "message": "m"}}, _ids, st.integers()),
    st.builds(lambda m, p: {"jsonrpc": "2.0", "method": m, "params": p},
              st.sampled_from(["notifications/progress", "notifications/message", "notifications/cancelled"]),
              st.fixed_dictionaries({"requestId": _ids})),
)


@given(_messages)
def test_the_fast_frame_classifier_agrees_with_the_full_parse(message):
    import json

    from mcp_stream_exporter.wire import classify_frame

    data = json.dumps(message, separators=(",", ":"))  # the SDK's compact serialisation
    assert classify_frame(data) == classify(data)


@given(_messages, st.booleans(), st.binary(max_size=6), st.floats(0, 1))
def test_a_json_body_reads_off_its_bytes_as_its_decoded_text_reads(message, ascii_only, noise, where):
    import json

    from mcp_stream_exporter.wire import classify_body, classify_frame

    body = json.dumps(message, separators=(",", ":"), ensure_ascii=ascii_only).encode()
    at = round(where * len(body))
    for payload in (body, body[:at] + noise + body[at:]):  # bytes that do not decode, anywhere (in an id too)
        assert classify_body(payload) == classify_frame(payload.decode("utf-8", "replace"))
        assert classify_body(bytearray(payload)) == classify_body(payload)


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3))


@given(_json_values, st.sampled_from(["", " ", "\n", "x", ",", "]"]), st.sampled_from(["", " ", "\t"]))
def test_a_payload_is_read_as_json_reads_it_whatever_surrounds_its_value(value, after, before):
    import json

    from mcp_stream_exporter.wire import _loads

    text = before + json.dumps(value, separators=(",", ":")) + after
    try:
        expected = ("value", json.loads(text))
    except ValueError:
        expected = ("error", None)
    try:
        got = ("value", _loads(text))
    except ValueError:
        got = ("error", None)
    assert got == expected


def test_a_payload_nested_deeper_than_json_can_read_is_not_json_rather_than_an_error():
    assert classify(b"[" * 100_000) == []


def test_a_frame_longer_than_many_chunks_is_read_whole_whatever_line_ends_split_it():
    payload = '{"jsonrpc":"2.0","id":9,"result":{"text":"' + "a" * 1_000_000 + '"}}'
    for end in (b"\r\n", b"\n", b"\r"):
        wire = b"id: 9" + end + b"data: " + payload.encode() + end + end
        chunks = [wire[i:i + 1024] for i in range(0, len(wire), 1024)]
        assert _parse(chunks)[0] == [SSEFrame(payload, None, "9")]


def test_the_end_of_input_dispatches_only_a_frame_whose_last_line_a_cr_ended_as_httpx2_does():
    assert _parse([b"data: x\r"])[0] == [SSEFrame("x")]
    assert _parse([b"data: x\r\n\r"])[0] == [SSEFrame("x")]
    assert _parse([b"data: x"])[0] == _parse([b"data: x\n"])[0] == _parse([b"data: x\r\n"])[0] == []


def _httpx2_frames(wire: bytes) -> list[tuple[str, str, int | None]]:
    """What the MCP SDK's client dispatches (httpx2's own decoder), line by line."""
    from httpx2._sse import _SSEEventDecoder

    decoder = _SSEEventDecoder()
    frames = []
    for line in wire.decode().split("\n"):
        sse = decoder.decode(line)
        if sse is not None:
            frames.append((sse.data, sse.event, sse.retry))
    return frames


_FIELD_LINES = st.sampled_from([b"data: x", b"data", b"event: e", b"id: 7", b"id: a\0b", b"id", b"retry: 9",
                                b"retry: 1x", b"retry: -3", b"retry:  12", b"retry", b": ping", b"", b"other: z"])


@given(st.lists(_FIELD_LINES, max_size=30))
def test_a_frame_is_dispatched_exactly_when_the_sdks_client_dispatches_one(lines):
    wire = b"".join(line + b"\n" for line in lines) + b"\n"
    frames, _ = _parse([wire])
    assert [(f.data, f.type, f.retry) for f in frames] == _httpx2_frames(wire)


_ANY_FIELD = st.one_of(st.sampled_from(["x", "", "message", "error", "7", " 7", "a\0b", "\u00e9", "1x", "12"]),
                       st.text(max_size=8))


@given(st.lists(st.tuples(st.sampled_from([b"id", b"event", b"data", b"retry", b"", b"other"]), _ANY_FIELD),
                max_size=5), st.sampled_from([b"\r\n", b"\n", b"\r"]), st.booleans())
def test_a_chunk_read_as_one_whole_sdk_frame_is_what_the_parser_reads_from_it(fields, end, blank):
    chunk = b"".join(name + (b": " if name else b"") + value.encode() + end for name, value in fields)
    chunk += end if blank else b""
    frame = whole_frame(chunk)
    if frame is not None:
        assert _parse([chunk])[0] == [frame]
    if frame is not None and not frame.data and frame.event in (None, "message"):
        assert _empty(chunk)  # the priming event
    if _empty(chunk):  # that, or a run of such frames (a client may read more than one in a chunk): no message
        assert all(not f.data and f.event in (None, "message") for f in _parse([chunk])[0])
    _assert_message_frame_reads_as_whole_frame(chunk, frame)
    wire = render(SSEFrame('{"jsonrpc":"2.0","id":1,"result":{}}', "message", "e-9")) + b""
    assert whole_frame(wire) == _parse([wire])[0][0]
    assert whole_frame(b"id: 3\r\ndata: \r\nretry: 750\r\n\r\n") == SSEFrame("", None, "3", 750)  # SDK priming
    assert _empty(b"id: 3\r\ndata: \r\nretry: 750\r\n\r\n") and _empty(b"id: 3\r\ndata: \r\n\r\n")


@given(st.one_of(st.none(), _ANY_FIELD), st.one_of(st.none(), _ANY_FIELD), _ANY_FIELD,
       st.one_of(st.none(), _ANY_FIELD))
def test_a_chunk_in_the_sdks_form_is_read_as_one_whole_frame_exactly_as_the_parser_reads_it(id_, event, data, retry):
    chunk = b"".join(f"{name}: {value}\r\n".encode() for name, value in
                     (("id", id_), ("event", event), ("data", data), ("retry", retry)) if value is not None) + b"\r\n"
    frame = whole_frame(chunk)
    assert _empty(chunk) == (frame is not None and not frame.data and frame.event in (None, "message"))
    _assert_message_frame_reads_as_whole_frame(chunk, frame)
    if frame is not None:
        assert _parse([chunk])[0] == [frame]
    elif not any(c in v for v in (id_ or "", event or "", data, retry or "") for c in "\r\n\0") and (
            retry is None or (retry.isascii() and retry.isdigit())):
        raise AssertionError(f"an SDK-form chunk not read whole: {chunk!r}")


def _empty(chunk: bytes) -> bool:
    """Whether ``chunk`` is frames with no data and the default event type, and nothing else (``empty_frames``)."""
    return bool(chunk) and empty_frames(chunk) == len(chunk)


_SDK_FORM_FRAME = st.builds(
    lambda id_, event, data, retry: b"".join(
        f"{name}: {value}\r\n".encode() for name, value in (("id", id_), ("event", event), ("data", data),
                                                            ("retry", retry)) if value is not None) + b"\r\n",
    st.one_of(st.none(), st.sampled_from(["e1", "7", ""])), st.sampled_from([None, "message", "error", "ping"]),
    st.sampled_from(["", '{"jsonrpc":"2.0","id":1,"result":{}}', "x\ry", "x\ny"]),
    st.sampled_from([None, "750", "x"])).filter(lambda chunk: whole_frame(chunk) is not None)


@given(st.lists(_SDK_FORM_FRAME, max_size=5))
def test_a_chunk_of_several_whole_frames_is_known_empty_up_to_its_first_frame_the_parser_finds_a_message_or_type_in(
        frames):
    chunk = b"".join(frames)
    parsed = _parse([chunk])[0]
    assert len(parsed) == len(frames)  # each whole, so each read as it is
    leading = next((i for i, f in enumerate(parsed) if f.data or f.event not in (None, "message")), len(parsed))
    assert empty_frames(chunk) == sum(len(frame) for frame in frames[:leading])
    at = empty_frames(chunk)
    rest = chunk[at:]
    head, head_at = message_frame(rest), message_frame(chunk, at)
    assert head_at == (None if head is None else (head[0], head[1] + at))


def _assert_message_frame_reads_as_whole_frame(chunk: bytes, frame: SSEFrame | None) -> None:
    """``message_frame`` reads a chunk exactly when ``whole_frame`` reads it as a frame of the default event
    type with no retry, with its id, and its data where it says (a result read off it is the data's)."""
    head = message_frame(chunk)
    assert (head is not None) == (frame is not None and frame.event in (None, "message") and frame.retry is None)
    if head is not None and frame is not None:
        assert head[0] == frame.id and chunk[head[1]:-4].decode("utf-8", "replace") == frame.data
        request_id = result_id(chunk, head[1])
        if request_id is not None:
            assert [(m.kind, m.id) for m in classify_frame(frame.data)] == [(sc.FRAME_RESPONSE, request_id)]


@given(st.one_of(st.none(), st.text(max_size=6).filter(lambda t: not any(c in t for c in "\r\n\0"))),
       st.sampled_from([None, "message"]), st.one_of(st.integers(-5, 10**20), st.text(max_size=6)),
       st.sampled_from([{}, {"content": [], "isError": True}, "x\ny"]))
def test_a_result_frame_is_known_by_its_head_as_its_full_read_knows_it(event_id, event, request_id, result):
    data = json.dumps({"jsonrpc": "2.0", "id": request_id, "result": result}, separators=(",", ":"),
                      ensure_ascii=False)
    chunk = render(SSEFrame(data, event, event_id))
    head = message_frame(chunk)
    assert head is not None and head[0] == event_id
    _assert_message_frame_reads_as_whole_frame(chunk, whole_frame(chunk))
    plain = isinstance(request_id, int) or not any(c in '"\\' or c < " " for c in request_id)  # json escapes
    assert result_id(chunk, head[1]) == (str(request_id) if plain else None)  # else read in full


def test_a_retry_too_long_for_an_int_is_ignored_as_httpx2_ignores_it_never_raised():
    wire = b"id: 1\r\ndata: x\r\nretry: " + b"9" * 5000 + b"\r\n\r\n"
    frames, _ = _parse([wire])
    assert [(f.data, f.type, f.retry) for f in frames] == _httpx2_frames(wire.replace(b"\r\n", b"\n"))
    assert whole_frame(wire) is None


def test_an_error_code_past_pythons_int_digit_limit_reads_as_not_json_and_never_raises():
    """A hostile server's ``{"code": <5,000 digits>}``: ``int()`` of it raised ValueError out of the client's tap,
    which killed the SDK's transport (and the session) where the plain SDK fails the one call it cannot parse."""
    from mcp_stream_exporter.wire import classify_body, classify_frame

    for digits, read in ((5000, []), (30, [10**29])):
        data = '{"jsonrpc":"2.0","id":1,"error":{"code":' + "1" + "0" * (digits - 1) + ',"message":"m"}}'
        assert [m.error_code for m in classify_frame(data)] == read
        assert [m.error_code for m in classify_body(data.encode())] == read
