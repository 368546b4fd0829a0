"""A tuning session as a synchronous state machine with time passed in.

The shell (``batchscope.tuning.runner``) drives it with a plain loop::

    trial = session.next_trial(now)             # None: the session is over
    # send trial.changes; the server refused them -> session.refused(trial, why, now)
    session.started(trial, now)                 # the server runs trial.point now
    # wait settle_s, then per window of window_s:
    verdict = session.add_window(trial, window, now)   # MORE, DONE or RESTORE
    # RESTORE (live traffic): send session.restore_changes() at once

and reads ``session.result(now)`` at the end. Nothing here reads a clock, sleeps or
does I/O, so every rule is tested with made-up windows and times.

The rules (the first three are ``figures.Stability`` and ``figures.Objective``):

- **Stability** (perf_analyzer's): a trial counts once its last ``windows`` measurement
  windows agree, throughput and p99 each within ``tolerance`` (10 %) of their mean;
  its figures are then the mean of those windows. After ``max_windows`` without
  agreement it ends *unstable*: reported, told to the optimizer, never the best.
- **Overload**: a trial whose last ``windows`` windows all break the SLO with the p99
  rising window after window is counted at once, as infeasible: its queue grows, and
  waiting for windows that agree would only leave a longer backlog (the shell lets
  the server work off what is left before the next trial).
- **Feasibility**: p99 at most the SLO, at most 1 % of requests failed, no out-of-memory
  event during the trial (the runtime's OOM recovery keeps requests safe; the point is
  marked infeasible), settings the server accepts, and for the latency objective the
  target rate served.
- **Objective**: goodput (requests per second answered within the SLO) subject to
  p99 <= SLO, goodputs within 5 % of the best a tie that the lower p99 wins; or the
  lowest p99 at a target rate.
- **Early stopping**: after ``min_trials``, the session ends when the best of the last
  ``patience`` trials improved on the best before them by less than ``min_gain``; also
  when the budget cannot fit another trial, when the search space is exhausted, or when
  the optimizer keeps proposing points already measured.
- **Live guard**: on live traffic a trial window that breaks the SLO ends the trial at
  once and the starting settings are put back, so no setting breaks the SLO for more
  than one window.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

from batchscope.tuning.figures import GOODPUT, GOODPUT_TIE, Objective, Stability, Window
from batchscope.tuning.space import SearchSpace, changes_between, point_key
from batchscope.tuning.trials import (ABORTED, CANCELLED, COUNTED, REFUSED, RUNNING, UNSTABLE,
                                      Trial, TuningResult)


class Verdict(Enum):
    MORE = "more"          # measure another window
    DONE = "done"          # the trial is over
    RESTORE = "restore"    # the trial is over; put the starting settings back now


@dataclass(frozen=True)
class Stopping:
    """When a session ends early. ``patience`` None: never on gains (the grid)."""

    budget_s: float
    min_trials: int = 16
    patience: int | None = 10
    min_gain: float = 0.02
    #: proposals of already measured points in a row before the search counts as done
    max_repeats: int = 30


class Proposer(Protocol):
    """What to try next. The first point proposed is the starting point."""

    def propose(self) -> dict | None: ...          # None: nothing left to try

    def observe(self, point: dict, score: float) -> None: ...


class TuningSession:
    def __init__(self, space: SearchSpace, proposer: Proposer, objective: Objective, *,
                 now: float, stopping: Stopping, stability: Stability = Stability(),
                 settle_s: float = 0.5, window_s: float = 1.0, live: bool = False) -> None:
        self.space, self.proposer, self.objective = space, proposer, objective
        self.stopping, self.stability = stopping, stability
        self.settle_s, self.window_s, self.live = settle_s, window_s, live
        self.started_at = now
        self.start = dict(space.start)
        #: the tuned settings the server runs now, as far as the session knows
        self.applied = dict(space.start)
        self.trials: list[Trial] = []
        self.stop_reason: str | None = None
        self._by_key: dict[str, Trial] = {}
        self._best_after: list[Trial | None] = []
        self._space_size = space.size()

    # -- what to try --------------------------------------------------------------------
    @property
    def min_trial_s(self) -> float:
        return self.settle_s + self.stability.windows * self.window_s

    def elapsed_s(self, now: float) -> float:
        return now - self.started_at

    def next_trial(self, now: float) -> Trial | None:
        """The next trial to run (its ``changes`` to send first), or None when over."""
        if self.stop_reason is None and self.trials:
            self.stop_reason = self._why_stop(now)
        if self.stop_reason is not None:
            return None
        repeats = 0
        while True:
            point = self.proposer.propose() if len(self._by_key) < self._space_size else None
            if point is None:
                self.stop_reason = f"every point of the space was measured ({len(self.trials)})"
                return None
            seen = self._by_key.get(point_key(point))
            if seen is None:
                break
            self.proposer.observe(point, seen.score if seen.score is not None else 0.0)
            repeats += 1
            if repeats >= self.stopping.max_repeats:
                self.stop_reason = (f"the search kept proposing measured points "
                                    f"({repeats} in a row)")
                return None
        trial = Trial(number=len(self.trials), point=point,
                      changes=changes_between(self.applied, point), started_s=now)
        self.trials.append(trial)
        self._by_key[point_key(point)] = trial
        return trial

    def _why_stop(self, now: float) -> str | None:
        left = self.stopping.budget_s - self.elapsed_s(now)
        if left < self.min_trial_s:
            return f"the budget of {self.stopping.budget_s:g} s was used"
        patience = self.stopping.patience
        done = len(self._best_after)
        if patience is None or done < max(self.stopping.min_trials, patience + 1):
            return None
        before, after = self._best_after[done - 1 - patience], self._best_after[-1]
        if before is None or after is None or before.figures is None or after.figures is None:
            return None
        if self.objective.gain(before.figures, after.figures) < self.stopping.min_gain:
            return (f"the last {patience} trials gained less than "
                    f"{100 * self.stopping.min_gain:g} % on the best")
        return None

    # -- what happened --------------------------------------------------------------------
    def started(self, trial: Trial, now: float) -> None:
        """The server accepted ``trial.changes``: it runs the trial's point now."""
        self.applied = dict(trial.point)

    def refused(self, trial: Trial, reason: str, now: float) -> None:
        """The server refused the settings (e.g. 422): an infeasible point."""
        self._finish(trial, REFUSED, None, f"refused by the server: {reason}", now)

    def add_window(self, trial: Trial, window: Window, now: float) -> Verdict:
        """One more measurement window of ``trial``; what to do next."""
        trial.windows.append(window)
        problem = self.objective.problem(window)
        if window.oom_events:
            self._finish(trial, COUNTED, window, problem, now)
            return Verdict.DONE
        if self.live and trial.number > 0 and self.objective.breaks_slo(window):
            self._finish(trial, ABORTED, window, f"{problem}; the starting settings were "
                                                 "put back after one window", now)
            return Verdict.RESTORE
        stab = self.stability
        if self._overloaded(trial.windows):
            figures = Window.mean_of(trial.windows[-stab.windows:])
            last = trial.windows[-1]
            self._finish(trial, COUNTED, figures,
                         f"p99 {last.p99_ms:.0f} ms > SLO {self.objective.slo_p99_ms:g} ms "
                         f"and rising for {stab.windows} windows: overloaded", now)
            return Verdict.DONE
        if stab.agree(trial.windows):
            figures = Window.mean_of(trial.windows[-stab.windows:])
            self._finish(trial, COUNTED, figures, self.objective.problem(figures), now)
            return Verdict.DONE
        over_budget = self.elapsed_s(now) >= self.stopping.budget_s and trial.number > 0
        if len(trial.windows) >= stab.max_windows or over_budget:
            figures = Window.mean_of(trial.windows)
            self._finish(trial, UNSTABLE, figures, self.objective.problem(figures), now)
            return Verdict.DONE
        return Verdict.MORE

    def _overloaded(self, windows: list[Window]) -> bool:
        n = self.stability.windows
        last = windows[-n:]
        if len(windows) < max(2, n) or not all(self.objective.breaks_slo(w) for w in last):
            return False
        p99s = [w.p99_ms for w in last]
        return all(p is not None for p in p99s) and all(b > a for a, b in zip(p99s, p99s[1:]))

    def _finish(self, trial: Trial, status: str, figures: Window | None, problem: str | None,
                now: float) -> None:
        trial.status, trial.figures, trial.problem, trial.ended_s = status, figures, problem, now
        trial.score = self.objective.score(figures, trial.feasible)
        self.proposer.observe(trial.point, trial.score)
        self._best_after.append(self.best)

    def cancel(self, now: float) -> None:
        """Stop the session (the running trial, if any, is dropped)."""
        for trial in self.trials:
            if trial.status == RUNNING:
                trial.status, trial.ended_s = CANCELLED, now
        self.stop_reason = "cancelled"

    def restore_changes(self) -> dict:
        """The settings to send to put the starting ones back (empty when they run)."""
        return changes_between(self.applied, self.start)

    def restored(self) -> None:
        self.applied = dict(self.start)

    # -- results --------------------------------------------------------------------------
    @property
    def baseline(self) -> Trial | None:
        """The trial of the starting settings."""
        first = self.trials[0] if self.trials else None
        return first if first is not None and first.point == self.start else None

    @property
    def best(self) -> Trial | None:
        """The feasible counted trial with the highest score; for goodput, of those within
        ``GOODPUT_TIE`` of it the one with the lowest p99 (the earliest on a tie)."""
        best = None
        for trial in self.trials:
            if trial.feasible and (best is None or (trial.score or 0) > (best.score or 0)):
                best = trial
        if best is None or self.objective.kind != GOODPUT:
            return best
        # goodput within GOODPUT_TIE of the best is a tie: the lowest p99 wins it
        top = best.score or 0.0
        tied = [t for t in self.trials if t.feasible and t.figures is not None
                and (t.score or 0.0) >= (1.0 - GOODPUT_TIE) * top]
        return min(tied, key=lambda t: (t.figures.p99_ms if t.figures.p99_ms is not None
                                        else math.inf, -(t.score or 0.0)))

    def progress(self, now: float) -> float:
        """How far the session is, 0..1 (of its budget; 1 once it ended)."""
        if self.stop_reason is not None:
            return 1.0
        return max(0.0, min(1.0, self.elapsed_s(now) / self.stopping.budget_s))

    def result(self, now: float, model: str = "") -> "TuningResult":
        return TuningResult(model=model, objective=self.objective, start=dict(self.start),
                            trials=list(self.trials), best=self.best, baseline=self.baseline,
                            elapsed_s=self.elapsed_s(now),
                            stop_reason=self.stop_reason or "running")
