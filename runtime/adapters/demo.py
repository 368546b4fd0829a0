"""Deterministic LoRA adapters of the bundled ``encoder`` for the demo, the benchmark and
the tests: ``write_demo_adapters(root, 8)`` writes ``enc-0`` ... ``enc-7`` in PEFT's
layout, ranks cycling through ``RANKS``, the weights drawn from a seed per adapter."""

from __future__ import annotations

import os

from runtime.adapters.lora import random_pairs, write_peft

#: ranks of the demo adapters, in turn
RANKS = (8, 16, 4, 8)
SEED = 9000


def demo_name(index: int) -> str:
    return f"enc-{index}"


def write_demo_adapters(root: str, count: int = 8) -> dict[str, str]:
    """Write ``count`` encoder adapters under ``root``; name -> directory."""
    from runtime.models.encoder import ADAPTER_TARGETS

    out = {}
    for i in range(count):
        path = os.path.join(root, demo_name(i))
        if not os.path.exists(os.path.join(path, "adapter_model.safetensors")):
            write_peft(path, random_pairs(ADAPTER_TARGETS, RANKS[i % len(RANKS)], SEED + i),
                       base_model="encoder")
        out[demo_name(i)] = path
    return out
