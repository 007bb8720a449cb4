"""Client hooks: what an MCP client on the SDK sends and receives, as spans.

A tap on the ``httpx2`` transport sees the final request (the ``Authorization`` an auth flow set, the
``Last-Event-ID`` of a resume) and every byte of every response before the SDK parses it: each SSE
frame, ``event: error`` frames the SDK drops with a warning, the wire JSON-RPC id the SDK rewrites,
and how each stream ended (the server ended it, the connection broke, or the client closed it). What a
request's body asks for is read off the SDK's message, the object ``httpx2`` encodes as that body. It
changes nothing: resolving a refused resume's pending calls is the guard's (``guard.resolve_refusals``).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import hmac
import json
import time
import types
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping
from typing import Any

import httpx2
from mcp.shared._httpx_utils import MCP_DEFAULT_SSE_READ_TIMEOUT, MCP_DEFAULT_TIMEOUT
from opentelemetry import trace

from mcp_stream_exporter import semconv as sc
from mcp_stream_exporter.auth import AuthView, TokenReader, ToolPolicy, checked_policy
from mcp_stream_exporter.coding import Decoder, decoder_for
from mcp_stream_exporter.exchange import (
    AUTHORIZATION,
    CONTENT_ENCODING,
    CONTENT_JSON,
    CONTENT_NONE,
    CONTENT_SSE,
    CONTENT_TYPE,
    LAST_EVENT_ID,
    PROTOCOL_VERSION,
    REQUEST_HEADERS,
    RESPONSE_HEADERS,
    SESSION_ID,
    Body,
    EncodedArguments,
    can_ask,
    content_of,
    era_of,
    read_body,
    read_message,
    stream_kind,
)
from mcp_stream_exporter.hooks import _defects
from mcp_stream_exporter.hooks._sdk_spans import SdkSpans, annotate
from mcp_stream_exporter.hooks._spans import Call, CallKey, DeviationTracer, Identify, Stream, Terminal, lacks
from mcp_stream_exporter.hooks._tracking import BROKEN_IN_PROCESS, HOLD_BYTES, HOLD_PIECES, HeldFrame, Tracker
from mcp_stream_exporter.sse import SSEFrame, SSEParser, empty_frames, message_frame
from mcp_stream_exporter.wire import MAX_PARSED_BODY, WireMessage, classify_body, classify_frame, result_id

_FINGERPRINT_CHARS = 16
# where ``_ReadingClient`` leaves, in a request's extensions, its body's stream and what that body asks for
_ASKED = "mcp_stream_exporter.asked"
_POST_TERMINAL = (sc.STREAM_KIND_POST, None)  # where a call answered by a JSON body had its terminal event
# A pending call's answer (``ClientInstrumentation._answer``): where its result came, or None to start it
PendingAnswer = Callable[[Terminal | None], Call | None]


class ClientInstrumentation:
    """The client side of the span model, shared by every request of one ``httpx2`` client."""

    def __init__(
        self,
        *,
        policy: ToolPolicy | None = None,
        token_reader: TokenReader | None = None,
        tracer_provider: trace.TracerProvider | None = None,
        max_calls: int = 10_000,
    ) -> None:
        self.policy = policy if policy is None else checked_policy(policy)
        self.tokens = token_reader or TokenReader()
        self.tracker = Tracker(DeviationTracer(tracer_provider), sc.ROLE_CLIENT, max_calls=max_calls,
                               broken=BROKEN_IN_PROCESS)
        self._sdk_spans = self._global_sdk_spans(told=False)
        self._protocol_version: str | None = None
        self._identify: Identify = self._fingerprint  # bound once, not per call

    def _global_sdk_spans(self, *, told: bool = True) -> SdkSpans | None:
        """The index of the SDK's own spans, on the global provider where the SDK makes them: looked up again at each
        request until one is set (an application may set its provider after building its clients), ``told`` once
        if none is by then."""
        sdk_spans = self._sdk_spans = SdkSpans.of_global_provider(told=told)
        if sdk_spans is not None:
            sdk_spans.watch(self.tracker)
        return sdk_spans

    def _request_calls(self, request: httpx2.Request, session_id: str | None,
                       protocol_version: str | None, view: AuthView,
                       start: int) -> list[Call] | tuple[WireMessage, bool]:
        """The calls a request carries, started; or, for a request of one call that nothing deviates in yet, the
        call's request and whether it is stateless, left pending: started only if its answer is anything but its
        result, or something looks it up (``_Pending``, ``_TapStream.started``), so the healthy path never starts it."""
        built: tuple[object, Body] | None = request.extensions.get(_ASKED)
        if built is not None and built[0] is request.stream:  # its body the SDK's message (``_ReadingClient``)
            asked = built[1]
        else:
            try:
                body = request.content
            except httpx2.RequestNotRead:
                return []
            if not can_ask(body):
                return []
            asked = read_body(body)
        if asked.protocol_version is not None:
            self._protocol_version = asked.protocol_version
        calls: list[Call] = []
        pending = None
        stateless = False
        if asked.calls:
            stateless = era_of(protocol_version) == sc.ERA_STATELESS
            if (len(asked.calls) == 1 and not (stateless and self.tracker.reissues_possible())
                    and not self._deviates(asked.calls[0], view)):
                pending = asked.calls[0]
            else:
                for msg in asked.calls:  # a loop, not a comprehension: that would be one more call
                    calls.append(self._start_call(msg, session_id, protocol_version, view, start, stateless))
        for request_id in asked.cancelled:
            self.tracker.cancel((session_id, request_id))
        return calls if pending is None else (pending, stateless)

    def _start_call(self, msg: WireMessage, session_id: str | None, protocol_version: str | None, view: AuthView,
                    start: int, stateless: bool, reissue: bool = True) -> Call:
        # a fingerprint matches a re-issue to the call it repeats: only the stateless era re-issues
        call = self.tracker.start_call(session_id, msg, protocol_version, view, stateless, start,
                                       self._identify if stateless else None, reissue)
        if self._sdk_spans is not None:
            call.sdk_span = self._sdk_spans.get(msg.traceparent)
            if call.sdk_span is not None:
                self._sdk_spans.bind(call.sdk_span, self.tracker, call)
        if self.policy is None:
            return call
        requirement, missing = self.policy.gap(msg.tool, view)
        if requirement is not None:
            call.require(requirement, missing)  # the call's span records it only where the audience is known
            if lacks(view, missing):
                self.tracker.span_of(call)  # calling with a token that lacks what the tool requires: a deviation
        return call

    def _deviates(self, msg: WireMessage, view: AuthView) -> bool:
        """Whether the call's token lacks what its tool requires (``_start_call`` gives it a span at once)."""
        if self.policy is None:
            return False
        return lacks(view, self.policy.gap(msg.tool, view)[1])

    def _answer(self, msg: WireMessage, session_id: str | None, protocol_version: str | None, view: AuthView,
                start: int, stateless: bool, terminal: Terminal | None) -> Call | None:
        """A pending call's answer: ``terminal``, where its result came, ends it on the healthy path, never
        started (where it came goes on the SDK's span, as ``Tracker.answered_by`` does); None starts it."""
        if terminal is not None:
            if self._sdk_spans is not None:
                sdk = self._sdk_spans.get(msg.traceparent)
                if sdk is not None:
                    annotate(sdk, terminal)
            if session_id is not None:  # a stateless call's id is no key
                assert msg.id is not None  # a call's
                self.tracker.answered_healthy((session_id, msg.id), msg.tool)
            return None
        return self._start_late(msg, session_id, protocol_version, view, start, stateless)

    def _start_late(self, msg: WireMessage, session_id: str | None, protocol_version: str | None, view: AuthView,
                    start: int, stateless: bool) -> Call:
        """A pending call, started as of its request: not as the re-issue of a call that broke since (none
        had when it went out, or it would not have been left pending)."""
        return self._start_call(msg, session_id, protocol_version, view, start, stateless, False)

    async def handle(self, inner: httpx2.AsyncBaseTransport, request: httpx2.Request) -> httpx2.Response:
        early: _Pending | None = None  # a resumable session's pending call, which a look-up may start first
        try:
            if self._sdk_spans is None:  # before the SDK's span of a call this client's session goes on to make
                self._global_sdk_spans()
            start = time.time_ns()
            headers = _picked(request.headers, REQUEST_HEADERS)
            session_id = headers.get(SESSION_ID)
            protocol_version = headers.get(PROTOCOL_VERSION) or self._protocol_version
            view = self.tokens.from_authorization(headers.get(AUTHORIZATION))
            requested = self._request_calls(request, session_id, protocol_version, view, start)
            pending: PendingAnswer | None = None
            if isinstance(requested, list):
                calls = requested
            else:
                calls = []
                msg, stateless = requested
                answer = functools.partial(self._answer, msg, session_id, protocol_version, view, start, stateless)
                if stateless:
                    pending = answer
                else:
                    assert msg.id is not None  # a call's
                    key = (session_id, msg.id)
                    early = _Pending(answer, self.tracker, key)
                    if self.tracker.pend(key, early):
                        pending = early
                    else:  # its id taken by a call pending still (MCP forbids it): started as any other
                        early = None
                        calls.append(_started(answer, None))
            cursor = headers.get(LAST_EVENT_ID)
            if cursor:
                if pending is not None:
                    calls.append(_started(pending, early))
                    pending = None
                calls.extend(self.tracker.calls_of_cursor(session_id, cursor))
            # the client's DELETE of its session: the streams the server closes as it accepts it end with the session
            deleting = None
            if request.method == "DELETE" and session_id is not None:
                deleting = (session_id, self.tracker.deleting(session_id))
        except Exception:  # the hooks' reading never fails the application's: the request goes unobserved
            _defects.report("a request")
            self._forget(early)
            return await inner.handle_async_request(request)
        try:
            response = await inner.handle_async_request(request)
        except BaseException as failed:
            try:
                if deleting is not None:
                    self.tracker.deleted(*deleting, None)
                if pending is not None:
                    calls.append(_started(pending, early))
                stream = self._open(request, session_id, protocol_version, calls, view, cursor, start, None,
                                    CONTENT_NONE)
                if stream is not None:  # cancelled before the answer began (a timeout): the client gave up, as below
                    self.tracker.end_stream(stream, sc.END_DROPPED if isinstance(failed, Exception) else sc.END_CLOSED)
            except Exception:
                _defects.report("a request")
            raise
        try:
            if deleting is not None:
                self.tracker.deleted(*deleting, response.status_code)
            response_headers = _picked(response.headers, RESPONSE_HEADERS)
            if session_id is None:
                session_id = response_headers.get(SESSION_ID)
            content = content_of(response_headers.get(CONTENT_TYPE, ""))
            status = response.status_code
            # a proxy's gzip: the answer read decoded, every line of the header as httpx2 reads them
            decoder = (decoder_for(response.headers.get_list(CONTENT_ENCODING)) if CONTENT_ENCODING in response_headers
                       else None)
            if pending is not None and 300 <= status < 400:
                # no answer: a redirect (the SDK sends the request again where it points, or fails it); its call is left
                # to the request that follows
                if early is not None:
                    early.forget()
                if early is None or early.call is None:
                    return response
            elif 300 <= status < 400 and calls and all(call.stateless and call.span is None for call in calls):
                return response  # the same, for stateless calls started as they went out (another's break: a re-issue?)
            if pending is not None:
                # most likely its result and no more: a JSON body; a resumable session's SSE answer, held. Unless a
                # look-up started it already
                if (early is None or early.call is None) and status < 300 and request.method == "POST" and (
                        content == CONTENT_JSON or (early is not None and content == CONTENT_SSE)):
                    assert isinstance(response.stream, httpx2.AsyncByteStream)
                    assert not isinstance(requested, list)
                    opener = functools.partial(self._open, request, session_id, protocol_version, calls, view, cursor,
                                               start, status, content)
                    sse = content == CONTENT_SSE
                    tap = _TapStream(response.stream, self.tracker, None, sse, status, calls, opener, decoder)
                    tap.pending, tap.pending_id = pending, requested[0].id
                    if sse:  # its chunks known by their heads while they show the healthy path
                        tap.held, tap.unparsed = [], []
                    if early is not None:  # counted as a stream carrying it once it starts (``_TapStream.started``)
                        early.tap = tap
                        tap.hold(session_id)
                    response.stream = tap
                    return response
                calls.append(_started(pending, early))
            single = len(calls) == 1 and not cursor and calls[0].span is None  # most likely its result and no more
            if status < 300 and request.method == "POST" and (
                    (content == CONTENT_SSE and calls) or (content == CONTENT_JSON and single)):
                assert isinstance(response.stream, httpx2.AsyncByteStream)
                opener = functools.partial(self._open, request, session_id, protocol_version, calls, view, cursor,
                                           start, status, content)
                sse = content == CONTENT_SSE
                tap = _TapStream(response.stream, self.tracker, None, sse, status, calls, opener, decoder)
                if sse:  # its frames read as they pass, and kept until it ends
                    tap.held = []
                    if single:  # its chunks known by their heads while they show the healthy path
                        tap.unparsed = []
                if sse or not calls[0].stateless:  # a stateless call's JSON answer: nothing else can need it first
                    tap.hold(session_id)
                if not single:
                    tap.held_stream()  # not the healthy path's shape: a stream from its start
                response.stream = tap
                return response
            stream = self._open(request, session_id, protocol_version, calls, view, cursor, start, status, content)
            if stream is None:
                return response
            # a redirect delivers nothing, and is no clean end either; nor does an error, but for the JSON-RPC error a
            # POST's calls may be answered with at an HTTP error status (400, 404), which the SDK hands its caller
            answers = status < 300 or (status >= 400 and content == CONTENT_JSON and request.method == "POST"
                                       and bool(calls))
            if content == CONTENT_NONE or not answers:
                self.tracker.end_stream(stream, sc.END_HTTP_ERROR if status >= 300 else sc.END_CLEAN, status)
                return response
            assert isinstance(response.stream, httpx2.AsyncByteStream)
            response.stream = _TapStream(response.stream, self.tracker, stream, content == CONTENT_SSE, status, calls,
                                         decoder=decoder)
            return response
        except Exception:
            _defects.report("an answer")
            self._forget(early)
            return response

    @staticmethod
    def _forget(early: _Pending | None) -> None:
        """A call left pending (``Tracker.pend``) of a request the hooks failed to read: never looked up as one."""
        if early is not None:
            with contextlib.suppress(Exception):
                early.forget()

    def _fingerprint(self, tool: str | None, arguments: Any) -> str:
        return _fingerprint(self.tokens.subject_salt, tool, arguments)

    def _open(self, request: httpx2.Request, session_id: str | None, protocol_version: str | None,
              calls: list[Call], auth: AuthView, cursor: str | None, start: int,
              status: int | None, content: str, holder: _TapStream | None = None) -> Stream | None:
        method = request.method
        return self.tracker.open_stream(stream_kind(method, cursor), session_id, calls,
                                        (method, content, protocol_version, cursor), auth, status, start_time=start,
                                        holder=holder)


