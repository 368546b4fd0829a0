"""What every OpenAI-style route (``/v1/...``) shares: the JSON body, JSON answers, the
model list, and noticing a client that went away.

* ``read_object(raw, content_encoding)``: the request body as a JSON object, or
  ``InvalidParam`` (400); more than ``runtime.server.bounds.MAX_JSON_BYTES`` is refused
  unparsed (413). A body sent with ``Content-Encoding`` gzip or deflate is inflated
  first, as on the KServe routes (``runtime.server.kserve.compression``), to at most
  ``MAX_JSON_BYTES`` (more: 413); any other coding is refused (415).
  ``read_request(request)`` is the same for a Starlette request, whose codings
  ``content_encoding(request)`` gives; ``parsed_body(request, parse)`` runs any such
  parser on a request's body. A compressed body over ``COMPRESSED_ASIDE_BYTES`` is
  inflated and parsed on a worker thread, off the event loop, as the KServe fast path
  does (``runtime.server.fastpath.LARGE_COMPRESSED_BYTES``), and so is a plain body over
  ``PLAIN_ASIDE_BYTES`` (``LARGE_BODY_BYTES`` there): how far it inflates is not
  known before it is inflated, and inflating and parsing up to ``MAX_JSON_BYTES`` would
  keep every other client waiting meanwhile.
* ``until_disconnected(request, work)``: awaits ``work`` unless the client closes its
  connection first; then ``work`` is cancelled (so what it queued is given up and its
  resources freed) and ``ClientGone`` raised. Streamed answers need no such wrapper
  once they started: the response notices the client leaving itself.
* ``model_routes(names)``: ``GET /v1/models`` and ``GET /v1/models/{model}``.
* ``begin_trace``, ``received_times(request)`` and ``TimedAnswer``: a traced request's
  trace, its receive times (from the HTTP/1 server's scope) and send times (around the
  write of its answer).
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable, TypeVar

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from runtime.core.tracing import one_traceparent
from runtime.server.bounds import MAX_JSON_BYTES, check_json_size
from runtime.server.http1.asgi import RECEIVED
from runtime.server.kserve.compression import decoded_body
from runtime.server.openai_errors import InvalidParam, error_response, model_not_found

T = TypeVar("T")

#: a compressed body larger than this is inflated and parsed on a worker thread, off the
#: event loop (the KServe fast path's ``LARGE_COMPRESSED_BYTES``): a gzip body inflates
#: up to 1,000-fold, so a few KiB of it may become the whole ``MAX_JSON_BYTES``
COMPRESSED_ASIDE_BYTES = 4096
#: a body that is not compressed is parsed on a worker thread past this many bytes (the
#: KServe fast path's ``LARGE_BODY_BYTES``): parsing a few MiB of JSON takes milliseconds
PLAIN_ASIDE_BYTES = 1 << 20


def json_response(data: Any, status: int = 200,
                  headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(data), status_code=status, media_type="application/json",
                    headers=headers or None)


def read_object(raw: bytes, content_encoding: str | None = None) -> dict[str, Any]:
    """The request body as a JSON object (at most ``MAX_JSON_BYTES``, else 413).

    ``content_encoding`` (the request's ``Content-Encoding``) is undone first, as the
    KServe routes do (``decoded_body``: gzip, deflate, identity; another coding is a
    415 naming those): a body is JSON and nothing else here, so it may inflate to
    ``MAX_JSON_BYTES`` and no more (413), and is never read as JSON still compressed."""
    if content_encoding:
        raw = decoded_body(raw, content_encoding, MAX_JSON_BYTES)
    check_json_size(len(raw), "the request body", "send fewer or shorter inputs per request")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidParam(None, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidParam(None, "the request body must be a JSON object")
    return body


def content_encoding(request: Request) -> str | None:
    """``request``'s ``Content-Encoding``, every header line of it in order (several
    lines are one list, RFC 9110), so that no coding is left undone; None: none sent."""
    codings = request.headers.getlist("content-encoding")
    return ", ".join(codings) if codings else None


async def parsed_body(request: Request, parse: Callable[[bytes, str | None], T]) -> T:
    """``parse(body, content_encoding)`` of ``request``: on a worker thread when the body
    is compressed and over ``COMPRESSED_ASIDE_BYTES`` (``parse`` inflates it, to at most
    its limit, and parses it there) or plain and over ``PLAIN_ASIDE_BYTES``, else in
    place (a thread hop would cost more than a small body takes)."""
    raw = await request.body()
    coding = content_encoding(request)
    if len(raw) > (COMPRESSED_ASIDE_BYTES if coding else PLAIN_ASIDE_BYTES):
        return await asyncio.to_thread(parse, raw, coding)
    return parse(raw, coding)


async def read_request(request: Request) -> dict[str, Any]:
    """``read_object`` of ``request``'s body, with its ``Content-Encoding``
    (``parsed_body``)."""
    return await parsed_body(request, read_object)


class ClientGone(Exception):
    """The client closed its connection before its answer was ready."""


#: what a handler answers a client that is gone (nobody reads it; nginx's number for it)
GONE_STATUS = 499


async def _disconnected(request: Request) -> None:
    # shielded: the ASGI server's disconnect future may be shared with a streamed
    # response's own listener, and cancelling this waiter must not cancel it
    while (await asyncio.shield(request.receive()))["type"] != "http.disconnect":
        pass


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """``await work``, unless the client goes away first: then ``work`` is cancelled
    and ``ClientGone`` raised. The request body must have been read."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        gone.cancel()
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)  # let it unwind before the caller goes on
    raise ClientGone()


