"""What a session tries next: Optuna's TPE sampler, or every point in turn.

Both propose the starting point first (so the session measures the current settings
before anything else) and take each trial's score back through ``observe``.

``OptunaSearch`` asks a seeded ``TPESampler`` (multivariate, grouped: the queue delay
is only a parameter under the dynamic policy) through Optuna's ask-and-tell interface;
the ordered settings (max batch size, queue delay) are integer indices into their
candidate lists, so the sampler sees their order. The same seed and the same scores
give the same proposals. ``GridSearch`` walks the exhaustive grid of the same space.
"""

from __future__ import annotations

import logging
import warnings
from collections import defaultdict
from typing import Any

from batchscope.tuning.space import SearchSpace, point_key

#: random proposals before TPE models the scores
STARTUP_TRIALS = 6


class OptunaSearch:
    def __init__(self, space: SearchSpace, *, seed: int = 0,
                 startup_trials: int = STARTUP_TRIALS) -> None:
        import optuna

        optuna.logging.set_verbosity(logging.WARNING)
        with warnings.catch_warnings():  # multivariate/group are marked experimental
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=startup_trials,
                                                 multivariate=True, group=True)
        self.space = space
        self.study = optuna.create_study(direction="maximize", sampler=sampler)
        self.study.enqueue_trial(space.start_params())
        self._asked: dict[str, list[Any]] = defaultdict(list)

    def propose(self) -> dict | None:
        trial = self.study.ask()
        point = self.space.suggest(trial)
        self._asked[point_key(point)].append(trial)
        return point

    def observe(self, point: dict, score: float) -> None:
        asked = self._asked.get(point_key(point))
        if asked:
            self.study.tell(asked.pop(0), score)


class GridSearch:
    def __init__(self, space: SearchSpace) -> None:
        self._points = iter(space.grid())

    def propose(self) -> dict | None:
        return next(self._points, None)

    def observe(self, point: dict, score: float) -> None:
        pass
