"""The Starlette application: KServe v2 REST, ``/metrics`` and the control API.

The KServe v2 routes, each also under ``/v2/models/{name}/versions/1/...`` where
Triton's clients use that form: model metadata (shapes led by the batch dimension,
-1), ``/ready``, ``POST /infer``, Triton's ``/config`` and statistics
(``GET /v2/models/stats`` for every model, ``/v2/models/{name}/stats`` for one), and
``POST /v2/repository/index``; the documents come from ``runtime.server.triton``.
Triton's trace extension (``GET``/``POST /v2/trace/setting`` and
``/v2/models/{name}/trace/setting``) is ``runtime.server.trace_api``'s.

``build_app(engine, ...)`` only wires routes to an engine that follows the
``runtime.engine.engine.Engine`` contract; starting and stopping the engine belongs to
the caller (see ``runtime.server.service``). Every failure, including a path no
route serves (404) and a method a route does not accept (405, with ``Allow``), is
answered by ``runtime.api.errors.error_answer``: ``{"error": message}`` with the
error's HTTP status, ``Retry-After`` on 429; anything unexpected is logged once and
becomes a 500 that leaks nothing. ``POST .../infer`` is served here for ASGI servers
and test clients; ``Service`` answers it first through
``runtime.server.fastpath.InferHook``, with the same answers. The control
requests (settings changes) pass ``auth``, the app's ``runtime.server.auth.AuthConfig``
(kept as ``app.state.auth``); a 401 carries ``WWW-Authenticate: Bearer``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Sequence

import orjson
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from runtime.api.errors import (ClientError, ModelNotFound, ModelNotReady, error_answer,
                                routing_error)
from runtime.api.model import ModelAPI
from runtime.server import openai_errors, triton
from runtime.server.auth import AuthConfig, Unauthorized
from runtime.server.adapter_api import adapter_routes
from runtime.server.control_api import (DEFAULT_AUTH, control_routes, json_response,
                                        model_directory)
from runtime.server.bounds import MemoryBudget, RequestBounds, check_json_size
from runtime.server.kserve import HEADER_LENGTH, encode_infer, parse_infer, run_infer
from runtime.server.metrics import CONTENT_TYPE, MetricsRecorder
from runtime.server.openai_http import TimedAnswer, received_times, request_traceparent
from runtime.server.trace_api import trace_routes
from runtime.server.triton import MODEL_VERSION

SERVER_NAME = "batchscope"
EXTENSIONS = ["binary_tensor_data", "schedule_policy", "batching_control", "metrics",
              "model_configuration", "statistics", "trace"]

Handler = Callable[[Request], Awaitable[Response]]


@dataclass(frozen=True)
class ServedModel:
    """What the HTTP layer needs to know about a model, computed once."""

    name: str
    model: ModelAPI
    metadata: dict[str, Any]


def error_response(exc: BaseException, where: str = "the request") -> Response:
    """The Starlette form of ``error_answer(exc, where)``."""
    status, headers, body = error_answer(exc, where)
    response = Response(body, status,
                        {k.decode("latin-1"): v.decode("latin-1") for k, v in headers})
    if isinstance(exc, Unauthorized):
        response.headers["WWW-Authenticate"] = exc.challenge
    return response


def guarded(handler: Handler) -> Handler:
    """Turn errors into ``{"error": ...}`` answers; never leak a stack trace."""

    async def run(request: Request) -> Response:
        try:
            return await handler(request)
        except Exception as exc:
            return error_response(exc, f"{request.method} {request.url.path}")

    run.__name__ = handler.__name__
    return run


def _allowed_methods(app: Any, path: str) -> list[str]:
    """Every method some route of ``app`` accepts on ``path``."""
    allowed: set[str] = set()
    for route in app.routes:
        if isinstance(route, Route) and route.methods and route.path_regex.match(path):
            allowed |= route.methods
    return sorted(allowed)


async def routing_refusal(request: Request, exc: HTTPException) -> Response:
    """Starlette's routing refusals (no route, wrong method) as JSON error answers."""
    method, path = request.method, request.url.path
    if path.startswith("/v1/"):  # the OpenAI-style routes answer in OpenAI's shape
        return await openai_errors.routing_refusal(request, exc)
    allow = _allowed_methods(request.app, path) if exc.status_code == 405 else []
    if exc.status_code == 405 and not allow:
        allow = [m.strip() for m in (exc.headers or {}).get("Allow", "").split(",") if m.strip()]
    return error_response(routing_error(exc.status_code, method, path, allow, exc.detail),
                          f"{method} {path}")


