"""A plain embedding server, written as a user would: FastAPI + sentence-transformers.

``POST /v1/embeddings`` with OpenAI's body (``input``: a text or a list of texts)
answers with ``model.encode(texts)``: one forward pass per request, no batching across
requests (FastAPI runs the synchronous handler on its thread pool), torch on one thread.

    python -m benchmarks.embedding_server --port 8002 --model-dir DIR
"""

from __future__ import annotations

import argparse
from typing import Any, Sequence

if __package__ in (None, ""):
    import common  # noqa: F401  (puts the repository root on sys.path)
from benchmarks.common import set_torch_threads


def create_app(model_dir: str, name: str) -> Any:
    from fastapi import Body, FastAPI
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(model_dir, device="cpu")
    app = FastAPI(docs_url=None, redoc_url=None)

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok"}

    @app.post("/v1/embeddings")
    def embeddings(body: dict = Body(...)) -> dict:
        texts = body["input"] if isinstance(body["input"], list) else [body["input"]]
        vectors = model.encode(texts)
        return {"object": "list", "model": name,
                "data": [{"object": "embedding", "index": i, "embedding": v.tolist()}
                         for i, v in enumerate(vectors)]}

    return app


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8002)
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--name", default="emb")
    args = parser.parse_args(argv)
    import uvicorn

    set_torch_threads(1)
    app = create_app(args.model_dir, args.name)
    print(f"embedding server on http://{args.host}:{args.port}", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