def _at_error_status(messages: list[WireMessage], calls: list[Call]) -> list[WireMessage]:
    """What an answer at an HTTP error status tells a POST's calls, as the SDK reads it: for a request of one call, a
    JSON-RPC error is its answer whatever id it names (none, when the request was refused before its id was read;
    a server's own, such as an old SDK's ``server-error``); anything else in it, nothing."""
    if len(calls) != 1:
        return []
    request_id = calls[0].key[1]
    return [m._replace(id=request_id) for m in messages if m.kind == sc.FRAME_ERROR and m.error_code is not None]


class _TapStream(httpx2.AsyncByteStream):
    """Passes every chunk through unchanged, parsing a copy; notes how the stream ended.

    A POST's answer to its calls is held (``Tracker.hold``): each SSE chunk is parsed as it passes and a
    terminal event in it delivered at once (``Tracker.deliver``: the call ends while the SDK's span is
    open), and its frames are kept, with the time each was seen, for the tracker to read when it ends.
    An answer to one call opens no stream (an ``opener``, no ``stream``) while it shows the healthy path:
    SSE frames with no data, then the call's result, which ends the call as it passes (each chunk known by
    its frames' heads and kept unparsed while it shows that path), or a JSON body that is its result, read at
    its end (``Tracker.answered``); the tap then lets go of it (``Tracker.settle``).
    Anything else opens the stream, with the frames kept so far, or with the JSON body read on it: it is
    then followed exactly as if it had been from the start.

    An iterator object rather than an async generator: the SDK stops reading at the response and
    closes the response, and an abandoned async generator costs the event loop a finaliser task. For
    the same reason it closes the inner stream's iterator itself, as ``httpx2`` does with the iterators
    it opens (it cannot see the one behind this object)."""

    # what a tap starts with and most never change, as class defaults: fewer stores on every response
    _chunks: AsyncIterator[bytes] | None = None
    _exhausted = False
    _parser: SSEParser | None = None
    _json: bytes | bytearray = b""  # a JSON body: its one chunk as it came (the usual), or the chunks joined
    held: list[HeldFrame] | None = None
    _held_bytes = 0
    _answered = False  # a deferred answer carried its call's result: it ends the healthy path's way
    _holding = False  # its calls count it as a stream carrying them (``Tracker.hold``)
    _session_id: str | None = None  # of a held answer
    # a deferred SSE answer's chunks, each of whole frames that keep it on the healthy path, and when each was
    # seen: parsed only if it leaves that path (``_healthy``)
    unparsed: list[tuple[bytes, int]] | None = None
    # a pending call's answer (``ClientInstrumentation._answer``): its result, known by its head (``pending_id``
    # its request's id) as it passes or at its end, ends it unstarted; anything else starts it (``started``)
    pending: PendingAnswer | None = None
    pending_id: str | None = None
    _answered_early: _Pending | None = None  # a resumable session's pending call its result ended as it passed
    _unread = False  # the hooks failed to read it (``_defects``): it passes on unread from then on
    _decoder: Decoder | None = None  # a compressed answer's: its chunks read decoded

    def __init__(self, inner: httpx2.AsyncByteStream, tracker: Tracker, stream: Stream | None, sse: bool,
                 status: int, calls: list[Call] | None = None,
                 opener: Callable[[_TapStream | None], Stream | None] | None = None,
                 decoder: Decoder | None = None) -> None:
        self._inner = inner
        self._tracker = tracker
        self._stream = stream
        self._calls = calls if calls is not None else []
        self._opener = opener
        if sse:
            self._parser = SSEParser()
        self._status = status
        if decoder is not None:
            self._decoder = decoder

    def __aiter__(self) -> AsyncIterator[bytes]:
        if self._chunks is None:  # httpx2 asks twice (``__aiter__()``, then ``async for``): one inner iterator
            self._chunks = self._inner.__aiter__()
        return self

    async def __anext__(self) -> bytes:
        assert self._chunks is not None
        try:
            chunk = await self._chunks.__anext__()
        except StopAsyncIteration:
            if not self._exhausted:
                self._exhausted = True  # so ``aclose`` spares the inner iterator's close, read or not
                if not self._unread:
                    try:
                        if self._decoder is not None and (tail := self._decoder.flush()):
                            self._take(tail)
                        self._ended()
                    except Exception:
                        self._failed()
            raise
        except Exception:
            self._end_as(sc.END_DROPPED)
            raise
        except BaseException:  # cancelled while reading: the client gave up on it
            self._end_as(sc.END_CLOSED)
            raise
        if not self._unread:
            try:
                self._take(chunk if self._decoder is None else self._decoder(chunk))
            except Exception:  # the hooks' reading never fails the application's
                self._failed()
        return chunk

    def _failed(self) -> None:
        """The hooks could not read this answer (``_defects``): it passes on unread, and ends, for the hooks, as a
        stream its client closed, which judges nothing."""
        _defects.report("an answer")
        self._unread = True
        with contextlib.suppress(Exception):
            self._end(sc.END_CLOSED)

    def _end_as(self, reason: str) -> None:
        """``_end``, where the application's own exception is on its way: one of the hooks' never replaces it."""
        if self._unread:
            return
        try:
            self._end(reason)
        except Exception:
            self._failed()

    def _take(self, chunk: bytes) -> None:
        """A chunk of the answer, as its reader will read it (decoded)."""
        held = self.held
        if held is not None:  # what ``_keep`` takes in, up to the bounds of a held stream, then followed
            unparsed = self.unparsed
            if unparsed is not None and self._healthy(chunk):
                unparsed.append((chunk, time.time_ns()))
            else:
                if unparsed is not None:
                    self._parse_unparsed()
                assert self._parser is not None
                self._keep(self._parser.feed(chunk), time.time_ns())
            self._held_bytes += len(chunk)
            if self._held_bytes > HOLD_BYTES or len(held) + len(self.unparsed or ()) > HOLD_PIECES:
                self._tracker.follow(self)
        elif self._parser is not None:
            self._feed(chunk)
        elif not self._json:
            self._json = chunk
        elif len(self._json) <= MAX_PARSED_BODY:
            if type(self._json) is bytes:  # a second chunk: joined in place from now on
                self._json = bytearray(self._json)
            self._json += chunk

    def _feed(self, chunk: bytes) -> None:
        assert self._parser is not None
        stream = self._stream
        if stream is None or stream.ended:
            return
        self._follow(stream, self._parser.feed(chunk))

    def _follow(self, stream: Stream, frames: list[SSEFrame]) -> None:
        for frame in frames:
            self._tracker.frame(stream, frame, classify_frame(frame.data) if frame.data else ())

    def _keep(self, frames: list[SSEFrame], seen: int) -> None:
        held = self.held
        assert held is not None
        if self._opener is not None:  # deferred: the frames the healthy path has, kept without a stream
            taken = self._deferred(held, frames, seen)
            if taken == len(frames):
                return
            frames = frames[taken:]
        stream = self._followed()
        assert stream is not None
        for frame in frames:
            messages = classify_frame(frame.data) if frame.data else ()
            held.append((frame, messages, seen))
            if not frame.event or frame.event == "message":  # what ``Tracker.frame`` reads messages of
                for msg in messages:
                    if msg.id is not None and msg.is_terminal:
                        self._tracker.deliver(stream, msg, frame.id)

    def _deferred(self, held: list[HeldFrame], frames: list[SSEFrame], seen: int) -> int:
        """How many of ``frames`` a deferred answer keeps on the healthy path: frames with no data before
        its call's result, and that result, which ends the call now (``Tracker.answered``)."""
        for taken, frame in enumerate(frames):
            if self._answered or (frame.event and frame.event != "message"):
                return taken
            messages = classify_frame(frame.data) if frame.data else ()
            if messages:
                if not self._tracker.answered(self._calls, messages, frame.id):
                    return taken
                self._answered = True
            held.append((frame, messages, seen))
        return len(frames)

    def _healthy(self, chunk: bytes) -> bool:
        """Whether ``chunk``, whole frames in the SDK's form (it sends one a chunk), keeps a deferred answer on the
        healthy path as ``_deferred`` reads it, known by their heads alone (no parse, no decoding): frames with
        no data before the call's result, then perhaps that result, which ends the call now
        (``Tracker.answered_by``). Anything else is for the parser: what was held unparsed is parsed first
        (``_parse_unparsed``)."""
        if self._answered:
            return False
        at = empty_frames(chunk)
        if at == len(chunk):
            return True
        head = message_frame(chunk, at)
        if head is None:
            return False
        request_id = result_id(chunk, head[1])
        if self.pending is not None:
            if request_id != self.pending_id:
                return False
            if isinstance(self.pending, _Pending):
                self._answered_early = self.pending
            self._take_pending((sc.STREAM_KIND_POST, head[0]))
        elif not self._tracker.answered_by(self._calls, request_id, head[0]):
            return False
        self._answered = True
        return True

    def _parse_unparsed(self) -> None:
        """The chunks held unparsed (``_healthy``), parsed now into the frames ``_deferred`` would have kept."""
        unparsed, self.unparsed = self.unparsed, None
        held, parser = self.held, self._parser
        assert unparsed is not None
        assert held is not None
        assert parser is not None
        for chunk, seen in unparsed:
            for frame in parser.feed(chunk):
                held.append((frame, classify_frame(frame.data) if frame.data else (), seen))

    def read_held(self) -> list[HeldFrame]:
        """The frames held so far (``Holder``); the chunks that follow are followed frame by frame."""
        if self.unparsed is not None:
            self._parse_unparsed()
        held, self.held = self.held, None
        return held or []

    def hold(self, session_id: str | None) -> None:
        """Held for its calls (``Tracker.hold``): what needs them first opens it and reads what it kept."""
        self._holding, self._session_id = True, session_id
        if self._calls:  # else its pending call, once it starts (``started``)
            self._tracker.hold(self, self._calls, session_id, False)  # not resumable

    def started(self, call: Call) -> None:
        """Its pending call started (something looked it up, or its answer is not its result): one it carries."""
        self.pending = None
        self._calls.append(call)
        if self._holding:
            self._tracker.hold(self, (call,), self._session_id, False)

    def _take_pending(self, terminal: Terminal | None) -> None:
        """Its pending call's answer: where its result came (``terminal``), or None: it starts."""
        pending, self.pending = self.pending, None
        if pending is not None and (call := pending(terminal)) is not None:
            self.started(call)

    def held_stream(self) -> Stream:
        """The held stream, opened now if it was deferred (``Holder``)."""
        stream = self._followed()
        assert stream is not None  # a POST carrying calls always has one
        return stream

    def _followed(self) -> Stream | None:
        """The stream, opened now if it was deferred: None once a deferred answer was the call's result."""
        if self.pending is not None:  # no answer, or one cut short: the call starts, and its stream opens
            self._take_pending(None)
        elif self._answered_early is not None and self._opener is not None:  # it deviates after its result
            answered, self._answered_early = self._answered_early, None
            assert answered.answered is not None
            call = answered.answered_late()
            self.started(call)
            self._tracker.answered_by(self._calls, call.key[1], answered.answered[1])
        if self._opener is not None:
            self._stream, self._opener = self._opener(self if self._holding else None), None
        return self._stream

    def _ended(self) -> None:
        """The server ended the response: its JSON body, if any, is read, and what the end of an SSE
        body dispatches (a frame its last CR ended, as httpx2 reads it) goes where its chunks went."""
        if self._parser is not None and (last := self._parser.close()):
            if self.held is not None:
                self._keep(last, time.time_ns())
            elif self._stream is not None and not self._stream.ended:
                self._follow(self._stream, last)
        body, messages = self._json, None
        if self.pending is not None:
            if body and result_id(body) == self.pending_id:  # its result: the healthy path, the call never started
                self._take_pending(_POST_TERMINAL)
                self._opener = None
                return
            self._take_pending(None)
        if self._opener is not None:
            if body and not self._answered:  # its call's result? By its head alone where that ends the call
                if self._tracker.answered_by(self._calls, result_id(body)):
                    self._answered = True
                else:
                    messages = classify_body(body)
                    self._answered = self._tracker.answered(self._calls, messages)
            if self._answered:
                self._settle()
                return
        if body and messages is None:
            messages = classify_body(body)
        stream = self._followed()
        if stream is None:
            return
        status = self._status
        if messages is not None:
            self._tracker.frame(stream, None, messages if status < 300 else _at_error_status(messages, self._calls))
        self._tracker.end_stream(stream, sc.END_HTTP_ERROR if status >= 300 else sc.END_CLEAN, status)

    def _settle(self) -> None:
        """A deferred answer that carried its call's result and nothing else ends unopened (``Tracker.settle``)."""
        self._opener = None
        if self._holding and self._calls:  # none when its pending call never started
            self._tracker.settle(self, self._calls, self._session_id)

    def _end(self, reason: str) -> None:
        if self._opener is not None and self._answered:
            self._settle()
            return
        stream = self._followed()
        if stream is not None:  # an error's answer ends as one, read or not
            self._tracker.end_stream(stream, sc.END_HTTP_ERROR if self._status >= 300 else reason, self._status)

    def aclose(self) -> Coroutine[Any, Any, None]:
        self._end_as(sc.END_CLOSED)
        chunks = self._chunks
        # an exhausted generator has nothing to close: closing it anyway costs a coroutine
        if not self._exhausted and isinstance(chunks, types.AsyncGeneratorType) and not chunks.ag_running:
            return self._close(chunks)
        return self._inner.aclose()  # its coroutine, not one more around it

    async def _close(self, chunks: types.AsyncGeneratorType[bytes, None]) -> None:
        await chunks.aclose()
        await self._inner.aclose()


