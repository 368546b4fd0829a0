"""HTTP control API: read and change a model's batching settings, read its stats.

``GET  /v2/models/{name}/batching``          -> {model, version, settings}
``POST|PATCH /v2/models/{name}/batching``    partial JSON object of settings -> applied
``GET  /v2/models/{name}/stats``             -> queue depth, effective max batch size, counts

A change is validated by the engine (``ConfigError`` -> 422, nothing changes) and
takes effect at the next batch boundary. ``X-Requested-By`` names who asked
(default ``"http"``); it is recorded with the settings-change event.
"""

from __future__ import annotations

from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from runtime.errors import ClientError, ModelNotFound

REQUESTED_BY_HEADER = "x-requested-by"


def json_response(doc: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY), status_code=status,
                    headers=headers, media_type="application/json")


def _known(engine: Any, name: str) -> str:
    if name not in engine.model_names():
        raise ModelNotFound(f"unknown model {name!r}; served models are {engine.model_names()}")
    return name


def settings_doc(engine: Any, name: str) -> dict[str, Any]:
    version, config = engine.get_settings(name)
    return {"model": name, "version": version, "settings": config.to_dict()}


async def get_batching(request: Request) -> Response:
    engine = request.app.state.engine
    return json_response(settings_doc(engine, _known(engine, request.path_params["name"])))


async def change_batching(request: Request) -> Response:
    engine = request.app.state.engine
    name = _known(engine, request.path_params["name"])
    body = await request.body()
    try:
        changes = orjson.loads(body) if body else None
    except orjson.JSONDecodeError:
        raise ClientError("the body must be a JSON object of settings to change, e.g. "
                          '{"max_batch_size": 16}') from None
    if not isinstance(changes, dict) or not changes:
        raise ClientError("the body must be a non-empty JSON object of settings to change, "
                          'e.g. {"max_batch_size": 16}')
    requested_by = request.headers.get(REQUESTED_BY_HEADER) or "http"
    version, config = engine.update_settings(name, changes, requested_by=requested_by[:64])
    return json_response({"model": name, "version": version, "settings": config.to_dict(),
                          "requested_by": requested_by[:64]})


async def get_stats(request: Request) -> Response:
    engine = request.app.state.engine
    name = _known(engine, request.path_params["name"])
    version, _ = engine.get_settings(name)
    return json_response({"model": name, "settings_version": version, **engine.stats(name)})


def control_routes() -> list[Route]:
    return [
        Route("/v2/models/{name}/batching", get_batching, methods=["GET"]),
        Route("/v2/models/{name}/batching", change_batching, methods=["POST", "PATCH"]),
        Route("/v2/models/{name}/stats", get_stats, methods=["GET"]),
    ]
