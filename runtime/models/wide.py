"""``wide``: a weight-bound multilayer perceptron, the batching trade-off of a large model.

INPUT0 FP32 [256] -> Linear(256, 4096) -> ReLU -> 3 x (Linear(4096, 4096) -> ReLU)
-> Linear(4096, 10) -> OUTPUT0 FP32 [10]; about 205 MB of seeded weights. Every batch
reads all of them, so on a CPU a batch of 16 costs about 3.5 times a batch of 1 and a batch
of 128 about 8 times (one torch thread: some 13 ms for 1, 47 ms for 32, 105 ms for 128):
most of a batch's time is fixed, as it is for large models on an accelerator, which is
where max_batch_size sets the capacity. ``mlp``'s hooks serve it unchanged.

Adapters: LoRA adapters may target each of its linear layers (the ``nn.Sequential``'s
modules ``0``, ``2``, ``4``, ``6``, ``8``; PEFT's ``target_modules=["0", "2", "4", "6",
"8"]``), up to rank 64. A batch in which some row has an adapter runs the layers one by
one (``runtime.adapters.lora.sequential_forward``), each adding its rows' terms.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from runtime.adapters.lora import AdapterBank, sequential_forward
from runtime.models import inference, seeded_init
from runtime.models.mlp import IN_FEATURES, OUT_FEATURES, MLPModel

HIDDEN = 4096
LAYERS = 3
SEED = 4321
#: (in_features, out_features) of the linear layers, in order
LINEAR_SHAPES: tuple[tuple[int, int], ...] = (
    ((IN_FEATURES, HIDDEN),) + ((HIDDEN, HIDDEN),) * LAYERS + ((HIDDEN, OUT_FEATURES),))
#: the layers LoRA adapters may target: module name -> (in_features, out_features); a
#: ReLU follows each linear layer but the last, so they are the Sequential's even modules
ADAPTER_TARGETS: dict[str, tuple[int, int]] = {
    str(2 * i): shape for i, shape in enumerate(LINEAR_SHAPES)}


def build_wide() -> nn.Sequential:
    layers: list[nn.Module] = []
    for fan_in, fan_out in LINEAR_SHAPES:
        layers += [nn.Linear(fan_in, fan_out), nn.ReLU()]
    net = nn.Sequential(*layers[:-1])
    seeded_init(net, SEED)
    return net.eval()


class WideModel(MLPModel):
    name = "wide"
    adapter_targets = ADAPTER_TARGETS

    def setup(self, device: Any) -> None:
        self.device = torch.device(device)
        self.net = build_wide().to(self.device)
        self.adapter_bank = AdapterBank.for_model(self, self.device)

    def predict(self, batch: torch.Tensor) -> torch.Tensor:
        with inference():
            if self.adapter_bank is not None and self.adapter_bank.active:
                return sequential_forward(self.net, batch, self.adapter_bank.apply)
            return self.net(batch)

    def estimate_batch_bytes(self, batch_size: int, padded_length: int) -> int | None:
        return batch_size * 4 * (IN_FEATURES + 2 * HIDDEN + OUT_FEATURES)
