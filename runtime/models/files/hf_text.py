"""``hf:PATH``: a Hugging Face model directory served for embeddings or classification.

The directory holds what ``save_pretrained`` writes (``config.json``, the weights in
``model.safetensors`` or ``pytorch_model.bin``) and a tokenizer (``tokenizer.json``, or
the files a slow tokenizer needs). Nothing is downloaded: every load is
``local_files_only``.

* ``task=embeddings`` (the default unless ``config.json`` names a
  ``...ForSequenceClassification``/``...ForCausalLM`` architecture): TEXT BYTES [1] ->
  tokens -> the encoder -> pooling -> EMBEDDING FP32 [hidden]. The pooling and the
  normalisation are read from a sentence-transformers layout when the directory has one
  (``modules.json``: a ``Pooling`` module's ``config.json`` says cls, mean, max or
  last-token, a ``Normalize`` module turns L2 normalisation on;
  ``sentence_bert_config.json`` gives ``max_seq_length``); a plain directory gets mean
  pooling over the real tokens and L2 normalisation, as sentence-transformers does. Served
  at ``/v1/embeddings`` too.
* ``task=classification``: TEXT -> LOGITS FP32 [num_labels] and LABEL BYTES [1] (the
  arg-max label from ``config.id2label``).

Token ids are taken instead of a text on the INPUT_IDS input (INT64 [-1]) and as a list
of integers on ``/v1/embeddings``; they should carry the tokenizer's special tokens.
A text longer than the model's limit (``max_length`` option, else the smallest of the
tokenizer's ``model_max_length``, ``max_seq_length`` and the position embeddings) is cut
as the tokenizer cuts it, and counted (``truncated_inputs``); with ``truncate=false`` it
is refused with 413 instead. Lengths are token counts, so length bucketing works on them.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from runtime.api.errors import ClientError, ConfigError, RequestTooLarge, ValidationError
from runtime.api.model import ModelAPI, TensorSpec
from runtime.models import inference
from runtime.models.files.spec import FileSpec

TEXT = "TEXT"
INPUT_IDS = "INPUT_IDS"
INSTALL_HINT = "pip install 'batchscope[minilm]' (transformers and tokenizers)"
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
#: a directory without any of these has no tokenizer (transformers would make an empty one)
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "vocab.json", "tokenizer.model", "spiece.model",
                   "sentencepiece.bpe.model")
POOLING_MODES = ("cls", "mean", "max", "lasttoken")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def transformers_module() -> Any:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import transformers
        from transformers.utils import logging as hf_logging
    except ImportError:
        raise ConfigError(f"hf: models need the package transformers: {INSTALL_HINT}") from None
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    return transformers


#: transformers builds a model under process-wide state (the meta device it creates the
#: parameters on, the default dtype), so two models loaded at once from two threads, as a
#: server's engines start theirs, can leave one with parameters on the meta device
#: ("Cannot copy out of meta tensor"); every load takes this lock
_LOADING = threading.Lock()


def load_pretrained(cls: Any, path: Path, **options: Any) -> Any:
    """``cls.from_pretrained(path, local_files_only=True, **options)``, one load at a time
    in this process."""
    with _LOADING:
        return cls.from_pretrained(str(path), local_files_only=True, **options)


def read_config(path: Path) -> Any:
    """The directory's ``config.json`` as a transformers config, or a ConfigError."""
    transformers = transformers_module()
    if not path.is_dir():
        raise ConfigError(f"hf:{path}: not a directory; give the folder save_pretrained() wrote")
    if not (path / "config.json").is_file():
        raise ConfigError(f"hf:{path}: no config.json; save the model with "
                          "model.save_pretrained(path)")
    if not any((path / f).is_file() for f in WEIGHT_FILES):
        raise ConfigError(f"hf:{path}: no weights ({' or '.join(WEIGHT_FILES[::2])}); save them "
                          "with model.save_pretrained(path)")
    try:
        return transformers.AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (ValueError, KeyError, OSError) as exc:
        raise ConfigError(f"hf:{path}: config.json is not a model transformers "
                          f"{transformers.__version__} knows: {_first_line(exc)}") from None


