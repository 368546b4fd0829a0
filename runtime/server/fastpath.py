"""``POST /v2/models/{name}[/versions/{v}]/infer`` answered without a framework.

``InferHook`` is the ``fast`` hook of ``runtime.server.http1.HttpServer``: it takes
an inference request straight from the parser, decodes it, hands it to the
engine's callback entry (``Engine.submit``) and answers from the batch-settle
callback, with no Task or coroutine per request. Every answer is the one the
Starlette route gives: same codec, and every refusal is built by
``runtime.api.errors.error_answer``, as the routes' are. Anything else (and a
request to a path that is not an inference route) is left to the ASGI app.

The success path allocates only what the answer needs: the parsed request, the
settle callback and the encoded body. Tracing (``runtime.engine.tracing``) adds one
header comparison (``traceparent``) and one attribute check (are trace settings
active) to a request that is not traced; a traced one gets a trace with its receive
times (the first byte of its head, the read that completed it), its send times
(around the write of its answer) and the engine's, recorded once answered: a plain
trace (a list of the few values that are its own) for a request of one item the
settings sampled, a ``RequestTrace`` for one with a ``traceparent`` or several items,
or whose model writes a trace file.

Shedding costs far less than serving: ``InferHook.early`` is asked by the HTTP
server as soon as a request head is complete, before the body is read, and answers
an ``/infer`` request to a served model that would be refused whatever its body says
(queue full, or too deep to drain within the longest timeout of recent requests and
the model's ``default_timeout_ms``: 429 with ``Retry-After``; shutting down or still
loading: 503) from
``Engine.admission_refusal``, an O(1) check. The same check runs again before the
body is parsed, since the queue may have filled while the body arrived.

A request whose inputs carry a batch dimension of k > 1 goes to the engine as k
items (``Engine.submit_items``) and is answered once, with the outputs stacked. A
body sent with ``Content-Encoding: gzip``/``deflate`` is inflated as it is parsed.

A body over ``LARGE_BODY_BYTES`` (a compressed one over ``LARGE_COMPRESSED_BYTES``)
is parsed on a parser thread instead of the event
loop (``orjson`` and numpy let go of the interpreter lock for much of it), so one
large request does not stall every other client; the parsed request is submitted
back on the loop. Small bodies are parsed in place: a thread hop would cost more
than it saves. Before any value is converted, what the body declares is checked
against the model's ``RequestBounds`` and the bytes its arrays will hold are reserved
in the app's ``MemoryBudget`` (``runtime.server.bounds``), given back when the request
is answered.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from batchscope.threadnames import name_native
from runtime.api.errors import ModelNotReady, error_answer
from runtime.core.tracing import (BATCH_ID_HEADER, PLAIN_BATCH_SEQ, PLAIN_ENDING,
                                  PLAIN_SEND_END, PLAIN_SEND_START, PLAIN_SPAN, full,
                                  settled, traceparent_bytes)
from runtime.engine.tracing import outcome_of
from runtime.server.bounds import MemoryBudget, RequestBounds
from runtime.server.http1.server import Reply
from runtime.server.kserve import HEADER_LENGTH, encode_infer, parse_infer, submit_infer
from runtime.server.routes import MODEL_VERSION, find_model

_JSON_HEADERS = [(b"content-type", b"application/json")]
_HEADER_LENGTH_B = HEADER_LENGTH.encode()
_CONTENT_ENCODING_B = b"content-encoding"
_TRACEPARENT_B = b"traceparent"
_BATCH_ID_B = BATCH_ID_HEADER.encode()
_PREFIX = "/v2/models/"
_SUFFIX = "/infer"
#: bodies larger than this are parsed on a parser thread, off the event loop
LARGE_BODY_BYTES = 1 << 20
#: a compressed body larger than this is parsed on the parser thread: how far it
#: inflates is not known before it is inflated (a gzip bomb inflates 1,000-fold)
LARGE_COMPRESSED_BYTES = 4096
#: threads that parse large bodies (the total in-flight body budget of the HTTP server
#: bounds how much waits for them)
PARSER_THREADS = 1
#: at most this many distinct request targets are remembered by ``InferHook.edge``
MAX_EDGE_PATHS = 256

Answer = Callable[[int, list[tuple[bytes, bytes]], bytes], None]


def infer_target(path: str) -> tuple[str, str | None] | None:
    """(model, version) for ``/v2/models/{m}[/versions/{v}]/infer``, else None."""
    if not (path.startswith(_PREFIX) and path.endswith(_SUFFIX)):
        return None
    parts = path[len(_PREFIX):-len(_SUFFIX)].split("/")
    if len(parts) == 1 and parts[0]:
        return parts[0], None
    if len(parts) == 3 and parts[0] and parts[1] == "versions" and parts[2]:
        return parts[0], parts[2]
    return None


class InferHook:
    """Answers inference requests for the models in ``state`` (the Starlette app's state)."""

    def __init__(self, state: Any) -> None:
        self.state = state
        self.engine = state.engine
        self.models = state.models
        #: the memory the decoded requests hold (``runtime.server.bounds``)
        self.budget: MemoryBudget = state.budget
        #: requests whose body was parsed on the parser thread
        self.large_parses = 0
        #: the last refusal ``early`` answered, and its answer
        self._refused: tuple[BaseException, tuple[int, list[tuple[bytes, bytes]], bytes]] | None = None
        #: raw ``/infer`` request targets seen while shedding -> the model they name
        self._edge_paths: dict[bytes, Any] = {}
        #: the engine's tracer (``runtime.engine.tracing``) and its settings, whose
        #: ``active`` is the one thing asked of a request without ``traceparent``
        self.tracer = getattr(self.engine, "tracer", None)
        self._tracing = self.tracer.control if self.tracer is not None else _NO_TRACING
        #: the engine's clock, read for a traced answer's send times
        self.now = self.tracer.clock.now if self.tracer is not None else time.monotonic
        #: (answer headers, batch id, those headers with the batch id) of the last traced
        #: answer: the members of one batch share one list, hence one prepared head
        self._batch_headers: tuple = (None, None, None)

    def early(self, method: bytes, path: str,
              headers: list[tuple[bytes, bytes]]) -> tuple[int, list[tuple[bytes, bytes]], bytes] | None:
        """The answer to a request refused on its head alone, or None to go on.

        Only ``POST`` to the ``/infer`` route of a served model (and version) is
        answered here, when the engine would refuse any request to it now; anything
        else (an unknown model, a bad path) is left to the full path, which says
        what is wrong. A queue-full refusal is counted and recorded as a rejected
        request, as one refused after parsing."""
        if method != b"POST" or not path.endswith(_SUFFIX):
            return None
        served = self._served_at(path)
        if served is None:
            return None
        return self._refusal(served, path)

    def edge(self, target: bytes) -> tuple[int, list[tuple[bytes, bytes]], bytes] | None:
        """``early`` for ``POST target``, asked by the HTTP server with the request
        target's raw bytes while it sheds (see ``runtime.server.http1``): the same
        answer, found through a dict of the paths seen so far."""
        served = self._edge_paths.get(target)
        if served is None:
            path = target.decode("latin-1")
            if not path.endswith(_SUFFIX):
                return None
            served = self._served_at(path)
            if served is None:
                return None
            if len(self._edge_paths) < MAX_EDGE_PATHS:
                self._edge_paths[target] = served
        return self._refusal(served, served.name)

    def _served_at(self, path: str) -> Any:
        """The served model an ``/infer`` path names (and a version it serves), else None."""
        target = infer_target(path)
        if target is None:
            return None
        served = self.models.get(target[0])
        if served is None or target[1] not in (None, MODEL_VERSION):
            return None
        return served

    def _refusal(self, served: Any,
                 path: str) -> tuple[int, list[tuple[bytes, bytes]], bytes] | None:
        refusal = self.engine.admission_refusal(served.name)
        if refusal is None:
            return None
        cached = self._refused
        if cached is not None and cached[0] is refusal:
            return cached[1]  # the engine handed out the same error again: same answer
        reply = error_answer(refusal, f"POST {path}")
        self._refused = (refusal, reply)
        return reply

    def __call__(self, conn: Any, method: bytes, path: str, headers: list[tuple[bytes, bytes]],
                 body: bytes, answer: Answer) -> bool:
        if method != b"POST" or not path.endswith(_SUFFIX):
            return False
        target = infer_target(path)
        if target is None:
            return False
        header_length = encoding = traceparent = None
        for key, value in headers:
            if key == _HEADER_LENGTH_B:
                header_length = value.decode("latin-1")
            elif key == _CONTENT_ENCODING_B:
                encoding = value.decode("latin-1")
            elif key == _TRACEPARENT_B:
                # two of them name no one parent (W3C Trace Context): neither is followed
                traceparent = value if traceparent is None else b""
        # maybe traced (tracing is on, or it names a trace): whom to ask its receive times
        received = conn if traceparent is not None or self._tracing.active else None
        try:
            served = find_model(self.models, target[0], target[1])
            name = served.name
            engine = self.engine
            if not engine.is_ready(name):
                raise ModelNotReady(f"model {name!r} is not ready yet; retry in a moment")
            refusal = engine.admission_refusal(name)
            if refusal is not None:  # refused whatever the body holds: do not parse it
                raise refusal
            model = served.model
            outputs = model.outputs
            cfg = engine.get_settings(name)[1]
            levels = cfg.priority_levels
            bounds = RequestBounds.of(cfg.max_queue_size, model.max_length)
            if len(body) > (LARGE_COMPRESSED_BYTES if encoding else LARGE_BODY_BYTES):
                loop = _running_loop()
                if loop is not None:  # parse off the loop: other clients keep being served
                    self._parse_aside(loop, path, body, header_length, encoding, served,
                                      levels, bounds, answer, traceparent,
                                      None if received is None else _Received(received))
                    return True
            req = parse_infer(body, header_length, name, model.inputs, outputs, levels,
                              encoding, bounds, self.budget)
            self._submit(name, req, outputs, answer, traceparent, received, path)
        except Exception as exc:  # a refusal (BatchScopeError) or a bug: answered alike
            answer(*error_answer(exc, f"POST {path}"))
        return True

    def _parse_aside(self, loop: asyncio.AbstractEventLoop, path: str, body: bytes,
                     header_length: str | None, encoding: str | None, served: Any,
                     levels: int, bounds: RequestBounds, answer: Answer,
                     traceparent: bytes | None = None, received: Any = None) -> None:
        """Parse a large body on the parser thread, then submit it back on the loop."""
        model = served.model

        def parse() -> None:
            try:
                req = parse_infer(body, header_length, served.name, model.inputs,
                                  model.outputs, levels, encoding, bounds, self.budget)
            except Exception as exc:
                loop.call_soon_threadsafe(answer, *error_answer(exc, f"POST {path}"))
                return
            loop.call_soon_threadsafe(self._submit_guarded, path, served.name, req,
                                      model.outputs, answer, traceparent, received)

        self.large_parses += 1
        _parser_pool().submit(parse)

    def _submit_guarded(self, path: str, name: str, req: Any, outputs: Any,
                        answer: Answer, traceparent: bytes | None = None,
                        received: Any = None) -> None:
        try:
            self._submit(name, req, outputs, answer, traceparent, received, path)
        except Exception as exc:
            answer(*error_answer(exc, f"POST {path}"))

    def _submit(self, name: str, req: Any, outputs: Any, answer: Answer,
                traceparent: bytes | None = None, received: Any = None,
                path: str = "") -> None:
        """Hand a parsed request to the engine; its answer goes to ``answer``.
        ``received``: None for a request that is not traced (tracing is off and it has no
        ``traceparent``), else what tells when it arrived (its connection's ``began_s``
        and ``last_active_s``), read only once the request is traced. A request the engine
        refuses raises, unless it is traced: then its refusal is answered here, through
        its trace, so that the answer carries the trace's headers as any traced one does
        (``path``: the request's, named where an unexpected error is logged)."""
        engine = self.engine
        trace = None
        tracer = self.tracer
        if received is not None and tracer is not None and (
                traceparent is not None or self._tracing.sample(name)):
            if traceparent is None and req.items is None:  # the common traced request
                trace = tracer.begin_plain(name, req.id, received.began_s or None,
                                           received.last_active_s or None)
            else:
                trace = tracer.begin(name, "http", req.id, traceparent, "infer",
                                     received.began_s or None, received.last_active_s or None,
                                     sampled=traceparent is None)
        try:
            submit_infer(engine, name, req, _InferDone(name, req, outputs, answer) if trace
                         is None else _InferDone(name, req, outputs, answer, trace, self), trace)
        except Exception as exc:
            req.release()
            if trace is None:
                raise
            # refused before the engine took it: settled now, answered through the trace
            settled(trace, None, self.now(), outcome_of(exc))
            self.answer_traced(name, trace, answer, *error_answer(exc, f"POST {path}"))
        except BaseException as exc:
            req.release()
            if trace is not None:
                self.tracer.finish(full(trace, name, self.now()), exc)
            raise

    def answer_traced(self, name: str, trace: Any, answer: Answer, status: int,
                      headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        """Send the answer of a traced request of model ``name``: its send times stamped
        around ``answer``, the trace's headers added (the batch id, and the
        ``traceparent`` of its span where spans are exported), the trace handed to the
        tracer. A plain trace answered from its batch gets its send times and headers,
        and nothing more (the engine's booking hands it over with its batch's); one that
        got another outcome (``settled``) is answered as the ``RequestTrace`` it makes."""
        now = self.now
        plain = type(trace) is list and trace[PLAIN_ENDING] is None  # answered from its batch
        if plain:
            seq, span = trace[PLAIN_BATCH_SEQ], trace[PLAIN_SPAN]
        else:
            trace = full(trace, name, now())
            seq, span = trace.batch_seq, trace.span
        if seq is not None:  # the members of a batch share one prepared head
            last = self._batch_headers
            headers = last[2] if last[0] is headers and last[1] == seq else \
                self.batch_headers(headers, seq)
        sent = now()
        if span is None:
            answer(status, headers, body)
        elif type(answer) is Reply:  # the traceparent line is its own: one more line
            answer.with_line(status, headers, body, span)
        else:
            answer(status, [*headers, (b"traceparent", traceparent_bytes(span))], body)
        if plain:
            trace[PLAIN_SEND_START] = sent
            trace[PLAIN_SEND_END] = now()
        else:
            trace.send_start, trace.send_end = sent, now()
            self.tracer.finish(trace)

    def batch_headers(self, headers: list[tuple[bytes, bytes]],
                      seq: int) -> list[tuple[bytes, bytes]]:
        """``headers`` with the batch id ``seq`` added: the members of one batch get one
        list (so the HTTP layer prepares its head once)."""
        last = self._batch_headers
        if last[0] is headers and last[1] == seq:
            return last[2]
        more = [*headers, (_BATCH_ID_B, b"%d" % seq)]
        self._batch_headers = (headers, seq, more)
        return more


class _InferDone:
    """The engine's ``on_done`` of one request: releases its body and answers it with its
    outputs (or its error), through ``InferHook.answer_traced`` when it is traced
    (``trace``; ``hook`` the hook that took it). One object, not a closure and its
    cells: every request in flight holds one, and the garbage collector traverses what
    requests in flight hold."""

    __slots__ = ("name", "req", "outputs", "answer", "trace", "hook")

    def __init__(self, name: str, req: Any, outputs: Any, answer: Answer, trace: Any = None,
                 hook: InferHook | None = None) -> None:
        self.name = name
        self.req = req
        self.outputs = outputs
        self.answer = answer
        self.trace = trace
        self.hook = hook

    def __call__(self, result: Any, error: BaseException | None) -> None:
        req = self.req
        req.release()
        if error is not None:
            status, headers, body = error_answer(error, f"POST /v2/models/{self.name}/infer")
        else:
            try:
                body, extra = encode_infer(self.name, MODEL_VERSION, req, result, self.outputs)
            except Exception as exc:
                status, headers, body = error_answer(
                    exc, f"POST /v2/models/{self.name}/infer (encoding the answer)")
            else:
                status, headers = 200, _JSON_HEADERS if not extra else [
                    (b"content-type", b"application/octet-stream")] + [
                    (k.lower().encode(), v.encode()) for k, v in extra.items()]
        if self.trace is None:
            self.answer(status, headers, body)
        else:
            self.hook.answer_traced(self.name, self.trace, self.answer, status, headers, body)


class _Received:
    """A connection's receive times of one request, kept while its body is parsed off
    the loop (the connection reads on meanwhile)."""

    __slots__ = ("began_s", "last_active_s")

    def __init__(self, conn: Any) -> None:
        self.began_s = getattr(conn, "began_s", 0.0)
        self.last_active_s = getattr(conn, "last_active_s", 0.0)


class _NoTracing:
    """The trace settings of an engine without a tracer: never active."""

    active = False


_NO_TRACING = _NoTracing()


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


_pool: ThreadPoolExecutor | None = None


def _parser_pool() -> ThreadPoolExecutor:
    """The threads that parse large bodies (made on first use)."""
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=PARSER_THREADS,
                                   thread_name_prefix="batchscope-parse", initializer=name_native)
    return _pool
