"""A small decoder-only transformer with a paged KV cache, for continuous batching.

The weights are generated from a seed (nothing is downloaded), so the text it writes
means nothing; what matters is that it does the real work of a decoder: causal
attention over a per-sequence KV cache kept in fixed-size blocks of one shared pool,
with every scheduled chunk (prompt pieces and decode tokens of many sequences)
computed in one forward per step. The token-wise layers run on all tokens of the step
at once; attention runs once for all single-token (decode) chunks together and once
per longer chunk.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from runtime.generation.model import ByteTokenizer, GenerationModel
from runtime.generation.scheduler import ScheduledChunk


#: a group of decode tokens holds contexts down to this fraction of its longest one
GROUP_RATIO = 0.7


class TinyDecoder(GenerationModel):
    name = "decoder"

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
        self.k_pool: torch.Tensor | None = None
        self.v_pool: torch.Tensor | None = None
        self.block_size = 0
        self._gather_buffers: list[torch.Tensor | None] = [None, None]

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
        shape = (self.n_layers, num_blocks, block_size, self.n_heads, self.head_dim)
        # fill explicitly: lazily mapped zero pages make the first gathers several times slower
        self.k_pool = torch.empty(shape, device=self.device).fill_(0.0)
        self.v_pool = torch.empty(shape, device=self.device).fill_(0.0)

    def kv_bytes_per_block(self) -> int | None:
        return 2 * self.n_layers * self.block_size * self.d_model * 4

    # -- the step ---------------------------------------------------------------------
    @torch.inference_mode()
    def step(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        if self.k_pool is None:
            raise RuntimeError("call setup(device, num_blocks, block_size) before step()")
        bs, dev = self.block_size, self.device
        # single tokens first, longest context first, so that each group of similar
        # context lengths is a contiguous range of rows
        decodes = sorted((c for c in chunks if len(c.token_ids) == 1),
                         key=lambda c: c.start_pos, reverse=True)
        longer = [c for c in chunks if len(c.token_ids) > 1]
        ordered = decodes + longer

        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        for c in ordered:
            table = c.block_table
            for offset, tok in enumerate(c.token_ids):
                p = c.start_pos + offset
                tokens.append(tok)
                positions.append(p)
                slots.append(table[p // bs] * bs + p % bs)
        tok_t = torch.tensor(tokens, device=dev)
        pos_t = torch.tensor(positions, device=dev)
        slot_t = torch.tensor(slots, device=dev)

        dec_groups = [(start, stop, self._decode_context(decodes[start:stop]))
                      for start, stop in self._length_groups(decodes)]
        long_ctx = [self._chunk_context(c) for c in longer]

        w = self.weights
        x = w["embed"][tok_t] + w["pos"][pos_t]
        n_tok, h, hd = x.shape[0], self.n_heads, self.head_dim
        for i in range(self.n_layers):
            qkv = (F.layer_norm(x, (self.d_model,)) @ w[f"{i}.qkv"]).view(n_tok, 3, h, hd)
            q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
            k_flat = self.k_pool[i].view(-1, h, hd)
            v_flat = self.v_pool[i].view(-1, h, hd)
            k_flat[slot_t] = k
            v_flat[slot_t] = v
            attn = torch.empty(n_tok, h, hd, device=dev)
            for start, stop, (blocks, mask) in dec_groups:
                attn[start:stop] = self._attend(q[start:stop].unsqueeze(1), self.k_pool[i],
                                                self.v_pool[i], blocks, mask)[:, 0]
            row = len(decodes)
            for c, (blocks, mask) in zip(longer, long_ctx):
                n = len(c.token_ids)
                attn[row:row + n] = self._attend(q[row:row + n].unsqueeze(0), self.k_pool[i],
                                                 self.v_pool[i], blocks, mask)[0]
                row += n
            x = x + attn.reshape(n_tok, self.d_model) @ w[f"{i}.out"]
            x = x + F.gelu(F.layer_norm(x, (self.d_model,)) @ w[f"{i}.up"]) @ w[f"{i}.down"]

        last_rows, row = [], 0
        for c in ordered:
            row += len(c.token_ids)
            last_rows.append(row - 1)
        final = F.layer_norm(x[last_rows], (self.d_model,))
        logits_ordered = final @ w["head"]
        # back to the caller's chunk order
        index = {id(c): j for j, c in enumerate(ordered)}
        return logits_ordered[[index[id(c)] for c in chunks]]

    def _length_groups(self, decodes: list[ScheduledChunk]) -> list[tuple[int, int]]:
        """Row ranges of single-token chunks (sorted longest first) whose context lengths
        are within ``GROUP_RATIO`` of the group's longest: attention pads each group only
        to its own longest context instead of the step's."""
        groups: list[tuple[int, int]] = []
        start = 0
        for j in range(1, len(decodes) + 1):
            if j == len(decodes) or decodes[j].start_pos + 1 < GROUP_RATIO * (decodes[start].start_pos + 1):
                groups.append((start, j))
                start = j
        return groups

    def _decode_context(self, decodes: list[ScheduledChunk]) -> tuple[torch.Tensor, torch.Tensor]:
        """Padded block tables [S, nb] and a key mask [S, 1, 1, nb*bs] for single-token chunks."""
        bs = self.block_size
        lens = [c.start_pos + 1 for c in decodes]
        nb = max(-(-n // bs) for n in lens)
        tables = [c.block_table[:nb] + [0] * (nb - len(c.block_table[:nb])) for c in decodes]
        blocks = torch.tensor(tables, device=self.device)
        key_pos = torch.arange(nb * bs, device=self.device)
        mask = key_pos[None, :] < torch.tensor(lens, device=self.device)[:, None]
        return blocks, mask[:, None, None, :]

    def _chunk_context(self, c: ScheduledChunk) -> tuple[torch.Tensor, torch.Tensor]:
        """Block table [1, nb] and a causal mask [1, 1, n, nb*bs] for a multi-token chunk."""
        bs = self.block_size
        n = len(c.token_ids)
        nb = -(-(c.start_pos + n) // bs)
        blocks = torch.tensor([c.block_table[:nb]], device=self.device)
        key_pos = torch.arange(nb * bs, device=self.device)
        query_pos = torch.arange(c.start_pos, c.start_pos + n, device=self.device)
        mask = key_pos[None, :] <= query_pos[:, None]
        return blocks, mask[None, None]

    def _gather_buffer(self, which: int, rows: int) -> torch.Tensor:
        buf = self._gather_buffers[which]
        if buf is None or buf.shape[0] < rows:
            width = self.block_size * self.d_model
            buf = torch.empty(max(rows, 2 * (0 if buf is None else buf.shape[0])), width,
                              device=self.device)
            self._gather_buffers[which] = buf
        return buf[:rows]

    def _attend(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                blocks: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """q [S, n, H, D] over the keys in ``blocks`` [S, nb] -> [S, n, H, D]."""
        s, nb = blocks.shape
        h, hd = self.n_heads, self.head_dim
        flat = blocks.flatten()
        # index_select over whole blocks copies contiguous rows (far cheaper than fancy
        # indexing) into reused buffers (fresh multi-megabyte buffers cost page faults)
        keys = torch.index_select(k_pool.view(k_pool.shape[0], -1), 0, flat,
                                  out=self._gather_buffer(0, flat.numel()))
        values = torch.index_select(v_pool.view(v_pool.shape[0], -1), 0, flat,
                                    out=self._gather_buffer(1, flat.numel()))
        keys = keys.view(s, nb * self.block_size, h, hd).transpose(1, 2)
        values = values.view(s, nb * self.block_size, h, hd).transpose(1, 2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask)
        return out.transpose(1, 2)

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