def find_model(models: dict[str, ServedModel], name: str, version: str | None) -> ServedModel:
    served = models.get(name)
    if served is None:
        raise ModelNotFound(f"unknown model {name!r}; served models are {sorted(models)}")
    triton.check_version(name, version)
    return served


def _served(request: Request) -> ServedModel:
    name = request.path_params["name"]
    try:
        return find_model(request.app.state.models, name, request.path_params.get("version"))
    except ModelNotFound:
        if name in model_directory(request.app).generation:
            raise ModelNotFound(f"model {name!r} is a generation model, served by the "
                                "OpenAI-style routes under /v1; its settings and statistics "
                                f"are at /v2/models/{name}/batching and "
                                f"/v2/models/{name}/batching/stats") from None
        raise


async def answer_infer(state: Any, name: str, version: str | None, body: bytes,
                       header_length: str | None,
                       content_encoding: str | None = None,
                       traceparent: str | None = None,
                       received: tuple[float | None, float | None] = (None, None),
                       ) -> tuple[bytes, dict[str, str], Any]:
    """One ``/infer`` call: decode, run through the engine, encode. Raises BatchScopeError.
    The third value is the request's trace (``runtime.engine.tracing``), None when it is
    not traced: its caller records it once the answer is sent (``TimedAnswer``), with
    the ``received`` times it began and finished arriving."""
    served = find_model(state.models, name, version)
    engine = state.engine
    if not engine.is_ready(served.name):
        raise ModelNotReady(f"model {served.name!r} is not ready yet; retry in a moment")
    _, config = engine.get_settings(served.name)
    model = served.model
    req = parse_infer(body, header_length, served.name, model.inputs, model.outputs,
                      config.priority_levels, content_encoding,
                      RequestBounds.of(config.max_queue_size, model.max_length), state.budget)
    tracer = getattr(engine, "tracer", None)
    trace = None
    if tracer is not None and (traceparent is not None or tracer.control.active):
        trace = tracer.begin(served.name, "http", req.id, traceparent, "infer", *received)
    try:
        result = await run_infer(engine, served.name, req, trace)
    except BaseException as exc:
        if trace is not None:
            tracer.finish(trace, exc)
        raise
    finally:
        req.release()
    try:
        payload, headers = encode_infer(served.name, MODEL_VERSION, req, result, model.outputs)
    except BaseException as exc:
        if trace is not None:
            tracer.finish(trace, exc)
        raise
    if trace is not None:
        headers = {**headers, **dict(trace.answer_headers())}
    return payload, headers, trace


# -- handlers -----------------------------------------------------------------------
async def health_live(request: Request) -> Response:
    return json_response({"live": True})


async def health_ready(request: Request) -> Response:
    ready = bool(request.app.state.engine.is_ready())
    return json_response({"ready": ready}, 200 if ready else 503)


async def server_metadata(request: Request) -> Response:
    return json_response({"name": SERVER_NAME, "version": request.app.state.version,
                          "extensions": EXTENSIONS})


async def model_metadata(request: Request) -> Response:
    served = _served(request)
    if getattr(served.model, "adapter_targets", None):  # the adapters loaded now
        return json_response({**served.metadata,
                              "adapters": request.app.state.engine.adapter_names(served.name)})
    return json_response(served.metadata)


async def model_ready(request: Request) -> Response:
    served = _served(request)
    ready = bool(request.app.state.engine.is_ready(served.name))
    return json_response({"name": served.name, "ready": ready}, 200 if ready else 503)


