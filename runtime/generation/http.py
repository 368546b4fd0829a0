"""OpenAI-compatible text generation over HTTP for ``GenerationEngine``s.

``generation_routes(engines)`` gives a server its generation routes to mount;
``routes(engines)`` adds ``/v1/models`` for generation models alone, and
``create_app(engines)`` is a small standalone app that starts and stops the engines
with the app (``runtime.server.openai_api`` puts them next to ``/v1/embeddings``).

    POST /v1/completions        {model, prompt, ...}
    POST /v1/chat/completions   {model, messages, ...}
    GET  /v1/models             GET /v1/models/{model}

What the bodies may hold is in ``runtime.generation.params``; chat messages become a
prompt through the model's template (``runtime.generation.chat``). ``prompt`` is a
string, a list of token ids, or a list of either; each prompt gets ``n`` choices,
choice ``i`` of prompt ``p`` at index ``p * n + i``. Temperature 0 (the default here)
is greedy; a higher one samples with ``seed``. ``stop`` strings end a choice where
its text reaches one (the text before it is returned, ``finish_reason`` "stop");
``usage`` counts the prompt tokens of every choice and every generated token.

Not streamed, the answer is one JSON document once every choice finished; a client
that goes away before that cancels its choices (their KV blocks are freed at once),
as a streamed one does. Streamed, the answer is Server-Sent Events (``data: {chunk}``
per token, ``data: [DONE]`` last), and the status line waits until every choice has
its first token: a request refused, expired in the queue or failed before that gets
its own status (429, 503, 500) and a JSON error, never a 200. Only what fails later
(the model raising in the middle, a shutdown) is sent as a last ``data: {"error": ...}``
event. Errors use OpenAI's shape and statuses (``runtime.server.openai_errors``).

``model: "<base>:<adapter>"`` generates with one of the base model's LoRA adapters, as
``/v1/embeddings`` does (404 naming the loaded ones for an adapter it does not have);
the answer's ``model`` repeats what was asked.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable

import orjson
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from runtime.generation.engine import GenerationEngine, GenerationStream, TokenEvent
from runtime.generation.params import GenerationRequest, parse_chat, parse_completion
from runtime.server.openai_errors import (InvalidParam, error_response, model_not_found,
                                          openai_answer, routing_refusal)
from runtime.server.openai_http import (GONE_STATUS, ClientGone, TimedAnswer, begin_trace,
                                        json_response, model_routes, parsed_body,
                                        until_disconnected)


# -- the two answer shapes ----------------------------------------------------------------
@dataclass(frozen=True)
class _Shape:
    """How one route writes its choices: a whole answer's and a stream chunk's."""

    where: str
    object: str
    chunk_object: str
    id_prefix: str
    chat: bool

    def choice(self, index: int, text: str, reason: str | None) -> dict[str, Any]:
        if self.chat:
            return {"index": index, "message": {"role": "assistant", "content": text},
                    "logprobs": None, "finish_reason": reason}
        return {"index": index, "text": text, "logprobs": None, "finish_reason": reason}

    def delta(self, index: int, text: str, reason: str | None) -> dict[str, Any]:
        if self.chat:
            delta = {"content": text} if text or reason is None else {}
            return {"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}
        return self.choice(index, text, reason)

    def opening(self, count: int) -> list[dict[str, Any]]:
        """The choices of the first chunk, before any token (chat: the assistant's role)."""
        if not self.chat:
            return []
        return [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None} for i in range(count)]


COMPLETIONS = _Shape("POST /v1/completions", "text_completion", "text_completion", "cmpl-",
                     chat=False)
CHAT = _Shape("POST /v1/chat/completions", "chat.completion", "chat.completion.chunk",
              "chatcmpl-", chat=True)


# -- submitting and following the choices -------------------------------------------------
def _chat_prompt(engine: GenerationEngine, req: GenerationRequest) -> list[tuple[None, str]]:
    model = engine.model
    if model.chat_template is None or model.tokenizer is None:
        raise InvalidParam("model", f"model {engine.name!r} has no chat template; send its "
                                    "prompts to /v1/completions")
    return [(None, model.chat_template.render(req.messages))]


def _engine_for(engines: dict[str, GenerationEngine], asked: str
                ) -> tuple[GenerationEngine, str | None]:
    """The engine and adapter ``model`` names: a served model, or ``<base>:<adapter>``
    with an adapter the base has loaded (else OpenAI's 404 naming what there is)."""
    name, adapter = asked, None
    if name not in engines and ":" in name:
        name, adapter = name.split(":", 1)
    engine = engines.get(name)
    if engine is None:
        raise model_not_found(asked, sorted(engines), "generation model")
    if adapter is not None:
        known = engine.adapter_names()
        if adapter not in known:
            raise model_not_found(asked, [f"{name}:{a}" for a in known] or [name],
                                  "adapter of " + repr(name) + " (or the base model)")
    return engine, adapter


