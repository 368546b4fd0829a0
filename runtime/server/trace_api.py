"""Triton's trace extension over HTTP: read and change the trace settings.

``GET  /v2/trace/setting``                  -> the global trace settings
``POST /v2/trace/setting``                  partial JSON object of settings -> applied
``GET  /v2/models/{name}/trace/setting``    -> the settings model ``name`` is traced with
``POST /v2/models/{name}/trace/setting``    its own values for some keys (null: clear one)

Settings and values as Triton has them (``runtime.core.tracing``): strings, and a list
of strings for ``trace_level``; every answer is the effective settings (a model's own
values over the global ones, ``trace_count`` the traces left). An unknown key or a bad
value is a 400 naming the known keys or the accepted form, and nothing changes.
``tritonclient``'s ``get_trace_settings``/``update_trace_settings`` work as they are;
the gRPC ``TraceSetting`` call (``runtime.server.grpc.handlers``) does the same.

A ``POST`` is a control request (``runtime.server.auth``, as the batching control
routes): another site's request is refused (403), the token is required when the server
has one (401 missing, 403 wrong), and without one only this machine may send it. The
body must be JSON, sent as ``application/json`` or without a ``Content-Type`` (as
``tritonclient.http`` sends it); any other type is a 400.
"""

from __future__ import annotations

from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from runtime.api.errors import ClientError, ModelNotFound, RouteNotFound
from runtime.core.tracing import KEYS, parse_changes
from runtime.server.auth import AuthConfig
from runtime.server.bounds import check_json_size
from runtime.server.control_api import DEFAULT_AUTH, json_response, model_directory


def tracer_of(app: Any) -> Any:
    """The tracer of the app's engine (``runtime.engine.tracing``)."""
    tracer = getattr(app.state.engine, "tracer", None)
    if tracer is None:
        raise RouteNotFound("this server's engine has no trace settings")
    return tracer


def traced_model(app: Any, name: str) -> str:
    """``name`` when it is a request model of the app's engine, else ``ModelNotFound``."""
    engine = app.state.engine
    traced = engine.tracer.control.models if getattr(engine, "tracer", None) else ()
    if name in engine.model_names() or name in traced:
        return name
    if name in model_directory(app).generation:
        raise ModelNotFound(f"model {name!r} is a generation model this server does not "
                            f"trace; traced models: {sorted(traced)}")
    raise ModelNotFound(f"unknown model {name!r}; served models are "
                        f"{sorted(engine.model_names())}")


def read_changes(body: bytes) -> dict[str, Any]:
    """The checked changes of a trace setting request body (400 before anything changes)."""
    check_json_size(len(body), "the trace setting request", "send only the settings to change")
    try:
        doc = orjson.loads(body) if body.strip() else {}
    except orjson.JSONDecodeError:
        raise ClientError('the body must be a JSON object of trace settings, e.g. '
                          '{"trace_level": ["TIMESTAMPS"], "trace_rate": "100"}; the trace '
                          f"settings are {', '.join(KEYS)}") from None
    return parse_changes(doc)


async def get_setting(request: Request) -> Response:
    name = request.path_params.get("name")
    model = None if name is None else traced_model(request.app, name)
    return json_response(tracer_of(request.app).settings(model))


async def change_setting(request: Request) -> Response:
    auth: AuthConfig = getattr(request.app.state, "auth", None) or DEFAULT_AUTH
    client = request.client
    auth.check(request.method, request.headers, client.host if client else None,
               untyped_json=True)
    name = request.path_params.get("name")
    model = None if name is None else traced_model(request.app, name)
    changes = read_changes(await request.body())
    return json_response(tracer_of(request.app).update(model, changes))


def trace_routes() -> list[Route]:
    return [
        Route("/v2/trace/setting", get_setting, methods=["GET"]),
        Route("/v2/trace/setting", change_setting, methods=["POST"]),
        Route("/v2/models/{name}/trace/setting", get_setting, methods=["GET"]),
        Route("/v2/models/{name}/trace/setting", change_setting, methods=["POST"]),
    ]
