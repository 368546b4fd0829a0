"""What speculation did and whether the next step speculates.

``SpecCounts`` holds vLLM's speculative-decoding counters (``spec_decode_*``).

``SpecController`` is the automatic off-switch: fed each step's batch size, proposed
and accepted tokens and time, it keeps, per batch-size bucket, the step time per
generated token with and without speculation, speculates only where that is cheaper
and the acceptance rate is above ``spec_min_acceptance_rate`` (a rate under it turns
speculation off as soon as ``LOW_ACCEPTANCE_EVIDENCE_TOKENS`` proposals measured it: one
step at a large batch), and probes again every ``spec_probe_interval_steps`` steps. It is synchronous, with time passed in; the
runner records each ``SpecSwitch`` it returns as a ``speculation`` event.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from runtime.generation.config import GenerationConfig

#: the most tokens one verification may propose (the bound of num_speculative_tokens)
MAX_SPEC_TOKENS = 16


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
#: proposed tokens enough to call an acceptance rate low: at a large batch one step
#: holds them, so a method that does not pay there is switched off after a step or two
LOW_ACCEPTANCE_EVIDENCE_TOKENS = 64
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
    #: tokens proposed since speculation was last (re)measured
    drafted_on: int = 0
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
                b.drafted_on += drafted
        else:
            b.cost_off, b.n_off = _ewma(b.cost_off, cost), b.n_off + 1
        if b.measuring is None:
            if self.steps - b.since_step >= config.spec_probe_interval_steps:
                b.measuring = "probe"  # measure the other side again
                if b.on:
                    b.n_off = 0
                else:
                    b.n_on = b.drafted_on = 0
            return None
        low = b.acceptance is not None and b.acceptance < config.spec_min_acceptance_rate
        if low and b.drafted_on >= LOW_ACCEPTANCE_EVIDENCE_TOKENS:
            return self._settle(config, b, batch_bucket(batch_size))
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
