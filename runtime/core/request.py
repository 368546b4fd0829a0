"""A request waiting in a model's queue.

``PendingRequest`` is what the batcher holds: the decoded item plus the few facts
the dispatch decision needs (length, priority, arrival, deadline, bypass). The
``future`` slot belongs to the shell that awaits the answer, ``trace`` to the
tracer (``runtime.engine.tracing``); the core never touches them. Removing a
request from the middle of a queue would cost O(n), so the
core marks it instead (``state``) and skips dead entries lazily when it meets them.
"""

from __future__ import annotations

from typing import Any

#: waiting in a queue
QUEUED = 0
#: taken into a batch
DISPATCHED = 1
#: deadline passed while queued; never executed
EXPIRED = 2
#: withdrawn by its caller (client went away) or at shutdown
CANCELLED = 3


class PendingRequest:
    """One queued request. Times are monotonic seconds."""

    __slots__ = ("item", "length", "priority", "bypass", "arrived_s", "deadline_s",
                 "seq", "state", "future", "bucket", "trace", "adapter")

    def __init__(self, item: Any, *, length: int = 1, priority: int = 0, bypass: bool = False,
                 arrived_s: float = 0.0, deadline_s: float | None = None,
                 future: Any = None, trace: Any = None, adapter: str | None = None) -> None:
        self.item = item
        self.length = length
        self.priority = priority
        self.bypass = bypass
        self.arrived_s = arrived_s
        self.deadline_s = deadline_s
        self.future = future
        #: arrival order within one batcher (set by ``Batcher.submit``)
        self.seq = 0
        self.state = QUEUED
        #: bucket edge it was queued under (None: fixed size or no bucketing; -1 overflow)
        self.bucket: int | None = None
        #: the request's ``runtime.core.tracing.RequestTrace`` when it is traced, else None
        #: (the only thing the engine checks for a request that is not)
        self.trace = trace
        #: the LoRA adapter the request names (None: the base model)
        self.adapter = adapter

    def __repr__(self) -> str:
        return (f"PendingRequest(seq={self.seq}, priority={self.priority}, length={self.length}, "
                f"bypass={self.bypass}, state={self.state})")
