"""``mlp``: a fixed-size multilayer perceptron, the overhead-bound reference model.

INPUT0 FP32 [256] -> Linear(256, 1024) -> ReLU -> Linear(1024, 1024) -> ReLU
-> Linear(1024, 10) -> OUTPUT0 FP32 [10]. Weights come from a seeded generator.
The hooks around the forward pass do as little as possible: decode keeps the numpy
array, collate is one ``np.stack``, split is one ``.numpy()`` and row views.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from runtime.api.errors import ClientError
from runtime.api.model import ModelAPI, TensorSpec
from runtime.models import inference, seeded_init, take_input

IN_FEATURES = 256
HIDDEN = 1024
OUT_FEATURES = 10
SEED = 1234


def build_mlp() -> nn.Sequential:
    net = nn.Sequential(nn.Linear(IN_FEATURES, HIDDEN), nn.ReLU(),
                        nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
                        nn.Linear(HIDDEN, OUT_FEATURES))
    seeded_init(net, SEED)
    return net.eval()


class MLPModel(ModelAPI):
    name = "mlp"
    inputs = (TensorSpec("INPUT0", "FP32", (IN_FEATURES,)),)
    outputs = (TensorSpec("OUTPUT0", "FP32", (OUT_FEATURES,)),)
    variable_length = False

    net: nn.Module | None = None

    def setup(self, device: Any) -> None:
        self.device = torch.device(device)
        self.net = build_mlp().to(self.device)

    def decode(self, inputs: dict[str, np.ndarray]) -> np.ndarray:
        x = take_input(inputs, "INPUT0", 1, f"FP32 [{IN_FEATURES}]")
        if x.shape[0] != IN_FEATURES:
            raise ClientError(f"input 'INPUT0' has shape [{x.shape[0]}]; expected FP32 [{IN_FEATURES}]")
        if x.dtype != np.float32:
            raise ClientError(f"input 'INPUT0' has datatype {x.dtype}; expected FP32 [{IN_FEATURES}]")
        return x

    def collate(self, items: list[np.ndarray], pad_to: int | None) -> torch.Tensor:
        batch = torch.from_numpy(np.stack(items))
        if self.device is not None and self.device.type != "cpu":
            batch = batch.to(self.device, non_blocking=True)
        return batch

    def predict(self, batch: torch.Tensor) -> torch.Tensor:
        with inference():
            return self.net(batch)

    def split(self, output: torch.Tensor, n: int) -> list[dict[str, np.ndarray]]:
        out = output.numpy() if output.device.type == "cpu" else output.cpu().numpy()
        return [{"OUTPUT0": out[i]} for i in range(n)]

    def estimate_batch_bytes(self, batch_size: int, padded_length: int) -> int | None:
        return batch_size * 4 * (IN_FEATURES + 2 * HIDDEN + OUT_FEATURES)
