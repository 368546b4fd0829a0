"""The no-batching baseline: a plain FastAPI app that runs one forward pass per request.

It speaks the same KServe v2 routes as the batching server (health, model metadata,
``POST /v2/models/{name}/infer`` with JSON tensors), so one load generator drives both.
Each request is decoded, run alone (batch of 1) and answered right away, on the event
loop, one at a time, torch on one thread: what a straightforward service would do.

    python -m benchmarks.baseline_server --port 8001 --model mlp --model encoder
    batchscope load --url http://127.0.0.1:8001 --model mlp --concurrency 32 --duration-s 10
"""

from __future__ import annotations

import argparse
import logging
from typing import Sequence

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response

if __package__ in (None, ""):
    import common  # noqa: F401  (puts the repository root on sys.path)
from benchmarks.common import decode_infer_request, encode_infer_response, set_torch_threads
from runtime.api.errors import BatchScopeError, ModelNotFound
from runtime.models.loader import load_model
from runtime.api.model import ModelAPI

log = logging.getLogger("batchscope.baseline")


def _json(doc: object, status: int = 200) -> Response:
    return Response(orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY), status_code=status,
                    media_type="application/json")


def infer_one(model: ModelAPI, inputs: dict) -> dict:
    """One request through the model alone: decode, a batch of one, predict, split."""
    item = model.decode(inputs)
    pad = model.length(item) if model.variable_length else None
    return model.split(model.predict(model.collate([item], pad)), 1)[0]


def create_app(models: dict[str, ModelAPI]) -> FastAPI:
    """An app serving already set-up ``models`` (name -> model)."""
    app = FastAPI(title="BatchScope no-batching baseline", docs_url=None, redoc_url=None)

    def get(name: str) -> ModelAPI:
        try:
            return models[name]
        except KeyError:
            raise ModelNotFound(f"model {name!r} is not served here; models: {sorted(models)}") from None

    @app.exception_handler(BatchScopeError)
    async def _error(request: Request, exc: BatchScopeError) -> Response:
        return _json(exc.to_dict(), exc.http_status)

    @app.get("/v2/health/live")
    @app.get("/v2/health/ready")
    async def health() -> Response:
        return _json({"live": True, "ready": True})

    @app.get("/v2")
    async def server_metadata() -> Response:
        return _json({"name": "batchscope-baseline", "version": "1", "extensions": []})

    @app.get("/v2/models/{name}")
    @app.get("/v2/models/{name}/versions/{version}")
    async def model_metadata(name: str, version: str | None = None) -> Response:
        return _json(get(name).metadata())

    @app.get("/v2/models/{name}/ready")
    async def model_ready(name: str) -> Response:
        get(name)
        return _json({"name": name, "ready": True})

    @app.post("/v2/models/{name}/infer")
    @app.post("/v2/models/{name}/versions/{version}/infer")
    async def infer(name: str, request: Request, version: str | None = None) -> Response:
        model = get(name)
        try:
            doc = orjson.loads(await request.body())
        except orjson.JSONDecodeError as exc:
            return _json({"error": f"the body is not valid JSON: {exc}"}, 400)
        try:
            result = infer_one(model, decode_infer_request(doc, model))
        except BatchScopeError:
            raise
        except Exception:
            log.exception("model %s failed", name)
            return _json({"error": "internal error"}, 500)
        return _json(encode_infer_response(model, result, doc.get("id")))

    return app


def load_models(specs: Sequence[str], device: str = "cpu") -> dict[str, ModelAPI]:
    models = {}
    for spec in specs:
        model = load_model(spec)
        model.setup(device)
        models[model.name] = model
    return models


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="no-batching KServe v2 baseline server")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--model", action="append", dest="models", help="model spec (repeatable)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    import uvicorn

    set_torch_threads(args.threads)
    models = load_models(args.models or ["mlp", "encoder"], args.device)
    print(f"baseline server on http://{args.host}:{args.port} serving {', '.join(sorted(models))}", flush=True)
    app = create_app(models)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
