"""The bundled draft model for speculative decoding, and a target that writes patterns.

Nothing is downloaded: both are the bundled paged decoder (``TinyDecoder``) with
weights trained here, for a few seconds on one CPU thread, from seeded
initialisations on the same seeded synthetic data, so they are the same on every
run and a draft's proposals are accepted for real reasons:

* ``patterned_sequences``: byte sequences that mostly follow a fixed successor table
  (``next_in_pattern``: token ``t`` is followed by ``successor[t]``) except where, with
  probability ``noise``, a random token starts a new run: the stand-in for a language
  both models learn (greedy, the target follows the table, and so does the draft;
  sampled, they differ where the noise spreads the target's distribution);
* ``PatternedDecoder``: a ``TinyDecoder`` trained on them to predict the next token.
  ``patterned_target()`` (3 layers, the decoder's size) is a target whose greedy text
  follows the patterns; ``bundled_draft(...)`` (no attention layers: token and
  position embeddings into the output head, the cheapest decoder there is) is the
  draft ``speculative_method="draft"`` uses for a byte-level target when the model
  brings none. For the seeded untrained ``decoder`` its proposals are mostly rejected,
  as a draft's are for a target it does not resemble, and the automatic off-switch
  turns speculation off.

Trained weights are kept per process (``functools.lru_cache``), so a second model of
the same shape costs nothing more.
"""

from __future__ import annotations

import random
from functools import lru_cache
from typing import Any

import torch
import torch.nn.functional as F

from runtime.generation.model import ByteTokenizer
from runtime.models.decoder import TinyDecoder

PATTERN_SEED = 1234
#: token ids the patterns use (the byte tokens); larger vocabularies leave the rest unused
PATTERN_TOKENS = 256


def successor_table(seed: int = PATTERN_SEED) -> list[int]:
    """The fixed next token of every byte token (a seeded permutation)."""
    table = list(range(PATTERN_TOKENS))
    random.Random(seed).shuffle(table)
    return table


def patterned_sequences(count: int, length: int, *, seed: int = 0, noise: float = 0.1
                        ) -> list[list[int]]:
    """``count`` sequences of ``length`` byte tokens following ``successor_table`` except
    where, with probability ``noise``, a random token starts a new run."""
    succ = successor_table()
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        seq = [rng.randrange(PATTERN_TOKENS)]
        while len(seq) < length:
            seq.append(rng.randrange(PATTERN_TOKENS) if rng.random() < noise
                       else next_in_pattern(seq, succ))
        out.append(seq)
    return out


def next_in_pattern(seq: list[int], succ: list[int]) -> int:
    """The token the patterns put after ``seq``: the successor of its last token."""
    return succ[seq[-1]]


@lru_cache(maxsize=8)
def _trained(vocab_size: int, d_model: int, n_heads: int, n_layers: int, max_model_len: int,
             seed: int, steps: int, seq_len: int) -> dict[str, torch.Tensor]:
    """Weights of a ``TinyDecoder`` of this shape after ``steps`` Adam steps (one sequence
    each, next-token cross-entropy) from its seeded initialisation."""
    model = TinyDecoder(vocab_size=vocab_size, d_model=d_model, n_heads=n_heads,
                        n_layers=n_layers, max_model_len=max_model_len, seed=seed)
    weights = {k: v.clone().requires_grad_(True) for k, v in model._generate_weights().items()}
    model.weights = weights
    forward = TinyDecoder.forward_full.__wrapped__  # the reference forward, with gradients
    opt = torch.optim.Adam(list(weights.values()), lr=3e-3)
    rng = random.Random(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for step, seq in enumerate(patterned_sequences(steps, seq_len, seed=seed)):
            # place the sequence anywhere the model attends, so every position is trained
            offset = rng.randrange(max(1, max_model_len - seq_len))
            ids = [int(t) for t in seq]
            logits = forward(model, ids) if offset == 0 else _shifted(forward, model, ids, offset)
            loss = F.cross_entropy(logits[:-1], torch.tensor(ids[1:]))
            opt.zero_grad()
            loss.backward()
            opt.step()
    return {k: v.detach().clone() for k, v in weights.items()}


def _shifted(forward: Any, model: TinyDecoder, ids: list[int], offset: int) -> torch.Tensor:
    """``forward`` over ``ids`` as if they sat at positions ``offset ...``: the position
    table is read from there (no attention layer sees the difference between a sequence
    starting at 0 and one whose earlier positions are absent, which is what is trained)."""
    full = model.weights["pos"]
    model.weights["pos"] = full[offset:]
    try:
        return forward(model, ids)
    finally:
        model.weights["pos"] = full


class PatternedDecoder(TinyDecoder):
    """A ``TinyDecoder`` whose weights were trained on ``patterned_sequences``."""

    name = "decoder-patterned"

    def __init__(self, *, train_steps: int = 300, train_seq_len: int = 48, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.train_steps = train_steps
        self.train_seq_len = train_seq_len

    def _generate_weights(self) -> dict[str, torch.Tensor]:
        return _trained(self.vocab_size, self.d_model, self.n_heads, self.n_layers,
                        self.max_model_len, self.seed, self.train_steps, self.train_seq_len)


def patterned_target(*, max_model_len: int = 1024, n_layers: int = 3,
                     train_steps: int = 300) -> PatternedDecoder:
    """A target (the decoder's default size) trained on the patterns."""
    return PatternedDecoder(max_model_len=max_model_len, n_layers=n_layers,
                            train_steps=train_steps)


def bundled_draft(*, vocab_size: int = 512, max_model_len: int = 1024,
                  train_steps: int = 300) -> PatternedDecoder:
    """The bundled draft: no attention layers, trained on the same patterns."""
    draft = PatternedDecoder(vocab_size=vocab_size, d_model=64, n_heads=1, n_layers=0,
                             max_model_len=max_model_len, seed=1, train_steps=train_steps)
    draft.name = "decoder-draft"  # type: ignore[misc]
    return draft


def bundled_draft_for(target: Any) -> PatternedDecoder | None:
    """The bundled draft sized for ``target`` when it reads bytes (``ByteTokenizer``);
    None otherwise."""
    if not isinstance(getattr(target, "tokenizer", None), ByteTokenizer) \
            or (target.vocab_size or 0) <= ByteTokenizer.eos_token_id:
        return None
    return bundled_draft(vocab_size=target.vocab_size, max_model_len=target.max_model_len or 1024)
