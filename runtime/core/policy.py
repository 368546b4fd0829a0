"""When a queue's batch is due, and how big it is (static / dynamic / adaptive).

Pure functions of the settings and the queue's state; no clock is read here.

* static: a batch is due when the queue holds a full batch, or when its oldest
  request has waited ``static_max_wait_ms`` (then a partial batch runs).
* dynamic: due when full, or when the oldest has waited ``max_queue_delay_ms``.
  With ``max_queue_delay_ms`` None the policy is work-conserving: anything queued
  is due while the model is idle; while it is busy only a full batch is due, so
  the queue fills and the next batch takes up to the maximum.
* adaptive: like dynamic with the window
  ``clamp(max(adaptive_floor_ms, adaptive_factor * recent mean batch compute), ceiling)``.
"""

from __future__ import annotations

from collections import deque

from runtime.api.config import BatchingConfig


def window_s(config: BatchingConfig, mean_compute_s: float | None) -> float | None:
    """How long the oldest request may wait for companions; None = work-conserving."""
    policy = config.policy
    if policy == "static":
        return config.static_max_wait_ms / 1000.0
    if policy == "adaptive":
        follow_ms = config.adaptive_factor * (mean_compute_s or 0.0) * 1000.0
        delay_ms = min(max(config.adaptive_floor_ms, follow_ms), config.adaptive_ceiling_ms)
        return delay_ms / 1000.0
    if config.max_queue_delay_ms is None:
        return None
    return config.max_queue_delay_ms / 1000.0


def due_at(window: float | None, count: int, cap: int, oldest_arrived_s: float,
           model_busy: bool) -> float | None:
    """The time a queue's batch becomes due; None = not until something changes.

    A full queue is due at once (``oldest_arrived_s``, which is never in the future).
    """
    if count >= cap:
        return oldest_arrived_s
    if window is None:
        return None if model_busy else oldest_arrived_s
    return oldest_arrived_s + window


def batch_size(config: BatchingConfig, available: int, cap: int) -> int:
    """How many requests to take: up to ``cap``; a partial batch is cut to the
    largest preferred batch size that fits, when one does."""
    n = available if available < cap else cap
    if n < cap and config.preferred_batch_sizes:
        fitting = [p for p in config.preferred_batch_sizes if p <= n]
        if fitting:
            return max(fitting)
    return n


class RecentMean:
    """Mean of the last ``size`` values, updated in O(1)."""

    __slots__ = ("_values", "_sum")

    def __init__(self, size: int = 32) -> None:
        self._values: deque[float] = deque(maxlen=size)
        self._sum = 0.0

    def add(self, value: float) -> None:
        if len(self._values) == self._values.maxlen:
            self._sum -= self._values[0]
        self._values.append(value)
        self._sum += value

    @property
    def mean(self) -> float | None:
        return self._sum / len(self._values) if self._values else None

    def __len__(self) -> int:
        return len(self._values)
