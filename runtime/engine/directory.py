"""``ModelDirectory``: one view over every served model.

A serving process runs one request engine (``runtime.engine.engine.Engine``) for the
KServe models and one ``GenerationEngine`` per generation model. The live link and
the HTTP control API both read and change settings and stats by model name without
caring which engine serves it; this class answers for both. The settings of a
request model are its ``BatchingConfig``, those of a generation model its
``GenerationConfig``.
"""

from __future__ import annotations

from typing import Any

from runtime.api.errors import ModelNotFound


class ModelDirectory:
    def __init__(self, engine: Any, generation: dict[str, Any] | None = None) -> None:
        self.engine = engine
        self.generation = dict(generation or {})

    def names(self) -> list[str]:
        return list(self.engine.model_names()) + list(self.generation)

    def require(self, model: str) -> str:
        """``model`` if served, else ``ModelNotFound`` naming the served models."""
        if model in self.generation or model in self.engine.model_names():
            return model
        raise ModelNotFound(f"unknown model {model!r}; served models are {self.names()}")

    def kind(self, model: str) -> str:
        if model in self.generation:
            return "generate"
        return getattr(self.engine.model(model), "kind", "request")

    def get_settings(self, model: str) -> tuple[int, Any]:
        gen = self.generation.get(model)
        return gen.get_settings() if gen is not None else self.engine.get_settings(model)

    def update_settings(self, model: str, changes: dict, requested_by: str) -> tuple[int, Any]:
        gen = self.generation.get(model)
        if gen is not None:
            return gen.update_settings(changes, requested_by=requested_by)
        return self.engine.update_settings(model, changes, requested_by=requested_by)

    def stats(self, model: str) -> dict[str, Any]:
        gen = self.generation.get(model)
        return gen.stats() if gen is not None else self.engine.stats(model)

    def listeners(self) -> list[list]:
        return [self.engine.on_settings_change] + [g.on_settings_change
                                                    for g in self.generation.values()]
