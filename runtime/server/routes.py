"""The Starlette application: KServe v2 REST, ``/metrics`` and the control API.

``build_app(engine, ...)`` only wires routes to an engine that follows the
``runtime.engine.engine.Engine`` contract; starting and stopping the engine belongs to
the caller (see ``runtime.server.service``). Every failure is answered as
``{"error": message}`` with the error's HTTP status; 429 carries ``Retry-After``;
anything unexpected becomes a 500 ``{"error": "internal error"}`` and is logged.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Sequence

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from runtime.api.errors import BatchScopeError, ModelNotFound, ModelNotReady
from runtime.api.model import ModelAPI
from runtime.server.control_api import control_routes, json_response
from runtime.server.kserve import HEADER_LENGTH, encode_infer, parse_infer
from runtime.server.metrics import CONTENT_TYPE, MetricsRecorder

log = logging.getLogger("batchscope.server")

SERVER_NAME = "batchscope"
EXTENSIONS = ["binary_tensor_data", "schedule_policy", "batching_control", "metrics"]
MODEL_VERSION = "1"

Handler = Callable[[Request], Awaitable[Response]]


@dataclass(frozen=True)
class ServedModel:
    """What the HTTP layer needs to know about a model, computed once."""

    name: str
    model: ModelAPI
    metadata: dict[str, Any]


def error_response(exc: BatchScopeError) -> Response:
    headers = None
    if exc.http_status == 429:
        retry = exc.retry_after_s if exc.retry_after_s is not None else 1.0
        headers = {"Retry-After": str(max(1, math.ceil(retry)))}
    return json_response(exc.to_dict(), exc.http_status, headers)


def guarded(handler: Handler) -> Handler:
    """Turn errors into ``{"error": ...}`` answers; never leak a stack trace."""

    async def run(request: Request) -> Response:
        try:
            return await handler(request)
        except BatchScopeError as exc:
            return error_response(exc)
        except Exception:
            log.exception("unexpected error answering %s %s", request.method, request.url.path)
            return json_response({"error": "internal error"}, 500)

    run.__name__ = handler.__name__
    return run


def find_model(models: dict[str, ServedModel], name: str, version: str | None) -> ServedModel:
    served = models.get(name)
    if served is None:
        raise ModelNotFound(f"unknown model {name!r}; served models are {sorted(models)}")
    if version is not None and version != MODEL_VERSION:
        raise ModelNotFound(f"model {name!r} has no version {version!r}; its only version is "
                            f"{MODEL_VERSION!r}")
    return served


def _served(request: Request) -> ServedModel:
    return find_model(request.app.state.models, request.path_params["name"],
                      request.path_params.get("version"))


async def answer_infer(state: Any, name: str, version: str | None, body: bytes,
                       header_length: str | None) -> tuple[bytes, dict[str, str]]:
    """One ``/infer`` call: decode, run through the engine, encode. Raises BatchScopeError."""
    served = find_model(state.models, name, version)
    engine = state.engine
    if not engine.is_ready(served.name):
        raise ModelNotReady(f"model {served.name!r} is not ready yet; retry in a moment")
    _, config = engine.get_settings(served.name)
    model = served.model
    req = parse_infer(body, header_length, served.name, model.inputs, model.outputs,
                      config.priority_levels)
    result = await engine.infer(served.name, req.inputs, priority=req.priority,
                                timeout_ms=req.timeout_ms, bypass=req.bypass)
    return encode_infer(served.name, MODEL_VERSION, req, result, model.outputs)


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
    return json_response(_served(request).metadata)


async def model_ready(request: Request) -> Response:
    served = _served(request)
    ready = bool(request.app.state.engine.is_ready(served.name))
    return json_response({"name": served.name, "ready": ready}, 200 if ready else 503)


async def infer(request: Request) -> Response:
    payload, headers = await answer_infer(
        request.app.state, request.path_params["name"], request.path_params.get("version"),
        await request.body(), request.headers.get(HEADER_LENGTH))
    media = "application/octet-stream" if headers else "application/json"
    return Response(payload, headers=headers, media_type=media)


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
    ]
    for prefix in ("/v2/models/{name}", "/v2/models/{name}/versions/{version}"):
        routes += [
            Route(prefix, model_metadata),
            Route(prefix + "/ready", model_ready),
            Route(prefix + "/infer", infer, methods=["POST"]),
        ]
    return routes


def build_app(engine: Any, *, metrics: MetricsRecorder | None = None,
              extra_routes: Sequence[BaseRoute] = (), version: str = "0.1.0",
              lifespan: Any = None) -> Starlette:
    """A Starlette app serving ``engine``'s models.

    ``extra_routes`` mounts more endpoints (e.g. ``/v1/completions`` of a generation
    model); ``lifespan`` is handed to Starlette unchanged.
    """
    routes: list[BaseRoute] = []
    for route in _kserve_routes() + control_routes():
        routes.append(Route(route.path, guarded(route.endpoint), methods=route.methods))
    routes.extend(extra_routes)
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.version = version
    app.state.models = {}
    for name in engine.model_names():
        model = engine.model(name)
        meta = model.metadata()
        meta["name"] = name
        app.state.models[name] = ServedModel(name=name, model=model, metadata=meta)
    return app


# -- the hot path without the framework ---------------------------------------------------
_JSON_HEADERS = [(b"content-type", b"application/json")]
_HEADER_LENGTH_B = HEADER_LENGTH.encode()
_INFER_PREFIX = "/v2/models/"
_INFER_SUFFIX = "/infer"


def _infer_target(path: str) -> tuple[str, str | None] | None:
    """(model, version) for ``/v2/models/{m}[/versions/{v}]/infer``, else None."""
    if not (path.startswith(_INFER_PREFIX) and path.endswith(_INFER_SUFFIX)):
        return None
    parts = path[len(_INFER_PREFIX):-len(_INFER_SUFFIX)].split("/")
    if len(parts) == 1 and parts[0]:
        return parts[0], None
    if len(parts) == 3 and parts[0] and parts[1] == "versions" and parts[2]:
        return parts[0], parts[2]
    return None


class FastInfer:
    """ASGI wrapper that answers ``POST .../infer`` directly and hands everything else
    (and the lifespan) to the Starlette app. Same answers as the Starlette route, with
    less per-request framework work, for ASGI servers and test clients; ``Service``
    serves the same route through ``runtime.server.fastpath.InferHook`` instead."""

    def __init__(self, app: Starlette) -> None:
        self.app = app
        self.state = app.state

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        target = None
        if scope["type"] == "http" and scope["method"] == "POST":
            target = _infer_target(scope["path"])
        if target is None:
            await self.app(scope, receive, send)
            return
        chunks = []
        more = True
        while more:
            message = await receive()
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        header_length = None
        for key, value in scope["headers"]:
            if key == _HEADER_LENGTH_B:
                header_length = value.decode("latin-1")
        status, headers = 200, _JSON_HEADERS
        try:
            payload, extra = await answer_infer(self.state, target[0], target[1],
                                                b"".join(chunks), header_length)
            if extra:
                headers = [(b"content-type", b"application/octet-stream")] + [
                    (k.lower().encode(), v.encode()) for k, v in extra.items()]
        except BatchScopeError as exc:
            response = error_response(exc)
            await response(scope, receive, send)
            return
        except Exception:
            log.exception("unexpected error answering POST %s", scope["path"])
            status, payload = 500, b'{"error":"internal error"}'
        await send({"type": "http.response.start", "status": status,
                    "headers": headers + [(b"content-length", str(len(payload)).encode())]})
        await send({"type": "http.response.body", "body": payload})
