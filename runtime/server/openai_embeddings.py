"""``POST /v1/embeddings``: OpenAI's embeddings API over the request engine.

    {model, input, encoding_format, dimensions, user, priority*, timeout_ms*}

A request model is served here when it names its ``embedding_output``
(``runtime.api.model.ModelAPI``). ``input`` is a string, a list of token ids, or a
list of up to ``MAX_INPUTS`` of either (and no more than the model's
``max_queue_size``), each text at most ``MAX_INPUT_CHARS`` long; inputs with many
characters in all are tokenized on a worker thread, off the event loop. Each input becomes the model's inputs through
``embedding_inputs``, and the call goes to the ``Engine`` as one request of that many
items (``Engine.infer_items``): every input is checked before any is queued, then
each is queued on its own, so the inputs of one call, and those of concurrent calls,
are batched together like any other requests of the model (same queue, same batching
settings, one record each).

``encoding_format`` "float" (the default: absent or null) answers lists of numbers,
"base64" the little-endian float32 bytes in base64 (what the ``openai`` client asks
for unless told otherwise, and decodes itself); anything else is refused.
``dimensions`` may only repeat the model's own; ``user``, when given, is a string.
An input the model reads as no tokens at all (an empty text), or as more tokens than
it reads (its ``max_length``), is refused naming its index. The body may be sent gzip-
or deflate-compressed (``Content-Encoding``, ``runtime.server.openai_http.read_object``;
a large one is inflated off the event loop, ``parsed_body``).
``priority`` (0 = most urgent, as on ``/v1/completions``) and ``timeout_ms`` are
extensions. ``model: "<base>:<adapter>"`` embeds with one of the base model's LoRA
adapters (404 naming the loaded ones for an adapter it does not have); the answer's
``model`` repeats what was asked for. ``usage`` counts the tokens of every input. If one input fails (queue
full, expired, invalid), the call answers that error and the inputs still queued are
withdrawn; a client that goes away withdraws them too.
"""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from runtime.api.errors import BatchScopeError, RequestTooLarge
from runtime.server.openai_errors import InvalidParam, error_response, model_not_found
from runtime.server.openai_http import (GONE_STATUS, ClientGone, TimedAnswer, begin_trace,
                                        json_response, read_request, until_disconnected)

MAX_INPUTS = 2048
#: the longest text one input may be (tokenizing holds the interpreter lock: ~1 ms a
#: thousand characters here)
MAX_INPUT_CHARS = 50_000
#: inputs with more characters than this in all are tokenized on a worker thread, so
#: the event loop serves other clients between inputs
THREAD_CHARS = 16_384
_WHERE = "POST /v1/embeddings"
#: token ids above this belong to no vocabulary (and would not fit the arrays)
_MAX_TOKEN_ID = 2 ** 31


def embedding_models(engine: Any) -> list[str]:
    """The engine's models that name an ``embedding_output``."""
    return [name for name in engine.model_names()
            if getattr(engine.model(name), "embedding_output", None) is not None]


def _is_ids(value: Any) -> bool:
    return (isinstance(value, list) and bool(value) and all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < _MAX_TOKEN_ID
        for t in value))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _text(value: str, index: int) -> str:
    if len(value) > MAX_INPUT_CHARS:
        error = RequestTooLarge(f"input[{index}] has {len(value)} characters; send at most "
                                f"{MAX_INPUT_CHARS} per input (the models here read a few "
                                "hundred tokens of it); split longer texts into several inputs")
        error.param = "input"  # type: ignore[attr-defined]
        raise error
    return value


def parse_inputs(value: Any, max_items: int = MAX_INPUTS) -> list[str | list[int]]:
    """``input`` as a list of texts and token-id lists, one embedding each: at most
    ``max_items`` of them, each text at most ``MAX_INPUT_CHARS`` long."""
    if isinstance(value, str):
        return [_text(value, 0)]
    if _is_ids(value):
        return [value]
    if isinstance(value, list) and len(value) > max_items:
        raise InvalidParam("input", f"input has {len(value)} items; at most {max_items} are "
                                    "embedded per request (at most the model's "
                                    f"max_queue_size and {MAX_INPUTS}); send the rest in "
                                    "further requests")
    if isinstance(value, list) and value and all(isinstance(v, str) or _is_ids(v)
                                                 for v in value):
        for i, v in enumerate(value):
            if isinstance(v, str):
                _text(v, i)
        return value
    raise InvalidParam("input", "input must be a string, a non-empty list of token ids "
                                "(integers from 0), or a non-empty list of either")


