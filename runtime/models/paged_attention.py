"""Attention over a paged KV cache for a whole generation step, shared by every decoder.

A step's chunks (prompt pieces and single decode tokens of many sequences) run as one
packed row of tokens. ``StepPlan.of(chunks)`` orders them — single tokens first,
longest context first, then the longer chunks — and computes, once per step, each
token's position and cache slot (``block_table[p // block_size] * block_size + p %
block_size``) and the contexts attention reads: decode tokens in groups of similar
context length (each group padded only to its own longest context), each longer chunk
on its own with a causal mask. ``PagedKV.attend(layer, q, k, v, plan)`` writes the
step's keys and values into the pools and returns every token's attention output;
``plan.restore`` puts the logits rows (``plan.logit_rows``: each chunk's last token, or
its last ``num_logits`` tokens when proposed tokens ride on it) back in the caller's
chunk order.

Key/value heads may be fewer than query heads (grouped-query attention): the pools hold
the key/value heads and attention repeats them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn.functional as F

#: a group of decode tokens holds contexts down to this fraction of its longest one
GROUP_RATIO = 0.7

Context = tuple[torch.Tensor, torch.Tensor]  # block tables [S, nb], key mask


@dataclass(slots=True)
class StepPlan:
    """Where every token of one step goes and what it attends to."""

    ordered: list[Any]  # the chunks in packed order
    tokens: torch.Tensor  # [T] token ids
    positions: torch.Tensor  # [T]
    slots: torch.Tensor  # [T] cache slots
    n_decodes: int
    decode_groups: list[tuple[int, int, Context]]  # row ranges of single-token chunks
    long_contexts: list[Context]  # one per multi-token chunk, in order
    #: the token rows whose next-token logits the step returns: each ordered chunk's last
    #: ``num_logits`` rows (1 unless speculative tokens ride on the chunk)
    logit_rows: list[int]
    back: list[int]  # logit_rows indices in the caller's chunk order

    @classmethod
    def of(cls, chunks: Sequence[Any], block_size: int, device: Any) -> "StepPlan":
        decodes = sorted((c for c in chunks if len(c.token_ids) == 1),
                         key=lambda c: c.start_pos, reverse=True)
        longer = [c for c in chunks if len(c.token_ids) > 1]
        ordered = decodes + longer
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logit_rows: list[int] = []
        first_logit: dict[int, int] = {}
        for c in ordered:
            table = c.block_table
            for offset, tok in enumerate(c.token_ids):
                p = c.start_pos + offset
                tokens.append(tok)
                positions.append(p)
                slots.append(table[p // block_size] * block_size + p % block_size)
            first_logit[id(c)] = len(logit_rows)
            logit_rows.extend(range(len(tokens) - getattr(c, "num_logits", 1), len(tokens)))
        groups = [(start, stop, _decode_context(decodes[start:stop], block_size, device))
                  for start, stop in _length_groups(decodes)]
        back = [first_logit[id(c)] + j for c in chunks for j in range(getattr(c, "num_logits", 1))]
        return cls(ordered, torch.tensor(tokens, device=device),
                   torch.tensor(positions, device=device), torch.tensor(slots, device=device),
                   len(decodes), groups, [_chunk_context(c, block_size, device) for c in longer],
                   logit_rows, back)

    def restore(self, rows: torch.Tensor) -> torch.Tensor:
        """Logits rows in packed chunk order (one per ``logit_rows``) -> in the caller's
        chunk order, each chunk's rows together."""
        return rows[self.back]


