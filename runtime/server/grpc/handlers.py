"""The methods of ``inference.GRPCInferenceService``, answered from the request engine.

``InferenceHandlers(engine, ...)`` answers, on the engine's own event loop (under
``grpc.aio``), what the KServe v2 REST routes answer:

* ``ServerLive``, ``ServerReady``, ``ModelReady`` (an unknown model is not ready, as
  Triton answers), ``ServerMetadata``, ``ModelMetadata`` (shapes led by the batch
  dimension, -1);
* ``ModelInfer``: decoded by ``runtime.server.grpc.tensors``, queued in the same
  ``Engine`` as HTTP requests (so the two batch together), with the same admission
  check before decoding (``Engine.admission_refusal``); a request whose inputs carry a
  batch dimension of k > 1 goes in as k items (``Engine.infer_items``) and is answered
  once, its outputs stacked. A call the client cancels, or whose gRPC deadline passes,
  takes its request out of the queue;
* ``ModelStreamInfer``: the same for each request of a stream, answered in the order
  the answers are ready (``id`` tells them apart); a failed request is answered with
  its ``error_message`` and the stream goes on. At most ``STREAM_AHEAD`` answers of a
  stream are outstanding: past that, the stream's requests are not read until the
  client has taken answers;
* Triton's extensions ``ModelConfig``, ``ModelStatistics`` (one model, or every model
  for an empty name) and ``RepositoryIndex``, from ``runtime.server.triton``;
* ``TraceSetting`` (Triton's trace extension, as ``/v2[/models/{name}]/trace/setting``
  over HTTP, ``runtime.server.trace_api``): a call without settings reads them, one with
  settings changes them (an empty value clears a model's own) and is a control call
  (``AuthConfig.check_rpc``: the token in the ``authorization`` metadata when the server
  has one, else a loopback peer). A traced ``ModelInfer`` (or stream request) records
  ``GRPC_WAITREAD_END`` (the handler is called with the message read) and
  ``GRPC_SEND_START`` (its answer built); a ``traceparent`` in the call's metadata
  follows the rule of ``runtime.engine.tracing``. A traced ``ModelInfer`` answer's
  initial metadata carries what a traced HTTP answer's headers do (``traceparent`` where
  spans are exported, ``batchscope-batch-id``); a stream's answers share one call's
  metadata, so theirs carry neither.

Every failure is answered by ``runtime.server.grpc.status``: the HTTP answer's message
under the matching status code. The methods of the service this server does not
implement (shared memory, model loading, log settings) answer UNIMPLEMENTED with their
name.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any, AsyncIterator, Awaitable, Callable, Iterable
from urllib.parse import unquote

import grpc
from google.protobuf import json_format
from google.protobuf.message import DecodeError, Message

from runtime.api.errors import ClientError, ModelNotFound, ModelNotReady, ShuttingDown
from runtime.core.tracing import parse_changes, quoted
from runtime.server import triton
from runtime.server.auth import AuthConfig
from runtime.server.grpc.protocol import SERVICE, SERVICE_NAME, message
from runtime.server.grpc.status import refusal
from runtime.server.bounds import MemoryBudget, RequestBounds
from runtime.server.grpc.tensors import decode_request, encode_response
from runtime.server.kserve import InferRequest, run_infer
from runtime.server.routes import EXTENSIONS, SERVER_NAME, ServedModel, find_model

#: answers of one stream that may be outstanding (queued, running, or ready and not
#: yet taken by the client) before the server stops reading that stream's requests
STREAM_AHEAD = 256
#: the refusal of a call that arrives while the server stops
STOPPING = ("the server is shutting down and takes no new calls; send this call again to "
            "another instance, or to this address once the server is back")

Unary = Callable[[Message, grpc.aio.ServicerContext], Awaitable[Message]]


def peer_host(peer: str | None) -> str | None:
    """The address of a gRPC peer (``ipv4:127.0.0.1:5000``, ``ipv6:[::1]:5000``), or None."""
    if not peer:
        return None
    kind, _, rest = unquote(peer).partition(":")
    if kind not in ("ipv4", "ipv6") or ":" not in rest:
        return None
    return rest.rsplit(":", 1)[0].strip("[]")


def _metadata(context: Any, key: str) -> str | None:
    """The value of the call's metadata ``key`` (lowercase), or None."""
    for item in context.invocation_metadata() or ():
        if item[0] == key:
            value = item[1]
            return value.decode("latin-1") if isinstance(value, bytes) else value
    return None


def _from_json(name: str, doc: dict[str, Any]) -> Message:
    """Message ``inference.<name>`` filled from a JSON-ready ``doc`` in its field names."""
    return json_format.ParseDict(doc, message(name)(), ignore_unknown_fields=True)


