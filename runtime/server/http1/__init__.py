"""A small HTTP/1.1 server on asyncio + ``httptools``, built for the inference path.

``HttpServer`` accepts connections; each is an ``asyncio.Protocol`` (``Connection``)
that parses with ``httptools.HttpRequestParser`` and buffers each request body
(up to ``max_body_bytes``, else 413). A complete request goes to one of two places:

* ``fast(conn, method, path, headers, body, answer)`` — a synchronous hook that may
  take the request (returns True) and later call ``answer(status, headers, body)``
  exactly once, from any callback on the loop. The inference route uses it: no Task,
  no coroutine, no ASGI dicts per request.
* otherwise the ASGI app, through a minimal ASGI 3 bridge (``asgi.AsgiCall``) that
  streams answers whose length is not known up front.

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

The parts: ``server`` (``HttpServer``: accepting, routing, shedding, draining,
shutdown), ``connection`` (``Connection``: parsing, limits, answering in order),
``asgi`` (the ASGI bridge), ``limits`` (every bound and its default) and ``wire``
(what they share: a request's state, status lines, the hooks' signatures).
"""

from runtime.server.http1.connection import Connection
from runtime.server.http1.limits import (BODY_TIMEOUT_S, EARLY_DRAIN_BYTES, HEADER_TIMEOUT_S,
                                         KEEP_ALIVE_S, LINGER_S, MAX_BODY_BYTES, MAX_HEADER_BYTES,
                                         MAX_HEADERS, MAX_INFLIGHT_BODY_BYTES, MAX_PIPELINED,
                                         MAX_URL_BYTES, MIN_BODY_BYTES_PER_S, SERVED_METHODS,
                                         default_max_connections)
from runtime.server.http1.server import HttpServer
from runtime.server.http1.wire import Answer, DrainHook, FastHook, status_line

__all__ = ["Answer", "BODY_TIMEOUT_S", "Connection", "DrainHook", "EARLY_DRAIN_BYTES", "FastHook",
           "HEADER_TIMEOUT_S", "HttpServer", "KEEP_ALIVE_S", "LINGER_S", "MAX_BODY_BYTES",
           "MAX_HEADER_BYTES", "MAX_HEADERS", "MAX_INFLIGHT_BODY_BYTES", "MAX_PIPELINED",
           "MAX_URL_BYTES", "MIN_BODY_BYTES_PER_S", "SERVED_METHODS", "default_max_connections",
           "status_line"]
