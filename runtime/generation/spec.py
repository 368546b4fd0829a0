"""Speculative decoding: proposers, the verification sampler and the on/off controller.

A step with speculation gives each decoding sequence ``k`` extra slots
(``Scheduler.schedule(now, num_spec_tokens=k)``). Before the model runs, a proposer
fills them with guessed next tokens; the model computes the newest token and the
guesses in one forward and returns the logits after each; ``verify`` keeps the
longest prefix of guesses the model agrees with plus one token of its own, and the
scheduler rolls back the rest (``update_from_output``)::

    proposals = proposer.propose([DraftRequest(seq, k), ...])   # runner.execute
    logits = model.step(chunks)                                  # 1 + k rows per sequence
    tokens = verify_greedy(...) / rejection_sample(...)          # 1 .. k + 1 tokens

Proposers (plain classes; ``propose`` runs on the engine's step thread):

* ``NgramProposer`` (``speculative_method="ngram"``, prompt lookup): finds the latest
  earlier occurrence of the sequence's last ``prompt_lookup_max`` .. ``_min`` tokens in
  its own prompt and output and proposes the tokens that followed it. No model.
* ``DraftProposer`` (``"draft"``): a small ``GenerationModel`` sharing the target's
  vocabulary runs greedily ``k`` steps, with a paged KV cache of its own (its entries
  for a sequence's known tokens are kept between steps; those of guesses are
  recomputed).

Verification leaves the output distribution unchanged: at temperature 0 the tokens
are exactly those of decoding without speculation; when sampling, a guess ``d`` drawn
from ``q`` is accepted with probability ``min(1, p(d) / q(d))`` (``p``: the model's
distribution), and on a rejection the token is drawn from ``max(0, p - q)``
normalised, which makes every emitted token distributed as ``p`` (Leviathan et al.
2023, Chen et al. 2023). A proposer that picks its guesses deterministically has a
one-hot ``q``. A sampled request's tokens then depend on its seed as before, though
not the same tokens as without speculation (the draws are used differently).

``SpecController`` is the automatic off-switch: fed each step's batch size, proposed
and accepted tokens and time, it keeps, per batch-size bucket, the step time per
generated token with and without speculation, speculates only where that is cheaper
and the acceptance rate is above ``spec_min_acceptance_rate``, and probes again every
``spec_probe_interval_steps`` steps. It is synchronous, with time passed in.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from runtime.api.errors import ConfigError
from runtime.generation.config import GenerationConfig
from runtime.generation.kv_cache import BlockManager
from runtime.generation.scheduler import ScheduledChunk, Sequence

#: the most tokens one verification may propose (the bound of num_speculative_tokens)
MAX_SPEC_TOKENS = 16


@dataclass(slots=True)
class DraftRequest:
    """One sequence to propose for: its known tokens are read, never changed."""

    seq: Sequence
    #: how many tokens to propose at most
    k: int


@dataclass(slots=True)
class Proposal:
    token_ids: list[int]
    #: [len(token_ids), vocab] probabilities each guess was drawn from; None: the
    #: proposer picked them deterministically (a one-hot distribution)
    probs: torch.Tensor | None = None


class Proposer(Protocol):
    method: str

    def propose(self, requests: list[DraftRequest]) -> list[Proposal]: ...

    def release(self, seq_id: int) -> None: ...


class _Releases:
    """Sequence ids whose proposer state is to be dropped: noted from the event loop,
    dropped on the step thread at the next ``propose`` (so they never race)."""

    def __init__(self) -> None:
        self._ids: list[int] = []
        self._lock = threading.Lock()

    def release(self, seq_id: int) -> None:
        with self._lock:
            self._ids.append(seq_id)

    def take(self) -> list[int]:
        with self._lock:
            ids, self._ids = self._ids, []
        return ids


# -- prompt lookup --------------------------------------------------------------------------
class NgramProposer:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the
    sequence's last n tokens (n from ``max_n`` down to ``min_n``), in its prompt and output."""

    method = "ngram"

    def __init__(self, min_n: int = 1, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ConfigError(f"prompt lookup needs 1 <= prompt_lookup_min ({min_n}) <= "
                              f"prompt_lookup_max ({max_n})")
        self.min_n, self.max_n = min_n, max_n

    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        return [Proposal(self.lookup(r.seq.prompt_ids + r.seq.output_ids, r.k))
                for r in requests]

    def lookup(self, context: list[int], k: int) -> list[int]:
        n_ctx = len(context)
        if k <= 0 or n_ctx < self.min_n + 1:
            return []
        arr = np.asarray(context, dtype=np.int64)
        for n in range(min(self.max_n, n_ctx - 1), self.min_n - 1, -1):
            # windows that start early enough to be followed by at least one token
            windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)
            hits = np.flatnonzero((windows == arr[-n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return arr[start:start + k].tolist()
        return []

    def release(self, seq_id: int) -> None:
        pass


# -- a draft model --------------------------------------------------------------------------
def check_draft(target: Any, draft: Any) -> None:
    """Refuse a draft model that cannot propose for ``target``: another vocabulary or end
    token (their ids would mean different tokens)."""
    if not draft.vocab_size or draft.vocab_size != target.vocab_size:
        raise ConfigError(
            f"the draft model {getattr(draft, 'name', '?')!r} has a vocabulary of "
            f"{draft.vocab_size} tokens but {target.name!r} has {target.vocab_size}; a draft "
            "model must share the target's tokenizer and vocabulary")
    if draft.eos_token_id != target.eos_token_id:
        raise ConfigError(
            f"the draft model's end token ({draft.eos_token_id}) differs from "
            f"{target.name!r}'s ({target.eos_token_id}); a draft model must share the "
            "target's tokenizer")


class DraftProposer:
    """Greedy proposals from a small ``GenerationModel`` with a paged KV cache of its own.

    Each ``propose`` runs the draft model ``k`` times over all the requests together:
    first each sequence's tokens the draft has not seen (usually the few accepted last
    step), then one guess at a time. Its entries for guesses are not kept: the next
    call starts from the sequence's known tokens again. A sequence whose draft blocks do
    not fit gets no proposal (it decodes without speculation this step).
    """

    method = "draft"

    def __init__(self, draft: Any, *, num_blocks: int, block_size: int) -> None:
        self.model = draft
        self.blocks = BlockManager(num_blocks, block_size)
        self._computed: dict[int, int] = {}
        self._releases = _Releases()
        self._ready = False

    def setup(self, device: Any) -> None:
        if not self._ready:
            self.model.setup(device, self.blocks.num_blocks, self.blocks.block_size)
            self._ready = True

    def release(self, seq_id: int) -> None:
        self._releases.release(seq_id)

    @property
    def num_tracked(self) -> int:
        return len(self._computed)

    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        for seq_id in self._releases.take():
            self.blocks.free(seq_id)
            self._computed.pop(seq_id, None)
        proposals = [Proposal([]) for _ in requests]
        live: list[tuple[int, DraftRequest, list[int]]] = []
        for i, r in enumerate(requests):
            tokens = r.seq.prompt_ids + r.seq.output_ids
            # the guesses fed back take positions up to len(tokens) + k - 2
            if r.k > 0 and self.blocks.allocate(r.seq.seq_id, len(tokens) + r.k - 1):
                live.append((i, r, tokens))
        if not live:
            return proposals
        proposed = [(r.seq.seq_id, len(tokens)) for _, r, tokens in live]
        chunks = []
        for _, r, tokens in live:
            start = min(self._computed.get(r.seq.seq_id, 0), len(tokens) - 1)
            chunks.append(self._chunk(r.seq.seq_id, tokens[start:], start))
        for rnd in range(max(r.k for _, r, _ in live)):
            picks = self.model.step(chunks).argmax(dim=-1).tolist()
            nxt = []
            for (i, r, tokens), tok in zip(live, picks):
                proposals[i].token_ids.append(int(tok))
                if rnd + 1 < r.k:
                    nxt.append((i, r, tokens))
            chunks = [self._chunk(r.seq.seq_id, [proposals[i].token_ids[-1]],
                                  len(tokens) + rnd) for i, r, tokens in nxt]
            live = nxt
            if not live:
                break
        for seq_id, n in proposed:
            self._computed[seq_id] = n  # what follows holds guesses: computed again next time
            self.blocks.truncate(seq_id, n)
        return proposals

    def _chunk(self, seq_id: int, token_ids: list[int], start: int) -> ScheduledChunk:
        return ScheduledChunk(seq_id=seq_id, token_ids=token_ids, start_pos=start,
                              block_table=self.blocks.block_table(seq_id), completes=True,
                              is_decode=len(token_ids) == 1)


def make_proposer(config: GenerationConfig, target: Any, draft: Any = None) -> Any:
    """The proposer ``config.speculative_method`` asks for (None for "none"); raises
    ConfigError when the draft model is missing or does not fit the target."""
    method = config.speculative_method
    if method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    if method != "draft":
        return None
    if draft is None:
        draft = getattr(target, "draft_model", None)
    if draft is None:
        from runtime.generation.draft import bundled_draft_for

        draft = bundled_draft_for(target)
    if draft is None:
        raise ConfigError(f"speculative_method='draft' needs a draft model for {target.name!r} "
                          "(it has none); use speculative_method='ngram', or give one")
    check_draft(target, draft)
    if draft.max_model_len and draft.max_model_len < config.max_model_len:
        raise ConfigError(f"the draft model attends over {draft.max_model_len} tokens, fewer "
                          f"than max_model_len={config.max_model_len}; lower max_model_len "
                          f"to at most {draft.max_model_len}")
    # room for every sequence the target's cache holds, plus the guesses
    extra = config.max_num_seqs * (-(-config.num_speculative_tokens // config.block_size) + 1)
    return DraftProposer(draft, num_blocks=config.num_cache_blocks + extra,
                         block_size=config.block_size)


# -- verification ---------------------------------------------------------------------------
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


# -- counts ---------------------------------------------------------------------------------
@dataclass
class SpecCounts:
    """vLLM's speculative-decoding counters (``spec_decode_*``), and requests served
    without speculation though they asked for it."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=lambda: [0] * MAX_SPEC_TOKENS)
    #: requests that asked for speculation from a model without a proposer
    requests_without_proposer: int = 0
    #: requests that opted out
    requests_opted_out: int = 0

    def add(self, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        for pos in range(accepted):
            self.accepted_per_pos[pos] += 1

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted over proposed tokens (vLLM's draft acceptance rate)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens each verification yields on average: 1 + accepted per draft."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None

    def as_dict(self) -> dict[str, Any]:
        last = max((i + 1 for i, n in enumerate(self.accepted_per_pos) if n), default=0)
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens,
                "accepted_per_pos": self.accepted_per_pos[:last],
                "acceptance_rate": self.acceptance_rate,
                "mean_acceptance_length": self.mean_acceptance_length,
                "requests_without_proposer": self.requests_without_proposer,
                "requests_opted_out": self.requests_opted_out}


# -- the automatic off-switch ---------------------------------------------------------------
#: steps measured in a row before a comparison counts (each way)
MIN_SAMPLES = 8
#: weight of the newest step in the running means
EWMA_WEIGHT = 0.2


def batch_bucket(batch_size: int) -> int:
    """Batch sizes measured together: 1, 2, 3-4, 5-8, 9-16, ... (the bucket's top)."""
    return 1 << max(0, batch_size - 1).bit_length()


@dataclass
class _Bucket:
    on: bool = True
    #: running means of the step time per generated token, with and without speculation
    cost_on: float | None = None
    cost_off: float | None = None
    acceptance: float | None = None
    n_on: int = 0
    n_off: int = 0
    #: the step at which the current decision was taken (for probing again)
    since_step: int = 0
    #: what the measurement in progress is for: "explore", "probe" or None (settled)
    measuring: str | None = "explore"


@dataclass(frozen=True)
class SpecSwitch:
    """A settled decision that changed: speculation on or off for a batch-size bucket."""

    on: bool
    bucket: int
    reason: str
    cost_on_s: float | None
    cost_off_s: float | None
    acceptance_rate: float | None


def _ewma(old: float | None, new: float) -> float:
    return new if old is None else old + EWMA_WEIGHT * (new - old)


class SpecController:
    """Whether the next step speculates, from what the steps so far measured."""

    def __init__(self) -> None:
        self.buckets: dict[int, _Bucket] = {}
        self.steps = 0

    def num_spec_tokens(self, config: GenerationConfig, batch_size: int) -> int:
        """Slots per sequence for the next step: ``num_speculative_tokens`` or 0."""
        if not config.speculating or batch_size < 1:
            return 0
        limit = config.speculative_disable_by_batch_size
        if limit is not None and batch_size > limit:
            return 0
        if not config.spec_auto_switch:
            return config.num_speculative_tokens
        return config.num_speculative_tokens if self._wants(batch_size) else 0

    def _wants(self, batch_size: int) -> bool:
        b = self.buckets.setdefault(batch_bucket(batch_size), _Bucket(since_step=self.steps))
        if b.measuring == "explore":  # first with, then without
            return b.n_on < MIN_SAMPLES
        if b.measuring == "probe":  # the side not taken, measured afresh
            return not b.on
        return b.on

    def observe(self, config: GenerationConfig, batch_size: int, speculated: bool,
                drafted: int, accepted: int, tokens: int, step_s: float) -> SpecSwitch | None:
        """Feed one step: whether it carried proposals, how many were proposed and
        accepted, the tokens it generated and its time. Returns the decision when a
        settled one changed."""
        self.steps += 1
        if not (config.speculating and config.spec_auto_switch) or tokens <= 0:
            return None
        b = self.buckets.setdefault(batch_bucket(batch_size), _Bucket(since_step=self.steps))
        cost = step_s / tokens
        if speculated:
            b.cost_on, b.n_on = _ewma(b.cost_on, cost), b.n_on + 1
            if drafted:
                b.acceptance = _ewma(b.acceptance, accepted / drafted)
        else:
            b.cost_off, b.n_off = _ewma(b.cost_off, cost), b.n_off + 1
        if b.measuring is None:
            if self.steps - b.since_step >= config.spec_probe_interval_steps:
                b.measuring = "probe"  # measure the other side again
                if b.on:
                    b.n_off = 0
                else:
                    b.n_on = 0
            return None
        low = b.acceptance is not None and b.acceptance < config.spec_min_acceptance_rate
        if b.n_on < MIN_SAMPLES or (b.n_off < MIN_SAMPLES and not low):
            return None  # low acceptance settles without measuring the other side
        return self._settle(config, b, batch_bucket(batch_size))

    def _settle(self, config: GenerationConfig, b: _Bucket, bucket: int) -> SpecSwitch | None:
        low_acceptance = b.acceptance is not None and b.acceptance < config.spec_min_acceptance_rate
        on = not low_acceptance and b.cost_on is not None and b.cost_off is not None \
            and b.cost_on < b.cost_off
        first = b.measuring == "explore"
        changed = first or on != b.on
        b.on, b.measuring, b.since_step = on, None, self.steps
        if not changed:
            return None
        if low_acceptance:
            reason = (f"{b.acceptance:.0%} of the proposed tokens are accepted, under "
                      f"spec_min_acceptance_rate={config.spec_min_acceptance_rate}")
        else:
            reason = (f"{_ms(b.cost_on)} per generated token with speculation, "
                      f"{_ms(b.cost_off)} without")
        return SpecSwitch(on=on, bucket=bucket, reason=reason, cost_on_s=b.cost_on,
                          cost_off_s=b.cost_off, acceptance_rate=b.acceptance)


def _ms(seconds: float | None) -> str:
    return "?" if seconds is None or not math.isfinite(seconds) else f"{seconds * 1e3:.3f} ms"
