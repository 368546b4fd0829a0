"""``hf:DIR,task=generation``: a Hugging Face causal LM served with continuous batching.

The model's own ``forward`` runs every step, with its attention swapped for the
runtime's paged attention (``runtime.models.paged_attention``): the step's chunks run as
one packed row of tokens with their real positions (``position_ids``), and each
attention layer writes its keys and values to the paged pools and reads its context
from them. Transformers lets a model's attention be replaced by name
(``AttentionInterface``); the extra argument ``batchscope_plan`` reaches every
attention call through the model's ``**kwargs``. So any architecture whose attention
goes through that interface (Llama, Mistral, Qwen2, GPT-2, Phi...) is served without
code of its own, rotary and learned positions alike; sliding-window attention and
logit soft-capping are not, and such a directory is refused at start.

The tokenizer is the directory's; text streams out through ``HFIncrementalDecoder``,
which holds back a token until the characters it completes are whole. The chat
template is the tokenizer's (``apply_chat_template``) when it has one.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from runtime.api.errors import ConfigError
from runtime.generation.model import GenerationModel
from runtime.models.files.hf_text import (DTYPES, check_architecture, load_pretrained,
                                          read_config, read_tokenizer, transformers_module)
from runtime.models.files.spec import FileSpec
from runtime.models.paged_attention import PagedKV, StepPlan

ATTENTION = "batchscope_paged"


def _paged_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: Any, *, batchscope_plan: Any = None, **_: Any) -> tuple:
    """Transformers' attention signature: q [1, H, T, D], k/v [1, Hkv, T, D] -> [1, T, H, D]."""
    if batchscope_plan is None:
        raise RuntimeError("a model set up for paged attention was called outside a step")
    model, plan = batchscope_plan
    out = model.kv.attend(model.layer_index[id(module)], query[0].transpose(0, 1),
                          key[0].transpose(0, 1), value[0].transpose(0, 1), plan)
    return out.unsqueeze(0), None


def _no_mask(*_: Any, **__: Any) -> None:
    return None


def register_attention() -> None:
    transformers = transformers_module()
    from transformers.masking_utils import AttentionMaskInterface

    transformers.AttentionInterface.register(ATTENTION, _paged_attention)
    AttentionMaskInterface.register(ATTENTION, _no_mask)


