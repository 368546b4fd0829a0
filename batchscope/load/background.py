"""A load that runs until stopped, read window by window: what the tuner measures with.

``BackgroundLoad`` runs one of the generator's loops (closed loop, Poisson open loop, or
a recorded schedule) on an event loop in a thread of its own. Every outcome is kept with
the time it finished (``time.perf_counter``), so ``window(start, end)`` gives the
latencies and failures of any span while the load keeps going: settings can change
under a steady load and each span be judged on its own. An open loop (Poisson or
recorded) can be paused: its arrivals keep their schedule but are not sent, so a server
left with a backlog can work it off before the next span.
"""

from __future__ import annotations

import asyncio
import threading
import time
from bisect import bisect_left
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np

from batchscope.load import loadgen
from batchscope.load.loadgen import LoadError, Tally, Until
from batchscope.load.replay import RecordedTraffic, replay_arrivals
from batchscope.threadnames import name_native


@dataclass(frozen=True)
class Completions:
    """What finished in one window: latencies of the answered requests and the rest."""

    duration_s: float
    #: client-side latencies of the 200 answers, in milliseconds
    latencies_ms: np.ndarray
    #: outcomes other than 200 (refusals, expiries, errors, failed connections)
    failed: int

    @property
    def finished(self) -> int:
        return int(self.latencies_ms.size) + self.failed


class BackgroundLoad:
    """Drive ``model`` at ``url`` until ``stop()``.

    ``rate``: Poisson arrivals per second (open loop); ``traffic``: a recorded schedule
    (open loop, ``speed`` times as fast); else ``concurrency`` connections (closed loop).
    """

    def __init__(self, url: str, model: str, *, concurrency: int | None = 16,
                 rate: float | None = None, traffic: RecordedTraffic | None = None,
                 speed: float = 1.0, lengths: str | None = None, timeout_ms: float | None = None,
                 seed: int = 0, max_connections: int = 512) -> None:
        loadgen.check_options(rate=rate, concurrency=concurrency if traffic is None else 1,
                              lengths=lengths)
        self.host, self.port = loadgen.split_url(url)
        self.url, self.model = url, model
        self.concurrency, self.rate, self.traffic, self.speed = concurrency, rate, traffic, speed
        self.lengths, self.timeout_ms, self.seed = lengths, timeout_ms, seed
        self.max_connections = max_connections
        self.metadata: dict = {}
        self.tally = Tally()
        self._until = Until(float("inf"))
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Future | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._paused = False

    @property
    def mode(self) -> str:
        return "replay" if self.traffic is not None else "open" if self.rate else "closed"

    def describe(self) -> str:
        lengths = f", lengths {self.lengths}" if self.lengths else ""
        if self.traffic is not None:
            return f"replay of {self.traffic.describe()} at {self.speed:g}x"
        if self.rate:
            return f"open loop at {self.rate:g} req/s{lengths}"
        return f"closed loop with {self.concurrency} connections{lengths}"

    # -- life cycle -------------------------------------------------------------------
    def start(self, timeout_s: float = 30.0) -> "BackgroundLoad":
        """Fetch the model's metadata, start the load; ``LoadError`` when it cannot."""
        self._thread = threading.Thread(target=self._run, name="batchscope-load", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout_s):
            self.stop()
            raise LoadError(f"the load on {self.url} did not start within {timeout_s:g} s")
        if self._error is not None:
            self.stop()
            raise self._error
        return self

    def stop(self, timeout_s: float = 15.0) -> None:
        """Stop sending and drop what is in flight (idempotent)."""
        loop, task = self._loop, self._task
        if loop is not None and task is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(task.cancel)
            except RuntimeError:  # the loop closed meanwhile
                pass
        if self._thread is not None:
            self._thread.join(timeout_s)

    def __enter__(self) -> "BackgroundLoad":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def _run(self) -> None:
        name_native()
        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            try:
                self.metadata = await loadgen.fetch_metadata(self.url, self.model)
                work = self._work()
            except BaseException as exc:  # reported by start()
                self._error = exc
                self._ready.set()
                return
            self._task = asyncio.ensure_future(work)
            self._ready.set()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

        try:
            loadgen.run_async(main())
        except BaseException as exc:  # pragma: no cover - a loop that could not start
            self._error = exc
            self._ready.set()

    def _work(self) -> Any:
        target = f"/v2/models/{self.model}/infer"

        def wrap(body: bytes) -> bytes:
            return loadgen.request_bytes("POST", self.host, self.port, target, body)

        if self.traffic is not None:
            recorded = replay_arrivals(self.traffic, self.metadata, speed=self.speed,
                                       seed=self.seed)
            arrivals: Iterator[tuple[bytes, float]] = ((wrap(b), gap) for b, gap in recorded)
        else:
            payloads = loadgen.build_payloads(self.metadata, lengths=self.lengths,
                                              timeout_ms=self.timeout_ms, seed=self.seed)
            requests = [wrap(b) for b in payloads]
            if not self.rate:
                return loadgen.closed_loop(self.host, self.port, requests,
                                           int(self.concurrency or 1), self._until,
                                           1 << 62, self.tally)
            arrivals = loadgen.poisson_arrivals(requests, self.rate, self.seed)
        return loadgen.open_loop(self.host, self.port, self._gated(arrivals), self._until, 1 << 62,
                                 self.max_connections, self.tally, drain_grace_s=0.0)

    def _gated(self, arrivals: Iterator[tuple[bytes, float]]) -> Iterator[tuple[bytes | None, float]]:
        for request, gap in arrivals:
            yield (None if self._paused else request), gap

    # -- pausing an open loop -----------------------------------------------------------
    @property
    def pausable(self) -> bool:
        return self.mode != "closed"

    def pause(self) -> None:
        """Stop sending new arrivals (an open loop; a closed loop has no backlog to work
        off, its connections wait for their answers)."""
        self._paused = self.pausable

    def resume(self) -> None:
        self._paused = False

    # -- reading ----------------------------------------------------------------------
    @property
    def in_flight(self) -> int:
        """Requests sent and not finished yet."""
        return max(0, self.tally.sent - len(self.tally.done_at))

    @staticmethod
    def now() -> float:
        """The clock completions are timed with."""
        return time.perf_counter()

    def window(self, start: float, end: float) -> Completions:
        """What finished between ``start`` and ``end`` (``now()`` seconds)."""
        tally = self.tally
        done = tally.done_at
        n = len(done)
        lo = bisect_left(done, start, 0, n)
        hi = bisect_left(done, end, lo, n)
        status = np.asarray(tally.status[lo:hi], dtype=np.int64)
        lat = np.asarray(tally.latency_s[lo:hi], dtype=np.float64) * 1000.0
        ok = status == 200
        return Completions(duration_s=max(0.0, end - start), latencies_ms=lat[ok],
                           failed=int((~ok).sum()))

    def count(self, start: float, end: float) -> int:
        """How many requests finished between ``start`` and ``end``."""
        done = self.tally.done_at
        n = len(done)
        return bisect_left(done, end, 0, n) - bisect_left(done, start, 0, n)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()
