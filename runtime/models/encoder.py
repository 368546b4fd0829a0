"""``encoder``: a small transformer encoder producing one embedding per token sequence.

INPUT_IDS INT64 [-1] (token ids in [0, 30522), 1..128 tokens; 0 is the padding id)
-> Embedding(30522, 256, padding_idx=0) -> TransformerEncoder(d_model 256, 4 heads,
4 layers, feed-forward 1024, no dropout, batch_first) with a key padding mask
-> mean over the real tokens -> EMBEDDING FP32 [256].

Requests differ in length, so the model is ``variable_length``: ``length(item)`` is
the token count and ``collate`` pads with 0 up to ``pad_to`` (or the longest item).
Benchmarks draw lengths from 8..128; anything from 1 to ``max_length`` is accepted.
There is no positional encoding: the definition is fixed so that figures compare
across tools, not to be a good language model.

It is served at ``/v1/embeddings`` too (``embedding_output``). Having no tokenizer of
its own, it reads a text as its UTF-8 bytes, byte ``b`` as token id ``b + 1`` (0 stays
the padding id), so a text embeds as long as it has 1..128 bytes; a list of token ids
is taken as it is.

Adapters: LoRA adapters may target the feed-forward layers of every encoder layer
(``encoder.layers.N.linear1`` 256 -> 1024 and ``encoder.layers.N.linear2`` 1024 -> 256,
PEFT's ``target_modules=["linear1", "linear2"]``), up to rank 64. A batch in which some
row has an adapter runs the layers module by module (``explicit_forward``), each target
adding its rows' terms (``runtime.adapters.lora.AdapterBank``); a batch without one runs
torch's fused encoder layers as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from runtime.adapters.lora import AdapterBank, Linear, plain_linear
from runtime.api.errors import ClientError, ValidationError
from runtime.api.model import ModelAPI, TensorSpec
from runtime.models import inference, seeded_init, take_input

VOCAB_SIZE = 30522
D_MODEL = 256
HEADS = 4
LAYERS = 4
FEEDFORWARD = 1024
MAX_LENGTH = 128
PAD_ID = 0
SEED = 4321
#: the layers LoRA adapters may target: module name -> (in_features, out_features)
ADAPTER_TARGETS: dict[str, tuple[int, int]] = {
    f"encoder.layers.{i}.{name}": shape
    for i in range(LAYERS)
    for name, shape in (("linear1", (D_MODEL, FEEDFORWARD)), ("linear2", (FEEDFORWARD, D_MODEL)))}


class EncoderNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB_SIZE, D_MODEL, padding_idx=PAD_ID)
        layer = nn.TransformerEncoderLayer(D_MODEL, HEADS, dim_feedforward=FEEDFORWARD,
                                           dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)

    def forward(self, ids: torch.Tensor, pad_mask: torch.Tensor,
                bank: AdapterBank | None = None) -> torch.Tensor:
        """ids (n, L) int64, pad_mask (n, L) bool with True at padding -> (n, D_MODEL);
        with an active adapter ``bank``, each row with its adapter."""
        if bank is not None and bank.active:
            return explicit_forward(self, ids, pad_mask, bank.apply)
        hidden = self.encoder(self.embedding(ids), src_key_padding_mask=pad_mask)
        return pool(hidden, pad_mask)


def explicit_forward(net: EncoderNet, ids: torch.Tensor, pad_mask: torch.Tensor,
                     linear: Linear = plain_linear) -> torch.Tensor:
    """``EncoderNet.forward`` module by module (post-norm layers, as torch's), the
    feed-forward layers through ``linear(name, layer, x)``; PEFT's wrapped modules run
    their adapters here too, which makes it the tests' oracle."""
    x = net.embedding(ids)
    for i, layer in enumerate(net.encoder.layers):
        x = layer.norm1(x + layer._sa_block(x, None, pad_mask))
        h = layer.activation(linear(f"encoder.layers.{i}.linear1", layer.linear1, x))
        x = layer.norm2(x + linear(f"encoder.layers.{i}.linear2", layer.linear2, h))
    return pool(x, pad_mask)


def pool(hidden: torch.Tensor, pad_mask: torch.Tensor) -> torch.Tensor:
    """Mean over the real tokens."""
    keep = (~pad_mask).unsqueeze(-1).to(hidden.dtype)
    return (hidden * keep).sum(dim=1) / keep.sum(dim=1).clamp(min=1.0)


def build_encoder() -> EncoderNet:
    net = EncoderNet()
    seeded_init(net, SEED)
    with torch.no_grad():
        net.embedding.weight[PAD_ID].zero_()
    return net.eval()


@dataclass(slots=True)
class EncoderBatch:
    """A padded batch: token ids and the padding mask (True where padded)."""

    ids: torch.Tensor
    pad_mask: torch.Tensor


class EncoderModel(ModelAPI):
    name = "encoder"
    inputs = (TensorSpec("INPUT_IDS", "INT64", (-1,)),)
    outputs = (TensorSpec("EMBEDDING", "FP32", (D_MODEL,)),)
    variable_length = True
    max_length = MAX_LENGTH
    embedding_output = "EMBEDDING"
    adapter_targets = ADAPTER_TARGETS

    net: EncoderNet | None = None

    def setup(self, device: Any) -> None:
        self.device = torch.device(device)
        self.net = build_encoder().to(self.device)
        self.adapter_bank = AdapterBank.for_model(self, self.device)

    def decode(self, inputs: dict[str, np.ndarray]) -> torch.Tensor:
        expected = f"INT64 [1..{MAX_LENGTH}] token ids in [0, {VOCAB_SIZE})"
        ids = take_input(inputs, "INPUT_IDS", 1, expected)
        if ids.dtype.kind not in "iu":
            raise ClientError(f"input 'INPUT_IDS' has datatype {ids.dtype}; expected {expected}")
        n = ids.shape[0]
        if n == 0 or n > MAX_LENGTH:
            raise ValidationError(f"input 'INPUT_IDS' has {n} tokens; expected 1..{MAX_LENGTH} "
                                  "(split longer texts into several requests)")
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= VOCAB_SIZE:
            bad = lo if lo < 0 else hi
            raise ValidationError(f"input 'INPUT_IDS' holds token id {bad}; ids must be in [0, {VOCAB_SIZE})")
        return torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64))

    def embedding_inputs(self, value: str | list[int]) -> tuple[dict[str, np.ndarray], int]:
        """A text as its UTF-8 bytes shifted by one (ids 1..256), token ids as they are;
        ``decode`` checks the length and the range."""
        if isinstance(value, str):
            ids = np.frombuffer(value.encode("utf-8"), dtype=np.uint8).astype(np.int64) + 1
        else:
            ids = np.asarray(value, dtype=np.int64)
        return {"INPUT_IDS": ids}, int(ids.shape[0])

    def length(self, item: torch.Tensor) -> int:
        return int(item.shape[0])

    def collate(self, items: list[torch.Tensor], pad_to: int | None) -> EncoderBatch:
        longest = max(int(t.shape[0]) for t in items)
        width = max(longest, pad_to or 0)
        ids = torch.full((len(items), width), PAD_ID, dtype=torch.int64)
        lengths = torch.empty(len(items), dtype=torch.int64)
        for row, item in enumerate(items):
            ids[row, : item.shape[0]] = item
            lengths[row] = item.shape[0]
        pad_mask = torch.arange(width).unsqueeze(0) >= lengths.unsqueeze(1)
        if self.device is not None and self.device.type != "cpu":
            ids = ids.to(self.device, non_blocking=True)
            pad_mask = pad_mask.to(self.device, non_blocking=True)
        return EncoderBatch(ids, pad_mask)

    def predict(self, batch: EncoderBatch) -> torch.Tensor:
        with inference():
            return self.net(batch.ids, batch.pad_mask, self.adapter_bank)

    def split(self, output: torch.Tensor, n: int) -> list[dict[str, np.ndarray]]:
        out = output.numpy() if output.device.type == "cpu" else output.cpu().numpy()
        return [{"EMBEDDING": out[i]} for i in range(n)]

    def estimate_batch_bytes(self, batch_size: int, padded_length: int) -> int | None:
        """Rough peak activations of one layer: token states and feed-forward (fp32)
        plus the attention score matrices, which grow with the square of the length."""
        per_token = 4 * (6 * D_MODEL + FEEDFORWARD)
        attention = 4 * 2 * HEADS * padded_length * padded_length
        return batch_size * (padded_length * per_token + attention)