def _embedding_dim(model: Any) -> int | None:
    for spec in model.outputs:
        if spec.name == model.embedding_output and len(spec.shape) == 1 and spec.shape[0] > 0:
            return int(spec.shape[0])
    return None


def _encode(vector: np.ndarray, fmt: str) -> Any:
    vector = np.asarray(vector, dtype="<f4").reshape(-1)
    if fmt == "base64":
        return base64.b64encode(vector.tobytes()).decode("ascii")
    return vector.tolist()


def _prepared(model: Any, name: str, values: list[str | list[int]]
              ) -> list[tuple[dict[str, np.ndarray], int]]:
    """Each input as the model's inputs and its token count (``embedding_inputs``). An
    input of no tokens is refused here, naming its index: the engine would refuse it
    too, but in the words of the model's tensors, not saying which input it was; so is
    an input of more tokens than the model reads (``_token_limit``)."""
    limit = _token_limit(model)
    out = []
    for i, value in enumerate(values):
        try:
            inputs, tokens = model.embedding_inputs(value)
        except BatchScopeError as exc:
            if getattr(exc, "param", None) is None:  # the model's words: say which input
                exc.message = f"input[{i}]: {exc.message}"
                exc.param = "input"  # type: ignore[attr-defined]
            raise
        except Exception as exc:  # a model's own check that is not one of ours
            raise InvalidParam("input", f"input[{i}] could not be read by model {name!r}: "
                                        f"{type(exc).__name__}: {exc}"[:500]) from None
        if tokens == 0:
            raise InvalidParam("input", f"input[{i}] is empty: model {name!r} reads no tokens "
                                        "from it; send at least one character or token id "
                                        "per input, or leave the empty ones out")
        if limit is not None and tokens > limit:
            raise InvalidParam("input", f"input[{i}] has {tokens} tokens, more than the "
                                        f"{limit} model {name!r} reads per input; shorten it, "
                                        "or split it into several inputs")
        out.append((inputs, tokens))
    return out


def _token_limit(model: Any) -> int | None:
    """The most tokens one input may have: the model's ``max_length``, which the engine
    holds each input to, unless the model cuts longer inputs itself (``truncate``, as
    ``hf:`` models do by default); None: no limit."""
    if not model.variable_length or getattr(model, "truncate", False):
        return None
    return model.max_length


def _options(body: dict[str, Any], dim: int | None) -> tuple[str, int | None, float | None]:
    """(encoding_format, priority, timeout_ms) of ``body``, each checked, and its
    ``dimensions`` and ``user`` checked; only an absent or null field takes the default
    (a 0 or "" is a mistake, not a request for it)."""
    fmt = body.get("encoding_format")
    fmt = "float" if fmt is None else fmt
    if not (isinstance(fmt, str) and fmt in ("float", "base64")):
        raise InvalidParam("encoding_format", f"encoding_format={fmt!r} must be \"float\" or "
                                              "\"base64\" (or left out for \"float\")")
    dimensions = body.get("dimensions")
    if dimensions is not None and not _is_int(dimensions):
        raise InvalidParam("dimensions", f"dimensions={dimensions!r} must be an integer: this "
                                         f"model's embeddings have {dim}; leave dimensions out")
    if dimensions is not None and dimensions != dim:
        raise InvalidParam("dimensions", f"dimensions={dimensions!r}: this model's embeddings "
                                         f"have {dim} dimensions and cannot be shortened; leave "
                                         "dimensions out")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise InvalidParam("user", f"user={user!r} must be a string (an id of the end user) "
                                   "or left out")
    priority = body.get("priority")
    if priority is not None and not _is_int(priority):
        raise InvalidParam("priority", f"priority={priority!r} must be an integer (0 is most "
                                       "urgent)")
    timeout_ms = body.get("timeout_ms")
    if timeout_ms is not None and (isinstance(timeout_ms, bool)
                                   or not isinstance(timeout_ms, (int, float))
                                   or not timeout_ms > 0):
        raise InvalidParam("timeout_ms", f"timeout_ms={timeout_ms!r} must be a positive number "
                                         "of milliseconds")
    return fmt, priority, timeout_ms


