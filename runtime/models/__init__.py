"""Bundled models, resolved lazily by name.

``BUILTIN_MODELS`` maps a builtin name to the ``module:Class`` that implements it;
nothing heavy is imported until ``runtime.models.loader.load_model`` asks for one.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, ContextManager

#: builtin name -> "module:Class"
BUILTIN_MODELS: dict[str, str] = {
    "mlp": "runtime.models.mlp:MLPModel",
    "encoder": "runtime.models.encoder:EncoderModel",
    # weight-bound: most of a batch's time is fixed, as for large models on accelerators
    "wide": "runtime.models.wide:WideModel",
    "minilm": "runtime.models.minilm:MiniLMModel",
    # generation (continuous batching), served at /v1/completions
    "decoder": "runtime.models.decoder:TinyDecoder",
}


def seeded_init(module, seed: int) -> None:
    """Fill every parameter of ``module`` from a seeded generator (no downloads, same on every machine).

    Matrices get U(-1/sqrt(fan_in), 1/sqrt(fan_in)); vectors named like norm weights stay 1,
    other vectors (biases, norm biases) stay 0. Embeddings get N(0, 1) with the padding row zeroed.
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if param.dim() >= 2:
                if "embedding" in name or name.endswith("embed.weight"):
                    param.copy_(torch.randn(param.shape, generator=gen))
                else:
                    bound = 1.0 / math.sqrt(param.shape[1])
                    param.copy_((torch.rand(param.shape, generator=gen) * 2 - 1) * bound)
            elif "norm" in name and name.endswith("weight"):
                param.fill_(1.0)
            else:
                param.zero_()


def take_input(inputs: dict, name: str, ndim: int, expected: str):
    """The array named ``name`` with ``ndim`` dimensions, a leading batch dimension of 1 removed.

    Raises ``ClientError`` naming the input and the ``expected`` shape/datatype when it is
    missing or has the wrong number of dimensions.
    """
    from runtime.api.errors import ClientError

    try:
        arr = inputs[name]
    except KeyError:
        raise ClientError(f"missing input {name!r}: expected {expected}; "
                          f"got inputs {sorted(inputs)}") from None
    shape = getattr(arr, "shape", None)
    if shape is None:
        raise ClientError(f"input {name!r} must be an array ({expected}), got {type(arr).__name__}")
    if len(shape) == ndim + 1 and shape[0] == 1:
        arr = arr[0]
    elif len(shape) != ndim:
        raise ClientError(f"input {name!r} has shape {list(shape)}; expected {expected} "
                          "(optionally with a leading batch dimension of 1)")
    return arr


def inference() -> ContextManager[Any]:
    """``torch.inference_mode()`` for a model's ``predict``, or nothing when autograd is
    off already: every batch the runtime runs is under inference mode, and a compiled
    model it cannot compile so runs under ``no_grad``. Entering inference mode again
    inside a compiled ``predict`` made torch 2.11's compiler fail on the bundled ``mlp``
    ("weakref to UntypedStorage", pytorch/pytorch#181512), and under ``no_grad`` made
    dynamo skip the frame (nothing compiled); this way the compiled graph holds no
    switch, and a direct call is still kept out of autograd."""
    import torch

    return torch.inference_mode() if torch.is_grad_enabled() else contextlib.nullcontext()
