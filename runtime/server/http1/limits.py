"""The limits that keep slow and hostile clients from holding the server.

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
"""

from __future__ import annotations

#: request bodies larger than this are refused with 413
MAX_BODY_BYTES = 64 * 1024 * 1024
#: request targets (path and query) longer than this are refused with 414
MAX_URL_BYTES = 64 * 1024
#: a request with more header fields than this, or more bytes of them, is refused with 431
MAX_HEADERS = 100
MAX_HEADER_BYTES = 64 * 1024
#: methods handed to the app; any other the fast hook does not take is refused with 405
SERVED_METHODS = frozenset({b"GET", b"HEAD", b"POST", b"PUT", b"PATCH", b"DELETE", b"OPTIONS"})
ALLOW = sorted(m.decode() for m in SERVED_METHODS)
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
UNBOUNDED = 1 << 62


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