async def _abort(context: grpc.aio.ServicerContext, exc: BaseException, where: str) -> None:
    """Answer ``exc`` as a gRPC status (``status.refusal``); raises AbortError."""
    answer = refusal(exc, where)
    if answer.metadata:
        context.set_trailing_metadata(answer.metadata)
    await context.abort(answer.code, answer.message)
    raise AssertionError("unreachable: abort raises")


class InFlight:
    """The calls being answered, and the stop's wait for them (``GrpcServer.stop``)."""

    def __init__(self) -> None:
        self.calls = 0
        #: set while stopping: new calls are refused with UNAVAILABLE (but ServerLive)
        self.stopping = False
        self._idle: asyncio.Event | None = None

    def enter(self) -> None:
        self.calls += 1

    def leave(self) -> None:
        self.calls -= 1
        if not self.calls and self._idle is not None:
            self._idle.set()

    async def drained(self, timeout_s: float) -> bool:
        """Wait, at most ``timeout_s``, until no call is in flight; whether none is."""
        if self.calls:
            self._idle = asyncio.Event()
            try:
                await asyncio.wait_for(self._idle.wait(), timeout_s)
            except asyncio.TimeoutError:
                pass
        return not self.calls


class Undecodable:
    """What a request message that does not parse becomes (``lenient``): answered
    INVALID_ARGUMENT (a stream's request, with its ``error_message``) rather than by
    gRPC's own handler of an unexpected exception (UNKNOWN, a traceback in the log)."""

    model_name = model_version = id = ""

    def __init__(self, type_name: str, exc: Exception) -> None:
        self.error = ClientError(f"the request is not a valid {type_name} message ({exc}); "
                                 f"send a serialized {type_name}")


def lenient(request: type) -> Callable[[bytes], Any]:
    """``request.FromString``, or an ``Undecodable`` where the bytes do not parse."""
    name = request.DESCRIPTOR.full_name

    def parse(data: bytes) -> Any:
        try:
            return request.FromString(data)
        except DecodeError as exc:
            return Undecodable(name, exc)

    return parse


