"""``Connection``: one client connection, an ``asyncio.Protocol`` that parses with
``httptools.HttpRequestParser``, buffers each body, hands complete requests to its
server and answers them in order.

Its parser callbacks check every request against the limits (``limits``) as its head
and body arrive; ``expire`` (called by the server's tick) closes it when its client
keeps it waiting too long; ``evict`` closes it to make room for a new connection.
"""

from __future__ import annotations

import asyncio
import socket
from collections import deque
from time import monotonic
import httptools

from runtime.api.errors import (BatchScopeError, ClientError, HeadersTooLarge,
                                HttpVersionNotSupported, RequestTimeout, RequestTooLarge, ServerBusy,
                                UrlTooLong, error_answer)
from runtime.server.http1.limits import (EARLY_DRAIN_BYTES, LINGER_S, MAX_HEADER_BYTES, MAX_HEADERS,
                                         MAX_PIPELINED, MAX_URL_BYTES)
from runtime.server.http1.wire import DROPPED, Exchange, Refused, status_line

# ``HttpServer`` (``server``) imports this module, so its name in annotations here is not
# imported


class Connection(asyncio.Protocol):
    """One client connection: parse, dispatch, answer in order."""

    def __init__(self, server: "HttpServer") -> None:
        self.server = server
        self.loop = server.loop
        server.accepted += 1
        #: order of arrival among the server's connections
        self.serial = server.accepted
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.current: Exchange | None = None
        #: exchanges in arrival order; the first one is the one being answered
        self.queue: deque[Exchange] = deque()
        self.body_bytes = 0
        #: Content-Length of the request being read (0: none or chunked)
        self.declared = 0
        #: body bytes accounted for; more than this arriving takes the slow path of
        #: ``on_body`` (chunked bodies: limits and budget counted as they arrive)
        self.body_allowed = 0
        #: when the first byte of the head being read arrived (0.0: no head being read)
        self.head_since = 0.0
        #: when the first byte of the latest request arrived (kept after its head: the
        #: receive start of a traced request, ``runtime.engine.tracing``)
        self.began_s = 0.0
        #: when the body being read was asked for (its head completed, or 100 Continue)
        self.body_since = 0.0
        self.closing = False
        self.closed = False
        #: set by a refusal: close by sending FIN first, then drain (see ``close``)
        self.linger = False
        self.last_active_s = 0.0
        self.client: tuple[str, int] | None = None
        self.local: tuple[str, int] | None = None
        self.reading_paused = False
        #: set while the transport's write buffer is over its high-water mark
        self.writable: asyncio.Future | None = None
        #: when ``writable`` was last set
        self.write_blocked_since = 0.0
        #: bytes that arrived once the server's pass budget was spent, not yet parsed
        self.held = b""

    # -- asyncio.Protocol ------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
        peer = transport.get_extra_info("peername")
        here = transport.get_extra_info("sockname")
        self.client = tuple(peer[:2]) if isinstance(peer, tuple) else None
        self.local = tuple(here[:2]) if isinstance(here, tuple) else None
        self.last_active_s = monotonic()
        server = self.server
        if len(server.connections) >= server.max_connections and not server.make_room():
            self.closing = True
            server.counts["refused_at_connection_limit"] += 1
            status, headers, body = error_answer(ServerBusy(
                f"the server has its limit of {server.max_connections} connections open, all "
                "of them busy; retry in a moment", retry_after_s=1.0), "a new connection")
            transport.write(b"".join([status_line(status), server.clock.header,
                                      *(k + b": " + v + b"\r\n" for k, v in headers),
                                      b"content-length: %d\r\nconnection: close\r\n\r\n"
                                      % len(body), body]))
            transport.close()
            return
        server.connections.add(self)

    def pause_writing(self) -> None:
        if self.writable is None:
            self.writable = self.loop.create_future()
            self.write_blocked_since = self.loop.time()
            # read no more requests while the client does not read the answers: what
            # waits for it stays bounded by the transport's write buffer
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        writable, self.writable = self.writable, None
        if writable is not None and not writable.done():
            writable.set_result(None)
        if not self.reading_paused and not self.closed and not self.held:
            self.transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.resume_writing()
        self.server.connections.discard(self)
        for ex in self.queue:
            if ex.disconnect is not None and not ex.disconnect.done():
                ex.disconnect.set_result(None)
        self.queue.clear()
        if self.current is not None:
            self.release(self.current)  # its body will never be dispatched
        self.current = None
        self.server.connection_closed()

    def data_received(self, data: bytes) -> None:
        if self.closing:
            return
        # the moment the bytes came (a traced request's receive times): uvloop's loop.time()
        # is the loop's cached millisecond, on the same monotonic clock
        self.last_active_s = monotonic()
        server = self.server
        if server.shedding and self.current is None and not self.queue and not self.held:
            answer = server.shed(data)
            if answer is not None:
                self.transport.write(answer)
                return
        if server.budget <= 0 or self.held:
            if self.server.hold(self, data):
                return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # the request before the upgrade is complete; this server speaks HTTP/1.1 only
            self.closing_after_answers()
        except httptools.HttpParserError as exc:
            if isinstance(exc.__context__, Refused) or self.closing:
                return  # a callback already answered and stopped the parse
            try:
                self.refuse(ClientError(f"malformed HTTP request ({exc}); send a valid "
                                        "HTTP/1.1 request"))
            except Refused:
                pass

    # -- httptools callbacks -------------------------------------------------------------
    def on_message_begin(self) -> None:
        self.current = Exchange()
        self.body_bytes = 0
        self.declared = 0
        # the data_received call that brought this first byte set last_active_s
        self.head_since = self.began_s = self.last_active_s

    def on_url(self, url: bytes) -> None:
        ex = self.current
        ex.url += url
        if len(ex.url) > MAX_URL_BYTES:
            self.refuse(UrlTooLong(f"the request URL is longer than this server accepts "
                                   f"({MAX_URL_BYTES} bytes); send large inputs in the "
                                   "request body"))

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        ex = self.current
        headers = ex.headers
        headers.append((name, value))
        if len(headers) > 16 or len(value) > 4096:  # few short ones: nothing to add up
            self._check_headers(headers)
        if name == b"content-length":
            try:
                declared = int(value)
            except ValueError:
                declared = -1
            if declared > self.server.max_body_bytes:
                self.refuse(RequestTooLarge(
                    f"the request body of {declared} bytes is larger than this server "
                    f"accepts ({self.server.max_body_bytes} bytes); send a smaller request"))
            self.declared = declared if declared > 0 else 0
        elif name == b"host":
            ex.hosts += 1
        elif name == b"expect" and value.lower() == b"100-continue":
            ex.expect_continue = True
        elif name == b"transfer-encoding" and value.strip().lower() != b"chunked":
            # the parser undoes chunked alone: a body under another coding would be read
            # as if it had none
            self.refuse(ClientError(
                f"Transfer-Encoding {value[:60].decode('latin-1')!r} is not supported; send "
                "the body with Content-Length or 'Transfer-Encoding: chunked' (a compressed "
                "body: Content-Encoding gzip or deflate)"))

    def _check_headers(self, headers: list[tuple[bytes, bytes]]) -> None:
        size = sum(len(k) + len(v) for k, v in headers)
        if len(headers) > MAX_HEADERS or size > MAX_HEADER_BYTES:
            self.refuse(HeadersTooLarge(
                f"the request has {len(headers)} header fields of {size} bytes so far; this "
                f"server reads at most {MAX_HEADERS} fields and {MAX_HEADER_BYTES} bytes of "
                "them; send fewer or shorter headers"))

    def on_headers_complete(self) -> None:
        ex = self.current
        parser = self.parser
        ex.method = parser.get_method()
        ex.version = parser.get_http_version()
        ex.keep_alive = parser.should_keep_alive() and not self.server.stopping
        ex.is_head = ex.method == b"HEAD"
        if ex.version not in ("1.1", "1.0"):
            self.refuse(HttpVersionNotSupported(f"HTTP/{ex.version} is not supported; use "
                                                "HTTP/1.1"))
        if ex.hosts != 1 and (ex.hosts or ex.version == "1.1"):  # RFC 9112, section 3.2
            self.refuse(ClientError(f"an HTTP/{ex.version} request must carry one Host header "
                                    f"field, this one has {ex.hosts}; send 'Host: "
                                    "<host>:<port>' once"))
        self.head_since = 0.0
        self.body_since = self.last_active_s
        server = self.server
        if server.draining is not None:
            self._while_draining(ex)
        declared = self.declared
        if server.early is not None and self._early(ex, declared):
            return
        if declared:
            if server.inflight_body_bytes + declared > server.max_inflight_body_bytes:
                self.refuse(self._busy(declared))
            server.inflight_body_bytes += declared
            ex.reserved = declared
        self.body_allowed = declared
        self.queue.append(ex)
        if ex.expect_continue and self.queue[0] is ex:
            self._send_continue(ex)

    def _while_draining(self, ex: Exchange) -> None:
        """A request whose head completed while the server drains: refused with the
        drain hook's answer and the connection closed (raises ``Refused``), or, when
        the hook lets it through, served as usual as the last one on its connection."""
        ex.keep_alive = False
        path = ex.url.split(b"?", 1)[0].decode("latin-1")
        try:
            reply = self.server.draining(ex.method, path)
        except Exception as exc:
            reply = error_answer(exc, f"{ex.method.decode('latin-1')} {path[:200]} (draining)")
        if reply is not None:
            self.server.counts["drain_refusals"] += 1
            self._end_with(ex, *reply)
            raise Refused()

    def _early(self, ex: Exchange, declared: int) -> bool:
        """Ask the hook's ``early`` about the request whose head just completed; True
        when it answered (the body is then dropped, or the connection closed)."""
        url = ex.url
        if b"?" in url or b"%" in url:
            return False  # as for the fast hook: such requests go to the app
        path = url.decode("latin-1")
        try:
            reply = self.server.early(ex.method, path, ex.headers)
        except Exception as exc:
            reply = error_answer(exc, f"{ex.method.decode('latin-1')} {path[:200]} (early)")
        if reply is None:
            return False
        self.server.counts["early_answers"] += 1
        self.server.shedding = self.server.edge is not None
        if (not ex.keep_alive or ex.expect_continue or declared > EARLY_DRAIN_BYTES
                or (not declared and self._chunked(ex))):
            self._end_with(ex, *reply)
            raise Refused()
        # a small body: read it and drop it, so the connection stays usable
        ex.body = DROPPED
        self.body_allowed = declared
        self.queue.append(ex)
        self.answer(ex, *reply)
        return True

    @staticmethod
    def _chunked(ex: Exchange) -> bool:
        """True when ``ex`` has a body of unknown length (Transfer-Encoding)."""
        return any(name == b"transfer-encoding" for name, _ in ex.headers)

    def _busy(self, size: int) -> ServerBusy:
        server = self.server
        left = max(0, server.max_inflight_body_bytes - server.inflight_body_bytes)
        server.counts["refused_body_budget"] += 1
        return ServerBusy(f"the server is already holding {server.inflight_body_bytes} bytes of "
                          f"request bodies; this one ({size} bytes so far) does not fit the "
                          f"{left} bytes left of its {server.max_inflight_body_bytes}-byte "
                          "budget; retry in a moment", retry_after_s=1.0)

    def on_body(self, body: bytes) -> None:
        self.body_bytes += len(body)
        if self.body_bytes > self.body_allowed:
            self._more_body(len(body))
        self.current.body.append(body)

    def _more_body(self, n: int) -> None:
        """More body than declared up front (a chunked body): check it as it arrives."""
        server = self.server
        ex = self.current
        if self.body_bytes > server.max_body_bytes:
            self.refuse(RequestTooLarge(f"the request body is larger than this server accepts "
                                        f"({server.max_body_bytes} bytes); send a smaller "
                                        "request"))
        if ex.body is not DROPPED:
            if server.inflight_body_bytes + n > server.max_inflight_body_bytes:
                self.refuse(self._busy(self.body_bytes))
            server.inflight_body_bytes += n
            ex.reserved += n
        self.body_allowed = self.body_bytes

    def on_message_complete(self) -> None:
        ex = self.current
        self.current = None
        ex.complete = True
        if ex.body is DROPPED:
            return  # answered early; its body was read only to be dropped
        self.server.budget -= 1
        body = ex.body[0] if len(ex.body) == 1 else b"".join(ex.body)
        ex.body = []
        if not ex.keep_alive:
            # nothing after this request will be answered
            self.closing = True
        elif len(self.queue) >= MAX_PIPELINED and not self.reading_paused:
            self.reading_paused = True
            self.transport.pause_reading()
        self.server.dispatch(self, ex, body)

    # -- answering -----------------------------------------------------------------------
    def _send_continue(self, ex: Exchange) -> None:
        if not ex.continue_sent and not ex.complete and not self.closed:
            ex.continue_sent = True
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            if ex is self.current:  # the body is asked for only now: time it from here
                self.body_since = self.last_active_s = monotonic()

    def write(self, ex: Exchange, data: bytes) -> None:
        if self.closed:
            return
        if self.queue and self.queue[0] is ex:
            self.transport.write(data)
        else:
            ex.buffered.append(data)

    def finish(self, ex: Exchange) -> None:
        """The response of ``ex`` is complete: flush what waited behind it, in order."""
        ex.finished = True
        if ex.reserved:
            self.release(ex)
        if self.server.owed is not None:
            self.server.settle_owed()
        if ex.disconnect is not None and not ex.disconnect.done():
            ex.disconnect.set_result(None)
        queue = self.queue
        if self.closed or not queue or queue[0] is not ex:
            return
        while queue and queue[0].finished:
            done = queue.popleft()
            if not done.keep_alive:
                self.close()
                return
            if queue:
                nxt = queue[0]
                if nxt.buffered:
                    self.transport.write(b"".join(nxt.buffered))
                    nxt.buffered = []
                if nxt.expect_continue:
                    self._send_continue(nxt)
        if self.reading_paused and len(queue) < MAX_PIPELINED // 2:
            self.reading_paused = False
            if self.writable is None and not self.held:
                self.transport.resume_reading()
        if not queue:
            self.last_active_s = monotonic()
            if self.server.stopping:
                self.close()

    def answer(self, ex: Exchange, status: int, headers: list[tuple[bytes, bytes]],
               body: bytes, line: bytes = b"") -> None:
        """A whole response at once (``Content-Length`` framing). ``line``: one more
        header line of this response alone (``name: value\r\n``), written after the
        prepared head of ``headers`` rather than making a head of its own."""
        if ex.keep_alive and not ex.is_head and ex.version == "1.1":
            # the common case: one prepared head per (status, headers) and this second
            head = self.server.heads.get((status, id(headers)))
            if head is None or head[0] is not headers:
                head = self.server.head_for(status, headers)
            ex.head_sent = True
            self.write(ex, b"%b%bcontent-length: %d\r\n\r\n%b" % (head[1], line, len(body),
                                                                   body))
            self.finish(ex)
            return
        parts = [status_line(status), self.server.clock.header]
        for k, v in headers:
            parts += (k, b": ", v, b"\r\n")
        parts += (line, b"content-length: ", str(len(body)).encode(), b"\r\n")
        if not ex.keep_alive:
            parts.append(b"connection: close\r\n")
        elif ex.version == "1.0":
            parts.append(b"connection: keep-alive\r\n")
        parts.append(b"\r\n")
        if not ex.is_head:
            parts.append(body)
        ex.head_sent = True
        self.write(ex, b"".join(parts))
        self.finish(ex)

    def release(self, ex: Exchange) -> None:
        """Give back the body bytes ``ex`` holds of the server's in-flight budget."""
        self.server.inflight_body_bytes -= ex.reserved
        ex.reserved = 0

    def refuse(self, error: BatchScopeError, ex: Exchange | None = None) -> None:
        """Answer an unusable request (``ex``, else the one being parsed) with ``error``
        and close the connection; stops parsing (raises out of the parser callback)."""
        self._end_with(ex, *error_answer(error, "a refused request"))
        raise Refused()

    def _end_with(self, ex: Exchange | None, status: int, headers: list[tuple[bytes, bytes]],
                  body: bytes, *, linger: bool = True) -> None:
        """Answer ``ex`` (else the request being parsed) as the last one on this
        connection, which closes once that answer is out (in order). Parsing stops:
        whatever else the client sends is dropped."""
        ex = ex or self.current or Exchange()
        self.current = None
        self.head_since = 0.0
        ex.keep_alive = False
        ex.complete = True
        if ex not in self.queue:
            self.queue.append(ex)
        self.closing = True
        self.linger = linger
        self.answer(ex, status, headers, body)

    # -- slow clients --------------------------------------------------------------------
    def waits_on_client(self) -> bool:
        """True when this connection waits for the client to send (it is idle, or a head
        or body is coming), not for an answer of the server, nor for the client to read
        one, nor for the server to ask for a body (``Expect: 100-continue``)."""
        if self.closing or self.reading_paused or self.writable is not None or self.held:
            return False
        ex = self.current
        if ex is None:
            return not self.queue
        return not (ex.expect_continue and not ex.continue_sent)

    def stalled_since(self) -> float:
        """Since when this connection has made no progress the server can use: the start
        of a head still incomplete, else its last byte."""
        return self.head_since or self.last_active_s

    def expire(self, now: float) -> None:
        """Close this connection if the client has kept it waiting too long: idle past
        ``keep_alive_s``, a head not complete ``header_timeout_s`` after it began, a body
        stalled for ``body_timeout_s`` or slower than ``min_body_bytes_per_s``."""
        server = self.server
        if self.writable is not None and not self.closed \
                and now - self.write_blocked_since > server.keep_alive_s:
            # the client has read none of our answers for that long: nothing we could
            # send would reach it, so drop the connection and what is queued for it
            server.counts["write_timeouts"] += 1
            self.transport.abort()
            return
        if not self.waits_on_client():
            return
        if self.current is None:
            if now - self.last_active_s > server.keep_alive_s:
                self.close()
            return
        if self.head_since:
            if now - self.head_since > server.header_timeout_s:
                self.time_out(RequestTimeout(
                    f"the request head (request line and headers) did not arrive within "
                    f"{server.header_timeout_s:g} s of its first byte; send the whole head "
                    "at once"), "header_timeouts")
            return
        if now - self.last_active_s > server.body_timeout_s:
            self.time_out(RequestTimeout(
                f"the request body stalled: no byte for {server.body_timeout_s:g} s after "
                f"{self.body_bytes} of {self.declared or 'a chunked number of'} bytes; send "
                "the whole body without pausing"), "body_timeouts")
            return
        under_way = now - self.body_since
        if under_way > server.body_timeout_s and \
                self.body_bytes < server.min_body_bytes_per_s * under_way:
            self.time_out(RequestTimeout(
                f"the request body is arriving too slowly: {self.body_bytes} bytes in "
                f"{under_way:.1f} s, under the {server.min_body_bytes_per_s} bytes/s this "
                "server requires; send the body faster"), "body_timeouts")

    def time_out(self, error: BatchScopeError, count: str, *, linger: bool = True) -> None:
        """Answer the request being read with ``error`` and close the connection."""
        self.server.counts[count] += 1
        self._end_with(None, *error_answer(error, "a timed-out request"), linger=linger)

    def evict(self) -> None:
        """Close at once to make room for a new connection (the server is at its limit)."""
        if self.closing:
            self.transport.close()  # lingering after an answer: stop now
        elif self.current is None:
            self.close()
        else:
            server = self.server
            self.time_out(RequestTimeout(
                f"this connection was closed to make room: the server has its limit of "
                f"{server.max_connections} connections open and this request had made no "
                f"progress for longer than any other; send requests without pausing"),
                "evicted_mid_request", linger=False)
            return
        self.server.counts["evicted_idle"] += 1

    def evictable(self) -> bool:
        """True when closing this connection loses nothing the server owes: it is
        lingering after a final answer, or it waits on the client with no earlier
        request of its own still being answered."""
        if self.closing:
            return not self.queue
        queue = self.queue
        return self.waits_on_client() and (not queue or queue[0] is self.current)

    def closing_after_answers(self) -> None:
        self.closing = True
        if not self.queue:
            self.close()
        else:
            self.queue[-1].keep_alive = False

    def close(self) -> None:
        transport = self.transport
        if self.closed or transport is None:
            return
        self.closing = True
        if self.linger and transport.can_write_eof():
            # the client may still be sending the refused request: end our side, keep
            # reading (and dropping) until it closes or LINGER_S has passed
            self.linger = False
            transport.write_eof()
            if self.reading_paused or self.held:
                self.reading_paused = False
                self.held = b""  # what follows a refusal is dropped anyway
                transport.resume_reading()
            self.loop.call_later(LINGER_S, transport.close)
            return
        transport.close()

    @property
    def idle(self) -> bool:
        return not self.queue and self.current is None
