"""``HttpServer``: accepts connections and routes their complete requests.

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
from collections import deque
from typing import Any

from runtime.api.errors import error_answer
from runtime.server.http1.asgi import AsgiCall
from runtime.server.http1.connection import Connection
from runtime.server.http1.limits import (BODY_TIMEOUT_S, HEADER_TIMEOUT_S, KEEP_ALIVE_S,
                                         MAX_BODY_BYTES, MAX_INFLIGHT_BODY_BYTES,
                                         MIN_BODY_BYTES_PER_S, PASS_BUDGET, SERVED_METHODS,
                                         TICK_S, UNBOUNDED, default_max_connections)
from runtime.server.http1.wire import (Clock, DrainHook, EarlyHook, EdgeHook, Exchange, FastHook,
                                       status_line, unsupported_method)

log = logging.getLogger("batchscope.server")


class Reply:
    """``conn.answer(ex, status, headers, body)`` as a callback of (status, headers,
    body), the fast path's way to answer: one object rather than a closure and its cells
    (each request in flight holds one)."""

    __slots__ = ("conn", "ex")

    def __init__(self, conn: Connection, ex: Exchange) -> None:
        self.conn = conn
        self.ex = ex

    def __call__(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        self.conn.answer(self.ex, status, headers, body)

    def with_line(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes,
                  line: bytes) -> None:
        """The answer with one more header line of its own (``Connection.answer``)."""
        self.conn.answer(self.ex, status, headers, body, line)


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
        self.pass_budget = UNBOUNDED if pass_budget is None else pass_budget
        #: requests that may still be taken in before the loop gets a turn (see ``hold``)
        self.budget = self.pass_budget
        #: connections holding bytes that arrived once the budget was spent, in order
        self.held: deque[Connection] = deque()
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
        self.clock = Clock()
        self.connections: set[Connection] = set()
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
        self._server = await self.loop.create_server(lambda: Connection(self), sock=sock,
                                                     backlog=2048)
        self._tick = self.loop.call_later(self.tick_s, self._on_tick)

    def _on_tick(self) -> None:
        if self.clock.refresh():
            self.heads.clear()
        self.expire(self.loop.time())
        self._tick = self.loop.call_later(self.tick_s, self._on_tick)

    def expire(self, now: float) -> None:
        """Close the connections whose client kept them waiting too long (see
        ``Connection.expire``); ``now`` is on the loop's clock."""
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
    def hold(self, conn: Connection, data: bytes) -> bool:
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
    def dispatch(self, conn: Connection, ex: Exchange, body: bytes) -> None:
        fast = self.fast
        if fast is not None:
            url = ex.url
            if b"?" not in url and b"%" not in url:
                try:
                    taken = fast(conn, ex.method, url.decode("latin-1"), ex.headers, body,
                                 Reply(conn, ex))
                except Exception as exc:
                    where = f"{ex.method.decode('latin-1')} {url[:200].decode('latin-1')}"
                    conn.answer(ex, *error_answer(exc, where))
                    return
                if taken:
                    return
        if ex.method not in SERVED_METHODS:
            # checked here, off the fast path: CONNECT, TRACE, WebDAV... never reach the
            # app (raises out of the parser callback that dispatched, like every refusal)
            conn.refuse(unsupported_method(ex.method), ex)
        task = self.loop.create_task(AsgiCall(conn, ex, body).run(self.app))
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