def request_traceparent(request: Request) -> str | None:
    """The request's ``traceparent`` header (``one_traceparent``: two are followed by none)."""
    return one_traceparent(request.headers.getlist("traceparent"))


def received_times(request: Request) -> tuple[float | None, float | None]:
    """When the request's bytes began and finished arriving (``runtime.server.http1``'s
    ``batchscope.received`` scope extension, on the event loop's clock, as the fast path
    reads them); (None, None) from a server that does not say."""
    received = (request.scope.get("extensions") or {}).get(RECEIVED)
    if not received:
        return None, None
    start, end = received
    return start or None, end or None


def begin_trace(tracer: Any, model: str, operation: str, request: Request) -> Any:
    """The request's trace when ``tracer`` (None: the server traces nothing) traces it:
    its settings sample it, or it carried a sampled ``traceparent``
    (``runtime.engine.tracing``); with its receive times where the server gave them."""
    if tracer is None:
        return None
    traceparent = request_traceparent(request)
    if traceparent is None and not tracer.control.active:
        return None
    recv_start, recv_end = received_times(request)
    return tracer.begin(model, "http", None, traceparent, operation=operation,
                        recv_start=recv_start, recv_end=recv_end)


class TimedAnswer:
    """``response`` (an ASGI app) written with a trace's send times stamped around the
    write, then ``on_end()`` (which records the trace) however the write ended.

    ``send_start``: as the first body message is handed to the server (its first bytes
    go out with it, the head included); ``send_end``: once the last one (no
    ``more_body``) has been written. A streamed answer's first bytes thus go out with
    its first events, its last with its end. ``request_end``, unless the route stamped
    it, is taken as that last message is handed over: the answer is all made then."""

    __slots__ = ("response", "trace", "now", "on_end")

    def __init__(self, response: Any, trace: Any, now: Callable[[], float],
                 on_end: Callable[[], None]) -> None:
        self.response = response
        self.trace = trace
        self.now = now
        self.on_end = on_end

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        trace, now = self.trace, self.now

        async def timed(message: dict) -> None:
            if message["type"] != "http.response.body":
                await send(message)
                return
            last = not message.get("more_body", False)
            if last and trace.request_end is None:
                trace.request_end = now()
            if trace.send_start is None:
                trace.send_start = now()
            await send(message)
            if last:
                trace.send_end = now()

        try:
            await self.response(scope, receive, timed)
        finally:
            self.on_end()


def model_routes(names: Callable[[], list[str]]) -> list[Route]:
    """``GET /v1/models`` and ``/v1/models/{model}`` for the models ``names()`` gives."""

    def card(name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": 0, "owned_by": "batchscope"}

    async def list_models(request: Request) -> Response:
        return json_response({"object": "list", "data": [card(n) for n in names()]})

    async def get_model(request: Request) -> Response:
        name, served = request.path_params["model"], names()
        if name not in served:
            return error_response(model_not_found(name, served, "model"),
                                  f"GET /v1/models/{name}")
        return json_response(card(name))

    return [Route("/v1/models", list_models, methods=["GET"]),
            Route("/v1/models/{model}", get_model, methods=["GET"])]