def _submit_all(engine: GenerationEngine, req: GenerationRequest,
                prompts: list[tuple[list[int] | None, str | None]],
                adapter: str | None = None) -> list[GenerationStream]:
    """One stream per choice, in choice-index order; all or none are queued."""
    engine.check_room(len(prompts) * req.n, req.priority, adapter)
    streams: list[GenerationStream] = []
    try:
        for ids, text in prompts:
            for i in range(req.n):
                seed = None if req.seed is None else req.seed + i
                streams.append(engine.submit(
                    ids, text, max_new_tokens=req.max_tokens, priority=req.priority,
                    timeout_ms=req.timeout_ms, ignore_eos=req.ignore_eos,
                    temperature=req.temperature, seed=seed, stop=req.stop,
                    speculative=req.speculative, adapter=adapter))
    except BaseException:
        _close(streams)
        raise
    return streams


def _close(streams: list[GenerationStream]) -> None:
    for stream in streams:
        stream.close()


async def _merged(streams: list[GenerationStream]) -> AsyncIterator[tuple[int, TokenEvent]]:
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


async def _first_of_each(events: AsyncIterator[tuple[int, TokenEvent]], count: int
                         ) -> list[tuple[int, TokenEvent]]:
    """The events up to the one that completes "every choice has a token"."""
    seen: set[int] = set()
    got: list[tuple[int, TokenEvent]] = []
    while len(seen) < count:
        index, event = await anext(events)
        seen.add(index)
        got.append((index, event))
    return got


async def _gather_all(events: AsyncIterator[tuple[int, TokenEvent]], count: int
                      ) -> tuple[list[str], list[str | None]]:
    texts: list[list[str]] = [[] for _ in range(count)]
    reasons: list[str | None] = [None] * count
    async for index, event in events:
        texts[index].append(event.text)
        reasons[index] = event.finish_reason or reasons[index]
    return ["".join(t) for t in texts], reasons


def _begin_trace(engine: GenerationEngine, shape: "_Shape", request: Request) -> Any:
    """The request's ``RequestTrace`` when the server's tracer (``engine.tracer``, set by
    the service) traces it, else None (see ``runtime.engine.tracing``); with its receive
    times, where the HTTP server gave them."""
    return begin_trace(getattr(engine, "tracer", None), engine.name,
                       "chat" if shape.chat else "text_completion", request)


def _end_trace(engine: GenerationEngine, trace: Any, streams: list[GenerationStream],
               error: BaseException | None = None) -> None:
    """Stamp ``trace`` from its choices' sequences and record it: queued at arrival,
    computing from the first scheduling until the last choice ended, its first token,
    its tokens and finish reasons, and its decoding (``_decoding``)."""
    if trace is None:
        return
    seqs = [s.seq for s in streams]
    _joined(trace, seqs)
    if seqs:
        trace.queue_start = min(s.arrival_s for s in seqs)
        started = [s.first_scheduled_s for s in seqs if s.first_scheduled_s is not None]
        firsts = [s.first_token_s for s in seqs if s.first_token_s is not None]
        ended = [s.finished_s for s in seqs  # a choice never scheduled never computed
                 if s.finished_s is not None and s.first_scheduled_s is not None]
        trace.compute_start = min(started) if started else None
        trace.first_token = min(firsts) if firsts else None
        trace.compute_end = max(ended) if ended else None
        trace.input_tokens = sum(len(s.prompt_ids) for s in seqs)
        trace.output_tokens = sum(len(s.output_ids) for s in seqs)
        trace.finish_reasons = tuple(s.finish_reason for s in seqs if s.finish_reason)
        bad = [s.outcome for s in seqs if s.outcome not in (None, "ok")]
        trace.outcome = bad[0] if bad else ("ok" if error is None else None)
    elif getattr(error, "refused_s", None) is not None:  # the queue was full: as its row
        trace.queue_start = error.refused_s
    engine.tracer.finish(trace, error, _decoding(seqs))


def _decoding(seqs: list[Any]) -> tuple[float, float | None] | None:
    """(start, end) of the decoding of a request's choices, for its ``decode`` span: from
    the first token of the earliest choice that had tokens after its first to the end of
    the last such choice (None while one runs); None when no choice had (each choice is
    judged on its own: totals cannot tell one choice of two tokens from two of one)."""
    decoded = [s for s in seqs if len(s.output_ids) > 1 and s.first_token_s is not None]
    if not decoded:
        return None
    ends = [s.finished_s for s in decoded]
    return (min(s.first_token_s for s in decoded),
            None if None in ends else max(ends))


def _joined(trace: Any, seqs: list[Any]) -> None:
    """The step the request joined (its first choice's first): its ``batch_seq``, the
    ``batchscope-batch-id`` its answer carries."""
    steps = [s.first_step for s in seqs if s.first_step is not None]
    if steps:
        trace.batch_seq = min(steps)


def _sent(response: Response, engine: GenerationEngine, trace: Any,
          streams: list[GenerationStream], error: BaseException | None = None) -> Any:
    """``response``, and for a traced request its trace stamped with the send times of
    its write (``TimedAnswer``: a stream's from its first byte to its last) and recorded
    once written (``_end_trace``)."""
    if trace is None:
        return response
    _joined(trace, [s.seq for s in streams])
    for name, value in trace.answer_headers():  # refusals and errors carry them too
        if name not in response.headers:
            response.headers[name] = value
    return TimedAnswer(response, trace, engine.tracer.clock.now,
                       lambda: _end_trace(engine, trace, streams, error))


