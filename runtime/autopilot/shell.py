"""``Autopilot``: the asyncio shell that runs a ``Controller`` per model.

Every ``interval_s`` it looks at every request model of the engine. A model whose
settings have ``autopilot_slo_p99_ms`` set gets a controller, started from its settings
at that moment; the controller is started afresh when the SLO or any setting changes
by someone else (the dashboard, the control API), so it never fights a person's change,
and dropped when the SLO is set back to null (the settings stay as they are).

Each tick builds an ``Observation`` from the model's ``OutcomeWindow`` (the engine's
booking feeds it), the engine's stats (queue depth, device time, recent batch time,
effective max batch size), its batch times per batch size (``Engine.inference_totals``)
and its settings, and hands it to the controller
(``tick(now)`` is synchronous, so tests drive it with any clock). A decision is applied
through the same path as a change from the control API, ``update_settings(...,
requested_by="autopilot")`` of the ``ModelDirectory``, so it becomes a
``settings_change`` event (old, new, requested_by) on the dashboard's timeline. Right
before it, an ``autopilot`` event carries the reason in its message and the
controller's state and window figures in its details; switching on and off are
``autopilot`` events too.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, replace
from typing import Any

from batchscope.storage.records import EventRow, RecorderLike
from runtime.api.errors import ConfigError
from runtime.autopilot.controller import Controller
from runtime.autopilot.terms import Decision, Knobs, Observation, Tuning
from runtime.autopilot.window import OutcomeWindow, Snapshot, WindowFigures, figures
from runtime.engine.directory import ModelDirectory

log = logging.getLogger("batchscope.autopilot")

#: how often the shell looks at the models
INTERVAL_S = 0.25
REQUESTED_BY = "autopilot"


def outcome_window(engine: Any, model: str) -> OutcomeWindow:
    """The running outcome figures the engine keeps for ``model``."""
    return engine.outcome_window(model)


def batch_totals(engine: Any, model: str) -> tuple[dict[int, tuple[int, float]], tuple[int, int]]:
    """The model's successful batches so far, from one read of its inference totals: by
    size (size -> (batches, summed compute seconds)), and their real and padded input
    elements; empty when the engine does not keep them."""
    reader = getattr(engine, "inference_totals", None)
    if reader is None:
        return {}, (0, 0)
    totals = reader(model)
    times = {int(n): (int(v[0]), float(v[1])) for n, v in totals.by_batch_size.items()}
    return times, (int(getattr(totals, "real_elements", 0)),
                   int(getattr(totals, "padded_elements", 0)))


def padding_share(before: tuple[int, int], after: tuple[int, int]) -> float | None:
    """The share of the padded elements between two ``batch_totals`` that is padding."""
    real, padded = after[0] - before[0], after[1] - before[1]
    return None if padded <= 0 else max(0.0, 1.0 - real / padded)


def knobs_of(config: Any, variable: bool) -> Knobs:
    """The controller's knobs from a model's settings; bucket edges only for a
    variable-length model that buckets by length."""
    knobs = Knobs(config.max_batch_size, config.max_queue_delay_ms)
    if variable and getattr(config, "bucketing", False):
        edges = config.bucket_edges
        knobs = replace(knobs, bucket_edges=None if edges is None else tuple(edges),
                        auto_bucket_count=config.auto_bucket_count)
    return knobs


def _window_times(before: dict[int, tuple[int, float]],
                  after: dict[int, tuple[int, float]]) -> dict[int, tuple[float, float]]:
    """size -> (batches, summed ms) between two ``batch_totals``."""
    out = {}
    for n, (count, seconds) in after.items():
        old_count, old_seconds = before.get(n, (0, 0.0))
        if count > old_count:
            out[n] = (float(count - old_count), (seconds - old_seconds) * 1000.0)
    return out


@dataclass
class _Pilot:
    """One model under the autopilot."""

    controller: Controller
    slo_p99_ms: float
    #: the settings version the autopilot knows (its own change, or the one it started on)
    version: int
    #: when the current window began, and the figures then
    since_s: float
    snapshot: Snapshot
    device_s: float
    times: dict[int, tuple[int, float]]
    #: the real and padded elements when the window began
    elements: tuple[int, int] = (0, 0)


class Autopilot:
    """Runs the autopilot of every model of ``engine`` that has it switched on."""

    def __init__(self, engine: Any, *, directory: ModelDirectory | None = None,
                 recorder: RecorderLike | None = None, instance_id: str = "local",
                 clock: Any = None, interval_s: float = INTERVAL_S,
                 tuning: Tuning | None = None) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s={interval_s!r} must be a positive number of seconds")
        self.engine = engine
        self.directory = directory or ModelDirectory(engine)
        self.recorder = recorder
        self.instance_id = instance_id
        self.clock = clock
        self.interval_s = interval_s
        self.tuning = tuning or Tuning()
        self._pilots: dict[str, _Pilot] = {}
        self._task: asyncio.Task | None = None
        #: every decision applied, oldest first (model, decision), the last 1000
        self.decisions: list[tuple[str, Decision]] = []

    # -- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(),
                                                                name="batchscope-autopilot")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    def _now(self) -> float:
        return self.clock.now() if self.clock is not None else time.monotonic()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                self.tick(self._now())
            except Exception:  # a bug here must not stop serving; say so and go on
                log.exception("the autopilot tick failed")

    def state(self, model: str) -> dict[str, Any] | None:
        """The controller's state of ``model`` (None: autopilot off)."""
        pilot = self._pilots.get(model)
        if pilot is None:
            return None
        c = pilot.controller
        return {"slo_p99_ms": pilot.slo_p99_ms, "state": c.state, "note": c.note,
                "start": c.start.settings()}

    # -- one tick ---------------------------------------------------------------------------
    def tick(self, now: float) -> list[Decision]:
        """Look at every model once; returns the decisions applied."""
        applied = []
        for name in self.engine.model_names():
            decision = self._tick_model(name, now)
            if decision is not None:
                applied.append(decision)
        return applied

    def _tick_model(self, name: str, now: float) -> Decision | None:
        version, config = self.directory.get_settings(name)
        slo = getattr(config, "autopilot_slo_p99_ms", None)
        pilot = self._pilots.get(name)
        if slo is None:
            if pilot is not None:
                del self._pilots[name]
                self._event(name, now, "autopilot off: the settings stay as they are",
                            state="off")
            return None
        stats = self.engine.stats(name)
        knobs = knobs_of(config, stats.get("bucket_edges") is not None)
        if pilot is None or pilot.slo_p99_ms != slo or pilot.version != version:
            why = ("on" if pilot is None else
                   "SLO changed" if pilot.slo_p99_ms != slo else "settings changed")
            controller = Controller(slo, knobs, now,
                                    min_batch_size=max(config.preferred_batch_sizes, default=1),
                                    tuning=self.tuning)
            self._pilots[name] = _Pilot(controller, slo, version, now,
                                        outcome_window(self.engine, name).snapshot(),
                                        stats.get("device_time_s", 0.0),
                                        *batch_totals(self.engine, name))
            self._event(name, now, f"autopilot {why}: p99 SLO {slo:g} ms, starting from "
                                   f"max_batch_size={knobs.max_batch_size}, max_queue_delay_ms="
                                   f"{_ms(knobs.max_queue_delay_ms)}",
                        state=controller.state, slo_p99_ms=slo)
            return None
        snapshot = outcome_window(self.engine, name).snapshot()
        times, done = batch_totals(self.engine, name)
        duration = now - pilot.since_s
        window = figures(pilot.snapshot, snapshot, duration, slo)
        device_s = stats.get("device_time_s", 0.0)
        compute = stats.get("mean_batch_compute_s")
        obs = Observation(
            now_s=now, window=window, queue_depth=int(stats.get("queue_depth", 0)),
            utilization=(min(1.0, max(0.0, (device_s - pilot.device_s) / duration))
                         if duration > 0 else 0.0),
            batch_compute_ms=None if compute is None else compute * 1000.0,
            effective_max_batch_size=int(stats.get("effective_max_batch_size",
                                                   knobs.max_batch_size)),
            knobs=knobs, batch_ms_by_size=_window_times(pilot.times, times),
            padding_share=(padding_share(pilot.elements, done)
                           if knobs.auto_bucket_count is not None else None))
        step = pilot.controller.observe(obs)
        if step.window_done:
            pilot.since_s, pilot.snapshot, pilot.device_s = now, snapshot, device_s
            pilot.times, pilot.elements = times, done
        if step.decision is None:
            return None
        return self._apply(name, pilot, step.decision, window, now)

    def _apply(self, name: str, pilot: _Pilot, decision: Decision, window: WindowFigures,
               now: float) -> Decision | None:
        self._event(name, now, decision.reason, state=decision.state, changes=decision.changes,
                    window=_window_doc(window))
        try:
            version, _ = self.directory.update_settings(name, decision.changes,
                                                        requested_by=REQUESTED_BY)
        except ConfigError as exc:
            # e.g. a preferred batch size above the new max: say so, keep the settings
            self._event(name, now, f"autopilot could not apply {decision.changes}: "
                                   f"{exc.message}", "warning", state=decision.state)
            return None
        pilot.version = version
        self.decisions.append((name, decision))
        del self.decisions[:-1000]
        return decision

    def _event(self, model: str, now: float, message: str, severity: str = "info",
               **details: Any) -> None:
        if self.recorder is None:
            return
        wall = self.clock.to_wall(now) if self.clock is not None and hasattr(
            self.clock, "to_wall") else time.time() - (time.monotonic() - now)
        self.recorder.put(EventRow(self.instance_id, model, wall, "autopilot", message,
                                   severity, json.dumps(details, default=str)))


def _ms(value: float | None) -> str:
    return "null" if value is None else f"{value:g}"


def _window_doc(w: WindowFigures) -> dict[str, Any]:
    return {"duration_s": round(w.duration_s, 3), "ok": w.ok, "failed": w.failed,
            "p50_ms": None if w.p50_ms is None else round(w.p50_ms, 2),
            "p99_ms": None if w.p99_ms is None else round(w.p99_ms, 2),
            "goodput_rps": round(w.goodput_rps, 1),
            "mean_batch_size": None if w.mean_batch_size is None else round(w.mean_batch_size, 2)}
