"""``AsgiCall``: a minimal ASGI 3 bridge for the requests the fast hook does not take.

``receive`` gives the buffered body, then waits until the client goes away or the
response is done and says ``http.disconnect``; ``send`` takes ``http.response.start``
and ``http.response.body``. A response without ``Content-Length`` whose body comes in
several parts goes out with chunked transfer encoding (HTTP/1.1) or until close
(HTTP/1.0), so streams stream. An app that fails before answering is answered by
``runtime.api.errors.error_answer``; one that fails mid-answer has its answer cut short.

The scope's ``extensions`` carry ``RECEIVED`` (``"batchscope.received"``): when the
request's first byte arrived and the read that completed it (its connection's
``began_s`` and ``last_active_s`` as it was dispatched, the event loop's clock), the
receive times a traced request's routes record (``runtime.engine.tracing``), as the
fast hook reads them from the connection.
"""

from __future__ import annotations

import logging
from typing import Any
from urllib.parse import unquote

import httptools

from runtime.api.errors import ClientError, error_answer
from runtime.server.http1.wire import Exchange, status_line

#: ``Connection`` (``connection``) and ``HttpServer`` (``server``) import this module, so
#: their names in annotations here are not imported
log = logging.getLogger("batchscope.server")
#: the scope extension holding (first byte arrived, last byte arrived) of the request
RECEIVED = "batchscope.received"


class AsgiCall:
    """Runs one request through an ASGI 3 application."""

    __slots__ = ("conn", "ex", "body", "started", "chunked", "length_known", "body_done",
                 "status", "head", "received")

    def __init__(self, conn: "Connection", ex: Exchange, body: bytes) -> None:
        self.conn = conn
        self.ex = ex
        self.body = body
        self.started = False
        self.chunked = False
        self.length_known = False
        self.body_done = False
        self.status = 0
        self.head: list[tuple[bytes, bytes]] = []
        #: the connection's receive times of this request, read now: a pipelined request
        #: parsed before the app runs moves them on
        self.received = (conn.began_s, conn.last_active_s)

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
            "headers": ex.headers, "state": {}, "extensions": {RECEIVED: self.received},
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