def _answered(method: str, fn: Unary, flight: InFlight) -> Unary:
    """``fn`` with every failure answered as a gRPC status (``status.refusal``), counted
    in ``flight``, and refused while the server stops (but a liveness call: the process
    is alive until it exits, as over HTTP)."""
    where = f"gRPC {method}"
    refused_while_stopping = method != "ServerLive"

    @functools.wraps(fn)
    async def call(request: Message, context: grpc.aio.ServicerContext) -> Message:
        if flight.stopping and refused_while_stopping:
            await _abort(context, ShuttingDown(STOPPING), where)
        flight.enter()
        try:
            if type(request) is Undecodable:
                raise request.error
            return await fn(request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await _abort(context, exc, where)
        finally:
            flight.leave()
        raise AssertionError("unreachable: abort raises")

    return call


class InferenceHandlers:
    """Answers the service's methods for the request models of ``engine`` (an object
    following the ``runtime.engine.engine.Engine`` contract, started on this loop)."""

    def __init__(self, engine: Any, *, version: str = "0.1.0",
                 generation: Iterable[str] = (), budget: MemoryBudget | None = None,
                 auth: AuthConfig | None = None) -> None:
        self.engine = engine
        #: decides ``TraceSetting`` calls that change settings (the HTTP server's gate)
        self.auth = auth if auth is not None else AuthConfig()
        #: the engine's tracer (``runtime.engine.tracing``), None for an engine without
        self.tracer = getattr(engine, "tracer", None)
        #: the memory of decoded requests, shared with the HTTP routes when given
        self.budget = budget if budget is not None else MemoryBudget()
        self.version = version
        #: generation models served next to the engine's, over HTTP only
        self.generation = frozenset(generation)
        #: the calls in flight, and whether the server stops
        self.flight = InFlight()
        self.models: dict[str, ServedModel] = {}
        for name in engine.model_names():
            model = engine.model(name)
            self.models[name] = ServedModel(name=name, model=model,
                                            metadata=triton.model_metadata(name, model))
        self._unary: dict[str, Unary] = {
            "ServerLive": self.server_live,
            "ServerReady": self.server_ready,
            "ModelReady": self.model_ready,
            "ServerMetadata": self.server_metadata,
            "ModelMetadata": self.model_metadata,
            "ModelInfer": self.model_infer,
            "ModelConfig": self.model_config,
            "ModelStatistics": self.model_statistics,
            "RepositoryIndex": self.repository_index,
            "TraceSetting": self.trace_setting,
        }

    # -- registration -------------------------------------------------------------------
    def generic_handler(self) -> grpc.GenericRpcHandler:
        """Every method of the service: the implemented ones, and UNIMPLEMENTED answers."""
        handlers = {}
        for method in SERVICE.methods:
            request = message(method.input_type.name)
            response = message(method.output_type.name)
            if method.name == "ModelStreamInfer":
                handlers[method.name] = grpc.stream_stream_rpc_method_handler(
                    self.model_stream_infer, request_deserializer=lenient(request),
                    response_serializer=response.SerializeToString)
                continue
            fn = self._unary.get(method.name) or self._unimplemented(method.name)
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(
                _answered(method.name, fn, self.flight), request_deserializer=lenient(request),
                response_serializer=response.SerializeToString)
        return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)

    @staticmethod
    def _unimplemented(name: str) -> Unary:
        async def refuse(request: Message, context: grpc.aio.ServicerContext) -> Message:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                                f"{name} is not supported by this server; it serves health, "
                                "metadata, inference (ModelInfer, ModelStreamInfer), model "
                                "configuration, statistics, the repository index and trace "
                                "settings")
            raise AssertionError("unreachable: abort raises")

        return refuse

    # -- lookups ------------------------------------------------------------------------
    def _served(self, name: str, version: str) -> ServedModel:
        try:
            return find_model(self.models, name, version or None)
        except ModelNotFound:
            if name in self.generation:
                raise ModelNotFound(f"model {name!r} is a generation model, served over HTTP "
                                    "at /v1/completions (and /v1/chat/completions), not over "
                                    "gRPC") from None
            raise

    # -- health and metadata ------------------------------------------------------------
    async def server_live(self, request: Message, context: Any) -> Message:
        return message("ServerLiveResponse")(live=True)

    async def server_ready(self, request: Message, context: Any) -> Message:
        return message("ServerReadyResponse")(ready=bool(self.engine.is_ready()))

    async def model_ready(self, request: Message, context: Any) -> Message:
        try:
            name = self._served(request.name, request.version).name
        except ModelNotFound:
            return message("ModelReadyResponse")(ready=False)
        return message("ModelReadyResponse")(ready=bool(self.engine.is_ready(name)))

    async def server_metadata(self, request: Message, context: Any) -> Message:
        return message("ServerMetadataResponse")(name=SERVER_NAME, version=self.version,
                                                 extensions=EXTENSIONS)

    async def model_metadata(self, request: Message, context: Any) -> Message:
        served = self._served(request.name, request.version)
        return _from_json("ModelMetadataResponse", served.metadata)

    async def model_config(self, request: Message, context: Any) -> Message:
        served = self._served(request.name, request.version)
        return _from_json("ModelConfigResponse",
                          {"config": triton.model_config(self.engine, served.name)})

    async def model_statistics(self, request: Message, context: Any) -> Message:
        names = [self._served(request.name, request.version).name] if request.name else None
        return _from_json("ModelStatisticsResponse",
                          triton.model_statistics(self.engine, names))

    async def repository_index(self, request: Message, context: Any) -> Message:
        index = triton.repository_index(self.engine, ready_only=request.ready)
        return _from_json("RepositoryIndexResponse", {"models": index})

    # -- trace settings -----------------------------------------------------------------
    async def trace_setting(self, request: Message, context: Any) -> Message:
        tracer = self.tracer
        if tracer is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                                "this engine has no trace settings")
        model = None
        if request.model_name:
            model = request.model_name
            traced = tracer.control.models  # the generation models too, as over HTTP
            if model not in traced:  # a short answer: a long name would not fit a status
                raise ModelNotFound(f"unknown model {quoted(model)}; traced models are "
                                    f"{sorted(traced)}")
        if request.settings:  # a change: a control call
            self.auth.check_rpc(_metadata(context, "authorization"), peer_host(context.peer()))
            changes = parse_changes({key: list(value.value) or None
                                     for key, value in request.settings.items()})
            settings = tracer.update(model, changes)
        else:
            settings = tracer.settings(model)
        response = message("TraceSettingResponse")()
        for key, value in settings.items():
            response.settings[key].value.extend(value if isinstance(value, list) else [value])
        return response

    # -- inference ----------------------------------------------------------------------
    def _admit(self, request: Message) -> tuple[ServedModel, InferRequest]:
        """The model and the decoded request; raises what refuses it, before decoding
        when any request to the model would be refused now."""
        served = self._served(request.model_name, request.model_version)
        name = served.name
        engine = self.engine
        if not engine.is_ready(name):
            raise ModelNotReady(f"model {name!r} is not ready yet; retry in a moment")
        early = engine.admission_refusal(name)
        if early is not None:
            raise early
        model = served.model
        cfg = engine.get_settings(name)[1]
        return served, decode_request(request, name, model.inputs, model.outputs,
                                      cfg.priority_levels,
                                      RequestBounds.of(cfg.max_queue_size, model.max_length),
                                      self.budget)

    async def _infer(self, request: Message, traceparent: str | None = None,
                     context: Any = None) -> Message:
        tracer = self.tracer
        traced = tracer is not None and (traceparent is not None or tracer.control.active)
        received = tracer.clock.now() if traced else None
        served, req = self._admit(request)
        trace = tracer.begin(served.name, "grpc", req.id, traceparent) if traced else None
        if trace is None:
            try:
                result = await run_infer(self.engine, served.name, req)
            finally:
                req.release()
            return encode_response(served.name, triton.MODEL_VERSION, req, result,
                                   served.model.outputs)
        trace.recv_end = received
        try:
            result = await run_infer(self.engine, served.name, req, trace)
        except BaseException as exc:
            tracer.finish(trace, exc)
            raise
        finally:
            req.release()
        reply = encode_response(served.name, triton.MODEL_VERSION, req, result,
                                served.model.outputs)
        trace.send_start = tracer.clock.now()
        if context is not None:  # a call of its own: its metadata says what HTTP headers do
            await context.send_initial_metadata(trace.answer_headers())
            if _finish_when_sent(context, tracer, trace):
                return reply
        tracer.finish(trace)
        return reply

    async def model_infer(self, request: Message, context: Any) -> Message:
        return await self._infer(request, _metadata(context, "traceparent"), context)

    async def model_stream_infer(self, requests: AsyncIterator[Message],
                                 context: grpc.aio.ServicerContext) -> AsyncIterator[Message]:
        """Answer each request of the stream as its answer is ready; a stream opened
        while the server stops is refused, and requests read from an open one then are
        answered with the refusal as their ``error_message``."""
        flight = self.flight
        if flight.stopping:
            await _abort(context, ShuttingDown(STOPPING), "gRPC ModelStreamInfer")
        flight.enter()
        stream = self._stream(requests, context)
        try:
            async for reply in stream:
                yield reply
        finally:
            await stream.aclose()  # its tasks are cancelled now, not when collected
            flight.leave()

    async def _stream(self, requests: AsyncIterator[Message],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[Message]:
        answers: asyncio.Queue[Message | None] = asyncio.Queue()
        room = asyncio.Semaphore(STREAM_AHEAD)
        running: set[asyncio.Task] = set()
        stream_response = message("ModelStreamInferResponse")
        traceparent = _metadata(context, "traceparent")

        async def answer(request: Message) -> None:
            try:
                if self.flight.stopping:
                    raise ShuttingDown(STOPPING)
                if type(request) is Undecodable:
                    raise request.error
                reply = stream_response(infer_response=await self._infer(request, traceparent))
            except Exception as exc:
                reply = stream_response(
                    error_message=refusal(exc, "gRPC ModelStreamInfer").message,
                    infer_response=message("ModelInferResponse")(
                        model_name=request.model_name, model_version=request.model_version,
                        id=request.id))
            answers.put_nowait(reply)

        async def read() -> None:
            try:
                async for request in requests:
                    await room.acquire()
                    task = asyncio.ensure_future(answer(request))
                    running.add(task)
                    task.add_done_callback(running.discard)
                if running:
                    await asyncio.wait(set(running))
            finally:
                answers.put_nowait(None)

        reader = asyncio.ensure_future(read())
        try:
            while (reply := await answers.get()) is not None:
                yield reply
                room.release()
            await reader  # raises what reading the stream raised
        finally:
            reader.cancel()
            for task in list(running):
                task.cancel()


def _finish_when_sent(context: Any, tracer: Any, trace: Any) -> bool:
    """Have ``trace`` finished once its call has ended (the answer and its status sent):
    its ``send_end`` (Triton's GRPC_SEND_END) is stamped then, on the event loop. False
    where this gRPC has no such callback (the trace is finished now, without it)."""
    loop = asyncio.get_running_loop()

    def finish(at: float) -> None:
        trace.send_end = at
        tracer.finish(trace)

    def ended(_context: Any) -> None:
        at = tracer.clock.now()
        try:
            here = asyncio.get_running_loop()
        except RuntimeError:
            here = None
        if here is loop:
            finish(at)
        elif not loop.is_closed():
            loop.call_soon_threadsafe(finish, at)

    try:
        context.add_done_callback(ended)
    except (AttributeError, NotImplementedError, RuntimeError):
        return False
    return True
