"""Deterministic LoRA adapters of the bundled models that take them, for the demo, the
benchmark and the tests: ``write_demo_adapters(root, 8)`` writes the ``encoder``'s
``enc-0`` ... ``enc-7`` in PEFT's layout, ``write_demo_adapters(root, 8, "wide")`` the
``wide`` model's ``wide-0`` ... ``wide-7``, ``write_demo_adapters(root, 8, "decoder")``
the generation model's ``dec-0`` ... ``dec-7``; ranks cycle through ``RANKS``, the weights are
drawn from a seed per adapter."""

from __future__ import annotations

import importlib
import os
from typing import Mapping

#: ranks of the demo adapters, in turn
RANKS = (8, 16, 4, 8)
SEED = 9000
#: model -> (prefix of its adapters' names, standard deviation of their weights: smaller
#: for wider layers, so that an adapter changes the output without swamping it)
DEMO_MODELS: dict[str, tuple[str, float]] = {"encoder": ("enc", 0.05), "wide": ("wide", 0.01),
                                             "decoder": ("dec", 0.05)}


def demo_name(index: int, model: str = "encoder") -> str:
    return f"{DEMO_MODELS[model][0]}-{index}"


def model_targets(model: str) -> dict[str, tuple[int, int]]:
    """The adapter targets a bundled model declares (no weights built: its class, or for
    a model whose targets follow its sizes, an instance made with its defaults)."""
    from runtime.models import BUILTIN_MODELS

    module, name = BUILTIN_MODELS[model].split(":")
    cls = getattr(importlib.import_module(module), name)
    targets = getattr(cls, "adapter_targets", None)
    return dict(targets if isinstance(targets, Mapping) else cls().adapter_targets)


def write_demo_adapters(root: str, count: int = 8, model: str = "encoder") -> dict[str, str]:
    """Write ``count`` adapters of the bundled ``model`` under ``root``; name -> directory."""
    from runtime.adapters.lora import random_pairs, write_peft  # torch: only when writing

    if model not in DEMO_MODELS:
        raise ValueError(f"no demo adapters for {model!r}; models: {sorted(DEMO_MODELS)}")
    targets = model_targets(model)
    std = DEMO_MODELS[model][1]
    out = {}
    for i in range(count):
        name = demo_name(i, model)
        path = os.path.join(root, name)
        if not os.path.exists(os.path.join(path, "adapter_model.safetensors")):
            write_peft(path, random_pairs(targets, RANKS[i % len(RANKS)], SEED + i, std=std),
                       base_model=model)
        out[name] = path
    return out
