"""The autopilot controller's terms: the settings it moves (``Knobs``), what it is shown
each tick (``Observation``), the constants it decides by (``Tuning``), what it decides
(``Decision``, within a ``Step``) and the states it reports. The rules that use them are
``runtime.autopilot.controller``'s."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from runtime.autopilot.window import WindowFigures

#: the states a controller reports
WATCHING, RAISING, LOWERING, SETTLING, VIOLATING, REVERTED, FALLBACK = (
    "watching", "raising", "lowering", "settling", "violating", "reverted", "fallback")


@dataclass(frozen=True, slots=True)
class Knobs:
    """The settings the controller moves."""

    max_batch_size: int
    #: None: work-conserving
    max_queue_delay_ms: float | None
    #: a variable-length model's bucket edges (None: derived from the traffic) ...
    bucket_edges: tuple[int, ...] | None = None
    #: ... and how many are derived; None: edges not moved (a fixed-length model)
    auto_bucket_count: int | None = None

    def settings(self) -> dict[str, Any]:
        """The settings these knobs stand for (bucket edges only when they are moved)."""
        out: dict[str, Any] = {"max_batch_size": self.max_batch_size,
                               "max_queue_delay_ms": self.max_queue_delay_ms}
        if self.auto_bucket_count is not None:
            edges = self.bucket_edges
            out["bucket_edges"] = None if edges is None else list(edges)
            out["auto_bucket_count"] = self.auto_bucket_count
        return out

    def changes_to(self, new: "Knobs") -> dict[str, Any]:
        """The settings changes that turn ``self`` into ``new``."""
        old = self.settings()
        return {k: v for k, v in new.settings().items() if old.get(k, object()) != v}


@dataclass(frozen=True, slots=True)
class Observation:
    """What the shell saw of one model at ``now_s``."""

    now_s: float
    #: the outcomes since the current window began
    window: WindowFigures
    queue_depth: int
    #: share of the window the device spent on this model's batches (0..1)
    utilization: float
    #: recent mean time of one batch (None: none ran yet)
    batch_compute_ms: float | None
    #: the largest batch the OOM governor allows now
    effective_max_batch_size: int
    knobs: Knobs
    #: the window's batches by size: size -> (batches, summed compute ms)
    batch_ms_by_size: Mapping[int, tuple[float, float]] = field(default_factory=dict)
    #: share of the window's padded input tokens that are padding (None: not known)
    padding_share: float | None = None


@dataclass(frozen=True, slots=True)
class Tuning:
    """The controller's constants (see the module docstring)."""

    min_samples: int = 100
    min_batches: int = 10
    min_window_s: float = 1.0
    max_window_s: float = 10.0
    cooldown_s: float = 1.0
    room: float = 0.7
    room_windows: int = 2
    batch_share: float = 0.25
    delay_share: float = 0.25
    delay_step_share: float = 0.05
    min_delay_ms: float = 0.5
    raise_factor: float = 1.5
    #: over the SLO and saturated, a raise may go up to this factor at once when the
    #: fitted line says ``raise_factor`` would not serve the arrivals with ``headroom``
    max_raise_factor: float = 2.0
    lower_floor: float = 0.5
    ceiling_factor: float = 4.0
    #: a batch counts as full at this share of the effective max batch size
    full_share: float = 0.8
    #: the device counts as busy at this share of the window
    busy_share: float = 0.6
    worse: float = 0.1
    gain: float = 0.05
    #: a longer delay must promise this much less device time per request
    delay_saving: float = 0.1
    same_load: float = 0.15
    block_s: float = 10.0
    #: each move undone in a row in one direction doubles its block, up to this
    max_block_s: float = 120.0
    #: over the SLO, a delay of at least this share of the p99 is halved before a batch
    #: that takes too long is made smaller
    delay_visible: float = 0.1
    #: over the SLO, a batch that takes too long is made smaller only while it takes at
    #: least this share of the p99
    batch_visible: float = 0.3
    #: a smaller batch must serve this much more than the arrival rate
    headroom: float = 0.2
    #: with room and batches not full, max_batch_size grows ahead of a burst while a full
    #: batch at the new size takes at most this share of the SLO ...
    ready_share: float = 0.35
    #: ... the line is fitted to at least this many batch sizes ...
    ready_sizes: int = 3
    #: ... and the new size is at most this many times the largest batch timed
    extrapolate: float = 4.0
    #: finer bucket edges once this share of the padded tokens is padding ...
    padding_high: float = 0.15
    #: ... up to this many derived edges
    max_bucket_count: int = 32
    fallback_after: int = 4
    improving: float = 0.1
    hold_s: float = 30.0


@dataclass(frozen=True, slots=True)
class Decision:
    """Settings to apply, and why."""

    changes: dict[str, Any]
    knobs: Knobs
    reason: str
    state: str


@dataclass(frozen=True, slots=True)
class Step:
    """What the controller made of one observation."""

    #: the window is judged (or dropped): the shell starts the next one now
    window_done: bool
    decision: Decision | None = None
