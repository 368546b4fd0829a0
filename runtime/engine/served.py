"""``ServedModel``: what the request engine keeps about one model, and who changes it.

The parts of a served model are split by owner, so that a reader can tell from
the attribute alone which code moves it:

* ``name``, ``api``, ``variable``, ``batcher``: fixed at construction. The
  batcher's queue is changed by admission (``Engine``) and dispatch
  (``runtime.engine.dispatch``); its settings only by ``apply_settings`` here.
* ``governor``: the effective max batch size after out-of-memory errors; replaced
  only by ``apply_settings``, moved by booking (``runtime.engine.booking``), which
  then calls ``apply_caps``.
* ``batch_times``: the recent device time of its batches, which sets their execution
  timeout (``runtime.device.timeouts``); fed only by its dispatch loop, read by its
  executor.
* ``counts``: the figures ``Engine.stats`` reports, and the inference totals
  (``InferenceTotals``) behind ``Engine.inference_totals``; changed only by booking.

What belongs to one model's dispatch loop (batches on the device, answers not yet
handed out, its device turn) lives in its ``Dispatcher``; the CUDA-graph runner
lives in its thread executor.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from runtime.adapters.registry import AdapterRegistry
from runtime.api.config import BatchingConfig
from runtime.api.model import ModelAPI
from runtime.core.batcher import Batcher
from runtime.autopilot.window import OutcomeWindow  # autopilot: per-window latency figures
from runtime.device.oom import SizeGovernor
from runtime.device.timeouts import BatchTimes


#: rejection and expiry events of a model are folded into at most one of each per this
#: many seconds (a request model's, ``runtime.engine.engine``, and a generation model's)
EVENT_INTERVAL_S = 1.0


class Throttle:
    """Counts occurrences and says when to report them (at most once per interval)."""

    __slots__ = ("interval_s", "_last", "_pending")

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._last = -math.inf
        self._pending = 0

    def hit(self, now: float, n: int = 1) -> int:
        """Returns how many occurrences to report now (0: stay quiet)."""
        self._pending += n
        if now - self._last < self.interval_s:
            return 0
        self._last = now
        out, self._pending = self._pending, 0
        return out


@dataclass(slots=True)
class InferenceTotals:
    """What one model has served since it started, in the terms of Triton's statistics
    extension: requests by outcome with their summed durations, and executed batches by
    size with their summed compute time (changed only by ``runtime.engine.booking``)."""

    #: requests answered with a result, and the sum of their latencies (arrival to answer)
    success: int = 0
    success_s: float = 0.0
    #: requests answered with an error (any outcome but ok), and the sum of their latencies
    fail: int = 0
    fail_s: float = 0.0
    #: of the successful requests: the summed time from arrival until their batch started,
    #: and their batches' summed compute time (each request counted with its whole batch's)
    queue_s: float = 0.0
    compute_s: float = 0.0
    #: of ``compute_s``: the part in ``collate`` and the part in ``split``
    input_s: float = 0.0
    output_s: float = 0.0
    #: batches that ran without error, by batch size: [batches, summed compute seconds,
    #: of which in collate, of which in split]
    executions: int = 0
    by_batch_size: dict[int, list] = field(default_factory=dict)
    #: of those batches: the real and the padded input elements (tokens of a
    #: variable-length model; the two are equal for a fixed-shape one)
    real_elements: int = 0
    padded_elements: int = 0
    #: wall-clock time (seconds since the epoch) of the last successful request
    last_success_at: float | None = None

    def copy(self) -> "InferenceTotals":
        return dataclasses.replace(self, by_batch_size={
            size: list(v) for size, v in self.by_batch_size.items()})


@dataclass(slots=True)
class Counts:
    """One model's running totals (changed only by ``runtime.engine.booking``)."""

    #: rejection and expiry events are folded into one per this many seconds
    event_interval_s: float
    #: batch rows recorded (one per attempt, out-of-memory attempts included)
    batches: int = 0
    #: requests that got their outcome, and how many of each outcome
    requests: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)
    oom_events: int = 0
    inference: InferenceTotals = field(default_factory=InferenceTotals)
    window: OutcomeWindow = field(default_factory=OutcomeWindow)  # autopilot: fed by booking
    rejections: Throttle = field(init=False)
    expiries: Throttle = field(init=False)

    def __post_init__(self) -> None:
        self.rejections = Throttle(self.event_interval_s)
        self.expiries = Throttle(self.event_interval_s)


class ServedModel:
    """One request/response model the engine serves."""

    __slots__ = ("name", "api", "variable", "batcher", "governor", "counts", "batch_times",
                 "adapters")

    def __init__(self, name: str, api: ModelAPI, config: BatchingConfig,
                 event_interval_s: float) -> None:
        self.name = name
        self.api = api
        self.variable = bool(api.variable_length)
        self.batcher = Batcher(name, config, variable_length=self.variable)
        self.governor = SizeGovernor(config.max_batch_size, config.oom_probe_after_batches)
        self.counts = Counts(event_interval_s)
        self.batch_times = BatchTimes()
        #: the LoRA adapters it knows (None: the model takes none; changed by the engine's
        #: ``load_adapter``/``unload_adapter``)
        self.adapters: AdapterRegistry | None = None
        if api.adapter_targets:
            self.adapters = AdapterRegistry(name, api.adapter_targets, api.max_adapter_rank)
            self.batcher.enable_adapters(self.adapters.ref)

    @property
    def config(self) -> BatchingConfig:
        return self.batcher.config

    @property
    def settings_version(self) -> int:
        return self.batcher.version

    def bucket_keys(self) -> list[int | None]:
        """The keys the governor and the batcher's size caps are kept under."""
        return self.batcher.bucket_keys()  # derived bucket edges: the batcher's

    def apply_caps(self) -> None:
        """Give the batcher the governor's effective max batch size of every bucket."""
        gov = self.governor
        batcher = self.batcher
        for key in self.bucket_keys():
            cap = gov.limit(key)
            batcher.set_size_cap(key, cap if cap < gov.configured_max else None)

    def apply_settings(self, changes: dict) -> tuple[int, BatchingConfig, BatchingConfig]:
        """Validate and apply ``changes`` (``ConfigError``: nothing changes); the
        batcher decides with them from its next batch. Returns (new version, old
        settings, new settings). A change of the buckets starts the governor afresh;
        otherwise it keeps the caps that still lie below the new maximum."""
        old = self.batcher.config
        new = old.with_changes(changes)
        version = self.batcher.version + 1
        self.batcher.set_config(new, version)
        if (old.bucketing, old.bucket_edges) != (new.bucketing, new.bucket_edges):
            self.governor = SizeGovernor(new.max_batch_size, new.oom_probe_after_batches)
        else:
            self.governor.reconfigure(new.max_batch_size, new.oom_probe_after_batches)
        for key in set(self.bucket_keys()) | {None, *(old.bucket_edges or ()), -1}:
            self.batcher.set_size_cap(key, None)
        self.apply_caps()
        return version, old, new
