"""Every OpenAI-style route of one server, put together.

``openai_routes(engine, generation)`` gives ``/v1/completions`` and
``/v1/chat/completions`` for the generation engines (``runtime.generation.http``),
``/v1/embeddings`` for the request engine's embedding models
(``runtime.server.openai_embeddings``) and ``/v1/models`` listing both kinds.
"""

from __future__ import annotations

from typing import Any

from starlette.routing import Route

from runtime.generation.http import generation_routes
from runtime.server.openai_embeddings import embedding_models, embedding_routes
from runtime.server.openai_http import model_routes


def openai_routes(engine: Any, generation: dict[str, Any] | None = None) -> list[Route]:
    """The ``/v1`` routes for ``engine`` (an ``Engine``) and ``generation`` (model name ->
    ``GenerationEngine``)."""
    generation = generation or {}
    return (generation_routes(generation) + embedding_routes(engine)
            + model_routes(lambda: list(generation) + embedding_models(engine)))
