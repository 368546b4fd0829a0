"""HTTP control API: read and change a model's settings, read its stats.

``GET  /v2/models/{name}/batching``          -> {model, kind, version, settings}
``POST|PATCH /v2/models/{name}/batching``    partial JSON object of settings -> applied
``GET  /v2/models/{name}/batching/stats``    -> queue depth, in flight, counts, ...

(``/v2/models/{name}/stats`` is Triton's statistics extension, see
``runtime.server.routes``.)

Every served model answers: a request model with its ``BatchingConfig`` and the
request engine's stats, a generation model (``/v1/completions``) with its
``GenerationConfig`` and its ``GenerationEngine``'s stats. The generation engines
are found in ``app.state.generation_engines`` when the server set it, else on the
mounted routes of ``runtime.generation.http.routes`` (they carry them).

A change is validated by the engine (``ConfigError`` -> 422, nothing changes) and
takes effect at the next batch boundary.

A change is a *control request*: before anything is read, ``runtime.server.auth``
decides it with the app's ``AuthConfig`` (``app.state.auth``; loopback only, no token
when the app has none): another site's request is refused (403), the token is
required when the server has one (401 missing, 403 wrong), and the body must be
``Content-Type: application/json`` (400). The settings-change event records the
identity the request proved (``"token:<digest>"`` or ``"loopback"``) as
``requested_by``. ``X-Requested-By`` is only a free-text note of the caller's: the
answer echoes it as ``requested_by`` (default ``"http"``) next to ``identity``, and
it is never taken as who asked.
"""

from __future__ import annotations

from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from runtime.engine.directory import ModelDirectory
from runtime.api.errors import ClientError
from runtime.server.auth import AuthConfig
from runtime.server.bounds import check_json_size

REQUESTED_BY_HEADER = "x-requested-by"
#: the gate of an app built without one: loopback peers only, no token
DEFAULT_AUTH = AuthConfig()


def json_response(doc: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY), status_code=status,
                    headers=headers, media_type="application/json")


def model_directory(app: Any) -> ModelDirectory:
    """The app's models, request and generation alike (built once per app)."""
    directory = getattr(app.state, "model_directory", None)
    if directory is None:
        generation = getattr(app.state, "generation_engines", None)
        if generation is None:
            generation = {}
            for route in app.routes:
                generation.update(getattr(route, "generation_engines", None) or {})
        directory = ModelDirectory(app.state.engine, generation)
        app.state.model_directory = directory
    return directory


def settings_doc(models: ModelDirectory, name: str) -> dict[str, Any]:
    version, config = models.get_settings(name)
    return {"model": name, "kind": models.kind(name), "version": version,
            "settings": config.to_dict()}


async def get_batching(request: Request) -> Response:
    models = model_directory(request.app)
    return json_response(settings_doc(models, models.require(request.path_params["name"])))


def authorize(request: Request) -> str:
    """The identity of the control request ``request``, or the error refusing it."""
    auth: AuthConfig = getattr(request.app.state, "auth", None) or DEFAULT_AUTH
    client = request.client
    return auth.check(request.method, request.headers, client.host if client else None)


async def change_batching(request: Request) -> Response:
    identity = authorize(request)
    models = model_directory(request.app)
    name = models.require(request.path_params["name"])
    body = await request.body()
    check_json_size(len(body), "the settings change", "send only the settings to change")
    try:
        changes = orjson.loads(body) if body else None
    except orjson.JSONDecodeError:
        raise ClientError("the body must be a JSON object of settings to change, e.g. "
                          '{"max_batch_size": 16}') from None
    if not isinstance(changes, dict) or not changes:
        raise ClientError("the body must be a non-empty JSON object of settings to change, "
                          'e.g. {"max_batch_size": 16}')
    note = (request.headers.get(REQUESTED_BY_HEADER) or "http")[:64]
    models.update_settings(name, changes, requested_by=identity)
    return json_response({**settings_doc(models, name), "identity": identity,
                          "requested_by": note})


async def get_stats(request: Request) -> Response:
    models = model_directory(request.app)
    name = models.require(request.path_params["name"])
    version, _ = models.get_settings(name)
    doc = {"model": name, "kind": models.kind(name), "settings_version": version,
           **models.stats(name)}
    autopilot = getattr(request.app.state, "autopilot", None)
    if autopilot is not None and models.kind(name) != "generate":
        doc["autopilot"] = autopilot.state(name)
    return json_response(doc)


def control_routes() -> list[Route]:
    return [
        Route("/v2/models/{name}/batching", get_batching, methods=["GET"]),
        Route("/v2/models/{name}/batching", change_batching, methods=["POST", "PATCH"]),
        Route("/v2/models/{name}/batching/stats", get_stats, methods=["GET"]),
    ]
