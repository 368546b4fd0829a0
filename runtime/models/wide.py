"""``wide``: a weight-bound multilayer perceptron, the batching trade-off of a large model.

INPUT0 FP32 [256] -> Linear(256, 4096) -> ReLU -> 3 x (Linear(4096, 4096) -> ReLU)
-> Linear(4096, 10) -> OUTPUT0 FP32 [10]; about 205 MB of seeded weights. Every batch
reads all of them, so on a CPU a batch of 16 costs about 3.5 times a batch of 1 and a batch
of 128 about 8 times (one torch thread: some 13 ms for 1, 47 ms for 32, 105 ms for 128):
most of a batch's time is fixed, as it is for large models on an accelerator, which is
where max_batch_size sets the capacity. ``mlp``'s hooks serve it unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from runtime.models import seeded_init
from runtime.models.mlp import IN_FEATURES, OUT_FEATURES, MLPModel

HIDDEN = 4096
LAYERS = 3
SEED = 4321


def build_wide() -> nn.Sequential:
    layers: list[nn.Module] = [nn.Linear(IN_FEATURES, HIDDEN), nn.ReLU()]
    for _ in range(LAYERS):
        layers += [nn.Linear(HIDDEN, HIDDEN), nn.ReLU()]
    layers.append(nn.Linear(HIDDEN, OUT_FEATURES))
    net = nn.Sequential(*layers)
    seeded_init(net, SEED)
    return net.eval()


class WideModel(MLPModel):
    name = "wide"

    def setup(self, device: Any) -> None:
        self.device = torch.device(device)
        self.net = build_wide().to(self.device)

    def estimate_batch_bytes(self, batch_size: int, padded_length: int) -> int | None:
        return batch_size * 4 * (IN_FEATURES + 2 * HIDDEN + OUT_FEATURES)