class HFIncrementalDecoder:
    """Token ids -> text deltas, re-decoding a short window so multi-token characters and
    word-piece spacing come out as the whole decode would write them."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # ids before this are settled
        self._read = 0  # text up to this id has been emitted

    def feed(self, token_id: int) -> str:
        self._ids.append(token_id)
        before = self._tok.decode(self._ids[self._prefix:self._read], skip_special_tokens=True)
        text = self._tok.decode(self._ids[self._prefix:], skip_special_tokens=True)
        if len(text) <= len(before) or text.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(before):]

    def flush(self) -> str:
        before = self._tok.decode(self._ids[self._prefix:self._read], skip_special_tokens=True)
        text = self._tok.decode(self._ids[self._prefix:], skip_special_tokens=True)
        self._prefix = self._read = len(self._ids)
        return text[len(before):]


class HFTokenizer:
    """The ``Tokenizer`` protocol of the generation engine over a transformers tokenizer."""

    def __init__(self, tokenizer: Any, eos_token_id: int | None) -> None:
        self._tok = tokenizer
        self.eos_token_id = eos_token_id

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text))

    def decoder(self) -> HFIncrementalDecoder:
        return HFIncrementalDecoder(self._tok)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=True)


class HFChatTemplate:
    """The tokenizer's own chat template as the engine's ``ChatTemplate``."""

    name = "tokenizer"

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer

    def render(self, messages: list[Any]) -> str:
        return self._tok.apply_chat_template([{"role": m.role, "content": m.content} for m in messages],
                                             tokenize=False, add_generation_prompt=True)


class HFCausalLM(GenerationModel):
    supports_num_logits = True

    def __init__(self, spec: FileSpec) -> None:
        self.spec = spec
        where = f"hf:{spec.path}"
        self.config = config = read_config(spec.path)
        check_architecture(spec.path, config, "generation")
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        for attr in ("sliding_window", "attn_logit_softcapping"):
            if getattr(text, attr, None):
                raise ConfigError(f"{where}: {attr}={getattr(text, attr)} is not supported by the "
                                  "paged attention; serve a model without it")
        tok = read_tokenizer(spec.path)
        eos = tok.eos_token_id if tok.eos_token_id is not None else getattr(config, "eos_token_id", None)
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        self.tokenizer = HFTokenizer(tok, eos)
        self.chat_template = HFChatTemplate(tok) if getattr(tok, "chat_template", None) else None
        self.name = spec.default_name()
        self.vocab_size = int(text.vocab_size)
        self.max_model_len = int(spec.option("max_length") or getattr(text, "max_position_embeddings", 0)
                                 or getattr(text, "n_positions", 0) or 2048)
        self.n_layers = int(text.num_hidden_layers)
        self.n_heads = int(text.num_attention_heads)
        self.n_kv_heads = int(getattr(text, "num_key_value_heads", None) or self.n_heads)
        self.head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // self.n_heads)
        self.dtype = DTYPES[str(spec.option("dtype", "float32"))]
        self.net: Any = None
        self.kv: PagedKV | None = None
        self.block_size = 0
        self.layer_index: dict[int, int] = {}

    def setup(self, device: Any, num_blocks: int, block_size: int) -> None:
        transformers = transformers_module()
        register_attention()
        self.device = torch.device(device)
        try:
            net = load_pretrained(transformers.AutoModelForCausalLM, self.spec.path,
                                  dtype=self.dtype, attn_implementation=ATTENTION)
        except (OSError, ValueError, RuntimeError) as exc:
            raise ConfigError(f"hf:{self.spec.path}: loading the weights failed: "
                              f"{str(exc).strip().splitlines()[0]}") from None
        self.net = net.eval().to(self.device)
        attention = [m for m in self.net.modules() if hasattr(m, "layer_idx") and
                     type(m).__name__.endswith("Attention")]
        if len(attention) != self.n_layers:
            raise ConfigError(f"hf:{self.spec.path}: found {len(attention)} attention layers for "
                              f"{self.n_layers} hidden layers; this architecture is not supported")
        self.layer_index = {id(m): int(m.layer_idx) for m in attention}
        self.block_size = block_size
        self.kv = PagedKV(self.n_layers, num_blocks, block_size, self.n_heads, self.n_kv_heads,
                          self.head_dim, self.device, self.dtype,
                          scale=getattr(attention[0], "scaling", None))

    def kv_bytes_per_block(self) -> int | None:
        return self.kv.bytes_per_block() if self.kv is not None else None

    @torch.inference_mode()
    def step(self, chunks: list[Any]) -> torch.Tensor:
        if self.kv is None:
            raise RuntimeError("call setup(device, num_blocks, block_size) before step()")
        plan = StepPlan.of(chunks, self.block_size, self.device)
        out = self.net(input_ids=plan.tokens[None], position_ids=plan.positions[None],
                       use_cache=False, batchscope_plan=(self, plan),
                       logits_to_keep=torch.tensor(plan.logit_rows, device=self.device))
        return plan.restore(out.logits[0].float())

    @torch.inference_mode()
    def forward_full(self, token_ids: list[int]) -> torch.Tensor:
        """Logits [n, vocab] for every position of one sequence, from the model's own
        attention (no paged cache): the reference the paged steps are checked against."""
        transformers = transformers_module()
        ref = load_pretrained(transformers.AutoModelForCausalLM, self.spec.path,
                              dtype=self.dtype, attn_implementation="eager").eval()
        return ref(input_ids=torch.tensor([token_ids])).logits[0].float()

    def metadata(self) -> dict[str, Any]:
        meta = super().metadata()
        meta["platform"] = "huggingface_transformers"
        meta["source"] = {**self.spec.describe(), "task": "generation",
                          "architecture": self.config.model_type,
                          "attention": "paged (batchscope)"}
        return meta