class _Pending:
    """A resumable session's call left pending (``ClientInstrumentation._request_calls``), registered for its
    session's look-ups (``Tracker.pend``): a cancel, a re-used id, shutdown start it as of its request, before
    or after its answer came (then its tap carries it: ``_TapStream.started``)."""

    __slots__ = ("_answer", "_key", "_tracker", "answered", "call", "tap")

    def __init__(self, answer: PendingAnswer, tracker: Tracker, key: CallKey) -> None:
        self._answer: PendingAnswer | None = answer
        self._tracker = tracker
        self._key = key
        self.call: Call | None = None  # started by a look-up before its answer came
        self.answered: Terminal | None = None  # where its result came: it ended on the healthy path, never started
        self.tap: _TapStream | None = None  # its answer's, once that came

    def __call__(self, terminal: Terminal | None) -> Call | None:
        """``ClientInstrumentation._answer``, once: None if a look-up started it already. Its result (``terminal``)
        leaves it startable (``answered_late``) for a stream that deviates after it."""
        answer = self._answer
        if answer is None or self.answered is not None:
            return None
        self._tracker.unpend(self._key)
        if terminal is None:
            self._answer = None
        else:
            self.answered = terminal
        return answer(terminal)

    def forget(self) -> None:
        """Its request was redirected, which loses nothing (the SDK sends it again where it points, or fails it): no
        longer pending, never started, unless a look-up started it already."""
        if self._answer is not None and self.answered is None:
            self._answer = None
            self._tracker.unpend(self._key)

    def answered_late(self) -> Call:
        """The call its result ended on the healthy path (``answered``), started now for a stream that deviated
        after that result: ended as it was by the caller (``Tracker.answered_by``), once it counts the stream."""
        answer, self._answer = self._answer, None
        assert answer is not None
        return _started(answer, None)

    def start_pending(self) -> None:
        call = self(None)
        if call is None:
            return
        if self.tap is not None:
            self.tap.started(call)
        else:
            self.call = call


