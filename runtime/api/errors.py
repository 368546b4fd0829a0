"""Error hierarchy of the runtime, and the one function that turns an error into an
HTTP answer.

Every error knows the HTTP status it maps to and carries a message that says what
was wrong and what the caller can do about it. ``error_answer(exc, where)`` is the
only place an error answer is built, for every server in the runtime (the HTTP/1
server and its inference fast path, the Starlette routes and control API, the
OpenAI-style generation routes):

* a ``BatchScopeError`` becomes its status and ``{"error": message}`` (its
  ``to_dict()``, or the caller's ``document``), with ``Retry-After`` on 429 and on a
  503 that knows when to retry, and ``Allow`` on 405;
* anything else is a bug: it is logged once, with its traceback and a short
  reference, and answered 500 with a message that names the reference and leaks
  nothing about the code.

It lives beside the hierarchy because the wire form of an error is part of what an
error is, and because every HTTP layer depends on this module; the OpenAI-style routes
(``runtime.generation.http``, ``runtime.server.openai_*``) add OpenAI's error shape in
``runtime.server.openai_errors``.
It depends on no web framework: it returns ``(status, headers, body)`` in the raw
form the HTTP/1 server writes, and each framework adapter wraps that in one line.
"""

from __future__ import annotations

import logging
import math
import uuid
from typing import Any, Callable, Sequence

import orjson

log = logging.getLogger("batchscope.server")

#: response headers in the raw form the HTTP/1 server and ASGI use
Headers = list[tuple[bytes, bytes]]
#: (status, headers, body) of an answer
Answer = tuple[int, Headers, bytes]


