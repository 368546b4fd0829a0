"""The autopilot against a simulated server, all on a fake clock.

The simulated server is the real batching core (``Batcher``) in front of one device
whose batch of ``n`` takes ``a * n + b`` plus seeded noise, fed by seeded Poisson
arrivals in phases (quiet, busy, burst, quiet). The autopilot's shell (``Autopilot``)
reads it through the same calls it makes on the engine (``model_names``, ``stats``,
``get_settings``/``update_settings``, the outcome window), so the whole loop, from the
window figures to the applied settings, runs deterministically (a simulated minute
takes a second or two).
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from types import SimpleNamespace

from runtime.api.config import BatchingConfig
from runtime.autopilot.shell import Autopilot
from runtime.autopilot.window import OutcomeWindow
from runtime.core.batcher import Batcher
from runtime.core.clock import FakeClock
from runtime.core.request import PendingRequest
from runtime.api.errors import QueueFull
from batchscope.storage.records import EventRow, ListRecorder

SLO_MS = 60.0
#: (seconds, arrivals per second)
PHASES = ((20.0, 50.0), (20.0, 350.0), (20.0, 600.0), (20.0, 50.0))


@dataclass
class SimServer:
    """One model on one device: batch time ``a * n + b`` seconds, plus noise; with
    ``lengths`` (lo, hi) a variable-length model whose requests' lengths are uniform in
    it and whose batch takes ``a`` per padded token instead of per item."""

    config: BatchingConfig
    a_s: float = 0.001
    b_s: float = 0.008
    noise: float = 0.05
    seed: int = 1
    lengths: tuple[int, int] | None = None
    clock: FakeClock = field(default_factory=lambda: FakeClock(start=0.0))

    def __post_init__(self) -> None:
        self.batcher = Batcher("sim", self.config, variable_length=self.lengths is not None)
        self.real = self.padded = 0
        self.window = OutcomeWindow()
        self.rng = random.Random(self.seed)
        self.device_s = 0.0
        self.busy_until: float | None = None
        self.running = None
        self.changes: list[tuple[float, dict, str]] = []
        #: (finished at, latency) of every request served, and refusals
        self.served: list[tuple[float, float]] = []
        #: batch size -> [batches, summed seconds], as the engine's inference totals keep them
        self.by_batch_size: dict[int, list] = {}
        self.refused = 0

    # -- what the autopilot's shell calls on an engine -----------------------------------
    def model_names(self) -> list[str]:
        return ["sim"]

    def get_settings(self, model: str) -> tuple[int, BatchingConfig]:
        return self.batcher.version, self.batcher.config

    def update_settings(self, model: str, changes: dict, requested_by: str):
        new = self.batcher.config.with_changes(changes)
        self.batcher.set_config(new, self.batcher.version + 1)
        self.changes.append((self.clock.now(), dict(changes), requested_by))
        return self.batcher.version, new

    def stats(self, model: str) -> dict:
        return {"queue_depth": self.batcher.depth, "device_time_s": self.device_s,
                "mean_batch_compute_s": self.batcher.mean_compute_s,
                "effective_max_batch_size": self.batcher.config.max_batch_size,
                "bucket_edges": (list(self.batcher.bucket_edges) if self.lengths else None)}

    def outcome_window(self, model: str) -> OutcomeWindow:
        return self.window

    def inference_totals(self, model: str) -> SimpleNamespace:
        return SimpleNamespace(by_batch_size={n: list(v) for n, v in self.by_batch_size.items()},
                               real_elements=self.real, padded_elements=self.padded)

    # -- the simulation ----------------------------------------------------------------------
    def _dispatch(self, now: float) -> None:
        if self.running is not None:
            return
        batch = self.batcher.next_batch(now)
        if batch is None:
            return
        n = batch.padded_elements if self.lengths else len(batch)
        took = (self.a_s * n + self.b_s) * (1.0 + self.noise * self.rng.uniform(-1, 1))
        self.running = batch
        self.busy_until = now + took

    def _finish(self, now: float) -> None:
        batch, self.running = self.running, None
        took = now - batch.dispatched_s
        self.busy_until = None
        self.device_s += took
        entry = self.by_batch_size.setdefault(len(batch), [0, 0.0])
        entry[0] += 1
        entry[1] += took
        self.real += batch.real_elements
        self.padded += batch.padded_elements
        arrived = [r.arrived_s for r in batch.requests]
        self.window.add_ok(now, arrived)
        self.served.extend((now, now - a) for a in arrived)
        self.batcher.complete(batch, now, took)

    def run(self, phases, pilot: Autopilot | None, tick_s: float = 0.25) -> None:
        clock = self.clock
        arrivals = random.Random(self.seed + 1)
        t = 0.0
        ends = []
        for length, rate in phases:
            ends.append((t + length, rate))
            t += length
        end = t
        phase = 0
        next_arrival = arrivals.expovariate(ends[0][1])
        next_tick = tick_s
        while True:
            now = clock.now()
            due = None if self.running is not None else self.batcher.due_at(now)
            candidates = [next_arrival, next_tick]
            if self.busy_until is not None:
                candidates.append(self.busy_until)
            if due is not None:
                candidates.append(max(due, now))
            at = min(candidates)
            if at > end:
                break
            clock.advance(max(0.0, at - now))
            now = clock.now()
            if self.busy_until is not None and now >= self.busy_until:
                self._finish(now)
            if now >= next_arrival:
                while phase < len(ends) - 1 and now >= ends[phase][0]:
                    phase += 1
                length = arrivals.randint(*self.lengths) if self.lengths else 1
                req = PendingRequest(None, length=length, arrived_s=now, priority=1)
                try:
                    self.batcher.submit(req, now)
                except QueueFull:
                    self.refused += 1
                    self.window.add_request("rejected", now, now)
                next_arrival = now + arrivals.expovariate(ends[phase][1])
            if now >= next_tick:
                if pilot is not None:
                    pilot.tick(now)
                next_tick += tick_s
            self._dispatch(now)

    def violation_seconds(self, slo_ms: float = SLO_MS) -> int:
        """Seconds whose served requests' p99 latency is over the SLO."""
        per_second: dict[int, list[float]] = {}
        for finished, latency in self.served:
            per_second.setdefault(int(finished), []).append(latency)
        bad = 0
        for latencies in per_second.values():
            latencies.sort()
            p99 = latencies[min(len(latencies) - 1, int(math.ceil(0.99 * len(latencies))) - 1)]
            bad += p99 * 1000.0 > slo_ms
        return bad

    def goodput(self, slo_ms: float = SLO_MS) -> int:
        return sum(1 for _, latency in self.served if latency * 1000.0 <= slo_ms)


