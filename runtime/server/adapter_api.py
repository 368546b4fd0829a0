"""HTTP control API of LoRA adapters (``docs/adapters.md``).

``GET    /v2/models/{name}/adapters``            -> {model, adapters: [...]}
``POST   /v2/models/{name}/adapters``            {"name": ..., "path": ...} -> the adapter
``DELETE /v2/models/{name}/adapters/{adapter}``  -> once its queued requests have finished

Loading reads the adapter's PEFT files off the event loop and checks them against the
model's targets: 422 naming what does not fit, 507 past ``adapter_memory_mb``; either
way nothing changes. Unloading refuses new requests for the adapter at once (404), lets
those queued or running for it finish, and answers when it is gone.

A generation model (``/v1/completions``) takes the same routes: its
``GenerationEngine`` answers them as the request engine does for a request model.

Loading and unloading are control requests, decided as settings changes are
(``runtime.server.auth``: same origin always, the token beyond loopback, a JSON body;
a ``DELETE`` may come without a body).
"""

from __future__ import annotations

from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from runtime.api.errors import ClientError
from runtime.server.bounds import check_json_size
from runtime.server.control_api import DEFAULT_AUTH, authorize, json_response, model_directory


def _model(request: Request) -> str:
    return model_directory(request.app).require(request.path_params["name"])


def _generation(request: Request, name: str) -> Any:
    """The ``GenerationEngine`` of ``name`` (None: a request model)."""
    return model_directory(request.app).generation.get(name)


async def list_adapters(request: Request) -> Response:
    name = _model(request)
    gen = _generation(request, name)
    adapters = gen.adapters() if gen is not None else request.app.state.engine.adapters(name)
    return json_response({"model": name, "adapters": adapters})


async def load_adapter(request: Request) -> Response:
    identity = authorize(request)
    name = _model(request)
    body = await request.body()
    check_json_size(len(body), "the adapter to load", "send its name and path only")
    try:
        doc = orjson.loads(body) if body else None
    except orjson.JSONDecodeError:
        doc = None
    if not isinstance(doc, dict) or not isinstance(doc.get("name"), str) \
            or not isinstance(doc.get("path"), str):
        raise ClientError('the body must be a JSON object {"name": "<adapter>", "path": '
                          '"<directory with adapter_config.json and adapter_model.safetensors>"}')
    gen = _generation(request, name)
    if gen is not None:
        entry = await gen.load_adapter(doc["name"], doc["path"], requested_by=identity)
    else:
        entry = await request.app.state.engine.load_adapter(name, doc["name"], doc["path"],
                                                            requested_by=identity)
    return json_response({"model": name, "identity": identity, **entry}, status=201)


async def unload_adapter(request: Request) -> Response:
    auth = getattr(request.app.state, "auth", None) or DEFAULT_AUTH
    client = request.client
    identity = auth.check(request.method, request.headers, client.host if client else None,
                          untyped_json=True)
    name = _model(request)
    adapter = request.path_params["adapter"]
    gen = _generation(request, name)
    if gen is not None:
        done = await gen.unload_adapter(adapter, requested_by=identity)
    else:
        done = await request.app.state.engine.unload_adapter(name, adapter,
                                                             requested_by=identity)
    return json_response({"model": name, "identity": identity, **done})


def adapter_routes() -> list[Route]:
    return [
        Route("/v2/models/{name}/adapters", list_adapters, methods=["GET"]),
        Route("/v2/models/{name}/adapters", load_adapter, methods=["POST"]),
        Route("/v2/models/{name}/adapters/{adapter}", unload_adapter, methods=["DELETE"]),
    ]