class BatchScopeError(Exception):
    """Base class: an error with an HTTP status and a user-facing message."""

    http_status: int = 500
    #: short machine-readable reason, also used as the outcome label in metrics
    reason: str = "internal"
    #: the request field the error is about, where one is (an OpenAI error body's
    #: ``param``); a subclass may name its own, a raise site the one it checked
    param: str | None = None

    def __init__(self, message: str, *, retry_after_s: float | None = None,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after_s = retry_after_s
        if param is not None:
            self.param = param

    def to_dict(self) -> dict[str, str]:
        return {"error": self.message}


class ClientError(BatchScopeError):
    """The request is malformed (bad JSON, wrong shape or datatype...)."""

    http_status = 400
    reason = "bad_request"


class ValidationError(BatchScopeError):
    """The request is well-formed but a value is out of range or inconsistent."""

    http_status = 422
    reason = "invalid"


class ConfigError(ValidationError):
    """A batching or server setting is invalid; nothing was changed."""

    reason = "invalid_config"


class ModelNotFound(BatchScopeError):
    http_status = 404
    reason = "not_found"


class RouteNotFound(BatchScopeError):
    """No route of this server matches the request's path."""

    http_status = 404
    reason = "no_route"


class MethodNotAllowed(BatchScopeError):
    """The path exists (or the server runs) but not with this method; ``allow`` lists
    the methods that are accepted, sent back as the ``Allow`` header."""

    http_status = 405
    reason = "method_not_allowed"

    def __init__(self, message: str, *, allow: Sequence[str]) -> None:
        super().__init__(message)
        self.allow = tuple(allow)


class RequestTooLarge(BatchScopeError):
    """The request body is over the server's limit."""

    http_status = 413
    reason = "too_large"


class UnsupportedEncoding(BatchScopeError):
    """The request body is compressed with a coding the server cannot undo."""

    http_status = 415
    reason = "unsupported_encoding"


class UrlTooLong(BatchScopeError):
    """The request target is over the server's limit."""

    http_status = 414
    reason = "url_too_long"


class HeadersTooLarge(BatchScopeError):
    """The request has more header fields, or more bytes of them, than the server reads."""

    http_status = 431
    reason = "headers_too_large"


class RequestTimeout(BatchScopeError):
    """The client took too long to send its request (head or body)."""

    http_status = 408
    reason = "request_timeout"


class ServerBusy(BatchScopeError):
    """The server holds as many connections or request bytes as it will; retry later."""

    http_status = 503
    reason = "busy"


class QueueFull(BatchScopeError):
    """Backpressure: the model's queue is at ``max_queue_size``."""

    http_status = 429
    reason = "rejected"


class RequestExpired(BatchScopeError):
    """The request's timeout passed while it waited in the queue; it never ran."""

    http_status = 503
    reason = "expired"


class ModelNotReady(BatchScopeError):
    http_status = 503
    reason = "not_ready"


class ShuttingDown(BatchScopeError):
    http_status = 503
    reason = "shutting_down"


class ModelError(BatchScopeError):
    """The model raised while running the batch this request was in."""

    http_status = 500
    reason = "model_error"


class BatchLost(BatchScopeError):
    """The process running the batch this request was in exited before answering (it is
    restarted); the request did not complete and may be sent again."""

    http_status = 503
    reason = "batch_lost"


class ModelTimedOut(BatchScopeError):
    """The batch this request was in ran past its model's ``execution_timeout_ms``."""

    http_status = 503
    reason = "model_timeout"


class HttpVersionNotSupported(BatchScopeError):
    http_status = 505
    reason = "http_version"


class OutOfMemory(BatchScopeError):
    """A single request does not fit in memory even alone."""

    http_status = 507
    reason = "oom"


class InsufficientMemory(BatchScopeError):
    """The requests being decoded and served hold as much memory as the server lets
    them (``runtime.server.bounds.MemoryBudget``); this one may be sent again later."""

    http_status = 507
    reason = "memory_budget"


class InsufficientStorage(BatchScopeError):
    """The server's disk has no room for what this request needs written; it may be
    sent again once there is."""

    http_status = 507
    reason = "storage"


#: where the routes of the server are listed, for a request that matched none
ROUTES_DOC = '"HTTP API" in docs/protocols.md'


def routing_error(status: int, method: str, path: str, allow: Sequence[str] = (),
                  detail: str = "") -> BatchScopeError:
    """The error for a request no route took (a web framework's 404 or 405)."""
    if status == 404:
        return RouteNotFound(f"no route for {method} {path}; see {ROUTES_DOC} for the routes "
                             "served")
    if status == 405:
        return MethodNotAllowed(f"{method} is not accepted on {path}; use {' or '.join(allow)}",
                                allow=allow)
    error = ClientError(f"{detail or 'refused'} ({method} {path})")
    error.http_status = status  # frameworks refuse nothing else today; keep what they say
    return error


# -- the wire form ----------------------------------------------------------------------
_JSON = (b"content-type", b"application/json")
#: shared by every answer without extra headers; never mutated
_JSON_ONLY: Headers = [_JSON]
#: the longest request description quoted back in an internal-error message
_WHERE_CHARS = 200


def retry_after_seconds(exc: BatchScopeError) -> int | None:
    """Whole seconds for ``Retry-After``, or None when the answer carries none.

    A 429 always carries one (1 s when the error does not say); a 503 carries one
    (and a 507) when the error knows when to retry. Fractions round up and the least is 1 s, so
    a client that waits as told never comes back early.
    """
    status = exc.http_status
    retry = exc.retry_after_s
    if status == 429 or (status in (503, 507) and retry is not None):
        if retry is None or not math.isfinite(retry):
            return 1
        return max(1, math.ceil(retry))
    return None


def internal_error(exc: BaseException, where: str) -> BatchScopeError:
    """Log ``exc`` (a bug: anything that is not a ``BatchScopeError``) once, with its
    traceback, and give the error a client sees instead: a 500 naming a reference
    that finds the log line, and nothing of the exception itself."""
    ref = uuid.uuid4().hex[:8]
    where = where[:_WHERE_CHARS]
    log.error("unexpected error answering %s (reference %s)", where, ref,
              exc_info=(type(exc), exc, exc.__traceback__))
    return BatchScopeError(f"internal error: the server failed answering {where} (logged on "
                           f"the server as {ref}); retry, and report {ref} if it keeps failing")


def error_answer(exc: BaseException, where: str,
                 document: Callable[[BatchScopeError], dict[str, Any]] | None = None
                 ) -> Answer:
    """``(status, headers, body)`` answering a request that failed with ``exc``.

    ``where`` names the request, e.g. ``"POST /v2/models/m/infer"``; it is used only
    when ``exc`` is unexpected (logged, then answered 500). ``document`` builds the
    JSON body from the error (default ``exc.to_dict()``, i.e. ``{"error": message}``);
    the OpenAI-style routes pass their own shape.
    """
    error = exc if isinstance(exc, BatchScopeError) else internal_error(exc, where)
    headers = _JSON_ONLY
    retry = retry_after_seconds(error)
    allow = getattr(error, "allow", None)
    if retry is not None or allow:
        headers = [_JSON]
        if retry is not None:
            headers.append((b"retry-after", b"%d" % retry))
        if allow:
            headers.append((b"allow", ", ".join(allow).encode("latin-1")))
    doc = error.to_dict() if document is None else document(error)
    return error.http_status, headers, orjson.dumps(doc)


class ListenError(OSError):
    """A port of the server could not be taken (in use, or not an address of this
    machine): the message names which; the command line says it in one line."""
