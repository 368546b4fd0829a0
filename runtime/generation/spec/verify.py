"""Verification: which of a sequence's guessed tokens it keeps.

The model computes the newest token and the ``k`` guesses in one forward and returns
the logits after each; verification keeps the longest prefix of guesses the model
agrees with plus one token of its own (1 .. k + 1 tokens), and the scheduler rolls
back the rest (``update_from_output``).

Verification leaves the output distribution unchanged: at temperature 0
(``verify_greedy``) the tokens are exactly those of decoding without speculation;
when sampling (``rejection_sample``), a guess ``d`` drawn from ``q`` is accepted with
probability ``min(1, p(d) / q(d))`` (``p``: the model's distribution), and on a
rejection the token is drawn from ``max(0, p - q)`` normalised, which makes every
emitted token distributed as ``p`` (Leviathan et al. 2023, Chen et al. 2023). A
proposer that picks its guesses deterministically has a one-hot ``q``. A sampled
request's tokens then depend on its seed as before, though not the same tokens as
without speculation (the draws are used differently).
"""

from __future__ import annotations

import torch


def verify_greedy(argmax_rows: list[int], draft_ids: list[int]) -> list[int]:
    """Temperature 0: the proposed tokens up to the first the model would not have picked,
    then the model's own pick there (or after the last, when all matched)."""
    out = []
    for j, d in enumerate(draft_ids):
        if d != argmax_rows[j]:
            break
        out.append(d)
    out.append(argmax_rows[len(out)])
    return out


def target_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``softmax(logits / temperature)`` over the last dimension, in float64 and shifted
    first, as ``model.sample`` draws (a tiny temperature gives 0 and 1, not nan)."""
    x = logits.double()
    return torch.softmax((x - x.max(dim=-1, keepdim=True).values) / temperature, dim=-1)


def rejection_sample(p: torch.Tensor, draft_ids: torch.Tensor, q: torch.Tensor | None,
                     generator: torch.Generator | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative rejection sampling for ``B`` sequences at once.

    ``p``: [B, k+1, V] the model's probabilities after the newest token and after each
    guess; ``draft_ids``: [B, k] the guesses; ``q``: [B, k, V] the distributions they were
    drawn from, or None for deterministic guesses. Returns ``tokens`` [B, k+1] and
    ``counts`` [B]: sequence b emits ``tokens[b, :counts[b]]``: its accepted guesses and
    one token drawn from the residual (or, all accepted, from ``p[b, k]``).
    """
    b, k = draft_ids.shape
    rows = torch.arange(b)
    p_d = p[:, :k].gather(2, draft_ids[..., None])[..., 0]
    if q is None:
        q_d = torch.ones_like(p_d)
    else:
        q_d = q.to(p.dtype).gather(2, draft_ids[..., None])[..., 0]
    u = torch.rand(b, k, generator=generator, dtype=p.dtype)
    accepted = (u * q_d < p_d).long().cumprod(dim=1).sum(dim=1)  # the accepted prefix
    at = accepted.clamp(max=k - 1) if k else accepted
    p_next = p[rows, accepted]
    if k:
        if q is None:
            q_next = torch.zeros_like(p_next)
            q_next[rows, draft_ids[rows, at]] = 1.0
        else:
            q_next = q.to(p.dtype)[rows, at]
        residual = torch.where((accepted < k)[:, None], (p_next - q_next).clamp(min=0), p_next)
    else:
        residual = p_next
    mass = residual.sum(dim=1, keepdim=True)
    # no mass left only when p and q agree exactly at a rejection (probability 0): use p
    residual = torch.where(mass > 0, residual / mass.clamp(min=1e-300), p_next)
    extra = torch.multinomial(residual, 1, generator=generator)[:, 0]
    tokens = torch.cat([draft_ids, torch.zeros(b, 1, dtype=draft_ids.dtype)], dim=1)
    tokens[rows, accepted] = extra
    return tokens, accepted + 1


def chi_square_p_value(statistic: float, dof: int) -> float:
    """P(X >= statistic) for a chi-square variable with ``dof`` degrees of freedom."""
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64),
                                         torch.tensor(statistic / 2.0, dtype=torch.float64)))