async def infer(request: Request) -> Response:
    payload, headers, trace = await answer_infer(
        request.app.state, request.path_params["name"], request.path_params.get("version"),
        await request.body(), request.headers.get(HEADER_LENGTH),
        request.headers.get("content-encoding"), request_traceparent(request),
        received_times(request))
    media = ("application/octet-stream" if "Inference-Header-Content-Length" in headers
             else "application/json")
    response = Response(payload, headers=headers, media_type=media)
    if trace is None:
        return response
    tracer = request.app.state.engine.tracer
    return TimedAnswer(response, trace, tracer.clock.now, lambda: tracer.finish(trace))


async def model_config(request: Request) -> Response:
    served = _served(request)
    return json_response(triton.model_config(request.app.state.engine, served.name))


async def model_statistics(request: Request) -> Response:
    engine = request.app.state.engine
    names = [_served(request).name] if "name" in request.path_params else None
    return json_response(triton.model_statistics(engine, names))


async def repository_index(request: Request) -> Response:
    body = await request.body()
    check_json_size(len(body), "the repository index request", 'send {"ready": true} or nothing')
    try:
        doc = orjson.loads(body) if body.strip() else {}
    except orjson.JSONDecodeError:
        doc = None
    ready = doc.get("ready", False) if isinstance(doc, dict) else None
    if not isinstance(ready, bool):
        raise ClientError('the body must be empty or a JSON object such as {"ready": true} '
                          "(true: list only the models ready for inference)")
    return json_response(triton.repository_index(request.app.state.engine, ready_only=ready))


async def metrics(request: Request) -> Response:
    recorder: MetricsRecorder | None = request.app.state.metrics
    if recorder is None:
        return Response(b"", media_type=CONTENT_TYPE)
    return Response(recorder.render(), media_type=CONTENT_TYPE)


def _kserve_routes() -> list[Route]:
    routes = [
        Route("/v2/health/live", health_live),
        Route("/v2/health/ready", health_ready),
        Route("/v2", server_metadata),
        Route("/metrics", metrics),
        Route("/v2/repository/index", repository_index, methods=["POST"]),
        # before /v2/models/{name}, which would take "stats" for a model's name
        Route("/v2/models/stats", model_statistics),
    ]
    for prefix in ("/v2/models/{name}", "/v2/models/{name}/versions/{version}"):
        routes += [
            Route(prefix, model_metadata),
            Route(prefix + "/ready", model_ready),
            Route(prefix + "/infer", infer, methods=["POST"]),
            Route(prefix + "/config", model_config),
            Route(prefix + "/stats", model_statistics),
        ]
    return routes


def build_app(engine: Any, *, metrics: MetricsRecorder | None = None,
              extra_routes: Sequence[BaseRoute] = (), version: str = "0.1.0",
              lifespan: Any = None, auth: AuthConfig | None = None,
              budget: MemoryBudget | None = None) -> Starlette:
    """A Starlette app serving ``engine``'s models.

    ``extra_routes`` mounts more endpoints (e.g. ``/v1/completions`` of a generation
    model); ``lifespan`` is handed to Starlette unchanged; ``auth`` decides control
    requests (default: from loopback peers only, no token); ``budget`` holds the
    memory of decoded requests (``runtime.server.bounds``; default: a new one).
    """
    routes: list[BaseRoute] = []
    for route in _kserve_routes() + control_routes() + adapter_routes() + trace_routes():
        routes.append(Route(route.path, guarded(route.endpoint), methods=route.methods))
    routes.extend(extra_routes)
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={HTTPException: routing_refusal})
    # a path with a slash added is not found: a redirect would name the client's Host
    app.router.redirect_slashes = False
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.version = version
    app.state.auth = auth if auth is not None else DEFAULT_AUTH
    app.state.budget = budget if budget is not None else MemoryBudget()
    app.state.models = {}
    for name in engine.model_names():
        model = engine.model(name)
        app.state.models[name] = ServedModel(name=name, model=model,
                                             metadata=triton.model_metadata(name, model))
    return app
