"""The gRPC status of an error, with the message its HTTP answer carries.

Every error of ``runtime.api.errors`` already knows its HTTP status; over gRPC it is
answered with the status code of the same meaning and the very message the HTTP body's
``{"error": ...}`` holds:

    400, 414, 422 (bad request, invalid value)      INVALID_ARGUMENT
    404 (unknown model or version)                  NOT_FOUND
    429 (queue full), 413 (too large), 507 (OOM)    RESOURCE_EXHAUSTED
    503 queue timeout passed (RequestExpired), 408  DEADLINE_EXCEEDED
    503 otherwise (not ready, stopping, busy)       UNAVAILABLE
    405, 415 (unknown compression), 505             UNIMPLEMENTED
    500 (the model failed) and anything else        INTERNAL

An error that is not a ``BatchScopeError`` is a bug: ``internal_error`` logs it once
with a reference and the client gets INTERNAL naming that reference, nothing more.
Where an HTTP answer carries ``Retry-After``, the gRPC one carries ``retry-after``
(whole seconds) in its trailing metadata.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from runtime.api.errors import (BatchScopeError, RequestExpired, RequestTimeout,
                                internal_error, retry_after_seconds)

_BY_HTTP_STATUS = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    405: grpc.StatusCode.UNIMPLEMENTED,
    408: grpc.StatusCode.DEADLINE_EXCEEDED,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    414: grpc.StatusCode.INVALID_ARGUMENT,
    415: grpc.StatusCode.UNIMPLEMENTED,
    422: grpc.StatusCode.INVALID_ARGUMENT,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    500: grpc.StatusCode.INTERNAL,
    503: grpc.StatusCode.UNAVAILABLE,
    505: grpc.StatusCode.UNIMPLEMENTED,
    507: grpc.StatusCode.RESOURCE_EXHAUSTED,
}


@dataclass(frozen=True, slots=True)
class Refusal:
    """What a failed call is answered with."""

    code: grpc.StatusCode
    message: str
    #: trailing metadata: ``retry-after`` where the HTTP answer has ``Retry-After``
    metadata: tuple[tuple[str, str], ...] = ()


def status_code(error: BatchScopeError) -> grpc.StatusCode:
    """The gRPC status code of ``error`` (see the table above)."""
    if isinstance(error, (RequestExpired, RequestTimeout)):
        return grpc.StatusCode.DEADLINE_EXCEEDED
    code = _BY_HTTP_STATUS.get(error.http_status)
    if code is not None:
        return code
    return grpc.StatusCode.INVALID_ARGUMENT if 400 <= error.http_status < 500 \
        else grpc.StatusCode.INTERNAL


def refusal(exc: BaseException, where: str) -> Refusal:
    """The answer to a call that failed with ``exc``; ``where`` names the call in the log
    line of an unexpected error."""
    error = exc if isinstance(exc, BatchScopeError) else internal_error(exc, where)
    retry = retry_after_seconds(error)
    metadata = (("retry-after", str(retry)),) if retry is not None else ()
    return Refusal(status_code(error), error.message, metadata)
