"""Per-request cost of the batching core with a no-op workload.

``python -m benchmarks.bench_core [n_requests]`` prints, for a few configurations,
the microseconds one request costs in ``submit`` plus its share of ``next_batch``
(the request object included, no model, no asyncio). Times vary with the machine;
this is a measurement tool, not a test.
"""

from __future__ import annotations

import sys
import time

from runtime.api.config import BatchingConfig
from runtime.core.batcher import Batcher
from runtime.core.request import PendingRequest


def measure(config: BatchingConfig, *, n: int, variable_length: bool = False,
            lengths: tuple[int, ...] = (1,), timeout_s: float | None = None,
            decide_every: int = 32) -> float:
    """Microseconds per request: submit every request, ask ``next_batch`` until it
    returns None every ``decide_every`` arrivals."""
    batcher = Batcher("bench", config, variable_length=variable_length)
    levels = config.priority_levels
    count = len(lengths)
    now = 0.0
    started = time.perf_counter()
    for i in range(n):
        now += 1e-6
        batcher.submit(PendingRequest(None, length=lengths[i % count], priority=i % levels,
                                      arrived_s=now,
                                      deadline_s=None if timeout_s is None else now + timeout_s),
                       now)
        if i % decide_every == decide_every - 1:
            while batcher.next_batch(now) is not None:
                pass
    return (time.perf_counter() - started) / n * 1e6


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    n = int(args[0]) if args else 200_000
    cases = [
        ("dynamic, fixed size, batches of 32", {}, dict(decide_every=32)),
        ("dynamic, fixed size, a decision per request", {}, dict(decide_every=1)),
        ("dynamic, fixed size, with deadlines", {}, dict(decide_every=32, timeout_s=1.0)),
        ("bucketed variable length, a decision per request", {"max_queue_delay_ms": 0.0},
         dict(decide_every=1, variable_length=True, lengths=(10, 50, 100, 200, 300))),
    ]
    for label, changes, kw in cases:
        us = measure(BatchingConfig().with_changes(changes), n=n, **kw)
        print(f"{label:52s} {us:6.2f} us per request")


if __name__ == "__main__":
    main()
