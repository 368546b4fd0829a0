"""A small HTTP/1.1 server on asyncio + ``httptools``, built for the inference path.

``HttpServer`` accepts connections; each is an ``asyncio.Protocol`` (``_Connection``)
that parses with ``httptools.HttpRequestParser`` and buffers each request body
(up to ``max_body_bytes``, else 413). A complete request goes to one of two places:

* ``fast(conn, method, path, headers, body, answer)`` — a synchronous hook that may
  take the request (returns True) and later call ``answer(status, headers, body)``
  exactly once, from any callback on the loop. The inference route uses it: no Task,
  no coroutine, no ASGI dicts per request.
* otherwise the ASGI app (``_AsgiCall``): a minimal ASGI 3 bridge — ``receive`` gives
  the buffered body, then waits until the client goes away or the response is done
  and says ``http.disconnect``; ``send`` takes ``http.response.start``/``body``, and a
  response without ``Content-Length`` whose body comes in several parts goes out with
  chunked transfer encoding (HTTP/1.1) or until close (HTTP/1.0), so streams stream.

HTTP/1.1 behaviour: keep-alive by default (HTTP/1.0 only when asked), ``Connection:
close`` honoured, pipelined requests run at once and are answered in order,
``Expect: 100-continue`` answered when the request is at the head of the line,
``Content-Length`` and chunked request bodies, HEAD answered without a body,
idle connections closed after ``keep_alive_s``. A request the server will not pass
on is answered with a JSON error and the connection closed: malformed (400), a
method outside ``SERVED_METHODS`` such as ``CONNECT`` or ``TRACE`` (405 with
``Allow``), a body over ``max_body_bytes`` (413), a URL over ``MAX_URL_BYTES``
(414), more than ``MAX_HEADERS`` header fields or ``MAX_HEADER_BYTES`` of them (431), an HTTP version other than 1.0/1.1 (505); the rest of what the client sends
is read and dropped for ``LINGER_S`` so that it reads the answer rather than a
reset. Every error answer, these and a 500 for a bug in a hook or the app, is built
by ``runtime.api.errors.error_answer``. A client that goes away mid-request changes
nothing for the work already started: its answer is dropped. ``shutdown()`` stops
accepting, closes idle connections, lets in-flight requests finish (bounded), then
closes the rest.

Draining. ``drain(hook)`` comes before ``shutdown()`` when the server stops on a
signal: it goes on listening and reading, but answers every request whose head
completes from then on with ``hook(method, path)`` (the caller's 503 with
``Retry-After``) and closes that connection once the answer is out, before the body
is read; when the hook returns None the request is served as usual, as the last one
on its connection. Requests taken in before are answered as usual, streams go on,
and idle keep-alive connections stay open (closing one could cross a request the
client is sending on it, which it would see as a reset; a request there gets the
503 instead). ``drain`` returns a future resolved once no request taken in is still
owed its answer.

Slow and hostile clients. Every limit is a constructor parameter of ``HttpServer``:

* a request head (request line and headers) must be complete ``header_timeout_s``
  after its first byte arrived, and a body must keep coming: no byte for
  ``body_timeout_s``, or less than ``min_body_bytes_per_s`` on average once it has been
  under way for ``body_timeout_s``, and the request is answered 408 and the connection
  closed. A body the server has not asked for yet (``Expect: 100-continue`` behind an
  earlier request) and a connection whose reading the server paused are never timed;
* at most ``max_connections`` connections are open at once (default: below the
  process's open-file limit, see ``default_max_connections``). One more makes room by
  closing the connection that has made no progress for longest among those that wait
  on the client (idle, or sending a head or a body); when every connection waits on
  the server instead, the new one is answered 503 and closed;
* the bodies of all requests being read or answered together hold at most
  ``max_inflight_body_bytes``. A request is counted from its head (by its declared
  ``Content-Length``; a chunked body as it arrives) until its answer is complete, and
  one that does not fit what is left is answered 503 with ``Retry-After`` before its
  body is read.

These checks cost the hot path nothing per request beyond a few attribute stores:
one timer per server (the tick) looks at every connection, the per-request state
lives on the connection, and the checks on a request's head are those it already
went through.

Early answers. A fast hook with an ``early(method, path, headers)`` method is asked
as soon as a request head is complete, before its body is read. An answer it returns
(``(status, headers, body)``) is sent at once, in order; the body is then read and
dropped when it is small and the connection stays open, else the connection is
closed after the answer (a body over ``EARLY_DRAIN_BYTES``, a chunked one, ``Expect:
100-continue`` or ``Connection: close``). None lets the request go on as usual.

Shedding. Once ``early`` has answered, the server sheds: a read that holds exactly one
plain request (see ``HttpServer.shed``) on a connection between requests is framed
from its bytes and its target handed to the hook's ``edge`` method, which refuses it
as ``early`` would; the answer goes out without the parser's callbacks, an exchange or
the body's round trip through the parser, so a refusal costs a fraction of a parsed
one (``benchmarks/reliability/http1_hot_path.py --refuse``). The first request
``edge`` lets through ends the shedding; anything not plain goes to the parser.

Work per loop pass. Under overload thousands of connections are readable in the same
pass of the event loop, and taking in all of their requests would hold back what else
waits on the loop (batch completions, expiry timers) for as long as that takes. So the
server takes in at most ``pass_budget`` requests (each pipelined request counts; one
answered early does not, refusing it costs little) and then stops: a connection whose bytes arrive once the budget is spent keeps them,
unparsed, and stops being read. One ``call_soon`` callback then renews the budget and
parses the held bytes, in the order they arrived, a budget's worth at a time, so the
loop's other callbacks run between slices. The budget is checked as each read arrives,
so one read holding many pipelined requests is parsed whole (at most what one read
brings, and a connection stops being read at ``MAX_PIPELINED`` waiting requests). A
connection driven by hand, off a running loop, is never held. The bound is off unless
``pass_budget`` is given: time spent held is not counted against a request's timeout
(the engine starts it when it admits the request), so under overload held requests
were admitted late and answered past their client's deadline.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections import deque
from email.utils import formatdate
from http import HTTPStatus
from typing import Any, Callable
from urllib.parse import unquote

import httptools

from runtime.api.errors import (BatchScopeError, ClientError, HeadersTooLarge,
                                HttpVersionNotSupported, MethodNotAllowed, RequestTimeout, RequestTooLarge, ServerBusy,
                                UrlTooLong, error_answer)

log = logging.getLogger("batchscope.server")

#: request bodies larger than this are refused with 413
MAX_BODY_BYTES = 64 * 1024 * 1024
#: request targets (path and query) longer than this are refused with 414
MAX_URL_BYTES = 64 * 1024
#: a request with more header fields than this, or more bytes of them, is refused with 431
MAX_HEADERS = 100
MAX_HEADER_BYTES = 64 * 1024
#: methods handed to the app; any other the fast hook does not take is refused with 405
SERVED_METHODS = frozenset({b"GET", b"HEAD", b"POST", b"PUT", b"PATCH", b"DELETE", b"OPTIONS"})
_ALLOW = sorted(m.decode() for m in SERVED_METHODS)
#: idle keep-alive connections are closed after this long
KEEP_ALIVE_S = 60.0
#: how often idle connections are checked and the Date header refreshed
TICK_S = 1.0
#: a connection stops being read while this many of its requests wait for answers
MAX_PIPELINED = 64
#: after a refusal, how long the rest of what the client sends is read and dropped,
#: so that closing with unread data does not reset the connection before the client
#: has read the answer
LINGER_S = 2.0
#: a request head must be complete this long after its first byte, else 408
HEADER_TIMEOUT_S = 10.0
#: a request body that brings no new byte for this long is answered 408
BODY_TIMEOUT_S = 10.0
#: ... and so is one slower than this on average, once under way for BODY_TIMEOUT_S
MIN_BODY_BYTES_PER_S = 1024
#: the bodies of all requests in flight together (read, or waiting for their answer)
MAX_INFLIGHT_BODY_BYTES = 256 * 1024 * 1024
#: after an early answer, a body up to this size is read and dropped to keep the
#: connection; a larger one (or a chunked one) closes the connection instead
EARLY_DRAIN_BYTES = 1024 * 1024
#: when the open-file limit is unknown, at most this many connections
FALLBACK_MAX_CONNECTIONS = 4096
#: requests the server takes in (parses and hands on) before it lets the event loop
#: run its other callbacks (batch completions, timers) again; None: no bound. Off by
#: default: under the overload benchmark, bytes held back wait outside every deadline
#: and goodput fell; see ``HttpServer``
PASS_BUDGET: int | None = None
#: the budget that stands for "no bound" (never spent)
_UNBOUNDED = 1 << 62

Answer = Callable[[int, list[tuple[bytes, bytes]], bytes], None]
#: (connection, method, path, headers, body, answer) -> True when it took the request
FastHook = Callable[[Any, bytes, str, list[tuple[bytes, bytes]], bytes, Answer], bool]
#: the optional ``early`` method of a fast hook: (method, path, headers) -> answer or None
EarlyHook = Callable[[bytes, str, list[tuple[bytes, bytes]]],
                     "tuple[int, list[tuple[bytes, bytes]], bytes] | None"]
#: the optional ``edge`` method: (raw request target of a POST) -> answer or None
EdgeHook = Callable[[bytes], "tuple[int, list[tuple[bytes, bytes]], bytes] | None"]
#: ``drain``'s hook: (method, path) of a request arriving while draining -> its refusal,
#: or None to serve it as usual
DrainHook = Callable[[bytes, str], "tuple[int, list[tuple[bytes, bytes]], bytes] | None"]


def default_max_connections() -> int:
    """Open connections allowed by default: the soft open-file limit less a reserve
    (an eighth of it, at least 64) for the files, pipes and sockets of everything
    else in the process, so that accepting never fails for want of a descriptor."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):
        return FALLBACK_MAX_CONNECTIONS
    if soft == resource.RLIM_INFINITY or soft <= 0:
        return FALLBACK_MAX_CONNECTIONS
    return max(16, soft - max(64, soft // 8))


class _Dropped:
    """Stands in for an exchange's body list when the body is read only to be dropped."""

    __slots__ = ()

    def append(self, data: bytes) -> None:
        pass


_DROPPED = _Dropped()


def _status_lines() -> dict[int, bytes]:
    return {int(s): f"HTTP/1.1 {int(s)} {s.phrase}\r\n".encode() for s in HTTPStatus}


STATUS_LINES = _status_lines()


def status_line(status: int) -> bytes:
    line = STATUS_LINES.get(status)
    return line if line is not None else f"HTTP/1.1 {status} \r\n".encode()


class _Clock:
    """The Date header, refreshed once per tick instead of formatted per response."""

    __slots__ = ("header",)

    def __init__(self) -> None:
        self.header = b""
        self.refresh()

    def refresh(self) -> bool:
        """Format the header for now; True when it changed (a new second)."""
        header = b"date: " + formatdate(time.time(), usegmt=True).encode() + b"\r\n"
        changed = header != self.header
        self.header = header
        return changed


class _Exchange:
    """One request on a connection: its parsed head, body and response state."""

    __slots__ = ("method", "url", "headers", "body", "version", "keep_alive", "expect_continue",
                 "complete", "head_sent", "finished", "buffered", "chunked", "is_head",
                 "disconnect", "continue_sent", "reserved")

    def __init__(self) -> None:
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []
        self.method = b""
        self.version = "1.1"
        self.keep_alive = True
        self.expect_continue = False
        self.continue_sent = False
        self.complete = False
        self.head_sent = False
        self.finished = False
        #: response bytes written while an earlier exchange still answers
        self.buffered: list[bytes] = []
        self.chunked = False
        self.is_head = False
        #: resolved when the client goes away or the response is done (ASGI receive)
        self.disconnect: asyncio.Future | None = None
        #: body bytes counted against the server's in-flight budget until it finishes
        self.reserved = 0


class _Connection(asyncio.Protocol):
    """One client connection: parse, dispatch, answer in order."""

    def __init__(self, server: "HttpServer") -> None:
        self.server = server
        self.loop = server.loop
        server.accepted += 1
        #: order of arrival among the server's connections
        self.serial = server.accepted
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.current: _Exchange | None = None
        #: exchanges in arrival order; the first one is the one being answered
        self.queue: deque[_Exchange] = deque()
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
        self.last_active_s = self.loop.time()
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
        self.last_active_s = self.loop.time()
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
            if isinstance(exc.__context__, _Refused) or self.closing:
                return  # a callback already answered and stopped the parse
            try:
                self.refuse(ClientError(f"malformed HTTP request ({exc}); send a valid "
                                        "HTTP/1.1 request"))
            except _Refused:
                pass

    # -- httptools callbacks -------------------------------------------------------------
    def on_message_begin(self) -> None:
        self.current = _Exchange()
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
        elif name == b"expect" and value.lower() == b"100-continue":
            ex.expect_continue = True

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

    def _while_draining(self, ex: _Exchange) -> None:
        """A request whose head completed while the server drains: refused with the
        drain hook's answer and the connection closed (raises ``_Refused``), or, when
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
            raise _Refused()

    def _early(self, ex: _Exchange, declared: int) -> bool:
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
            raise _Refused()
        # a small body: read it and drop it, so the connection stays usable
        ex.body = _DROPPED
        self.body_allowed = declared
        self.queue.append(ex)
        self.answer(ex, *reply)
        return True

    @staticmethod
    def _chunked(ex: _Exchange) -> bool:
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
        if ex.body is not _DROPPED:
            if server.inflight_body_bytes + n > server.max_inflight_body_bytes:
                self.refuse(self._busy(self.body_bytes))
            server.inflight_body_bytes += n
            ex.reserved += n
        self.body_allowed = self.body_bytes

    def on_message_complete(self) -> None:
        ex = self.current
        self.current = None
        ex.complete = True
        if ex.body is _DROPPED:
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
    def _send_continue(self, ex: _Exchange) -> None:
        if not ex.continue_sent and not ex.complete and not self.closed:
            ex.continue_sent = True
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            if ex is self.current:  # the body is asked for only now: time it from here
                self.body_since = self.last_active_s = self.loop.time()

    def write(self, ex: _Exchange, data: bytes) -> None:
        if self.closed:
            return
        if self.queue and self.queue[0] is ex:
            self.transport.write(data)
        else:
            ex.buffered.append(data)

    def finish(self, ex: _Exchange) -> None:
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
            self.last_active_s = self.loop.time()
            if self.server.stopping:
                self.close()

    def answer(self, ex: _Exchange, status: int, headers: list[tuple[bytes, bytes]],
               body: bytes) -> None:
        """A whole response at once (``Content-Length`` framing)."""
        if ex.keep_alive and not ex.is_head and ex.version == "1.1":
            # the common case: one prepared head per (status, headers) and this second
            head = self.server.heads.get((status, id(headers)))
            if head is None or head[0] is not headers:
                head = self.server.head_for(status, headers)
            ex.head_sent = True
            self.write(ex, b"%bcontent-length: %d\r\n\r\n%b" % (head[1], len(body), body))
            self.finish(ex)
            return
        parts = [status_line(status), self.server.clock.header]
        for k, v in headers:
            parts += (k, b": ", v, b"\r\n")
        parts += (b"content-length: ", str(len(body)).encode(), b"\r\n")
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

    def release(self, ex: _Exchange) -> None:
        """Give back the body bytes ``ex`` holds of the server's in-flight budget."""
        self.server.inflight_body_bytes -= ex.reserved
        ex.reserved = 0

    def refuse(self, error: BatchScopeError, ex: _Exchange | None = None) -> None:
        """Answer an unusable request (``ex``, else the one being parsed) with ``error``
        and close the connection; stops parsing (raises out of the parser callback)."""
        self._end_with(ex, *error_answer(error, "a refused request"))
        raise _Refused()

    def _end_with(self, ex: _Exchange | None, status: int, headers: list[tuple[bytes, bytes]],
                  body: bytes, *, linger: bool = True) -> None:
        """Answer ``ex`` (else the request being parsed) as the last one on this
        connection, which closes once that answer is out (in order). Parsing stops:
        whatever else the client sends is dropped."""
        ex = ex or self.current or _Exchange()
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


class _Refused(Exception):
    """Raised out of a parser callback to stop parsing after a refusal was answered."""


def _unsupported_method(method: bytes) -> MethodNotAllowed:
    name = method.decode("latin-1")
    why = "this server is not a proxy" if method == b"CONNECT" else "this server does not serve it"
    return MethodNotAllowed(f"{name} is not supported: {why}; it serves {', '.join(_ALLOW)}",
                            allow=_ALLOW)


class _AsgiCall:
    """Runs one request through an ASGI 3 application."""

    __slots__ = ("conn", "ex", "body", "started", "chunked", "length_known", "body_done",
                 "status", "head")

    def __init__(self, conn: _Connection, ex: _Exchange, body: bytes) -> None:
        self.conn = conn
        self.ex = ex
        self.body = body
        self.started = False
        self.chunked = False
        self.length_known = False
        self.body_done = False
        self.status = 0
        self.head: list[tuple[bytes, bytes]] = []

    def scope(self) -> dict:
        """The ASGI scope; raises ``ClientError`` for a target that is not a URL path."""
        ex = self.ex
        try:
            url = httptools.parse_url(ex.url)
        except httptools.HttpParserInvalidURLError:
            raise ClientError(f"the request target {ex.url[:200].decode('latin-1')!r} is not "
                              "a URL path; send a path such as /v2/health/live") from None
        raw_path = url.path or b"/"
        path = raw_path.decode("latin-1")
        if "%" in path:
            path = unquote(path)
        return {
            "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": ex.version, "server": self.conn.local, "client": self.conn.client,
            "scheme": "http", "method": ex.method.decode("ascii"), "root_path": "",
            "path": path, "raw_path": raw_path, "query_string": url.query or b"",
            "headers": ex.headers, "state": {},
        }

    def where(self) -> str:
        """The request, as error messages and the log name it."""
        return f"{self.ex.method.decode('latin-1')} {self.ex.url[:200].decode('latin-1')}"

    async def run(self, app: Any) -> None:
        try:
            await app(self.scope(), self.receive, self.send)
        except Exception as exc:
            if not self.started:
                self.conn.answer(self.ex, *error_answer(exc, self.where()))
                return
            # the answer is under way: all that is left is to log and cut it short
            log.exception("unexpected error answering %s", self.where())
            self.ex.keep_alive = False
            self._end()
            return
        if not self.started:
            self.conn.answer(self.ex, *error_answer(
                RuntimeError("the application returned without sending a response"),
                self.where()))
        elif not self.body_done:
            self.ex.keep_alive = False
            self._end()

    async def receive(self) -> dict:
        if self.body is not None:
            body, self.body = self.body, None
            return {"type": "http.request", "body": body, "more_body": False}
        ex = self.ex
        if not self.conn.closed and not ex.finished:
            if ex.disconnect is None:
                ex.disconnect = self.conn.loop.create_future()
            await ex.disconnect
        return {"type": "http.disconnect"}

    async def send(self, message: dict) -> None:
        kind = message["type"]
        ex = self.ex
        conn = self.conn
        if kind == "http.response.start":
            if self.started:
                raise RuntimeError("http.response.start sent twice")
            self.started = True
            self.status = int(message["status"])
            self.head = list(message.get("headers") or ())
            self.length_known = any(k.lower() == b"content-length" for k, _ in self.head)
            return
        if kind != "http.response.body":
            raise RuntimeError(f"unexpected ASGI message {kind!r}")
        if not self.started:
            raise RuntimeError("http.response.body before http.response.start")
        if self.body_done:
            raise RuntimeError("http.response.body after the response ended")
        body = message.get("body", b"")
        more = message.get("more_body", False)
        if not ex.head_sent:
            if not more and not self.length_known:
                self.body_done = True
                conn.answer(ex, self.status, self.head, body)
                return
            self._write_head()
        if body and not ex.is_head:
            conn.write(ex, b"%x\r\n%b\r\n" % (len(body), body) if self.chunked else body)
        if not more:
            self._end()
        elif conn.writable is not None:
            await conn.writable  # the client reads slower than the app writes

    def _write_head(self) -> None:
        ex = self.ex
        parts = [status_line(self.status), self.conn.server.clock.header]
        for k, v in self.head:
            parts += (k, b": ", v, b"\r\n")
        if not self.length_known and not ex.is_head:
            if ex.version == "1.1":
                self.chunked = True
                parts.append(b"transfer-encoding: chunked\r\n")
            else:
                ex.keep_alive = False
        if not ex.keep_alive:
            parts.append(b"connection: close\r\n")
        elif ex.version == "1.0":
            parts.append(b"connection: keep-alive\r\n")
        parts.append(b"\r\n")
        ex.head_sent = True
        self.conn.write(ex, b"".join(parts))

    def _end(self) -> None:
        if self.body_done:
            return
        self.body_done = True
        if self.ex.head_sent and self.chunked:
            self.conn.write(self.ex, b"0\r\n\r\n")
        self.conn.finish(self.ex)


class HttpServer:
    """Serves an ASGI app (and an optional synchronous fast hook) over HTTP/1.1."""

    def __init__(self, app: Any, *, fast: FastHook | None = None,
                 max_body_bytes: int = MAX_BODY_BYTES, keep_alive_s: float = KEEP_ALIVE_S,
                 header_timeout_s: float = HEADER_TIMEOUT_S,
                 body_timeout_s: float = BODY_TIMEOUT_S,
                 min_body_bytes_per_s: float = MIN_BODY_BYTES_PER_S,
                 max_inflight_body_bytes: int = MAX_INFLIGHT_BODY_BYTES,
                 max_connections: int | None = None,
                 pass_budget: int | None = PASS_BUDGET) -> None:
        if max_connections is None:
            max_connections = default_max_connections()
        for name, value in (("max_body_bytes", max_body_bytes), ("keep_alive_s", keep_alive_s),
                            ("header_timeout_s", header_timeout_s),
                            ("body_timeout_s", body_timeout_s),
                            ("max_connections", max_connections),
                            ("pass_budget", 1 if pass_budget is None else pass_budget)):
            if not value > 0:
                raise ValueError(f"HttpServer: {name} must be positive, got {value!r}")
        if min_body_bytes_per_s < 0:
            raise ValueError(f"HttpServer: min_body_bytes_per_s must be 0 or more, got "
                             f"{min_body_bytes_per_s!r}")
        if max_inflight_body_bytes < max_body_bytes:
            raise ValueError(f"HttpServer: max_inflight_body_bytes ({max_inflight_body_bytes}) "
                             f"must be at least max_body_bytes ({max_body_bytes}), else a "
                             "request of the largest accepted size could never be served")
        self.app = app
        self.fast = fast
        #: the fast hook's ``early`` method, asked when a request head is complete
        self.early: EarlyHook | None = getattr(fast, "early", None)
        #: the fast hook's ``edge`` method: ``early`` asked with a request target's bytes
        self.edge: EdgeHook | None = getattr(fast, "edge", None)
        #: True from an early answer until ``edge`` lets a request through (see ``shed``)
        self.shedding = False
        #: (reply, date header, response bytes) of the last refusal ``shed`` sent
        self._shed_bytes: tuple[Any, bytes, bytes] | None = None
        self.max_body_bytes = max_body_bytes
        self.keep_alive_s = keep_alive_s
        self.header_timeout_s = header_timeout_s
        self.body_timeout_s = body_timeout_s
        self.min_body_bytes_per_s = min_body_bytes_per_s
        self.max_inflight_body_bytes = max_inflight_body_bytes
        self.max_connections = max_connections
        self.pass_budget = _UNBOUNDED if pass_budget is None else pass_budget
        #: requests that may still be taken in before the loop gets a turn (see ``hold``)
        self.budget = self.pass_budget
        #: connections holding bytes that arrived once the budget was spent, in order
        self.held: deque[_Connection] = deque()
        self._next_slice: asyncio.Handle | None = None
        #: body bytes of the requests being read or answered, on all connections
        self.inflight_body_bytes = 0
        #: connections accepted so far
        self.accepted = 0
        #: how often connections are checked for timeouts (a fraction of the shortest)
        self.tick_s = min(TICK_S, header_timeout_s / 4, body_timeout_s / 4)
        #: what the limits did, by kind (slow paths only)
        self.counts: dict[str, int] = dict.fromkeys(
            ("header_timeouts", "body_timeouts", "write_timeouts", "evicted_idle", "evicted_mid_request",
             "refused_at_connection_limit", "refused_body_budget", "early_answers",
             "held_reads", "shed_answers", "drain_refusals"), 0)
        self.clock = _Clock()
        self.connections: set[_Connection] = set()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.stopping = False
        #: set by ``drain``: answers the requests that arrive from then on
        self.draining: DrainHook | None = None
        #: while draining: resolved once no request taken in is owed its answer
        self.owed: asyncio.Future | None = None
        self._server: asyncio.AbstractServer | None = None
        self._tick: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task] = set()
        self._drained: asyncio.Future | None = None
        #: (status, id(headers)) -> (headers, status line + date + headers), this second
        self.heads: dict[tuple[int, int], tuple[list, bytes]] = {}

    def head_for(self, status: int, headers: list[tuple[bytes, bytes]]) -> tuple[list, bytes]:
        """The response head up to ``content-length`` (kept with ``headers`` itself, so a
        reused id never picks up another list's head)."""
        if len(self.heads) > 256:
            self.heads.clear()
        block = b"".join([status_line(status), self.clock.header,
                          *(k + b": " + v + b"\r\n" for k, v in headers)])
        head = (headers, block)
        self.heads[(status, id(headers))] = head
        return head

    async def start(self, sock: socket.socket) -> None:
        """Accept connections on ``sock`` (already bound and listening)."""
        self.loop = asyncio.get_running_loop()
        self._server = await self.loop.create_server(lambda: _Connection(self), sock=sock,
                                                     backlog=2048)
        self._tick = self.loop.call_later(self.tick_s, self._on_tick)

    def _on_tick(self) -> None:
        if self.clock.refresh():
            self.heads.clear()
        self.expire(self.loop.time())
        self._tick = self.loop.call_later(self.tick_s, self._on_tick)

    def expire(self, now: float) -> None:
        """Close the connections whose client kept them waiting too long (see
        ``_Connection.expire``); ``now`` is on the loop's clock."""
        for conn in list(self.connections):
            conn.expire(now)

    def make_room(self) -> bool:
        """At the connection limit: close the connection that has made no progress for
        longest among those that lose nothing by closing; False when there is none."""
        victim = None
        oldest = (0.0, 0)
        for conn in self.connections:
            if conn.evictable():
                # lingering ones first; on a tie (the clock is coarse) the older connection
                key = (-1.0 if conn.closing else conn.stalled_since(), conn.serial)
                if victim is None or key < oldest:
                    victim, oldest = conn, key
        if victim is None:
            return False
        victim.evict()
        return True

    # -- shedding ---------------------------------------------------------------------------
    def shed(self, data: bytes) -> bytes | None:
        """The whole response to ``data`` when it is one complete request, plain
        enough to frame without the parser, that the hook's ``edge`` refuses now;
        None (nothing counted) to parse it as usual. Asked only while shedding, for
        a connection between requests.

        Plain enough: ``POST`` over HTTP/1.1, the read holding exactly the head and
        the ``Content-Length`` bytes it declares, and no header that changes the
        framing or the connection (``Transfer-Encoding``, ``Expect``, a second
        ``Content-Length``, anything saying ``close`` or ``upgrade``). Anything else
        goes to the parser, which is always right; this only spares a refused
        request the parser's callbacks, the exchange and the dropped body."""
        if data[:5] != b"POST " or self.stopping or self.draining is not None:
            return None
        sp = data.find(b" ", 5, 5 + 512)
        if sp < 0 or data[sp:sp + 11] != b" HTTP/1.1\r\n":
            return None
        end = data.find(b"\r\n\r\n", sp + 9)
        if end < 0:
            return None
        head = data[sp + 11:end + 2].lower()
        at = head.find(b"content-length:")
        if at < 0 or (at and head[at - 2:at] != b"\r\n"):
            return None
        stop = head.find(b"\r\n", at)
        try:
            declared = int(head[at + 15:stop])
        except ValueError:
            return None
        if (end + 4 + declared != len(data) or b"transfer-encoding" in head
                or b"expect" in head or b"close" in head or b"upgrade" in head
                or b"content-length:" in head[stop:]):
            return None
        reply = self.edge(data[5:sp])
        if reply is None:
            self.shedding = False  # the model takes requests again: the usual path
            return None
        self.counts["shed_answers"] += 1
        header = self.clock.header
        cached = self._shed_bytes
        if cached is not None and cached[0] is reply and cached[1] is header:
            return cached[2]
        status, headers, body = reply
        out = b"".join([status_line(status), header,
                        *(k + b": " + v + b"\r\n" for k, v in headers),
                        b"content-length: %d\r\n\r\n" % len(body), body])
        self._shed_bytes = (reply, header, out)
        return out

    # -- work per loop pass ------------------------------------------------------------------
    def hold(self, conn: _Connection, data: bytes) -> bool:
        """``data`` arrived on ``conn`` once the pass budget was spent (or behind bytes it
        already holds): keep it unparsed and stop reading ``conn`` until a later slice
        parses it. False (the caller parses it now) when no loop is running to give a
        turn to, such as a connection fed by hand."""
        loop = self.loop
        if not conn.held:
            if loop is None or not loop.is_running():
                self.budget = self.pass_budget
                return False
            self.held.append(conn)
            conn.transport.pause_reading()
            self.counts["held_reads"] += 1
        conn.held += data
        if self._next_slice is None:
            self._next_slice = loop.call_soon(self._slice)
        return True

    def _slice(self) -> None:
        """Renew the pass budget and parse what the held connections keep, oldest first,
        until the budget is spent again (then the rest waits for the next slice)."""
        self._next_slice = None
        self.budget = self.pass_budget
        held = self.held
        while held and self.budget > 0:
            conn = held.popleft()
            data, conn.held = conn.held, b""
            if conn.closed or conn.closing:
                continue
            if not conn.reading_paused and conn.writable is None:
                conn.transport.resume_reading()
            conn.data_received(data)
        if held and self._next_slice is None:
            self._next_slice = self.loop.call_soon(self._slice)

    # -- requests --------------------------------------------------------------------------
    def dispatch(self, conn: _Connection, ex: _Exchange, body: bytes) -> None:
        fast = self.fast
        if fast is not None:
            url = ex.url
            if b"?" not in url and b"%" not in url:
                try:
                    taken = fast(conn, ex.method, url.decode("latin-1"), ex.headers, body,
                                 lambda status, headers, payload: conn.answer(ex, status, headers,
                                                                              payload))
                except Exception as exc:
                    where = f"{ex.method.decode('latin-1')} {url[:200].decode('latin-1')}"
                    conn.answer(ex, *error_answer(exc, where))
                    return
                if taken:
                    return
        if ex.method not in SERVED_METHODS:
            # checked here, off the fast path: CONNECT, TRACE, WebDAV... never reach the
            # app (raises out of the parser callback that dispatched, like every refusal)
            conn.refuse(_unsupported_method(ex.method), ex)
        task = self.loop.create_task(_AsgiCall(conn, ex, body).run(self.app))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def connection_closed(self) -> None:
        if self.owed is not None:
            self.settle_owed()
        if self.stopping and not self.connections and self._drained is not None \
                and not self._drained.done():
            self._drained.set_result(None)

    # -- shutdown --------------------------------------------------------------------------
    def drain(self, hook: DrainHook) -> asyncio.Future:
        """Take no new requests from now on, but keep listening and reading: a request
        whose head completes is answered ``hook(method, path)`` and its connection
        closed (None from the hook: served as usual, then the connection closed).
        Requests already taken in are answered as usual. Returns a future resolved
        once none of them is owed its answer any more (at once when none is);
        ``owed_answers()`` counts them. ``shutdown()`` comes next."""
        self.draining = hook
        self.shedding = False
        if self.owed is None:
            self.owed = self.loop.create_future()
            self.settle_owed()
        return self.owed

    def owed_answers(self) -> int:
        """Requests taken in (their head complete) whose answer is not complete yet,
        on connections still open."""
        return sum(not ex.finished for conn in self.connections for ex in conn.queue)

    def settle_owed(self) -> None:
        """Resolve the ``owed`` future once no answer is owed (while draining)."""
        owed = self.owed
        if owed.done():
            return
        for conn in self.connections:
            for ex in conn.queue:
                if not ex.finished:
                    return
        owed.set_result(None)

    async def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop accepting, close idle connections, let in-flight answers go out for up to
        ``timeout_s``, then close whatever is left."""
        self.stopping = True
        if self._tick is not None:
            self._tick.cancel()
        if self._next_slice is not None:
            self._next_slice.cancel()
            self._next_slice = None
        for conn in self.held:
            conn.held = b""  # requests not yet read: dropped with their idle connections
        self.held.clear()
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            if conn.idle:
                conn.close()
            elif conn.queue:
                conn.queue[-1].keep_alive = False
                conn.closing = True
        if self.connections:
            self._drained = self.loop.create_future()
            try:
                await asyncio.wait_for(asyncio.shield(self._drained), timeout_s)
            except asyncio.TimeoutError:
                log.warning("%d connection(s) still busy after %.1f s; closing them",
                            len(self.connections), timeout_s)
        for conn in list(self.connections):
            conn.close()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
