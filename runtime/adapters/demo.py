"""Deterministic LoRA adapters of the bundled models that take them, for the demo, the
benchmark and the tests: ``write_demo_adapters(root, 8)`` writes the ``encoder``'s
``enc-0`` ... ``enc-7`` in PEFT's layout, ``write_demo_adapters(root, 8, "wide")`` the
``wide`` model's ``wide-0`` ... ``wide-7``, ``write_demo_adapters(root, 8, "decoder")``
the generation model's ``dec-0`` ... ``dec-7``; ranks cycle through ``RANKS``, the weights are
drawn from a seed per adapter.

Each adapter is written into a folder of its own beside its final place and renamed into
it, so a folder that exists is complete: several processes may write the same root at
once, and one killed while writing leaves no half-written adapter behind.
``cached_root(model)`` is a root that lasts (the user's cache folder): the demo writes
there once and reuses it, so a demo killed with SIGKILL leaves nothing in the temporary
folder."""

from __future__ import annotations

import hashlib
import importlib
import os
import shutil
import tempfile
from typing import Mapping

#: ranks of the demo adapters, in turn
RANKS = (8, 16, 4, 8)
SEED = 9000
#: the version of the files' layout, part of ``cached_root``'s name
FORMAT = 1
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


def _check_model(model: str) -> None:
    if model not in DEMO_MODELS:
        raise ValueError(f"no demo adapters for {model!r}; models: {sorted(DEMO_MODELS)}")


def cached_root(model: str = "encoder") -> str:
    """A lasting root for ``model``'s demo adapters: ``$XDG_CACHE_HOME/batchscope`` (else
    ``~/.cache/batchscope``), in a folder named by what the weights are drawn from, so a
    change to the recipe never reuses old files. Created (0700) if missing; raises
    ``OSError`` when it cannot be."""
    _check_model(model)
    recipe = repr((FORMAT, SEED, RANKS, DEMO_MODELS[model], sorted(model_targets(model).items())))
    digest = hashlib.sha256(recipe.encode()).hexdigest()[:12]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    root = os.path.join(base, "batchscope", "demo-adapters", f"{model}-{digest}")
    os.makedirs(root, mode=0o700, exist_ok=True)
    return root


def write_demo_adapters(root: str, count: int = 8, model: str = "encoder") -> dict[str, str]:
    """Write ``count`` adapters of the bundled ``model`` under ``root`` (those already
    there are kept); name -> directory."""
    from runtime.adapters.lora import random_pairs, write_peft  # torch: only when writing

    _check_model(model)
    targets = model_targets(model)
    std = DEMO_MODELS[model][1]
    out = {}
    for i in range(count):
        name = demo_name(i, model)
        path = os.path.join(root, name)
        if not os.path.isdir(path):
            part = tempfile.mkdtemp(prefix=f".{name}-", dir=root)
            try:
                write_peft(part, random_pairs(targets, RANKS[i % len(RANKS)], SEED + i,
                                              std=std), base_model=model)
                os.rename(part, path)
            except OSError:
                if not os.path.isdir(path):  # not another writer's rename first
                    raise
            finally:
                shutil.rmtree(part, ignore_errors=True)
        out[name] = path
    return out
