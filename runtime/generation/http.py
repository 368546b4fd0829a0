"""OpenAI-compatible completions over HTTP for ``GenerationEngine``s.

``routes(engines)`` gives the server its routes to mount; ``create_app(engines)`` is a
small standalone app that starts and stops the engines with the app.

    POST /v1/completions   {model, prompt, max_tokens, stream, stream_options,
                            temperature, seed, priority*, ignore_eos*, timeout_ms*}
    GET  /v1/models        GET /v1/models/{model}

(* extensions). ``prompt`` is a string, a list of token ids, or a list of either
(one choice per prompt). Temperature 0 (the default here) is greedy; a higher one
samples with ``seed`` (drawn by the server when absent). A stream is Server-Sent
Events: ``data: {chunk}`` per token with ``choices[i].text`` deltas, then
``data: [DONE]``. Errors use OpenAI's shape ``{"error": {message, type, param, code}}``
(``error_body``), built by ``runtime.api.errors.error_answer`` like every other error
answer of the runtime: same statuses, same ``Retry-After``, and a bug is logged once
and answered 500 without internals, also in the middle of a stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from typing import Any, AsyncIterator

import orjson
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from runtime.api.errors import (BatchScopeError, ClientError, ModelNotFound, ValidationError,
                                error_answer, routing_error)
from runtime.generation.engine import GenerationEngine, GenerationStream

#: request fields accepted only at their neutral value, with what to do instead
_UNSUPPORTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "n": ((None, 1), "n must be 1; send the prompt several times for several choices"),
    "best_of": ((None, 1), "best_of must be 1"),
    "echo": ((None, False), "echo is not supported"),
    "logprobs": ((None, 0), "logprobs are not supported; leave logprobs null"),
    "suffix": ((None, ""), "suffix is not supported"),
    "stop": ((None, [], ""), "stop sequences are not supported; generation ends at the end "
                             "token or after max_tokens"),
    "top_p": ((None, 1, 1.0), "top_p must be 1 (sampling uses the whole distribution)"),
    "presence_penalty": ((None, 0, 0.0), "presence_penalty must be 0"),
    "frequency_penalty": ((None, 0, 0.0), "frequency_penalty must be 0"),
    "logit_bias": ((None, {}), "logit_bias is not supported"),
}

_ERROR_TYPES = {400: "invalid_request_error", 404: "invalid_request_error",
                422: "invalid_request_error", 429: "rate_limit_error"}


def _json(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(data), status_code=status, media_type="application/json",
                    headers=headers)


def error_body(error: BatchScopeError) -> dict[str, Any]:
    """The OpenAI-shaped document of ``error`` (the ``document`` given to ``error_answer``)."""
    code = "model_not_found" if isinstance(error, ModelNotFound) else (
        "rate_limit_exceeded" if error.http_status == 429 else error.reason)
    return {"error": {"message": error.message,
                      "type": _ERROR_TYPES.get(error.http_status, "server_error"),
                      "param": None, "code": code}}


def error_response(error: BaseException, where: str = "the request") -> Response:
    """The Starlette form of ``error_answer`` with the OpenAI error shape."""
    status, headers, body = error_answer(error, where, error_body)
    return Response(body, status, {k.decode("latin-1"): v.decode("latin-1") for k, v in headers})


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# -- request parsing ----------------------------------------------------------------------
def parse_prompts(prompt: Any) -> list[tuple[list[int] | None, str | None]]:
    """Normalise ``prompt`` to a list of (token ids, text) pairs, one of them None."""
    if isinstance(prompt, str):
        return [(None, prompt)]
    if isinstance(prompt, list) and prompt:
        if all(_is_int(t) for t in prompt):
            return [(list(prompt), None)]
        out: list[tuple[list[int] | None, str | None]] = []
        for item in prompt:
            if isinstance(item, str):
                out.append((None, item))
            elif isinstance(item, list) and item and all(_is_int(t) for t in item):
                out.append((list(item), None))
            else:
                break
        else:
            return out
    raise ClientError("prompt must be a string, a non-empty list of token ids, or a list of "
                      "strings / token-id lists (one choice each)")


def parse_body(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ClientError(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ClientError("the request body must be a JSON object")
    for key, (allowed, message) in _UNSUPPORTED.items():
        if key in body and body[key] not in allowed:
            raise ClientError(f"{key}={body[key]!r}: {message}")
    if not isinstance(body.get("model"), str):
        raise ClientError("model is required: the name of one of GET /v1/models")
    if "prompt" not in body:
        raise ClientError("prompt is required: a string or a list of token ids")
    max_tokens = body.get("max_tokens")
    if max_tokens is not None and not (_is_int(max_tokens) and max_tokens >= 1):
        raise ValidationError(f"max_tokens={max_tokens!r} must be a positive integer")
    temperature = body.get("temperature", 0)
    if temperature is None:
        temperature = 0
    if not (isinstance(temperature, (int, float)) and not isinstance(temperature, bool)
            and 0 <= temperature <= 2):
        raise ValidationError(f"temperature={temperature!r} must be a number from 0 to 2")
    seed = body.get("seed")
    if seed is not None and not _is_int(seed):
        raise ClientError(f"seed={seed!r} must be an integer")
    for key in ("stream", "ignore_eos"):
        if body.get(key) not in (None, True, False):
            raise ClientError(f"{key}={body[key]!r} must be true or false")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise ClientError("stream_options must be an object like {\"include_usage\": true}")
    priority = body.get("priority")
    if priority is not None and not _is_int(priority):
        raise ClientError(f"priority={priority!r} must be an integer (0 is most urgent)")
    timeout_ms = body.get("timeout_ms")
    if timeout_ms is not None and not (isinstance(timeout_ms, (int, float))
                                       and not isinstance(timeout_ms, bool)):
        raise ClientError(f"timeout_ms={timeout_ms!r} must be a number of milliseconds")
    return {"model": body["model"], "prompts": parse_prompts(body["prompt"]),
            "max_new_tokens": max_tokens, "stream": bool(body.get("stream")),
            "include_usage": bool(options.get("include_usage")), "temperature": float(temperature),
            "seed": seed, "priority": priority, "ignore_eos": bool(body.get("ignore_eos")),
            "timeout_ms": timeout_ms}


def _submit_all(engine: GenerationEngine, req: dict[str, Any]) -> list[GenerationStream]:
    streams: list[GenerationStream] = []
    try:
        for ids, text in req["prompts"]:
            streams.append(engine.submit(
                ids, text, max_new_tokens=req["max_new_tokens"], priority=req["priority"],
                timeout_ms=req["timeout_ms"], ignore_eos=req["ignore_eos"],
                temperature=req["temperature"], seed=req["seed"]))
    except BaseException:
        for stream in streams:
            stream.close()
        raise
    return streams


async def _merged(streams: list[GenerationStream]) -> AsyncIterator[tuple[int, Any]]:
    """(choice index, TokenEvent) from all streams as they come; re-raises the first error."""
    if len(streams) == 1:
        async for event in streams[0]:
            yield 0, event
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: GenerationStream) -> None:
        try:
            async for event in stream:
                queue.put_nowait((index, event))
        except BaseException as exc:  # handed over to the consumer
            queue.put_nowait((index, exc))
        finally:
            queue.put_nowait((index, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


def _usage(streams: list[GenerationStream]) -> dict[str, int]:
    prompt = sum(s.prompt_tokens for s in streams)
    completion = sum(s.output_tokens for s in streams)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


# -- handlers -----------------------------------------------------------------------------
def routes(engines: dict[str, GenerationEngine]) -> list[Route]:
    """The OpenAI-style routes serving ``engines`` (model name -> engine); each route
    carries ``engines`` as ``generation_engines`` for the app's control API."""

    def model_card(name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": 0, "owned_by": "batchscope"}

    async def list_models(request: Request) -> Response:
        return _json({"object": "list", "data": [model_card(n) for n in engines]})

    async def get_model(request: Request) -> Response:
        name = request.path_params["model"]
        if name not in engines:
            return error_response(_not_found(name, engines))
        return _json(model_card(name))

    async def completions(request: Request) -> Response:
        try:
            req = parse_body(await request.body())
            engine = engines.get(req["model"])
            if engine is None:
                raise _not_found(req["model"], engines)
            streams = _submit_all(engine, req)
        except Exception as exc:
            return error_response(exc, _COMPLETIONS)
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
                "created": int(time.time()), "model": req["model"]}
        if req["stream"]:
            return StreamingResponse(_sse(head, streams, req["include_usage"]),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        texts = [[] for _ in streams]
        reasons: list[str | None] = [None] * len(streams)
        try:
            async for index, event in _merged(streams):
                texts[index].append(event.text)
                reasons[index] = event.finish_reason or reasons[index]
        except Exception as exc:
            return error_response(exc, _COMPLETIONS)
        finally:
            for stream in streams:
                stream.close()
        choices = [{"index": i, "text": "".join(t), "logprobs": None, "finish_reason": reasons[i]}
                   for i, t in enumerate(texts)]
        return _json({**head, "choices": choices, "usage": _usage(streams)})

    served = [Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/models", list_models, methods=["GET"]),
              Route("/v1/models/{model}", get_model, methods=["GET"])]
    for route in served:
        # lets the app's other endpoints (the control API) find the engines it mounts
        route.generation_engines = engines  # type: ignore[attr-defined]
    return served


def _not_found(name: str, engines: dict[str, GenerationEngine]) -> ModelNotFound:
    return ModelNotFound(f"model {name!r} does not exist here; generation models are "
                         f"{sorted(engines)}")


#: how error messages and the log name a completions request
_COMPLETIONS = "POST /v1/completions"


def _sse_line(data: Any) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


async def _sse(head: dict[str, Any], streams: list[GenerationStream],
               include_usage: bool) -> AsyncIterator[bytes]:
    try:
        async for index, event in _merged(streams):
            chunk = {**head, "choices": [{"index": index, "text": event.text, "logprobs": None,
                                          "finish_reason": event.finish_reason}]}
            if include_usage:
                chunk["usage"] = None
            yield _sse_line(chunk)
        if include_usage:
            yield _sse_line({**head, "choices": [], "usage": _usage(streams)})
    except Exception as exc:  # the status line is gone: the error goes in the stream
        yield b"data: " + error_answer(exc, _COMPLETIONS + " (stream)", error_body)[2] + b"\n\n"
    finally:
        for stream in streams:
            stream.close()
    yield b"data: [DONE]\n\n"


def create_app(engines: dict[str, GenerationEngine]) -> Starlette:
    """A standalone app serving ``engines``; starts them on startup, drains them on shutdown."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        for engine in engines.values():
            await engine.start()
        try:
            yield
        finally:
            for engine in engines.values():
                await engine.stop()

    return Starlette(routes=routes(engines), lifespan=lifespan,
                     exception_handlers={HTTPException: _routing_refusal})


async def _routing_refusal(request: Request, exc: HTTPException) -> Response:
    """No route, or a method the route does not accept, in the OpenAI error shape."""
    allow = [m.strip() for m in (exc.headers or {}).get("Allow", "").split(",") if m.strip()]
    where = f"{request.method} {request.url.path}"
    return error_response(routing_error(exc.status_code, request.method, request.url.path,
                                        allow, exc.detail), where)
