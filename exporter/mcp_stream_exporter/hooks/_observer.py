"""The server's wire: an ASGI observer that turns every exchange on the MCP endpoint into tracker input.

Every request, status and SSE frame, a client disconnect told apart from a server end, and what the
``ToolPolicy`` requires of each ``tools/call`` against the request's token. It changes nothing: a
call refused by whatever enforces the policy (``guard.CallGuard``) is seen as its JSON-RPC error.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from opentelemetry.context import Context, get_current

from mcp_stream_exporter import scope as request_scope
from mcp_stream_exporter import semconv as sc
from mcp_stream_exporter.asgi import ASGIApp, Message, Receive, Scope, Send, route_path
from mcp_stream_exporter.auth import NOTHING_MISSING, Requirement, TokenReader, ToolPolicy
from mcp_stream_exporter.coding import Decoder, decoder_for
from mcp_stream_exporter.exchange import (
    AUTHORIZATION,
    CONTENT_ENCODING,
    CONTENT_JSON,
    CONTENT_SSE,
    CONTENT_TYPE,
    LAST_EVENT_ID,
    PROTOCOL_VERSION,
    REQUEST_HEADERS,
    RESPONSE_HEADERS,
    SESSION_ID,
    calls_only,
    can_ask,
    content_of,
    era_of,
    most_calls,
    read_body,
    stream_kind,
)
from mcp_stream_exporter.headers import pick, values
from mcp_stream_exporter.hooks import _defects
from mcp_stream_exporter.hooks._owners import SessionOwners
from mcp_stream_exporter.hooks._recorder import outcome_of
from mcp_stream_exporter.hooks._spans import Call, CallKey, Stream, lacks
from mcp_stream_exporter.hooks._tracking import HOLD_BYTES, HOLD_PIECES, HeldFrame, Requirements, Tracker
from mcp_stream_exporter.sse import SSEFrame, SSEParser, empty_frames, message_frame, whole_frame
from mcp_stream_exporter.wire import (
    MAX_PARSED_BODY,
    REFUSED_ERROR_CODE,
    TOOLS_CALL,
    WireMessage,
    classify_body,
    classify_frame,
    request_message,
    result_id,
)

_EXCHANGE = "mcp_stream.exchange"  # where the observer leaves its _Exchange in the ASGI scope
# what Streamable HTTP sends: a health check's HEAD or a browser's CORS preflight (OPTIONS) is no stream
_MCP_METHODS = frozenset({"POST", "GET", "DELETE"})
# what only an MCP client's requests to its endpoint carry (after ``initialize``): a POST elsewhere with it is told of
_MCP_HEADERS: Mapping[bytes, str] = {SESSION_ID.encode(): SESSION_ID}
_log = logging.getLogger("mcp_stream_exporter.hooks")
DECISION_ALLOWED = "allowed"
DECISION_REFUSED = "refused"
DECISION_UNKNOWN_TOOL = "unknown_tool"
# What the policy says of a call (``WireObserver._judge``): its requirement, what the token lacks of it, the decision
Judged = tuple[Requirement | None, tuple[frozenset[str], frozenset[str]], str]


class _Exchange:
    """One HTTP request to the MCP endpoint and its response, as the observer sees them."""

    __slots__ = ("asked_in", "body", "calls", "cancelled", "complete", "context", "cursor", "decoder", "deferred",
                 "disconnected", "failed", "held", "held_bytes", "json_body", "method", "observer", "oversized",
                 "parser", "pending", "protocol_version", "scope", "start_ns", "status", "stream", "tracker", "unread")

    def __init__(self, observer: WireObserver, method: str, start_ns: int, cursor: str | None,
                 scope: request_scope.RequestScope, protocol_version: str | None) -> None:
        self.observer = observer  # reads a body left unread (``unread``) when its calls are needed first
        self.tracker = observer.tracker
        self.method = method
        self.start_ns = start_ns
        self.cursor = cursor  # Last-Event-ID
        self.scope = scope
        self.asked_in = scope.session_id  # the request's session: its calls', whatever session the answer names
        self.protocol_version = protocol_version
        self.body: bytearray | None = None  # a body that comes in several messages, gathered
        # a body of calls only, left for the SDK's middleware (``dispatched``): read if anything needs its calls first
        self.unread: bytes | None = None
        # where a body left unread would have been read: a call started later makes a span at once in it, as it
        # would have then (its parent, when the SDK's ``traceparent`` gives none)
        self.context: Context | None = None
        self.calls: list[Call] = []
        self.cancelled: tuple[str, ...] = ()  # the calls the body cancels: cancelled once the server accepts it
        # the exchange's one call, handed over by the SDK's middleware, not started as a ``Call`` until something
        # other than its result comes (``start_pending``): the healthy path never starts it. A stateless call's
        # JSON answer is read at its end; a resumable session's, held SSE, is registered for look-ups by its key
        # (``Tracker.pend``), None for a stateless call
        self.pending: tuple[WireMessage, Judged, Context, CallKey | None] | None = None
        self.stream: Stream | None = None
        # the content of an answer whose stream is opened only if it deviates (``open``): a stateless call's
        # JSON answer, a POST's SSE stream (held)
        self.deferred: str | None = None
        self.parser: SSEParser | None = None
        self.held: list[tuple[bytes, int]] | None = None  # a POST's SSE chunks and when each was sent, unread
        self.held_bytes = 0
        self.complete = False  # the app sent the body's last message (before ``follow``: it reads all that is held)
        self.json_body: bytearray | None = None
        self.status = 0
        self.disconnected = False
        self.oversized = False
        self.decoder: Decoder | None = None  # an answer a middleware inside the observed app compressed
        self.failed = False  # the hooks failed to read it (``_defects``): left unobserved from then on

    def abandon(self) -> None:
        """The hooks could not read it (``_defects``): the tracker lets go of it and its calls, judging nothing."""
        self.take_unread()
        if self.pending is not None and self.pending[3] is not None:
            self.tracker.unpend(self.pending[3])
        self.pending = None
        self.tracker.abandon(self, self.calls, self.scope.session_id)

    def decoded(self, message: Message) -> Message:
        """A compressed answer's body message, as the app's SDK wrote it."""
        assert self.decoder is not None
        body = self.decoder(message.get("body", b""))
        more = message.get("more_body", False)
        if not more:
            body += self.decoder.flush()
        return {"type": "http.response.body", "body": body, "more_body": more}

    def release(self) -> None:
        """The exchange is over: let go of its calls, stream and parser. The app's objects that hold our
        ``receive`` and ``send`` (and the scope) are often in reference cycles, which only the garbage
        collector frees: what they reach would otherwise wait for it, and make its passes more frequent."""
        if self.pending is not None and self.pending[3] is not None:  # a resumable session's: tracked, as any other
            self.start_pending()
        for call in self.calls:
            if not call.done:
                call.exchange_over()
                if call.stored_result is not None and not call.open_streams and not call.replaying:
                    self.tracker.unsent(call)  # stored, and its exchange ended without carrying it
        self.calls.clear()
        self.pending = None  # a stateless call never started: its exchange ended with no stream to judge it
        self.stream = self.parser = self.held = self.json_body = self.unread = None

    def start(self, msg: WireMessage, judged: Judged, session_id: str | None, stateless: bool) -> Call:
        """A call of this exchange, started with what the policy says of it; held with the exchange's SSE
        answer if that is held already (its response started before the SDK handed the call over)."""
        call = self.tracker.start_call(session_id, msg, self.protocol_version, self.scope.auth, stateless,
                                       self.start_ns)
        requirement, missing, decision = judged
        call.require(requirement, missing, decision)
        call.on_exchange = True
        self.calls.append(call)
        if self.held is not None:
            self.tracker.hold(self, (call,), self.scope.session_id, True)
        return call

    def start_pending(self) -> None:
        """Start the call left pending (``pending``) exactly as it would have been when it was handed over,
        with its result's store if that came meanwhile (``Tracker.keep_stored``)."""
        pending, self.pending = self.pending, None
        if pending is not None:
            msg, judged, context, key = pending
            kept = () if key is None else self.tracker.unpend(key)
            call = self.start(msg, judged, self.asked_in, key is None)
            call.in_sdk_request(context)
            for fields, timestamp, message in kept:
                call.event(sc.EVENT_STORED, fields, timestamp)
                self.tracker.stored(call, fields[1] or "", outcome_of(message), timestamp)

    def read_unread(self) -> None:
        """Read the body left unread now (``Unread``): a look-up of a call of its session needs its calls."""
        self.observer.read_unread(self)

    def take_unread(self) -> bytes | None:
        """The body left unread, taken: to be read, or its call handed over; no look-up needs it any more."""
        body, self.unread = self.unread, None
        if body is not None:
            self.tracker.read(self, self.asked_in)
        return body

    def open(self, content: str) -> Stream | None:
        """Its stream, opened now, with every call it carries and the calls a resume continues
        (``Tracker.open_stream``)."""
        if self.unread is not None:
            self.read_unread()
        self.start_pending()
        if self.held is not None and not self.calls:  # held for calls its body turned out not to carry: as if never
            self.tracker.settle(self, (), self.scope.session_id)
            self.held = None
        cursor, calls, scope = self.cursor, self.calls, self.scope
        if cursor:
            calls = calls + list(self.tracker.calls_of_cursor(scope.session_id, cursor))
        self.deferred = None
        self.stream = self.tracker.open_stream(stream_kind(self.method, cursor), scope.session_id, calls,
                                               (self.method, content, self.protocol_version, cursor), scope.auth,
                                               self.status, start_time=self.start_ns,
                                               holder=self if self.held is not None else None)
        return self.stream

    def held_stream(self) -> Stream | None:
        """The held POST's stream, opened now if it was not yet (``Holder``): None if it carried no call."""
        return self.stream if self.deferred is None else self.open(self.deferred)

    def read_held(self) -> list[HeldFrame]:
        """The SSE chunks held so far, parsed now, each frame with the time its chunk was sent; the
        parser goes on from there with the chunks that follow (``Holder``). A refusal among them is
        recorded on its call before anything reads them, as following them would have."""
        held, self.held = self.held, None
        frames: list[HeldFrame] = []
        if held is None:
            return frames
        parser = self.parser = SSEParser()
        for chunk, seen in held:
            self._read(parser.feed(chunk), seen, frames)
        if self.complete and held:  # what the body's end dispatches, at its last chunk's time
            self._read(parser.close(), held[-1][1], frames)
        return frames

    def _read(self, parsed: list[SSEFrame], seen: int, frames: list[HeldFrame]) -> None:
        for frame in parsed:
            if frame.data:
                messages = classify_frame(frame.data)
                for msg in messages:
                    if msg.error_code is not None:
                        _refusals(self.calls, messages)
                        break
                frames.append((frame, messages, seen))
            else:
                frames.append((frame, (), seen))