def _usage(streams: list[GenerationStream]) -> dict[str, int]:
    prompt = sum(s.prompt_tokens for s in streams)
    completion = sum(s.output_tokens for s in streams)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


class _EventStream(StreamingResponse):
    """Server-Sent Events that close the request's streams however the response ends
    (finished, the client gone, the server stopping), also when it never started."""

    def __init__(self, body: AsyncIterator[bytes], streams: list[GenerationStream],
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(body, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", **(headers or {})})
        self._streams = streams

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            _close(self._streams)


def _sse_line(data: Any) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


async def _sse(shape: _Shape, head: dict[str, Any], first: list[tuple[int, TokenEvent]],
               events: AsyncIterator[tuple[int, TokenEvent]], streams: list[GenerationStream],
               include_usage: bool) -> AsyncIterator[bytes]:
    extra = {"usage": None} if include_usage else {}
    opening = shape.opening(len(streams))
    if opening:
        yield _sse_line({**head, "choices": opening, **extra})
    try:
        for index, event in first:
            yield _sse_line({**head, "choices": [shape.delta(index, event.text,
                                                             event.finish_reason)], **extra})
        async for index, event in events:
            yield _sse_line({**head, "choices": [shape.delta(index, event.text,
                                                             event.finish_reason)], **extra})
        if include_usage:
            yield _sse_line({**head, "choices": [], "usage": _usage(streams)})
    except Exception as exc:  # the status line is gone: the error goes in the stream
        yield b"data: " + openai_answer(exc, shape.where + " (stream)")[2] + b"\n\n"
    yield b"data: [DONE]\n\n"


# -- handlers -----------------------------------------------------------------------------
def _answerer(engines: dict[str, GenerationEngine], shape: _Shape,
              parse: Callable[[bytes, str | None], GenerationRequest]
              ) -> Callable[[Request], Awaitable[Response]]:
    async def answer(request: Request) -> Response:
        try:
            req = await parsed_body(request, parse)
            engine, adapter = _engine_for(engines, req.model)
            prompts = _chat_prompt(engine, req) if shape.chat else req.prompts
            trace = _begin_trace(engine, shape, request)
        except Exception as exc:
            return error_response(exc, shape.where)
        try:
            streams = _submit_all(engine, req, prompts, adapter)
            if trace is not None and trace.span is not None:  # the step it joins: a span
                for stream in streams:
                    stream.seq.traced = True
        except Exception as exc:  # refused (queue full, a bad prompt): answered, then recorded
            return _sent(error_response(exc, shape.where), engine, trace, [], exc)
        except BaseException as exc:
            _end_trace(engine, trace, [], exc)
            raise
        head = {"id": f"{shape.id_prefix}{uuid.uuid4().hex}", "object": shape.chunk_object,
                "created": int(time.time()), "model": req.model}
        events = _merged(streams)
        try:
            if req.stream:
                first = await until_disconnected(request, _first_of_each(events, len(streams)))
                return _sent(_EventStream(_sse(shape, head, first, events, streams,
                                               req.include_usage),
                                          streams),
                             engine, trace, streams)
            texts, reasons = await until_disconnected(request, _gather_all(events, len(streams)))
        except ClientGone as exc:  # nobody reads the answer: recorded with no send times
            _close(streams)
            _end_trace(engine, trace, streams, exc)
            return Response(status_code=GONE_STATUS)
        except Exception as exc:
            _close(streams)
            return _sent(error_response(exc, shape.where), engine, trace, streams, exc)
        _close(streams)
        if trace is not None:  # every choice is done: what is left is writing the answer
            trace.request_end = engine.tracer.clock.now()
        choices = [shape.choice(i, t, r) for i, (t, r) in enumerate(zip(texts, reasons))]
        return _sent(json_response({**head, "object": shape.object, "choices": choices,
                                    "usage": _usage(streams)}),
                     engine, trace, streams)

    return answer


def generation_routes(engines: dict[str, GenerationEngine]) -> list[Route]:
    """``/v1/completions`` and ``/v1/chat/completions`` serving ``engines`` (model name
    -> engine); each route carries ``engines`` as ``generation_engines`` for the app's
    control API."""
    served = [Route("/v1/completions", _answerer(engines, COMPLETIONS, parse_completion),
                    methods=["POST"]),
              Route("/v1/chat/completions", _answerer(engines, CHAT, parse_chat),
                    methods=["POST"])]
    for route in served:
        # lets the app's other endpoints (the control API) find the engines it mounts
        route.generation_engines = engines  # type: ignore[attr-defined]
    return served


def routes(engines: dict[str, GenerationEngine]) -> list[Route]:
    """Every OpenAI-style route for generation models alone."""
    return generation_routes(engines) + model_routes(lambda: list(engines))


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

    app = Starlette(routes=routes(engines), lifespan=lifespan,
                    exception_handlers={HTTPException: routing_refusal})
    app.router.redirect_slashes = False  # as runtime.server.routes: no redirect to Host
    return app
