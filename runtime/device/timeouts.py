"""How long one batch may run before it is cut: from the model's own recent batches.

A fixed ``execution_timeout_ms`` must leave room for the slowest legitimate batch of
any model, a first batch's warm-up included (30 s by default), so a model that hangs
holds its requests, and its device, for that long. With ``execution_timeout_auto`` on
(the default) a model that has run ``MIN_BATCHES`` batches gets ``MULTIPLE`` times the
99th percentile of its last ``WINDOW`` batch times instead, never less than
``FLOOR_S`` and never more than ``execution_timeout_ms`` (which stays the ceiling, and
the timeout of the first batches). A mlp batch of a few milliseconds is then cut after
2 s, not 30. The percentile leaves out the longest batch even among a few (one in a
hundred among many): one hang that ran to its end before the model had batches enough
for a timeout of its own, or a slow first batch, must not set the next timeout, while
a model whose long batches are a real part of its traffic keeps room for them.

``typical_s`` (the median) is what the dispatch loop takes as "this batch overstays"
(``runtime.engine.dispatch``), for the same reason.

``BatchTimes`` is fed by the model's dispatch loop with each batch's device time and
read by its executor when a batch is sent. Synchronous and clock-free.
"""

from __future__ import annotations

from collections import deque
from typing import Any

#: batches a model must have run before its timeout follows them
MIN_BATCHES = 5
#: the timeout is this many times the recent 99th percentile batch time ...
MULTIPLE = 10.0
#: ... and at least this long
FLOOR_S = 2.0
#: how many recent batch times are kept
WINDOW = 512
#: the percentile is recomputed after this many new batch times
REFRESH_EVERY = 32


class BatchTimes:
    """The recent batch times of one model and the execution timeout they give."""

    __slots__ = ("_times", "_new", "_p50", "_p99")

    def __init__(self) -> None:
        self._times: deque[float] = deque(maxlen=WINDOW)
        self._new = 0
        self._p50: float | None = None
        self._p99: float | None = None

    def observe(self, seconds: float) -> None:
        """A batch of the model ran for ``seconds`` on the device."""
        self._times.append(seconds)
        self._new += 1

    def _refresh(self) -> bool:
        """Recompute the percentiles when due; False before ``MIN_BATCHES``."""
        times = self._times
        if len(times) < MIN_BATCHES:
            return False
        if self._p99 is None or self._new >= REFRESH_EVERY:
            ordered = sorted(times)
            n = len(ordered)
            self._p50 = ordered[n // 2]
            self._p99 = ordered[n - 1 - max(1, n // 100)]  # the longest one left out
            self._new = 0
        return True

    @property
    def p99_s(self) -> float | None:
        """The 99th percentile of the recent batch times, never the longest one (None
        before ``MIN_BATCHES``)."""
        return self._p99 if self._refresh() else None

    @property
    def typical_s(self) -> float | None:
        """The median recent batch time (None before ``MIN_BATCHES``)."""
        return self._p50 if self._refresh() else None

    def timeout_s(self, config: Any) -> float | None:
        """The execution timeout of the model's next batch under ``config`` (a
        ``BatchingConfig``), in seconds; None: no timeout."""
        ceiling_ms = config.execution_timeout_ms
        ceiling = None if ceiling_ms is None else ceiling_ms / 1000.0
        if not config.execution_timeout_auto:
            return ceiling
        p99 = self.p99_s
        if p99 is None:
            return ceiling
        auto = max(FLOOR_S, MULTIPLE * p99)
        return auto if ceiling is None else min(auto, ceiling)