def read_tokenizer(path: Path) -> Any:
    """The directory's fast tokenizer (a ``tokenizers.Tokenizer``), or a ConfigError."""
    transformers = transformers_module()
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        raise ConfigError(f"hf:{path}: no usable tokenizer (none of {', '.join(TOKENIZER_FILES)}); "
                          "save one beside the model with tokenizer.save_pretrained(path)")
    try:
        tok = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (ValueError, OSError, TypeError, KeyError) as exc:
        raise ConfigError(f"hf:{path}: no usable tokenizer ({_first_line(exc)}); save one beside "
                          "the model with tokenizer.save_pretrained(path)") from None
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None or isinstance(tok, bool):
        raise ConfigError(f"hf:{path}: the tokenizer has no fast (Rust) form; save it with "
                          "tokenizer.save_pretrained(path) from a fast tokenizer")
    return tok


def check_architecture(path: Path, config: Any, task: str) -> None:
    """ConfigError unless transformers has a model class for ``config`` and ``task``."""
    from transformers.models.auto import modeling_auto as auto

    table = {"embeddings": auto.MODEL_MAPPING_NAMES,
             "classification": auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
             "generation": auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES}[task]
    if config.model_type not in table:
        raise ConfigError(f"hf:{path}: architecture {config.model_type!r} has no {task} model in "
                          f"transformers; pick another task= or a supported architecture")


def infer_task(config: Any) -> str:
    names = " ".join(getattr(config, "architectures", None) or ())
    if "ForSequenceClassification" in names:
        return "classification"
    if "ForCausalLM" in names or "LMHeadModel" in names:
        return "generation"
    return "embeddings"