def _started(pending: PendingAnswer, early: _Pending | None) -> Call:
    """A pending call, started now (its answer is no result, or there is none); or the one a look-up started."""
    if early is not None and early.call is not None:
        return early.call
    call = pending(None)
    assert call is not None
    return call


def _picked(headers: httpx2.Headers, names: Mapping[bytes, str]) -> dict[str, str]:
    """``headers.pick`` of httpx2's headers, read off the lower-cased names it keeps beside the raw ones
    (``Headers._list``, pinned by tests/integration/test_sdk_contract.py): no list of pairs built, no
    name lowered and hashed again, on every request and response."""
    picked: dict[str, str] = {}
    for _, key, value in headers._list:  # a loop, not a comprehension: that would be one more call
        if key in names and names[key] not in picked:  # the first, as the server reads it
            picked[names[key]] = value.decode("latin-1")
    return picked


def _fingerprint(salt: bytes, tool: str | None, arguments: Any) -> str:
    """Which call this is, for matching a re-issue to the call it repeats: a salted hash of the tool
    and its canonical arguments (sorted keys, no whitespace), never the arguments themselves."""
    try:
        if type(arguments) is EncodedArguments:
            arguments = arguments.value()
        canonical = json.dumps(arguments, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    except (RecursionError, ValueError):  # nested deeper than JSON is read or written here: known by its tool alone
        canonical = "\x00"
    digest = hmac.new(salt, f"{tool}\x00{canonical}".encode(), hashlib.sha256)
    return digest.hexdigest()[:_FINGERPRINT_CHARS]


class ClientTap(httpx2.AsyncBaseTransport):
    """An ``httpx2`` transport that observes the MCP exchanges going through ``inner``."""

    def __init__(self, inner: httpx2.AsyncBaseTransport, instrumentation: ClientInstrumentation) -> None:
        self._inner = inner
        self.instrumentation = instrumentation

    def handle_async_request(self, request: httpx2.Request) -> Coroutine[Any, Any, httpx2.Response]:
        return self.instrumentation.handle(self._inner, request)  # its coroutine, not one more around it

    async def __aenter__(self) -> ClientTap:
        await self._inner.__aenter__()
        return self

    async def aclose(self) -> None:
        self.instrumentation.tracker.client_closed()  # its client closes: the SDK's calls through it are over
        await self._inner.aclose()


def instrument_client(
    client: httpx2.AsyncClient | None = None,
    *,
    policy: ToolPolicy | None = None,
    token_reader: TokenReader | None = None,
    tracer_provider: trace.TracerProvider | None = None,
    **client_options: Any,
) -> httpx2.AsyncClient:
    """An ``httpx2.AsyncClient`` for ``streamable_http_client(url, http_client=...)``, with the tap.

    Without ``client``, builds one with the MCP SDK's default timeouts (``client_options`` go to
    ``httpx2.AsyncClient``, e.g. ``auth=``, ``proxy=``), its transports as ``httpx2`` builds them (a proxy from the
    environment included). Either way every transport the client routes through is tapped in place, its own and its
    mounts' (a proxy's): that touches ``AsyncClient._transport`` and ``_mounts``, which
    ``tests/integration/test_sdk_contract.py`` pins. Its ``build_request`` reads what a body asks for off the
    SDK's message as it is encoded (``reads_messages``: a plain ``AsyncClient`` becomes a subclass of itself).
    """
    instr = ClientInstrumentation(policy=policy, token_reader=token_reader, tracer_provider=tracer_provider)
    if client is None:
        client_options.setdefault("timeout", httpx2.Timeout(MCP_DEFAULT_TIMEOUT, read=MCP_DEFAULT_SSE_READ_TIMEOUT))
        client = httpx2.AsyncClient(**client_options)
    reads_messages(client)
    client._transport = ClientTap(client._transport, instr)
    client._mounts = {pattern: None if transport is None else ClientTap(transport, instr)
                      for pattern, transport in client._mounts.items()}
    return client


def reads_messages(client: httpx2.AsyncClient) -> None:
    """``client``, a plain ``AsyncClient``, made a ``_ReadingClient`` in place; one of another class left as it is."""
    if type(client) is httpx2.AsyncClient:
        client.__class__ = _ReadingClient


class _ReadingClient(httpx2.AsyncClient):
    """``httpx2.AsyncClient`` whose ``build_request`` leaves in a request whose body is a JSON object (``json=``, as
    the SDK sends every message: its ``model_dump``, which ``httpx2`` encodes right there) what that body asks for,
    read off the object (``read_message``), so the tap need not decode and parse the body again. A class, not a
    method set on the instance, so that a copy of the client builds with its own settings; only a plain
    ``AsyncClient`` becomes one (``reads_messages``): a subclass's own ``build_request`` may send another body than
    the object it was handed. A request built otherwise (a body given as bytes, a stream, a form; a redirect's or an
    auth flow's with another body) is read off the wire."""

    def build_request(self, *args: Any, **kwargs: Any) -> httpx2.Request:
        request = httpx2.AsyncClient.build_request(self, *args, **kwargs)
        message = kwargs.get("json")
        if (type(message) is dict and kwargs.get("content") is None and kwargs.get("data") is None
                and kwargs.get("files") is None and isinstance(request.stream, httpx2.ByteStream)):
            try:
                asked = read_message(message, request.content)
            except Exception:  # the hooks' reading never fails the application's: read off its bytes, or not at all
                _defects.report("a request")
                asked = None
            if asked is not None:
                # with its body's stream: a redirect's request shares the extensions, and carries that body or none
                request.extensions[_ASKED] = (request.stream, asked)
        return request
