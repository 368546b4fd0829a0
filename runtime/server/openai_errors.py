"""Errors of the OpenAI-style routes (``/v1/...``) in the shape OpenAI's clients read.

Every error is still answered by ``runtime.api.errors.error_answer`` (same
``Retry-After``, same logging of bugs); only the document and two things of the
status differ from the rest of the server:

* the body is ``{"error": {"message", "type", "param", "code"}}``, ``param`` naming
  the request field at fault when it is known (``InvalidParam``, or an error class
  with a ``param`` attribute);
* a value out of range is 400 (OpenAI's answer) where the KServe routes answer 422.

The official ``openai`` client raises ``BadRequestError`` (400), ``NotFoundError``
(404), ``RateLimitError`` (429) or ``InternalServerError`` (5xx) from these, with
``message``, ``code`` and ``param`` taken from the body.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from runtime.api.errors import (Answer, BatchScopeError, ClientError, ModelNotFound,
                                error_answer, routing_error)

#: statuses the OpenAI API does not use, and the one it answers the same case with
_OPENAI_STATUS = {422: 400}

#: the ``type`` of each status's errors: a client's mistake is an ``invalid_request_error``
_TYPES = {400: "invalid_request_error", 404: "invalid_request_error",
          405: "invalid_request_error", 413: "invalid_request_error",
          415: "invalid_request_error", 429: "rate_limit_error"}


class InvalidParam(ClientError):
    """A request field of an OpenAI-style route is missing, of the wrong type, or holds
    a value this server does not take; ``param`` names the field."""

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message)
        self.param = param


def model_not_found(name: str, served: list[str], kind: str) -> ModelNotFound:
    """``kind``: "model", "generation model", ... (what the route serves)."""
    error = ModelNotFound(f"no {kind} named {name!r} is served here; {kind}s: {sorted(served)} "
                          "(GET /v1/models lists every model)")
    error.param = "model"  # type: ignore[attr-defined]
    return error


def openai_status(error: BatchScopeError) -> int:
    return _OPENAI_STATUS.get(error.http_status, error.http_status)


def error_body(error: BatchScopeError) -> dict[str, Any]:
    """The OpenAI-shaped document of ``error`` (the ``document`` given to ``error_answer``)."""
    status = openai_status(error)
    if isinstance(error, ModelNotFound):
        code = "model_not_found"
    elif status == 429:
        code = "rate_limit_exceeded"
    else:
        code = error.reason
    return {"error": {"message": error.message, "type": _TYPES.get(status, "server_error"),
                      "param": getattr(error, "param", None), "code": code}}


def openai_answer(exc: BaseException, where: str = "the request") -> Answer:
    """``error_answer`` with the OpenAI body and status."""
    status, headers, body = error_answer(exc, where, error_body)
    return _OPENAI_STATUS.get(status, status), headers, body


def error_response(exc: BaseException, where: str = "the request") -> Response:
    """The Starlette form of ``openai_answer``."""
    status, headers, body = openai_answer(exc, where)
    return Response(body, status, {k.decode("latin-1"): v.decode("latin-1") for k, v in headers})


async def routing_refusal(request: Request, exc: Any) -> Response:
    """A Starlette ``HTTPException`` (no route, or a method the route does not take) in the
    OpenAI shape, for an app that serves only OpenAI-style routes."""
    allow = [m.strip() for m in (exc.headers or {}).get("Allow", "").split(",") if m.strip()]
    where = f"{request.method} {request.url.path}"
    return error_response(routing_error(exc.status_code, request.method, request.url.path,
                                        allow, exc.detail), where)