@dataclass(frozen=True, slots=True)
class Pooling:
    mode: str = "mean"
    normalize: bool = True
    max_seq_length: int | None = None

    @classmethod
    def read(cls, path: Path) -> "Pooling":
        """From a sentence-transformers layout; mean + normalize without one."""
        modules_file = path / "modules.json"
        max_len = None
        st_config = path / "sentence_bert_config.json"
        if st_config.is_file():
            max_len = _json(st_config).get("max_seq_length")
        if not modules_file.is_file():
            return cls("mean", True, max_len)
        modules = _json(modules_file)
        types = {str(m.get("type", "")).rsplit(".", 1)[-1]: m for m in modules}
        mode = "mean"
        if "Pooling" in types:
            conf = _json(path / types["Pooling"].get("path", "") / "config.json")
            picked = [m for m in POOLING_MODES if conf.get(f"pooling_mode_{m}_token")
                      or conf.get(f"pooling_mode_{m}_tokens") or conf.get(f"pooling_mode_{m}")]
            if len(picked) > 1 or conf.get("pooling_mode_mean_sqrt_len_tokens"):
                raise ConfigError(f"hf:{path}: pooling {conf} combines modes; one of "
                                  f"{', '.join(POOLING_MODES)} is supported")
            mode = picked[0] if picked else "mean"
        return cls(mode, "Normalize" in types, max_len)

    def apply(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """hidden [n, L, d], mask [n, L] (1 = real token) -> [n, d]."""
        if self.mode == "cls":
            pooled = hidden[:, 0]
        elif self.mode == "lasttoken":
            last = mask.sum(dim=1).clamp(min=1) - 1
            pooled = hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
        else:
            keep = mask.unsqueeze(-1).to(hidden.dtype)
            if self.mode == "max":
                pooled = hidden.masked_fill(keep == 0, torch.finfo(hidden.dtype).min).amax(dim=1)
            else:
                pooled = (hidden * keep).sum(dim=1) / keep.sum(dim=1).clamp(min=1e-9)
        pooled = pooled.float()
        return torch.nn.functional.normalize(pooled, p=2, dim=1) if self.normalize else pooled


@dataclass(slots=True)
class TokenBatch:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor


class HFTextModel(ModelAPI):
    """A Hugging Face encoder directory: embeddings or sequence classification."""

    variable_length = True

    def __init__(self, spec: FileSpec, task: str | None = None) -> None:
        self.spec = spec
        path = spec.path
        self.config = read_config(path)
        self.task = task or str(spec.option("task") or infer_task(self.config))
        if self.task == "generation":
            raise ConfigError("hf: task=generation is served by HFCausalLM, not HFTextModel")
        check_architecture(path, self.config, self.task)
        tok = read_tokenizer(path)
        self.pooling = Pooling.read(path)
        limits = [n for n in (spec.option("max_length"), self.pooling.max_seq_length,
                              getattr(self.config, "max_position_embeddings", None),
                              _sane(getattr(tok, "model_max_length", None))) if n]
        self.max_length = int(min(limits)) if limits else 512
        self.truncate = bool(spec.option("truncate", True))
        self.tokenizer = tok.backend_tokenizer
        self.tokenizer.no_padding()
        self.tokenizer.enable_truncation(max_length=self.max_length)
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
        self.vocab_size = len(tok)
        self.uses_token_types = "token_type_ids" in (tok.model_input_names or ())
        self.truncated_inputs = 0
        self.name = spec.default_name()
        self.inputs = (TensorSpec(TEXT, "BYTES", (1,), optional=True),
                       TensorSpec(INPUT_IDS, "INT64", (-1,), optional=True))
        if self.task == "embeddings":
            dim = int(getattr(self.config, "hidden_size", 0) or getattr(self.config, "dim", 0))
            self.outputs = (TensorSpec("EMBEDDING", "FP32", (dim,)),)
            self.embedding_output = "EMBEDDING"
        else:
            labels = getattr(self.config, "id2label", None) or {}
            self.labels = [str(labels.get(i, f"LABEL_{i}")) for i in range(self.config.num_labels)]
            self.outputs = (TensorSpec("LOGITS", "FP32", (self.config.num_labels,)),
                            TensorSpec("LABEL", "BYTES", (1,)))
            self.embedding_output = None
        self.dtype = DTYPES[str(spec.option("dtype", "float32"))]
        self.net: Any = None

    # -- loading ----------------------------------------------------------------------
    def setup(self, device: Any) -> None:
        transformers = transformers_module()
        self.device = torch.device(device)
        cls = transformers.AutoModel if self.task == "embeddings" \
            else transformers.AutoModelForSequenceClassification
        try:
            net = load_pretrained(cls, self.spec.path, dtype=self.dtype)
        except (OSError, ValueError, RuntimeError) as exc:
            raise ConfigError(f"hf:{self.spec.path}: loading the weights failed: "
                              f"{_first_line(exc)}") from None
        self.net = net.eval().to(self.device)

    # -- requests -----------------------------------------------------------------------
    def encode_text(self, text: str) -> list[int]:
        enc = self.tokenizer.encode(text)
        if enc.overflowing:
            if not self.truncate:
                raise RequestTooLarge(
                    f"the text has more than {self.max_length} tokens, the most model "
                    f"{self.name!r} reads; send a shorter text (it is served with truncate=false)")
            self.truncated_inputs += 1
        return enc.ids

    def embedding_inputs(self, value: str | list[int]) -> tuple[dict[str, np.ndarray], int]:
        ids = self.encode_text(value) if isinstance(value, str) else value
        return {INPUT_IDS: np.asarray(ids, dtype=np.int64)}, len(ids)

    def decode(self, inputs: dict[str, np.ndarray]) -> torch.Tensor:
        if INPUT_IDS in inputs:
            return self._token_ids(inputs[INPUT_IDS])
        if TEXT not in inputs:
            raise ClientError(f"missing input {TEXT!r}: model {self.name!r} takes {TEXT!r} (BYTES "
                              f"[1], one UTF-8 string) or {INPUT_IDS!r} (INT64 [-1] token ids); "
                              f"got {sorted(inputs)}")
        arr = inputs[TEXT].reshape(-1)
        if arr.shape[0] != 1:
            raise ClientError(f"input {TEXT!r} has {arr.shape[0]} strings; send one string per "
                              "request (shape [1], or [k, 1] for a batch of k)")
        value = arr[0]
        if isinstance(value, (bytes, bytearray, np.bytes_)):
            try:
                value = bytes(value).decode("utf-8")
            except UnicodeDecodeError:
                raise ClientError(f"input {TEXT!r} is not valid UTF-8") from None
        elif not isinstance(value, str):
            raise ClientError(f"input {TEXT!r} must hold a string, got {type(value).__name__}")
        return torch.tensor(self.encode_text(value), dtype=torch.int64)

    def _token_ids(self, ids: np.ndarray) -> torch.Tensor:
        ids = np.asarray(ids)
        if ids.ndim == 2 and ids.shape[0] == 1:
            ids = ids[0]
        if ids.ndim != 1 or ids.dtype.kind not in "iu":
            raise ClientError(f"input {INPUT_IDS!r} must be INT64 [-1] token ids")
        if not 1 <= ids.shape[0] <= self.max_length:
            if ids.shape[0] > self.max_length and not self.truncate:
                raise RequestTooLarge(f"{ids.shape[0]} token ids are more than the "
                                      f"{self.max_length} model {self.name!r} reads")
            if ids.shape[0] == 0:
                raise ValidationError(f"input {INPUT_IDS!r} is empty; send 1 to "
                                      f"{self.max_length} token ids")
            self.truncated_inputs += 1
            ids = ids[: self.max_length]
        if int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size:
            raise ValidationError(f"token ids must be in [0, {self.vocab_size})")
        return torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64))

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
            ids, mask = ids.to(self.device, non_blocking=True), mask.to(self.device, non_blocking=True)
        return TokenBatch(ids, mask)

    def predict(self, batch: TokenBatch) -> torch.Tensor:
        kwargs: dict[str, torch.Tensor] = {"input_ids": batch.input_ids,
                                           "attention_mask": batch.attention_mask}
        if self.uses_token_types:
            kwargs["token_type_ids"] = torch.zeros_like(batch.input_ids)
        with inference():
            out = self.net(**kwargs)
            if self.task == "embeddings":
                return self.pooling.apply(out.last_hidden_state, batch.attention_mask)
            return out.logits.float()

    def split(self, output: torch.Tensor, n: int) -> list[dict[str, np.ndarray]]:
        out = output.cpu().numpy()
        if self.task == "embeddings":
            return [{"EMBEDDING": out[i]} for i in range(n)]
        best = out.argmax(axis=1)
        return [{"LOGITS": out[i], "LABEL": np.array([self.labels[best[i]].encode()], dtype=object)}
                for i in range(n)]

    def estimate_batch_bytes(self, batch_size: int, padded_length: int) -> int | None:
        d = int(getattr(self.config, "hidden_size", 0) or 0)
        heads = int(getattr(self.config, "num_attention_heads", 0) or 0)
        inner = int(getattr(self.config, "intermediate_size", 0) or 4 * d)
        if not d or not heads:
            return None
        width = torch.finfo(self.dtype).bits // 8
        per_token = width * (6 * d + inner)
        attention = width * 2 * heads * padded_length * padded_length
        return batch_size * (padded_length * per_token + attention)

    def metadata(self) -> dict[str, Any]:
        meta = super().metadata()
        meta["platform"] = "huggingface_transformers"
        meta["source"] = {**self.spec.describe(), "task": self.task,
                          "architecture": self.config.model_type, "max_length": self.max_length}
        if self.task == "embeddings":
            meta["source"]["pooling"] = self.pooling.mode
            meta["source"]["normalize"] = self.pooling.normalize
        return meta


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"hf: cannot read {path}: {_first_line(exc)}") from None


def _sane(n: Any) -> int | None:
    """A tokenizer's ``model_max_length`` unless it is transformers' 'no limit' sentinel."""
    return int(n) if isinstance(n, int) and 0 < n < 1_000_000 else None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