class WireObserver:
    """Observes the ASGI app's exchanges on one MCP endpoint for the server's tracker."""

    def __init__(self, tracker: Tracker, requirements: Requirements, policy: ToolPolicy, tokens: TokenReader,
                 path: str) -> None:
        self.tracker = tracker
        self.requirements = requirements
        self.policy = policy
        self.tokens = tokens
        self.path = path.rstrip("/")
        self.owners = SessionOwners()
        # whether the SDK holds a session still (``instrument_server`` given the server); None: not known, and every
        # 404 to another principal than a session's opener reads as the SDK's refusal of a live session
        self.holds: Callable[[str], bool] | None = None
        self._endpoint_seen = False  # until a request comes to the endpoint, one elsewhere may say why (``_elsewhere``)

    def asgi(self, app: ASGIApp) -> ASGIApp:
        """Wrap the ASGI app: every exchange on the MCP endpoint becomes a stream span."""
        tracker = self.tracker

        async def observed(scope: Scope, receive: Receive, send: Send) -> None:
            if (scope["type"] != "http" or scope["method"] not in _MCP_METHODS
                    or route_path(scope).rstrip("/") != self.path):
                if not self._endpoint_seen and scope["type"] == "http" and scope["method"] == "POST":
                    self._elsewhere(scope)
                await app(scope, receive, send)
                return
            self._endpoint_seen = True
            try:
                headers = pick(scope.get("headers", ()), REQUEST_HEADERS, True)  # lowered
                rs = request_scope.RequestScope(headers.get(SESSION_ID),
                                                self.tokens.from_authorization(headers.get(AUTHORIZATION)))
                ex = _Exchange(self, scope.get("method", ""), time.time_ns(), headers.get(LAST_EVENT_ID), rs,
                               headers.get(PROTOCOL_VERSION))
            except Exception:  # the hooks' reading never fails the application's: the exchange goes unobserved
                _defects.report("an exchange")
                await app(scope, receive, send)
                return
            token = request_scope.bind(rs)
            outer = scope.get(_EXCHANGE)  # another observer's, around this one (an app instrumented twice)
            scope[_EXCHANGE] = ex  # the SDK hands this scope to middleware as ctx.request.scope
            deleting: tuple[str, int] | None = None  # a DELETE of the session the SDK may act on (``deleting``)

            async def observed_receive() -> Message:
                nonlocal deleting
                message = await receive()
                if ex.failed:
                    return message
                try:
                    kind = message["type"]
                    if kind == "http.request":
                        if ex.method == "POST" and not ex.oversized:
                            self._on_body(ex, message)
                        elif (ex.method == "DELETE" and rs.session_id is not None and deleting is None
                              and not message.get("more_body", False)):
                            # read whole: the SDK acts on none before (its body limit reads every body first), so one
                            # whose body is held back ends nothing, and no stream waits on it
                            deleting = (rs.session_id, tracker.deleting(rs.session_id))
                    elif kind == "http.disconnect":
                        if ex.method == "DELETE" and rs.session_id is not None and deleting is None:
                            deleting = (rs.session_id, tracker.deleting(rs.session_id))  # the SDK acts on it as it is
                        ex.disconnected = True
                        stream = ex.stream if ex.deferred is None else ex.open(ex.deferred)
                        if stream is not None:
                            tracker.end_stream(stream, sc.END_DROPPED, ex.status)
                except Exception:  # the hooks' reading never fails the application's
                    self._failed(ex)
                return message

            def observed_send(message: Message) -> Awaitable[None]:  # send's own awaitable: no coroutine of ours
                nonlocal deleting
                if ex.failed:
                    return send(message)
                try:
                    kind = message["type"]
                    if kind == "http.response.body":
                        if not message.get("more_body", False):
                            ex.complete = True
                        self._on_response_body(ex, message if ex.decoder is None else ex.decoded(message))
                    elif kind == "http.response.start":
                        self._on_response_start(ex, message)
                        if ex.status == 404 or rs.session_id is not ex.asked_in:  # a 404, or a session opened
                            self._owned(ex, scope)
                        if deleting is not None:
                            if 200 <= ex.status < 300:
                                self.owners.ended(deleting[0])
                            tracker.deleted(*deleting, ex.status)
                            deleting = None
                except Exception:
                    self._failed(ex)
                return send(message)

            try:
                await app(scope, observed_receive, observed_send)
            finally:
                request_scope.unbind(token)
                if outer is None:
                    del scope[_EXCHANGE]
                else:
                    scope[_EXCHANGE] = outer
                try:
                    if deleting is not None:  # never answered
                        tracker.deleted(*deleting, None)
                    if not ex.failed:
                        if ex.unread is not None:  # calls the SDK's middleware never saw, and no stream read them
                            self.read_unread(ex)
                        stream = ex.stream if ex.deferred is None else ex.open(ex.deferred)
                        if stream is not None:
                            # an app that returned or failed (a cancel at shutdown) before its body's last message
                            # leaves a response its client reads as cut short, not ended
                            complete = ex.complete and not ex.disconnected
                            tracker.end_stream(stream, sc.END_CLEAN if complete else sc.END_DROPPED, ex.status)
                    ex.release()
                except Exception:
                    self._failed(ex)

        return observed

    def _elsewhere(self, scope: Scope) -> None:
        """A POST of an MCP session to another path than the endpoint's, before any request came to the endpoint:
        most likely the hooks were given the endpoint's path as the SDK's app routes it, and observe an app that
        mounts that one under a prefix. They would observe nothing, silently: said once, as a warning (another
        server's endpoint in the same app, observed by hooks of its own, reads the same: the warning says so)."""
        if pick(scope.get("headers", ()), _MCP_HEADERS, True):
            path = route_path(scope).rstrip("/")
            self._endpoint_seen = True
            _log.warning("MCP requests come to %r, which these hooks do not observe: they observe %r. If that is the "
                         "endpoint they are for, give instrument_server its path as the app it observes routes it "
                         "(streamable_http_path=...)", path[:200] or "/", self.path or "/")

    @staticmethod
    def _failed(ex: _Exchange) -> None:
        """The hooks could not read this exchange (``_defects``): it goes on unobserved, and the tracker lets go of
        it and its calls."""
        _defects.report("an exchange")
        if not ex.failed:
            ex.failed = True
            with contextlib.suppress(Exception):
                ex.abandon()

    def _owned(self, ex: _Exchange, scope: Scope) -> None:
        """Who opened a session its first answer names; and a 404 the SDK gave another principal than that, which
        tells nothing of the session (``SessionOwners``), marked on its stream's span. A cancel its opener sent
        after the session was gone (404) cancels nothing, but tells, as a late cancel does, that the client never
        got a result that went out before (``Tracker.cancelled_in_gone``): a half-open connection's loss, whose
        session ended before its caller's timeout."""
        session_id = ex.scope.session_id
        if session_id is None:
            return
        if ex.asked_in is None:
            if ex.status < 300:
                self.owners.opened(session_id, scope)
        elif ex.cancelled and self.owners.same(session_id, scope):
            for request_id in ex.cancelled:
                self.tracker.cancelled_in_gone((session_id, request_id))
        elif ex.stream is not None and self.owners.other(session_id, scope) and (
                self.holds is None or self.holds(session_id)):  # else gone (idle timeout, terminate): as it tells
            ex.stream.also({sc.SESSION_OWNER: sc.SESSION_OWNER_OTHER})

    def dispatched(self, request: Any, request_id: str | int, params: Any, context: Context) -> None:
        """The ``tools/call`` the SDK's server middleware is about to run, in ``context`` (where the SDK's
        own span for it is current), as a call of the exchange the observer left in its request's ASGI
        scope (the SDK's ``ctx.request``): the one already read from the body, or one taken here from the
        SDK's own parse of a body left unread. A stateless body's one call that the policy has nothing against
        is left pending (``_Exchange.pending``), as is a resumable session's whose SSE answer is held already:
        started only if its exchange shows anything but its result."""
        ex = getattr(request, "scope", {}).get(_EXCHANGE)
        if not isinstance(ex, _Exchange) or ex.observer is not self or ex.failed:
            return  # another app's exchange (``instrument_server`` run twice on one server): its own middleware's
        wire_id = str(request_id)
        for call in ex.calls:
            if call.key[1] == wire_id:
                call.in_sdk_request(context)
                if not call.stateless:
                    self.tracker.runs(call.key, call)
                self.tracker.doomed(call)
                return
        body = ex.unread
        if body is None:  # read already: a call it did not hold is none of this exchange's
            return
        msg = request_message(request_id, TOOLS_CALL, params)
        if msg.id is None:
            return
        stateless = era_of(ex.protocol_version) == sc.ERA_STATELESS
        if not stateless:
            self.tracker.runs((ex.asked_in, msg.id))
        judged, deviates = self._judge(ex, msg, stateless)
        taken = len(ex.calls) + 1
        if taken >= most_calls(body):  # every call the body can hold is taken: nothing left to read
            ex.take_unread()
            if taken == 1 and not deviates:
                if stateless:  # its answer most likely JSON, read at its end
                    if ex.held is None:
                        ex.pending = (msg, judged, context, None)
                        return
                elif ex.held is not None:  # its SSE answer held already, read at its end: a look-up starts it
                    key = (ex.asked_in, msg.id)
                    if self.tracker.pend(key, ex):
                        ex.pending = (msg, judged, context, key)
                        return
        call = self._start_call(ex, msg, judged, deviates, stateless)
        call.in_sdk_request(context)
        self.tracker.doomed(call)  # a session whose store failed: it will never be sent its result

    def _on_body(self, ex: _Exchange, message: Message) -> None:
        body: bytes = message.get("body", b"")
        more = message.get("more_body", False)
        if more or ex.body:  # a body in several messages: gathered (one message, the usual, is read as it is)
            if ex.body is None:
                ex.body = bytearray()
            ex.body += body
            if len(ex.body) > MAX_PARSED_BODY:  # too large to parse: observe the exchange without its calls
                ex.oversized = True
                ex.body.clear()
                return
            if more:
                return
            body = bytes(ex.body)
            ex.body.clear()
        elif len(body) > MAX_PARSED_BODY:
            ex.oversized = True
            return
        if not can_ask(body):  # no tools/call, cancel or initialize in it: nothing to parse for
            return
        if calls_only(body):
            # The SDK parses it and hands each call to its middleware (``dispatched``), mostly before its
            # response starts; a resumable session's SSE answer often starts first, and is then held
            # (``_on_response_start``) until the SDK hands the call over. Read only when something needs its
            # calls first: a response not held, the held stream opened, a look-up of a call of its session
            # (``Tracker.call``), the exchange's end. A resumable session's batch (2025-03-26) is read now,
            # its calls in their order, whatever order the SDK hands them over in.
            stateless = era_of(ex.protocol_version) == sc.ERA_STATELESS
            if stateless or most_calls(body) == 1:
                ex.unread = body
                if not stateless:
                    ex.context = get_current()
                    self.tracker.unread(ex, ex.asked_in)
                return
        self._read(ex, body)

    def read_unread(self, ex: _Exchange) -> None:
        """Read the body left for the SDK's middleware (``_Exchange.unread``): its calls are needed first."""
        body = ex.take_unread()
        if body is not None:
            self._read(ex, body)

    def _read(self, ex: _Exchange, body: bytes) -> None:
        asked = read_body(body)
        if asked.protocol_version is not None:
            ex.protocol_version = asked.protocol_version
        if asked.calls:
            started = {call.key[1] for call in ex.calls} if ex.calls else ()  # by the SDK's middleware
            stateless = era_of(ex.protocol_version) == sc.ERA_STATELESS
            for msg in asked.calls:
                if msg.id not in started:
                    judged, deviates = self._judge(ex, msg, stateless)
                    self._start_call(ex, msg, judged, deviates, stateless)
        ex.cancelled = asked.cancelled

    def _start_call(self, ex: _Exchange, msg: WireMessage, judged: Judged, deviates: bool, stateless: bool) -> Call:
        """A call started now with what the policy says of it (``_judge``): a span at once if that deviates."""
        call = ex.start(msg, judged, ex.asked_in, stateless)
        if deviates:
            self.tracker.span_of(call, ex.context)
        return call

    def _judge(self, ex: _Exchange, msg: WireMessage, stateless: bool) -> tuple[Judged, bool]:
        """What the policy says of a call, and whether that deviates already: the token is the request's,
        so the audience gap at call time is known here, before any handler runs, and is worth a span,
        refused or not. A resumable session remembers what the call requires, for its resumes."""
        auth = ex.scope.auth
        requirement, missing = self.policy.gap(msg.tool, auth)
        if requirement is None:
            return (None, NOTHING_MISSING, DECISION_UNKNOWN_TOOL), False
        if not stateless and msg.id is not None:
            self.requirements.remember((ex.asked_in, msg.id), requirement)
        return (requirement, missing, DECISION_ALLOWED), lacks(auth, missing)

    def _on_response_start(self, ex: _Exchange, message: Message) -> None:
        status = int(message.get("status", 0))
        headers = pick(message.get("headers", ()), RESPONSE_HEADERS, True)  # lowered
        content = content_of(headers.get(CONTENT_TYPE, ""))
        if CONTENT_ENCODING in headers:  # a compressing middleware inside the observed app: read as httpx2 will
            ex.decoder = decoder_for(values(message.get("headers", ()), CONTENT_ENCODING))
        held = content == CONTENT_SSE and ex.method == "POST" and status < 400 and not ex.cursor
        if ex.unread is not None:
            if not held:  # calls the SDK's middleware did not see yet, or never will
                self.read_unread(ex)
            elif ex.context is None:  # they start when it does: in this context, as if read now
                ex.context = get_current()
        ex.status = status
        if ex.cancelled and status < 300:  # refused (the guard's 403, the SDK's 401 or 404), it cancels nothing
            for request_id in ex.cancelled:
                self.tracker.cancel((ex.asked_in, request_id))
        if ex.scope.session_id is None and SESSION_ID in headers:
            ex.scope.session_id = headers[SESSION_ID]  # initialize: the session's scope
        if ex.pending is not None:
            if content == CONTENT_JSON and status < 400 and not ex.cursor:  # most likely its result
                ex.json_body, ex.deferred = bytearray(), content
                return
            ex.start_pending()
        if content == CONTENT_SSE:
            if held and (ex.calls or ex.unread is not None):
                # held: read at its end, or when something needs it, and opened as a stream only then; with
                # its calls, and those the SDK hands over later (``_Exchange.start``)
                ex.held, ex.deferred = [], content
                self.tracker.hold(ex, ex.calls, ex.scope.session_id, True)  # resumable
                return
            ex.parser = SSEParser()
        elif content == CONTENT_JSON:
            ex.json_body = bytearray()
            calls = ex.calls
            if (len(calls) == 1 and status < 400 and ex.method == "POST" and not ex.cursor and calls[0].stateless
                    and calls[0].span is None):
                ex.deferred = content  # its one body is most likely the call's result: see ``_on_deferred_body``
                return
        ex.open(content)

    def _on_deferred_body(self, ex: _Exchange, message: Message) -> None:
        """A stateless call's JSON answer, gathered, then read once: the call's result ends it and no
        stream is followed (``Tracker.answered_by`` off its head, else ``Tracker.answered``); anything else
        opens the stream and reads the body on it, exactly as if it had been followed from the start."""
        json_body = ex.json_body
        assert json_body is not None
        body: bytes | bytearray = message.get("body", b"")
        more = message.get("more_body", False)
        if more or json_body:  # an answer in several messages: gathered (one message, the usual, is read as it is)
            if len(json_body) <= MAX_PARSED_BODY:
                json_body += body
            if more:
                return
            body = json_body
        pending = ex.pending
        if pending is not None:
            if body and result_id(body) == pending[0].id:  # its result: the healthy path, the call never started
                ex.pending = ex.deferred = None
                return
            ex.start_pending()
        if body and self.tracker.answered_by(ex.calls, result_id(body)):
            ex.deferred = None
            return
        messages = classify_body(body) if body else []
        if self.tracker.answered(ex.calls, messages):
            ex.deferred = None
            return
        stream = ex.open(CONTENT_JSON)
        assert stream is not None  # a POST carrying a call always has one
        if body:
            self._frame(ex, stream, None, messages)
        self.tracker.end_stream(stream, sc.END_CLEAN, ex.status)

    def _on_response_body(self, ex: _Exchange, message: Message) -> None:
        held = ex.held
        if held is not None:  # a held stream (``_on_response_start``): its chunks kept, read at its end
            chunk = message.get("body", b"")
            if chunk:
                held.append((chunk, time.time_ns()))
                ex.held_bytes += len(chunk)
                if ex.held_bytes > HOLD_BYTES or len(held) > HOLD_PIECES:
                    self.tracker.follow(ex)
            if ex.complete and not self._settled_unparsed(ex) and (stream := ex.held_stream()) is not None:
                self.tracker.end_stream(stream, sc.END_CLEAN, ex.status)
            return
        stream = ex.stream
        if stream is None:
            if ex.deferred is not None:
                self._on_deferred_body(ex, message)
            return
        if stream.ended:
            return
        chunk = message.get("body", b"")
        if ex.parser is not None:
            if chunk:
                self._follow(ex, stream, ex.parser.feed(chunk))
        elif ex.json_body is not None and len(ex.json_body) <= MAX_PARSED_BODY:
            ex.json_body += chunk
        if message.get("more_body", False):
            return
        if ex.parser is not None:  # a frame its last CR ended is dispatched, as the SDK's client reads it
            self._follow(ex, stream, ex.parser.close())
        if ex.json_body:
            self._frame(ex, stream, None, classify_body(ex.json_body))
        # a redirect delivers nothing either: its client sends the request again where it points, or fails it
        self.tracker.end_stream(stream, sc.END_HTTP_ERROR if ex.status >= 300 else sc.END_CLEAN, ex.status)

    def _settled_unparsed(self, ex: _Exchange) -> bool:
        """End a held POST of one call on the healthy path from one read of each chunk, never opened as a
        stream: every chunk one whole frame in the SDK's form (it sends one a chunk), none of another event
        type, no result but in the last, which is the call's own. Anything else (a ping, an error frame,
        frames split or joined, a refusal) is left to ``end_stream`` to read in full."""
        if ex.unread is not None:  # calls the SDK's middleware never handed over (an app without it)
            self.read_unread(ex)
        held, calls, pending = ex.held, ex.calls, ex.pending
        if not held or ex.status >= 400 or len(calls) + (pending is not None) != 1:
            return False
        for chunk, _ in held[:-1]:
            if empty_frames(chunk) == len(chunk):  # a priming event: no message in it
                continue
            frame = _message(chunk)
            if frame is None:
                return False
            for msg in classify_frame(frame.data) if frame.data else ():
                if msg.is_terminal:
                    return False
        last = held[-1][0]
        if pending is not None:  # a call never started: its result by the frame's head alone, or it starts
            head = message_frame(last)
            key = pending[3]
            if head is None or key is None or result_id(last, head[1]) != key[1]:
                return False
            ex.pending = None
            self.tracker.unpend(key)
            self.tracker.result_out(key, pending[0].tool, head[0], held[-1][1], pending[0].traceparent)
            if key[0] is not None:
                self.tracker.answered_healthy(key, pending[0].tool)
        elif not self._answered_by(calls, last):
            return False
        self.tracker.settle(ex, calls, ex.scope.session_id)
        ex.deferred = None
        return True

    def _answered_by(self, calls: list[Call], chunk: bytes) -> bool:
        """Whether ``chunk`` is one whole frame in the SDK's form that is the one call's result and nothing
        else, which then ends the call (``Tracker.answered``): known by its head alone where it can be."""
        head = message_frame(chunk)
        if head is not None and self.tracker.answered_by(calls, result_id(chunk, head[1]), head[0]):
            return True
        frame = _message(chunk)
        if frame is None:
            return False
        messages = classify_frame(frame.data) if frame.data else ()
        return len(messages) == 1 and self.tracker.answered(calls, messages, frame.id)

    def _follow(self, ex: _Exchange, stream: Stream, frames: list[SSEFrame]) -> None:
        for frame in frames:
            self._frame(ex, stream, frame, classify_frame(frame.data) if frame.data else ())

    def _frame(self, ex: _Exchange, stream: Stream, frame: SSEFrame | None, messages: Sequence[WireMessage]) -> None:
        _refusals(ex.calls, messages)
        self.tracker.frame(stream, frame, messages)


def _message(chunk: bytes) -> SSEFrame | None:
    """The frame ``chunk`` is when it is one whole frame in the SDK's form of the default event type."""
    frame = whole_frame(chunk)
    return frame if frame is not None and frame.event in (None, "message") else None


def _refusals(calls: Sequence[Call], messages: Sequence[WireMessage]) -> None:
    """The policy was enforced: a refusal is recorded on its call before the error ends it."""
    for msg in messages:
        if msg.error_code == REFUSED_ERROR_CODE:
            for call in calls:
                if call.key[1] == msg.id and call.decision == DECISION_ALLOWED:
                    call.require(call.requirement, call.missing, DECISION_REFUSED)
