"""What a diagnosis rule returns (``Flag``), the thresholds the rules go by
(``Thresholds``) and the helpers they share for reading a window's bundle."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field

SEVERITY_ORDER = {"critical": 0, "warning": 1, "info": 2}
OOM_KINDS = ("oom", "oom_failed")


@dataclass(frozen=True)
class Flag:
    rule: str
    severity: str  # critical | warning | info
    title: str
    evidence: dict
    steps: list[str] = field(default_factory=list)
    chart: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Thresholds:
    min_batches: int = 20
    memory_near_fraction: float = 0.90
    repeated_oom_count: int = 3
    tail_ratio: float = 4.0
    tail_min_p99_s: float = 0.005
    not_forming_mean_size: float = 1.5
    not_forming_min_max_size: int = 4
    #: ... unless requests queue: this many waiting on average when a batch leaves, or
    #: ``rejected_fraction`` of the requests refused or expired (then clients are not
    #: too few: something ends the batches early)
    not_forming_queued_depth: float = 1.0
    wait_over_compute: float = 2.0
    low_load_utilization_pct: float = 40.0
    low_load_size_fraction: float = 0.25
    rejected_fraction: float = 0.01
    queue_growth_factor: float = 2.0
    padding_waste_fraction: float = 0.30
    diminishing_gain: float = 1.15
    diminishing_min_batches_per_size: int = 5
    low_utilization_pct: float = 30.0
    low_utilization_queue_depth: float = 1.0
    preemptions_per_step: float = 0.10
    preemptions_per_sequence: float = 0.5
    starvation_expired_fraction: float = 0.10
    starvation_wait_ratio: float = 10.0
    starvation_min_wait_s: float = 0.100
    #: speculation_not_paying: judged at the current batch size once it has this many
    #: speculating steps, while this share of the window's last quarter speculates
    spec_min_steps: int = 20
    spec_on_fraction: float = 0.5
    #: ... when fewer of the proposed tokens are accepted (and speculation is not measured
    #: cheaper), or a generated token costs this much more with it than without, each
    #: way measured over this many steps without prefill
    spec_low_acceptance_rate: float = 0.3
    spec_cost_ratio: float = 1.05
    spec_min_compare_steps: int = 8
    #: long_prefill_stall: steps that decode and prefill at least this many tokens, this
    #: many of them, taking this many times a decode-only step; the suggested cap brings
    #: such a step to ``long_prefill_target_ratio`` times a decode-only one
    long_prefill_min_tokens: int = 256
    long_prefill_min_steps: int = 5
    long_prefill_stall_ratio: float = 4.0
    long_prefill_target_ratio: float = 2.0
    #: LoRA adapters: slot evictions per minute (and at least this many) that are thrash
    adapter_thrash_evictions_per_min: float = 10.0
    adapter_thrash_min_evictions: int = 10
    #: an adapter is starving when its p99 is this many times the other adapters' median
    #: p99, or this fraction of its requests expired (with this many requests at least)
    adapter_starving_p99_ratio: float = 4.0
    adapter_starving_expired_fraction: float = 0.10
    adapter_min_requests: int = 20
    #: mixing off while at least this many adapters have traffic
    adapter_spread_min_adapters: int = 4


def _num(value, default: float = 0.0) -> float:
    try:
        out = float(value)
    except (TypeError, ValueError):
        return default
    return default if math.isnan(out) else out


def _ms(seconds: float) -> float:
    return round(seconds * 1000.0, 2)


def _head(bundle: dict) -> dict:
    head = bundle.get("headline")
    return head.iloc[0].to_dict() if head is not None and len(head) else {}


def _enough(h: dict, th: Thresholds) -> bool:
    return _num(h.get("batches")) >= th.min_batches


def json_object(raw) -> dict:
    """A recorded JSON text (an event's details, an instance's settings) as a dict: {}
    for nothing, text that is not JSON, or JSON that is not an object."""
    try:
        found = json.loads(raw or "{}")
    except (TypeError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}
