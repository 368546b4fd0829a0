"""What a session found: each ``Trial``, and the ``TuningResult`` with its sentence.

The sentence states the result the way Model Analyzer does: "`max_batch_size=64,
max_queue_delay_ms=null` gives 23 % more goodput than the current settings at
p99 <= 50 ms (17 trials, 120 s)", with the variants for a best point that is the
current one, a current setting that breaks the SLO, and no setting that meets it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from batchscope.tuning.figures import GOODPUT, LATENCY, Objective, Window
from batchscope.tuning.space import changes_between, format_point

# trial statuses
RUNNING = "running"
COUNTED = "counted"        # stable windows (or decisive: out of memory)
UNSTABLE = "unstable"      # no agreement within max_windows, or cut by the budget
REFUSED = "refused"        # the server refused the settings
ABORTED = "aborted"        # live traffic: broke the SLO in a window, start put back
CANCELLED = "cancelled"


@dataclass
class Trial:
    number: int
    point: dict
    #: the settings sent to reach the point from what ran before it
    changes: dict
    started_s: float
    status: str = RUNNING
    windows: list[Window] = field(default_factory=list)
    figures: Window | None = None
    #: why the point is infeasible (None: feasible, or not decided)
    problem: str | None = None
    ended_s: float | None = None
    score: float | None = None

    @property
    def feasible(self) -> bool:
        return self.status == COUNTED and self.problem is None

    @property
    def duration_s(self) -> float:
        return (self.ended_s or self.started_s) - self.started_s

    def row(self, start: dict) -> dict[str, Any]:
        """The trial as a table row (for the dashboard and ``--json``)."""
        f = self.figures
        return {"trial": self.number, "status": self.status, "feasible": self.feasible,
                "goodput_rps": None if f is None else round(f.goodput_rps, 2),
                "throughput_rps": None if f is None else round(f.throughput_rps, 2),
                "p99_ms": None if f is None or f.p99_ms is None else round(f.p99_ms, 2),
                "windows": len(self.windows), "duration_s": round(self.duration_s, 2),
                "settings": format_point(self.point),
                "changed": format_point(changes_between(start, self.point)) or "(starting)",
                "problem": self.problem, "point": self.point}


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} ms"


@dataclass
class TuningResult:
    model: str
    objective: Objective
    start: dict
    trials: list[Trial]
    best: Trial | None
    baseline: Trial | None
    elapsed_s: float
    stop_reason: str
    #: what became of the server's settings at the end: "restored", "applied", ...
    outcome: str = ""
    #: the stored session's id (``batchscope.tuning.store``), and where it is stored or
    #: why it is not
    stored_as: int | None = None
    storage: str = ""

    @property
    def measured(self) -> int:
        """Trials that ran (refused ones included, cancelled ones not)."""
        return sum(t.status not in (RUNNING, CANCELLED) for t in self.trials)

    @property
    def recommended(self) -> dict | None:
        """The best point's settings that differ from the starting ones (None: no
        feasible point; empty: the starting settings are the best)."""
        if self.best is None:
            return None
        return changes_between(self.start, self.best.point)

    def sentence(self) -> str:
        """The result the way Model Analyzer states it."""
        tail = f" ({self.measured} trials, {self.elapsed_s:.0f} s)"
        best = self.best
        if best is None or best.figures is None:
            return self._nothing_met() + tail + "."
        changed = changes_between(self.start, best.point)
        if not changed:
            return self._start_is_best(best.figures) + tail + "."
        return self._compared(f"`{format_point(changed)}`", best.figures) + tail + "."

    def _nothing_met(self) -> str:
        slo = self.objective.slo_p99_ms
        unsettled = [t for t in self.trials
                     if t.status == UNSTABLE and t.problem is None and t.figures is not None]
        if unsettled:
            top = max(unsettled, key=lambda t: t.score or 0.0)
            fig = top.figures
            assert fig is not None
            what = format_point(changes_between(self.start, top.point)) or "the current settings"
            return (f"No setting's windows agreed within the stability tolerance (a noisy load "
                    f"or machine; try a longer --window-s); the best unsettled one was `{what}` "
                    f"with {fig.goodput_rps:.1f} req/s of goodput at p99 {_ms(fig.p99_ms)}")
        measured = [(t.figures.p99_ms, t) for t in self.trials
                    if t.figures is not None and t.figures.p99_ms is not None]
        if not measured:
            return "No setting could be measured"
        p99, low = min(measured, key=lambda pair: pair[0])
        return (f"No setting met p99 <= {slo:g} ms; the lowest p99 was {_ms(p99)} with "
                f"`{format_point(low.point)}`")

    def _start_is_best(self, fig: Window) -> str:
        slo = self.objective.slo_p99_ms
        what = (f"{fig.goodput_rps:.1f} req/s of goodput" if self.objective.kind == GOODPUT
                else f"the lowest p99 at {self.objective.target_rps:g} req/s")
        return (f"The current settings are the best found: {what} at p99 <= {slo:g} ms "
                f"(p99 {_ms(fig.p99_ms)})")

    def _compared(self, text: str, fig: Window) -> str:
        slo = self.objective.slo_p99_ms
        base = self.baseline
        old = None if base is None else base.figures
        if base is None or old is None or base.problem is not None \
                or base.status not in (COUNTED, UNSTABLE):
            why = "" if base is None or base.problem is None else f" ({base.problem})"
            return (f"{text} meets p99 <= {slo:g} ms with {fig.goodput_rps:.1f} req/s of "
                    f"goodput (p99 {_ms(fig.p99_ms)}); the current settings do not{why}")
        settled = "" if base.status == COUNTED else "; the current settings' windows never agreed"
        pct = 100 * self.objective.gain(old, fig)
        if self.objective.kind == LATENCY:
            return (f"{text} gives {pct:.0f} % lower p99 than the current settings at "
                    f"{self.objective.target_rps:g} req/s ({_ms(fig.p99_ms)} instead of "
                    f"{_ms(old.p99_ms)}, SLO {slo:g} ms{settled})")
        return (f"{text} gives {pct:.0f} % more goodput than the current settings at "
                f"p99 <= {slo:g} ms ({fig.goodput_rps:.1f} vs {old.goodput_rps:.1f} req/s"
                f"{settled})")

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "objective": self.objective.kind,
                "slo_p99_ms": self.objective.slo_p99_ms, "target_rps": self.objective.target_rps,
                "start": self.start, "recommended": self.recommended,
                "best": None if self.best is None else self.best.row(self.start),
                "baseline": None if self.baseline is None else self.baseline.row(self.start),
                "trials": [t.row(self.start) for t in self.trials], "elapsed_s": self.elapsed_s,
                "stop_reason": self.stop_reason, "outcome": self.outcome,
                "stored_as": self.stored_as, "storage": self.storage,
                "sentence": self.sentence()}