class PagedKV:
    """Key and value pools [layers, blocks, block_size, kv_heads, head_dim] and attention over them."""

    def __init__(self, n_layers: int, num_blocks: int, block_size: int, n_heads: int,
                 n_kv_heads: int, head_dim: int, device: Any, dtype: torch.dtype = torch.float32,
                 scale: float | None = None) -> None:
        if n_heads % n_kv_heads:
            raise ValueError(f"{n_heads} query heads cannot share {n_kv_heads} key/value heads")
        self.block_size = block_size
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.device = torch.device(device)
        self.scale = scale
        shape = (n_layers, num_blocks, block_size, n_kv_heads, head_dim)
        # fill explicitly: lazily mapped zero pages make the first gathers several times slower
        self.k_pool = torch.empty(shape, device=self.device, dtype=dtype).fill_(0.0)
        self.v_pool = torch.empty(shape, device=self.device, dtype=dtype).fill_(0.0)
        self._buffers: list[torch.Tensor | None] = [None, None]

    def bytes_per_block(self) -> int:
        return 2 * self.k_pool.shape[0] * self.k_pool[0, 0].numel() * self.k_pool.element_size()

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               plan: StepPlan) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D] of the step's tokens -> attention output [T, H, D]."""
        k_pool, v_pool = self.k_pool[layer], self.v_pool[layer]
        k_pool.view(-1, self.n_kv_heads, self.head_dim)[plan.slots] = k.to(k_pool.dtype)
        v_pool.view(-1, self.n_kv_heads, self.head_dim)[plan.slots] = v.to(v_pool.dtype)
        out = torch.empty(q.shape, device=q.device, dtype=q.dtype)
        for start, stop, (blocks, mask) in plan.decode_groups:
            out[start:stop] = self._attend(q[start:stop].unsqueeze(1), k_pool, v_pool, blocks, mask)[:, 0]
        row = plan.n_decodes
        for (blocks, mask), c in zip(plan.long_contexts, plan.ordered[plan.n_decodes:]):
            n = len(c.token_ids)
            out[row:row + n] = self._attend(q[row:row + n].unsqueeze(0), k_pool, v_pool, blocks, mask)[0]
            row += n
        return out

    def _buffer(self, which: int, rows: int) -> torch.Tensor:
        buf = self._buffers[which]
        if buf is None or buf.shape[0] < rows:
            width = self.block_size * self.n_kv_heads * self.head_dim
            buf = torch.empty(max(rows, 2 * (0 if buf is None else buf.shape[0])), width,
                              device=self.device, dtype=self.k_pool.dtype)
            self._buffers[which] = buf
        return buf[:rows]

    def _attend(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                blocks: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """q [S, n, H, D] over the keys in ``blocks`` [S, nb] -> [S, n, H, D]."""
        s, nb = blocks.shape
        hk, hd = self.n_kv_heads, self.head_dim
        flat = blocks.flatten()
        # index_select over whole blocks copies contiguous rows (far cheaper than fancy
        # indexing) into reused buffers (fresh multi-megabyte buffers cost page faults)
        keys = torch.index_select(k_pool.view(k_pool.shape[0], -1), 0, flat,
                                  out=self._buffer(0, flat.numel()))
        values = torch.index_select(v_pool.view(v_pool.shape[0], -1), 0, flat,
                                    out=self._buffer(1, flat.numel()))
        keys = keys.view(s, nb * self.block_size, hk, hd).transpose(1, 2).to(q.dtype)
        values = values.view(s, nb * self.block_size, hk, hd).transpose(1, 2).to(q.dtype)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask,
                                             scale=self.scale, enable_gqa=hk != self.n_heads)
        return out.transpose(1, 2)


def _length_groups(decodes: list[Any]) -> list[tuple[int, int]]:
    """Row ranges of single-token chunks (sorted longest first) whose context lengths are
    within ``GROUP_RATIO`` of the group's longest."""
    groups: list[tuple[int, int]] = []
    start = 0
    for j in range(1, len(decodes) + 1):
        if j == len(decodes) or decodes[j].start_pos + 1 < GROUP_RATIO * (decodes[start].start_pos + 1):
            groups.append((start, j))
            start = j
    return groups


def _decode_context(decodes: list[Any], bs: int, device: Any) -> Context:
    """Padded block tables [S, nb] and a key mask [S, 1, 1, nb*bs] for single-token chunks."""
    lens = [c.start_pos + 1 for c in decodes]
    nb = max(-(-n // bs) for n in lens)
    tables = [c.block_table[:nb] + [0] * (nb - len(c.block_table[:nb])) for c in decodes]
    blocks = torch.tensor(tables, device=device)
    key_pos = torch.arange(nb * bs, device=device)
    mask = key_pos[None, :] < torch.tensor(lens, device=device)[:, None]
    return blocks, mask[:, None, None, :]


def _chunk_context(c: Any, bs: int, device: Any) -> Context:
    """Block table [1, nb] and a causal mask [1, 1, n, nb*bs] for a multi-token chunk."""
    n = len(c.token_ids)
    nb = -(-(c.start_pos + n) // bs)
    blocks = torch.tensor([c.block_table[:nb]], device=device)
    key_pos = torch.arange(nb * bs, device=device)
    query_pos = torch.arange(c.start_pos, c.start_pos + n, device=device)
    mask = key_pos[None, :] <= query_pos[:, None]
    return blocks, mask[None, None]