def _known_adapter(engine: Any, model: str, adapter: str) -> str:
    """``adapter`` when ``model`` has it loaded; else OpenAI's 404 naming the loaded ones."""
    known = engine.adapter_names(model)
    if adapter not in known:
        raise model_not_found(f"{model}:{adapter}", [f"{model}:{a}" for a in known] or [model],
                              "adapter of " + repr(model) + " (or the base model)")
    return adapter


def _begin_trace(engine: Any, name: str, request: Request, tokens: int) -> Any:
    """The request's trace when the server traces it (``runtime.engine.tracing``: its
    settings sample it, or it carried a sampled ``traceparent``), else None; one trace
    for all its inputs, as a KServe request of several items has."""
    trace = begin_trace(getattr(engine, "tracer", None), name, "embeddings", request)
    if trace is not None:
        trace.input_tokens = tokens
    return trace


def _sent(engine: Any, trace: Any, response: Response,
          error: BaseException | None = None) -> Any:
    """``response``, and for a traced request its trace stamped with the send times of
    its write and recorded once written (``TimedAnswer``)."""
    if trace is None:
        return response
    tracer = engine.tracer
    return TimedAnswer(response, trace, tracer.clock.now, lambda: tracer.finish(trace, error))


def embedding_routes(engine: Any) -> list[Route]:
    """``POST /v1/embeddings`` for ``engine``'s embedding models (``embedding_models``)."""

    async def embeddings(request: Request) -> Response:
        try:
            body = await read_request(request)
            name = body.get("model")
            served = embedding_models(engine)
            if not isinstance(name, str):
                raise InvalidParam("model", "model is required: the name of an embedding "
                                            f"model, one of {served}")
            asked = name
            adapter = None
            if name not in served and ":" in name:
                name, adapter = name.split(":", 1)
            if name not in served:
                raise model_not_found(asked, served, "embedding model")
            if adapter is not None:
                adapter = _known_adapter(engine, name, adapter)
            model = engine.model(name)
            fmt, priority, timeout_ms = _options(body, _embedding_dim(model))
            cfg = engine.get_settings(name)[1]
            values = parse_inputs(body.get("input"), min(MAX_INPUTS, cfg.max_queue_size))
            if sum(len(v) for v in values if isinstance(v, str)) > THREAD_CHARS:
                prepared = await asyncio.to_thread(_prepared, model, name, values)
            else:
                prepared = _prepared(model, name, values)
        except Exception as exc:
            return error_response(exc, _WHERE)
        tokens = sum(n for _, n in prepared)
        trace = _begin_trace(engine, name, request, tokens)
        try:
            extra = {} if adapter is None else {"adapter": adapter}
            results = await until_disconnected(request, engine.infer_items(
                name, [inputs for inputs, _ in prepared], priority=priority,
                timeout_ms=timeout_ms, trace=trace, **extra))
            answer = json_response({
                "object": "list", "model": asked,
                "data": [{"object": "embedding", "index": i,
                          "embedding": _encode(r[model.embedding_output], fmt)}
                         for i, r in enumerate(results)],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})
        except ClientGone as exc:
            if trace is not None:  # nothing is sent to a client that has gone
                engine.tracer.finish(trace, exc)
            return Response(status_code=GONE_STATUS)
        except Exception as exc:
            return _sent(engine, trace, error_response(exc, _WHERE), exc)
        except BaseException as exc:  # cancelled (the server stopping): recorded, not sent
            if trace is not None:
                engine.tracer.finish(trace, exc)
            raise
        if trace is not None:
            answer.headers.update(dict(trace.answer_headers()))
        return _sent(engine, trace, answer)

    return [Route("/v1/embeddings", embeddings, methods=["POST"])]
