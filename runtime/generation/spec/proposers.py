"""Proposers: where a step's guessed tokens come from.

A step with speculation gives each decoding sequence ``k`` extra slots
(``Scheduler.schedule(now, num_spec_tokens=k)``); before the model runs, the runner
asks the proposer for up to ``k`` guesses per sequence (``propose``, on the engine's
step thread) and puts them in those slots.

* ``NgramProposer`` (``speculative_method="ngram"``, prompt lookup): finds the latest
  earlier occurrence of the sequence's last ``prompt_lookup_max`` .. ``_min`` tokens in
  its own prompt and output and proposes the tokens that followed it. No model.
* ``DraftProposer`` (``"draft"``): a small ``GenerationModel`` sharing the target's
  vocabulary runs greedily ``k`` steps, with a paged KV cache of its own (its entries
  for a sequence's known tokens are kept between steps; those of guesses are
  recomputed).

``make_proposer`` picks the one a ``GenerationConfig`` names (None for "none").
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from runtime.api.errors import ConfigError
from runtime.generation.config import GenerationConfig
from runtime.generation.kv_cache import BlockManager
from runtime.generation.scheduler import ScheduledChunk, Sequence


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
    sequence's last n tokens (n from ``max_n`` down to ``min_n``), in its prompt and output.

    Each sequence's tokens are kept in a growing array between steps (only the tokens
    accepted since the last step are appended), and one comparison over it finds the
    earlier positions of the last token; longer n-grams only filter those. A step costs
    a few microseconds per sequence however long its context, instead of copying and
    scanning the whole context once per n."""

    method = "ngram"

    def __init__(self, min_n: int = 1, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ConfigError(f"prompt lookup needs 1 <= prompt_lookup_min ({min_n}) <= "
                              f"prompt_lookup_max ({max_n})")
        self.min_n, self.max_n = min_n, max_n
        #: seq_id -> (its tokens so far, in an array with room to grow; how many)
        self._tokens: dict[int, tuple[np.ndarray, int]] = {}
        self._releases = _Releases()

    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        for seq_id in self._releases.take():
            self._tokens.pop(seq_id, None)
        return [Proposal(self._lookup_in(self._synced(r.seq), r.k)) for r in requests]

    def _synced(self, seq: Sequence) -> np.ndarray:
        """The sequence's tokens as an array, appending only what is new."""
        n_prompt, n = len(seq.prompt_ids), len(seq.prompt_ids) + len(seq.output_ids)
        held = self._tokens.get(seq.seq_id)
        if held is None or held[1] > n or held[1] < n_prompt:
            buf, have = np.empty(max(64, 2 * n), dtype=np.int64), 0
        else:
            buf, have = held
        if have < n_prompt:
            buf[:n_prompt] = seq.prompt_ids
            have = n_prompt
        if have < n:
            if n > buf.size:
                grown = np.empty(2 * n, dtype=np.int64)
                grown[:have] = buf[:have]
                buf = grown
            buf[have:n] = seq.output_ids[have - n_prompt:]
        self._tokens[seq.seq_id] = (buf, n)
        return buf[:n]

    def lookup(self, context: list[int], k: int) -> list[int]:
        """The proposal for ``context`` (kept nowhere: for one-off calls and tests)."""
        return self._lookup_in(np.asarray(context, dtype=np.int64), k)

    def _lookup_in(self, arr: np.ndarray, k: int) -> list[int]:
        n_ctx = arr.size
        if k <= 0 or n_ctx < self.min_n + 1:
            return []
        # positions (before the last) holding the last token: where an n-gram ending
        # there is followed by at least one token
        ends = np.flatnonzero(arr[:-1] == arr[-1])
        best = None
        for n in range(1, min(self.max_n, n_ctx - 1) + 1):
            if n > 1:  # the n-gram's earlier tokens match too
                ends = ends[ends >= n - 1]
                ends = ends[arr[ends - (n - 1)] == arr[n_ctx - n]]
            if not ends.size:
                break
            if n >= self.min_n:
                best = int(ends[-1]) + 1
        return [] if best is None else arr[best:best + k].tolist()

    def release(self, seq_id: int) -> None:
        if seq_id in self._tokens:  # only sequences it proposed for hold an array
            self._releases.release(seq_id)


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
