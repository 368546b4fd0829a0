"""When a device process on the CPU runs nicer than the serving process.

On a CPU device the device process's forward passes and the serving process's event loop
share the cores. Which of the two should yield depends on which is the pipeline's narrow
part:

* a small model (``mlp``): a request costs the loop more CPU (HTTP, JSON, batching) than
  it costs the model in a batch, so the loop is the bound, and every moment it waits for
  a core behind a forward pass, every request waits. The device process should run
  nicer and take the cores the loop leaves (``mlp`` at 64 clients on 2 cores: 1.09x the
  throughput, ``benchmarks/bench_device_nice.py``);
* a model whose compute dominates (``encoder``, ``wide``): the model is the bound; a
  nicer device process gains nothing at normal load and, under overload, loses the
  cores to the loop refusing requests (``wide`` at 3x its capacity: 88 % goodput and
  answers past their deadline in one run of two, against 101 % and none).

``LoopBound`` tells the two apart from what the engine measures anyway: the loop
thread's CPU time per request offered to the engine, refused ones included
(``time.thread_time`` on the loop, over windows of at least ``MIN_REQUESTS``), against
the model's device time per request in its batches
(``Batcher.mean_compute_per_request_s``). Counting the refused keeps an overloaded
server's model first: at 3x its capacity the loop refuses two requests for each it
serves, and its cost per request served triples, while its cost per request does not. Once the model's is the
smaller, the process is made ``nice`` levels nicer, for good: an unprivileged process
may lower its own or its children's priority but never raise it back, so the decision is
one way (a new child after a crash starts at the level reached). A synchronous state
machine with time and counters passed in; ``runtime.engine.executors.ProcessExecutor``
is its shell.
"""

from __future__ import annotations

#: how often a process not yet made nicer is looked at (seconds)
CHECK_EVERY_S = 1.0
#: the fewest requests a window must hold before the loop's cost per request is trusted
MIN_REQUESTS = 200


class RequestTally:
    """Requests offered to the engine, refused or not, all models together (the loop's
    CPU is shared by all of them)."""

    __slots__ = ("n",)

    def __init__(self) -> None:
        self.n = 0


class LoopBound:
    """Whether one device process should now run ``nice`` levels nicer (see module doc)."""

    def __init__(self, nice: int, tally: RequestTally, *, check_every_s: float = CHECK_EVERY_S,
                 min_requests: int = MIN_REQUESTS) -> None:
        self.nice = int(nice)
        self.tally = tally
        self.check_every_s = check_every_s
        self.min_requests = min_requests
        #: made nicer already (nothing more to decide)
        self.applied = False
        #: the loop's CPU seconds per request over the last window that held enough
        self.loop_s_per_request: float | None = None
        #: (time, loop CPU seconds, requests) where the current window began
        self._since: tuple[float, float, int] | None = None

    def due(self, now: float) -> bool:
        """Whether a look is due at ``now`` (cheap: asked at every batch)."""
        if self.applied or self.nice <= 0:
            return False
        return self._since is None or now - self._since[0] >= self.check_every_s

    def decide(self, now: float, loop_cpu_s: float, device_s_per_request: float | None) -> bool:
        """A look at ``now``: True (once) when the process should be made nicer, the
        model's device time per request being below the loop's CPU per request over the
        window that ends here. A window of too few requests is extended, not judged."""
        if self.applied or self.nice <= 0:
            return False
        if self._since is None:
            self._since = (now, loop_cpu_s, self.tally.n)
            return False
        began, cpu0, req0 = self._since
        served = self.tally.n - req0
        if served < self.min_requests:
            return False
        self._since = (now, loop_cpu_s, self.tally.n)
        self.loop_s_per_request = (loop_cpu_s - cpu0) / served
        if device_s_per_request is not None and device_s_per_request < self.loop_s_per_request:
            self.applied = True
            return True
        return False
