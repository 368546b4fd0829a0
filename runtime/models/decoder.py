"""A small decoder-only transformer with a paged KV cache, for continuous batching.

The weights are generated from a seed (nothing is downloaded), so the text it writes
means nothing; what matters is that it does the real work of a decoder: causal
attention over a per-sequence KV cache kept in fixed-size blocks of one shared pool,
with every scheduled chunk (prompt pieces and decode tokens of many sequences)
computed in one forward per step. The token-wise layers run on all tokens of the step
at once; attention (``runtime.models.paged_attention``) runs once per group of decode
tokens of similar context length and once per longer chunk.

LoRA adapters may target the four linear layers of every block (``adapter_targets``:
``layers.<i>.qkv``, the fused query/key/value projection, ``layers.<i>.out``,
``layers.<i>.up`` and ``layers.<i>.down``; PEFT's ``target_modules=["qkv", "out", "up",
"down"]``, or any of them). Each token row of a step takes the adapter of its chunk's
sequence (``ScheduledChunk.adapter_slot``): the base product runs once for all the
step's tokens and ``AdapterBank.add`` adds each row's term, the tokens grouped by slot.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from typing import Any

import torch
import torch.nn.functional as F

from runtime.adapters.lora import AdapterBank
from runtime.generation.model import ByteTokenizer, GenerationModel
from runtime.generation.scheduler import ScheduledChunk
from runtime.models.paged_attention import PagedKV, StepPlan


#: the linear layers of a block adapters may target, and their weights' (in, out) sizes
#: in units of ``d_model``
_TARGETS = {"qkv": (1, 3), "out": (1, 1), "up": (1, 4), "down": (4, 1)}


class TinyDecoder(GenerationModel):
    name = "decoder"
    supports_num_logits = True
    #: the highest LoRA rank an adapter may have
    max_adapter_rank = 64

    def __init__(self, *, vocab_size: int = 512, d_model: int = 128, n_heads: int = 4,
                 n_layers: int = 3, max_model_len: int = 1024, seed: int = 0) -> None:
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} must be a multiple of n_heads={n_heads}")
        self.tokenizer = ByteTokenizer()
        if vocab_size <= self.tokenizer.eos_token_id:
            raise ValueError(f"vocab_size={vocab_size} must exceed the end token id "
                             f"{self.tokenizer.eos_token_id}")
        self.vocab_size = vocab_size
        self.d_model = d_model
        self.n_heads = n_heads
        self.head_dim = d_model // n_heads
        self.n_layers = n_layers
        self.max_model_len = max_model_len
        self.seed = seed
        self.weights: dict[str, torch.Tensor] = {}
        self.kv: PagedKV | None = None
        self.block_size = 0
        #: module name -> (in_features, out_features) of the layers adapters may target
        self.adapter_targets: dict[str, tuple[int, int]] = {
            f"layers.{i}.{part}": (d_model * a, d_model * b)
            for i in range(n_layers) for part, (a, b) in _TARGETS.items()}
        #: the adapters resident on the device (made in ``setup``)
        self.adapter_bank: AdapterBank | None = None

    # -- weights and cache ------------------------------------------------------------
    def _generate_weights(self) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(self.seed)
        d = self.d_model

        def rand(*shape: int, std: float) -> torch.Tensor:
            return torch.randn(*shape, generator=gen) * std

        w = {"embed": rand(self.vocab_size, d, std=1.0),
             "pos": rand(self.max_model_len, d, std=0.5),
             "head": rand(d, self.vocab_size, std=1.0 / math.sqrt(d))}
        for i in range(self.n_layers):
            w[f"{i}.qkv"] = rand(d, 3 * d, std=1.0 / math.sqrt(d))
            w[f"{i}.out"] = rand(d, d, std=1.0 / math.sqrt(d) / math.sqrt(2 * self.n_layers))
            w[f"{i}.up"] = rand(d, 4 * d, std=1.0 / math.sqrt(d))
            w[f"{i}.down"] = rand(4 * d, d, std=1.0 / math.sqrt(4 * d) / math.sqrt(2 * self.n_layers))
        return w

    def setup(self, device: Any, num_blocks: int, block_size: int) -> None:
        self.device = torch.device(device)
        self.weights = {k: v.to(self.device) for k, v in self._generate_weights().items()}
        self.block_size = block_size
        self.kv = PagedKV(self.n_layers, num_blocks, block_size, self.n_heads, self.n_heads,
                          self.head_dim, self.device)
        if self.adapter_targets:
            self.adapter_bank = AdapterBank(self.adapter_targets, self.device,
                                            max_rank=self.max_adapter_rank)

    def kv_bytes_per_block(self) -> int | None:
        return 2 * self.n_layers * self.block_size * self.d_model * 4

    # -- the step ---------------------------------------------------------------------
    @torch.inference_mode()
    def step(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        if self.kv is None:
            raise RuntimeError("call setup(device, num_blocks, block_size) before step()")
        plan = StepPlan.of(chunks, self.block_size, self.device)
        bank = self.adapter_bank
        rows = None
        if bank is not None and any(getattr(c, "adapter_slot", -1) >= 0 for c in chunks):
            # every token row takes its chunk's adapter, in the plan's packed order
            rows = [c.adapter_slot for c in plan.ordered for _ in c.token_ids]
        with bank.activate(rows) if rows is not None else nullcontext():
            w = self.weights
            x = w["embed"][plan.tokens] + w["pos"][plan.positions]
            n_tok, h, hd = x.shape[0], self.n_heads, self.head_dim
            lin = self._linear
            for i in range(self.n_layers):
                qkv = lin(i, "qkv", F.layer_norm(x, (self.d_model,))).view(n_tok, 3, h, hd)
                attn = self.kv.attend(i, qkv[:, 0], qkv[:, 1], qkv[:, 2], plan)
                x = x + lin(i, "out", attn.reshape(n_tok, self.d_model))
                x = x + lin(i, "down", F.gelu(lin(i, "up", F.layer_norm(x, (self.d_model,)))))
            final = F.layer_norm(x[plan.logit_rows], (self.d_model,))
            return plan.restore(final @ w["head"])

    def _linear(self, layer: int, part: str, x: torch.Tensor) -> torch.Tensor:
        """``x @ W`` of one block's linear layer, plus each row's adapter term while a
        step with adapters runs."""
        y = x @ self.weights[f"{layer}.{part}"]
        bank = self.adapter_bank
        if bank is not None and bank.active:
            return bank.add(f"layers.{layer}.{part}", x, y)
        return y

    # -- a cache-free reference ----------------------------------------------------------
    @torch.inference_mode()
    def forward_full(self, token_ids: list[int]) -> torch.Tensor:
        """Logits [n, vocab] for every position of one sequence, recomputed without a cache."""
        if not self.weights:
            self.weights = {k: v.to(self.device or "cpu") for k, v in self._generate_weights().items()}
        w, n = self.weights, len(token_ids)
        dev = w["embed"].device
        h, hd = self.n_heads, self.head_dim
        x = w["embed"][torch.tensor(token_ids, device=dev)] + w["pos"][:n]
        for i in range(self.n_layers):
            qkv = (F.layer_norm(x, (self.d_model,)) @ w[f"{i}.qkv"]).view(n, 3, h, hd)
            q, k, v = (qkv[:, j].transpose(0, 1) for j in range(3))
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1)
            x = x + attn.reshape(n, self.d_model) @ w[f"{i}.out"]
            x = x + F.gelu(F.layer_norm(x, (self.d_model,)) @ w[f"{i}.up"]) @ w[f"{i}.down"]
        return F.layer_norm(x, (self.d_model,)) @ w["head"]
