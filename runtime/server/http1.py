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
(414), an HTTP version other than 1.0/1.1 (505); the rest of what the client sends
is read and dropped for ``LINGER_S`` so that it reads the answer rather than a
reset. Every error answer, these and a 500 for a bug in a hook or the app, is built
by ``runtime.api.errors.error_answer``. A client that goes away mid-request changes
nothing for the work already started: its answer is dropped. ``shutdown()`` stops
accepting, closes idle connections, lets in-flight requests finish (bounded), then
closes the rest.
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

from runtime.api.errors import (BatchScopeError, ClientError, HttpVersionNotSupported,
                                MethodNotAllowed, RequestTooLarge, UrlTooLong, error_answer)

log = logging.getLogger("batchscope.server")

#: request bodies larger than this are refused with 413
MAX_BODY_BYTES = 64 * 1024 * 1024
#: request targets (path and query) longer than this are refused with 414
MAX_URL_BYTES = 64 * 1024
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

Answer = Callable[[int, list[tuple[bytes, bytes]], bytes], None]
#: (connection, method, path, headers, body, answer) -> True when it took the request
FastHook = Callable[[Any, bytes, str, list[tuple[bytes, bytes]], bytes, Answer], bool]


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

    def refresh(self) -> None:
        self.header = b"date: " + formatdate(time.time(), usegmt=True).encode() + b"\r\n"


class _Exchange:
    """One request on a connection: its parsed head, body and response state."""

    __slots__ = ("method", "url", "headers", "body", "version", "keep_alive", "expect_continue",
                 "complete", "head_sent", "finished", "buffered", "chunked", "is_head",
                 "disconnect", "continue_sent")

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


class _Connection(asyncio.Protocol):
    """One client connection: parse, dispatch, answer in order."""

    def __init__(self, server: "HttpServer") -> None:
        self.server = server
        self.loop = server.loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.current: _Exchange | None = None
        #: exchanges in arrival order; the first one is the one being answered
        self.queue: deque[_Exchange] = deque()
        self.body_bytes = 0
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
        self.server.connections.add(self)

    def pause_writing(self) -> None:
        if self.writable is None:
            self.writable = self.loop.create_future()

    def resume_writing(self) -> None:
        writable, self.writable = self.writable, None
        if writable is not None and not writable.done():
            writable.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.resume_writing()
        self.server.connections.discard(self)
        for ex in self.queue:
            if ex.disconnect is not None and not ex.disconnect.done():
                ex.disconnect.set_result(None)
        self.queue.clear()
        self.current = None
        self.server.connection_closed()

    def data_received(self, data: bytes) -> None:
        if self.closing:
            return
        self.last_active_s = self.loop.time()
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
        ex.headers.append((name, value))
        if name == b"content-length":
            try:
                declared = int(value)
            except ValueError:
                declared = -1
            if declared > self.server.max_body_bytes:
                self.refuse(RequestTooLarge(
                    f"the request body of {declared} bytes is larger than this server "
                    f"accepts ({self.server.max_body_bytes} bytes); send a smaller request"))
        elif name == b"expect" and value.lower() == b"100-continue":
            ex.expect_continue = True

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
        self.queue.append(ex)
        if ex.expect_continue and self.queue[0] is ex:
            self._send_continue(ex)

    def on_body(self, body: bytes) -> None:
        self.body_bytes += len(body)
        if self.body_bytes > self.server.max_body_bytes:
            self.refuse(RequestTooLarge(f"the request body is larger than this server accepts "
                                        f"({self.server.max_body_bytes} bytes); send a smaller "
                                        "request"))
        self.current.body.append(body)

    def on_message_complete(self) -> None:
        ex = self.current
        self.current = None
        ex.complete = True
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

    def refuse(self, error: BatchScopeError, ex: _Exchange | None = None) -> None:
        """Answer an unusable request (``ex``, else the one being parsed) with ``error``
        and close the connection; stops parsing (raises out of the parser callback)."""
        ex = ex or self.current or _Exchange()
        self.current = None
        ex.keep_alive = False
        ex.complete = True
        if ex not in self.queue:
            self.queue.append(ex)
        self.closing = True
        self.linger = True
        self.answer(ex, *error_answer(error, "a refused request"))
        raise _Refused()

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
            if self.reading_paused:
                self.reading_paused = False
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
                 max_body_bytes: int = MAX_BODY_BYTES, keep_alive_s: float = KEEP_ALIVE_S) -> None:
        self.app = app
        self.fast = fast
        self.max_body_bytes = max_body_bytes
        self.keep_alive_s = keep_alive_s
        self.clock = _Clock()
        self.connections: set[_Connection] = set()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.stopping = False
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
        self._tick = self.loop.call_later(TICK_S, self._on_tick)

    def _on_tick(self) -> None:
        self.clock.refresh()
        self.heads.clear()
        limit = self.loop.time() - self.keep_alive_s
        for conn in list(self.connections):
            if conn.idle and conn.last_active_s < limit:
                conn.close()
        self._tick = self.loop.call_later(TICK_S, self._on_tick)

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
        if self.stopping and not self.connections and self._drained is not None \
                and not self._drained.done():
            self._drained.set_result(None)

    # -- shutdown --------------------------------------------------------------------------
    async def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop accepting, close idle connections, let in-flight answers go out for up to
        ``timeout_s``, then close whatever is left."""
        self.stopping = True
        if self._tick is not None:
            self._tick.cancel()
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