def simulate(config: BatchingConfig, autopilot: bool, seed: int = 1, phases=PHASES, **sim):
    server = SimServer(config, seed=seed, **sim)
    recorder = ListRecorder()
    pilot = Autopilot(server, recorder=recorder, clock=server.clock) if autopilot else None
    server.run(phases, pilot)
    return server, recorder


#: a poor starting point: small batches that wait long for companions
POOR = BatchingConfig(max_batch_size=8, max_queue_delay_ms=40.0)


def test_the_autopilot_holds_the_slo_where_its_starting_settings_do_not():
    fixed, _ = simulate(POOR, autopilot=False)
    piloted, recorder = simulate(POOR.with_changes({"autopilot_slo_p99_ms": SLO_MS}),
                                 autopilot=True)
    # the burst outruns batches of 8: the fixed settings build a backlog for the whole
    # phase; the autopilot grows the batch and halves the delay
    assert fixed.violation_seconds() >= 15
    assert piloted.violation_seconds() * 2 <= fixed.violation_seconds()
    assert piloted.goodput() >= 1.5 * fixed.goodput()
    sizes = [c["max_batch_size"] for _, c, _ in piloted.changes if "max_batch_size" in c]
    assert sizes and sizes[0] == 12 and max(sizes) <= 32  # steps of 1.5x, at most 4x
    # every change came from the autopilot, each after an autopilot event with its reason
    assert all(by == "autopilot" for _, _, by in piloted.changes)
    events = [r for r in recorder.of(EventRow) if r.kind == "autopilot"]
    assert len(events) == len(piloted.changes) + 1  # + switching on
    assert events[0].message.startswith("autopilot on: p99 SLO 60 ms")
    assert all(json.loads(e.details_json)["window"]["ok"] >= 100 for e in events[1:])


def test_from_good_defaults_the_autopilot_does_no_harm():
    plain, _ = simulate(BatchingConfig(), autopilot=False)
    piloted, _ = simulate(BatchingConfig(autopilot_slo_p99_ms=SLO_MS), autopilot=True)
    assert piloted.violation_seconds() <= plain.violation_seconds() + 1
    assert piloted.goodput() >= 0.98 * plain.goodput()


def test_coarse_bucket_edges_give_way_to_derived_ones_when_padding_holds_the_device():
    # a variable-length model (lengths 8..128) whose batch time is per padded token: with
    # fixed edges 64, 128 a fifth of its device time pads, and the burst outruns it
    phases = ((20.0, 200.0), (20.0, 600.0), (20.0, 1000.0), (20.0, 200.0))
    coarse = BatchingConfig(max_batch_size=32, bucket_edges=(64, 128))
    sim = dict(lengths=(8, 128), a_s=0.00001, b_s=0.002, phases=phases)
    fixed, _ = simulate(coarse, autopilot=False, **sim)
    piloted, recorder = simulate(coarse.with_changes({"autopilot_slo_p99_ms": 100.0}),
                                 autopilot=True, **sim)
    assert fixed.violation_seconds(100.0) >= 15
    assert piloted.violation_seconds(100.0) * 2 <= fixed.violation_seconds(100.0)
    assert piloted.goodput(100.0) >= 1.5 * fixed.goodput(100.0)
    assert 1 - piloted.real / piloted.padded < 0.8 * (1 - fixed.real / fixed.padded)
    edges = [(at, c) for at, c, _ in piloted.changes if "bucket_edges" in c]
    assert edges and edges[0][1]["bucket_edges"] is None and 40.0 <= edges[0][0] < 45.0
    reasons = [e.message for e in recorder.of(EventRow) if "bucket_edges" in e.message]
    assert reasons and "of the padded tokens padding" in reasons[0]
    assert "bucket_edges 64,128 -> null" in reasons[0]
