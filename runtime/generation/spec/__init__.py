"""Speculative decoding: proposers, verification and the on/off controller.

A step with speculation gives each decoding sequence ``k`` extra slots
(``Scheduler.schedule(now, num_spec_tokens=k)``). Before the model runs, a proposer
fills them with guessed next tokens; the model computes the newest token and the
guesses in one forward and returns the logits after each; verification keeps the
longest prefix of guesses the model agrees with plus one token of its own, and the
scheduler rolls back the rest (``update_from_output``)::

    proposals = proposer.propose([DraftRequest(seq, k), ...])   # runner.execute
    logits = model.step(chunks)                                  # 1 + k rows per sequence
    tokens = verify_greedy(...) / rejection_sample(...)          # 1 .. k + 1 tokens

The parts, each a module of this package:

* ``proposers``: where the guesses come from (``NgramProposer``: prompt lookup, no
  model; ``DraftProposer``: a small draft model with a paged KV cache of its own;
  ``make_proposer`` picks the one the settings name);
* ``verify``: which guesses are kept, at temperature 0 (``verify_greedy``) and when
  sampling (``rejection_sample``, which keeps the model's output distribution);
* ``controller``: what speculation did (``SpecCounts``, vLLM's ``spec_decode_*``
  counters) and whether the next step speculates (``SpecController``, the automatic
  off-switch per batch size, whose decisions become ``speculation`` events).

This module puts their public names in one place.
"""

from __future__ import annotations

from runtime.generation.spec.controller import (EWMA_WEIGHT, MAX_SPEC_TOKENS, MIN_SAMPLES,
                                                SpecController, SpecCounts, SpecSwitch,
                                                batch_bucket)
from runtime.generation.spec.proposers import (DraftProposer, DraftRequest, NgramProposer,
                                               Proposal, Proposer, check_draft, make_proposer)
from runtime.generation.spec.verify import (chi_square_p_value, rejection_sample, target_probs,
                                            verify_greedy)

__all__ = [
    "EWMA_WEIGHT", "MAX_SPEC_TOKENS", "MIN_SAMPLES", "DraftProposer", "DraftRequest",
    "NgramProposer", "Proposal", "Proposer", "SpecController", "SpecCounts", "SpecSwitch",
    "batch_bucket", "check_draft", "chi_square_p_value", "make_proposer", "rejection_sample",
    "target_probs", "verify_greedy",
]
