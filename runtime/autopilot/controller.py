"""``Controller``: keep one model's p99 latency under an SLO while serving as much as it can.

A synchronous state machine with time passed in: the shell (``runtime.autopilot.shell``)
hands it an ``Observation`` every tick (the window of outcomes since the window began,
the queue depth, the device's busy share, the batch times by size, the settings) and
applies what it decides. It moves the settings of the dynamic policy, in bounded steps:

* ``max_queue_delay_ms`` (None = work-conserving): how long a partial batch waits;
* ``max_batch_size``: between the largest preferred batch size (or 1) and
  ``Tuning.ceiling_factor`` times the starting value, never raised while the OOM
  governor holds the model below it;
* for a variable-length model, its bucket edges: fixed edges become edges derived from
  the traffic, and derived ones grow finer (``auto_bucket_count`` doubles, up to
  ``max_bucket_count``) -- less padding, so less device time per request.

The controller predicts with the model's measured batch times (``BatchCost``, a line
``per_item_ms * n + per_batch_ms`` fitted to the batch sizes seen, runtime.autopilot.cost):
a full batch's time at a new size, the capacity ``n / time(n)`` and the device time per
request.

A window is judged once it holds ``min_samples`` outcomes and ``min_batches`` successful
batches (a model whose batches take long serves in steps, and a window of a few of them
says little about its rate) and lasts ``min_window_s`` (a window that reaches
``max_window_s`` with fewer is dropped: too quiet to judge; one where most requests fail
needs no batches).
Then, with ``S`` the SLO:

1. **Over the SLO** (p99 > S, or nothing succeeded): when the model is *saturated*
   (batches run full and a full one waits: arrivals outrun it) and a bigger batch
   would serve ``gain`` more (or too few sizes were seen to tell), ``max_batch_size``
   grows (by ``raise_factor``, or up to ``max_raise_factor`` when the fitted line says
   that is what serves the arrivals -- settled requests plus the queue's growth -- with
   ``headroom``); else, when a full batch takes more than ``batch_share`` of S and at
   least ``batch_visible`` of the p99 (a p99 many times the longest batch is the queue's
   wait, which a smaller batch does not shorten), ``max_batch_size`` shrinks to the
   largest batch that fits in it (at most by half a
   step) -- while saturated only if that costs less than ``worse`` of the capacity, and
   never below the size whose capacity is ``headroom`` above the arrival rate --
   unless the delay is at least ``delay_visible`` of the p99: a delay is halved first
   then, and whenever the batch does not shrink (below ``min_delay_ms`` it becomes
   work-conserving). Before the delay and the size come down, a variable-length model
   whose device is ``busy_share`` busy with a queue waiting, and whose batches' padded
   tokens are at least ``padding_high`` padding, gets finer bucket edges.
2. **Room** (p99 < ``room`` · S for ``room_windows`` windows in a row): when the model
   is saturated, ``max_batch_size`` grows while the bigger batch stays within
   ``batch_share`` of S and serves more; else, when the queue builds (requests wait
   while the device is ``busy_share`` busy) but batches are small, and the per-batch
   cost says fuller batches would need ``delay_saving`` less device time per request,
   the delay grows by ``delay_step_share`` of S (up to ``delay_share`` of S). Before
   that, with batches not full (work-conserving dispatch sizes them to the arrivals, so a
   higher cap costs nothing now), the controller gets ready for a burst: when the fitted
   line (``ready_sizes`` sizes or more) says a full batch ``raise_factor`` larger would
   still take at most ``ready_share`` of S and serve ``gain`` more, ``max_batch_size``
   grows -- never past ``extrapolate`` times the largest batch it has timed.
3. Between the two (hysteresis): no move.

Guard rails: after every move a ``cooldown_s`` passes before the next window starts;
a move is undone when the window after it is worse, and its direction is not tried
again for ``block_s`` (doubled for each move in that direction undone in a row, up to
``max_block_s``). Worse means, after a shorter delay (made over the SLO, so it can only
have cost capacity): serving ``worse`` less while the queue grew by ``worse`` of that
rate and the p99 did not come down; after a longer delay: a p99 over the SLO; when the model
was saturated before the move (its backlog makes latency grow whatever is done, so only
the rate tells): serving ``worse`` less, or -- after growing the batch, still saturated
-- not ``gain`` more; otherwise, at about the same load: the share of requests within
the SLO down by ``worse``, p99 pushed over the SLO, or -- after a longer delay --
device time per request not down by half what the move promised (at least ``gain`` / 2).
When p99 stays over the SLO for ``fallback_after`` windows with neither p99 nor the
queue going down, the settings the controller started from come back and it holds
them for ``hold_s`` ("fallback") -- unless the model is saturated and the fitted line
says they serve ``worse`` less than the present ones (a backlog is worked off faster
where it is). Every decision carries its reason in words.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from runtime.autopilot.cost import BatchCost, BatchTimes
from runtime.autopilot.terms import (FALLBACK, LOWERING, RAISING, REVERTED, SETTLING, VIOLATING,
                                     WATCHING, Decision, Knobs, Observation, Step, Tuning)
from runtime.autopilot.window import WindowFigures

@dataclass(slots=True)
class _Probe:
    """A move whose effect the next window shows."""

    before: Knobs
    direction: str
    window: WindowFigures
    saturated: bool
    #: device time per request served in the window before the move
    device_ms: float
    #: the queue's depth when the move was made
    depth: int = 0
    #: the share of device time per request the move promised to save (a longer delay)
    promised: float = 0.0


def _ms(value: float | None) -> str:
    return "null" if value is None else f"{value:g}"


def _word(name: str, value: Any) -> str:
    """A setting's value in a decision's reason: null, 4.5, 32,64,128."""
    if value is None:
        return "null"
    if name == "max_queue_delay_ms":
        return _ms(value)
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value)
    return str(value)


@dataclass
class Controller:
    """The autopilot of one model (see the module docstring)."""

    slo_p99_ms: float
    start: Knobs
    now_s: float
    #: the smallest max_batch_size it may set (the largest preferred batch size, or 1)
    min_batch_size: int = 1
    tuning: Tuning = field(default_factory=Tuning)
    state: str = field(default=WATCHING, init=False)
    #: the last decision's reason, or what it is doing when it did not move
    note: str = field(default="started", init=False)

    def __post_init__(self) -> None:
        if not (self.slo_p99_ms > 0 and math.isfinite(self.slo_p99_ms)):
            raise ValueError(f"slo_p99_ms={self.slo_p99_ms!r} must be a positive number")
        self.min_batch_size = max(1, min(self.min_batch_size, self.start.max_batch_size))
        self._settle_until = self.now_s
        self._hold_until = -math.inf
        self._blocked: dict[str, float] = {}
        #: moves undone in a row, per direction (each doubles the next block)
        self._undone: dict[str, int] = {}
        self._probe: _Probe | None = None
        self._last_p99: float | None = None
        self._last_depth: int | None = None
        self._last_at: float | None = None
        self._stuck = 0
        self._room = 0
        self._times = BatchTimes()

    @property
    def ceiling(self) -> int:
        return min(4096, max(self.start.max_batch_size,
                             int(self.start.max_batch_size * self.tuning.ceiling_factor)))

    # -- the tick -----------------------------------------------------------------------
    def observe(self, obs: Observation) -> Step:
        t = self.tuning
        w = obs.window
        if obs.now_s < self._settle_until:
            self.state = SETTLING
            return Step(True)
        if w.samples < t.min_samples or w.duration_s < t.min_window_s or (
                w.batches < t.min_batches and w.failed <= w.ok):
            if w.duration_s >= t.max_window_s:
                self._probe = None
                self._last_p99 = self._last_depth = self._last_at = None
                self.note = (f"{w.samples} requests in {w.batches} batches in "
                             f"{w.duration_s:.1f} s: too few to judge (needs {t.min_samples} "
                             f"in {t.min_batches})")
                return Step(True)
            return Step(False)
        self._times.add(obs.batch_ms_by_size)
        decision = self._judge(obs)
        self._last_p99 = self._p99(w)
        self._last_depth = obs.queue_depth
        self._last_at = obs.now_s
        if decision is not None:
            self._settle_until = obs.now_s + t.cooldown_s
            self.note = decision.reason
            self.state = decision.state
        return Step(True, decision)

    @staticmethod
    def _p99(w: WindowFigures) -> float:
        return w.p99_ms if w.p99_ms is not None else math.inf

    def _judge(self, obs: Observation) -> Decision | None:
        t = self.tuning
        now, w, knobs = obs.now_s, obs.window, obs.knobs
        slo = self.slo_p99_ms
        p99 = self._p99(w)
        if now < self._hold_until:
            self.state = FALLBACK
            return None
        probe, self._probe = self._probe, None
        if probe is not None and self._worse(probe, obs):
            undone = self._undone[probe.direction] = self._undone.get(probe.direction, 0) + 1
            self._blocked[probe.direction] = now + min(t.max_block_s,
                                                       t.block_s * 2.0 ** (undone - 1))
            self._stuck = 0
            return self._decide(knobs, probe.before, REVERTED,
                                f"{self._figures(w)} after {probe.direction.replace('_', ' ')} "
                                f"(was {self._figures(probe.window)}): back to")
        if probe is not None:
            self._undone.pop(probe.direction, None)
        if p99 > slo:
            self._room = 0
            last, depth = self._last_p99, self._last_depth
            improving = last is not None and (
                p99 < (1.0 - t.improving) * last
                or (depth is not None and obs.queue_depth < (1.0 - t.improving) * depth))
            self._stuck = 0 if improving else self._stuck + 1
            if self._stuck >= t.fallback_after and knobs != self.start \
                    and not self._start_serves_less(obs):
                self._stuck = 0
                self._hold_until = now + t.hold_s
                self._blocked.clear()
                self._undone.clear()
                return self._decide(knobs, self.start, FALLBACK,
                                    f"p99 {p99:.0f} ms over the SLO of {slo:g} ms for "
                                    f"{t.fallback_after} windows without improving: back to "
                                    "the starting settings,")
            decision = self._over(obs, p99)
            if decision is None:
                self.state = VIOLATING
                self.note = f"p99 {p99:.0f} ms > SLO {slo:g} ms and no step left"
            return decision
        self._stuck = 0
        if p99 >= t.room * slo:
            self._room = 0
            self.state = WATCHING
            return None
        self._room += 1
        if self._room < t.room_windows:
            self.state = WATCHING
            return None
        decision = self._under(obs, p99)
        if decision is not None:
            self._room = 0
        else:
            self.state = WATCHING
        return decision

    # -- the moves --------------------------------------------------------------------------
    def _over(self, obs: Observation, p99: float) -> Decision | None:
        t = self.tuning
        knobs, slo = obs.knobs, self.slo_p99_ms
        delay = knobs.max_queue_delay_ms
        head = f"p99 {p99:.0f} ms > SLO {slo:g} ms"
        cost = self._cost(obs)
        size = min(knobs.max_batch_size, obs.effective_max_batch_size)
        saturated = self._saturated(obs)
        if saturated and self._can_raise(obs):
            arrivals = self._arrival_rps(obs)
            bigger = self._raised(knobs, cost, (1.0 + t.headroom) * arrivals)
            if cost is None or cost.sizes < 2 or \
                    cost.capacity_rps(bigger) >= (1.0 + t.gain) * cost.capacity_rps(size):
                return self._move(obs, replace(knobs, max_batch_size=bigger), "batch_up",
                                  RAISING, f"{head} with {obs.queue_depth} queued, full "
                                           f"batches and about {arrivals:.0f} arrivals/s"
                                           f"{self._capacity(cost, size, bigger)}:")
        finer = self._finer_buckets(obs, head)
        if finer is not None:
            return finer
        halve = delay is not None and self._allowed("delay_down", obs.now_s)
        limit = t.batch_share * slo
        # the longest batch is what a smaller maximum shortens: the largest batch the
        # window ran, not the maximum itself (work-conserving batches that stay small are
        # not what holds the p99 up, and a lower maximum would only cost the next burst)
        top = min(size, max(obs.batch_ms_by_size, default=size))
        # ... and only while that batch is a visible part of the p99: a p99 many times the
        # longest batch is the queue's wait, which a smaller batch does not shorten (it
        # would only serve less)
        long_batch = (cost is not None and top > self.min_batch_size and cost.ms(top) > limit
                      and cost.ms(top) >= t.batch_visible * p99)
        # a delay that is a visible part of the latency goes first; a short one is not what
        # holds the p99 up while a full batch takes too long
        if halve and (not long_batch or delay >= t.delay_visible * p99):
            return self._halve_delay(obs, head)
        shrink = self._shrink(obs, head, cost, size, top, saturated) if long_batch else None
        if shrink is None and halve:
            return self._halve_delay(obs, head)
        return shrink

    def _finer_buckets(self, obs: Observation, head: str) -> Decision | None:
        """Finer bucket edges for a busy variable-length model whose batches are mostly
        padding (module docstring, rule 1): fixed edges become derived ones (at least
        twice as many), derived ones twice as many."""
        t = self.tuning
        knobs, share = obs.knobs, obs.padding_share
        count = knobs.auto_bucket_count
        if count is None or share is None or share < t.padding_high \
                or obs.utilization < t.busy_share or obs.queue_depth <= 0 \
                or not self._allowed("buckets_up", obs.now_s):
            return None
        if knobs.bucket_edges is not None:
            finer = min(t.max_bucket_count, max(count, 2 * len(knobs.bucket_edges)))
            new = replace(knobs, bucket_edges=None, auto_bucket_count=finer)
        elif count < t.max_bucket_count:
            new = replace(knobs, auto_bucket_count=min(t.max_bucket_count, 2 * count))
        else:
            return None
        return self._move(obs, new, "buckets_up", LOWERING,
                          f"{head}, device {obs.utilization:.0%} busy with {obs.queue_depth} "
                          f"queued and {share:.0%} of the padded tokens padding:")

    def _halve_delay(self, obs: Observation, head: str) -> Decision | None:
        knobs = obs.knobs
        half = (knobs.max_queue_delay_ms or 0.0) / 2.0
        new = replace(knobs, max_queue_delay_ms=half if half >= self.tuning.min_delay_ms else None)
        return self._move(obs, new, "delay_down", LOWERING, f"{head}:")

    def _shrink(self, obs: Observation, head: str, cost: BatchCost, size: int, top: int,
                saturated: bool) -> Decision | None:
        """A smaller ``max_batch_size``: the largest batch within ``batch_share`` of the SLO,
        at most half a step down, and only one below ``top``, the largest batch the window
        ran (a lower maximum the batches do not reach shortens nothing); while saturated
        only if it keeps the capacity, and never one whose capacity (by the fitted line)
        is below ``1 + headroom`` times the rate requests arrive at (or ``1 - worse`` of
        this size's, when that is lower)."""
        t = self.tuning
        if not self._allowed("batch_down", obs.now_s):
            return None
        lower = max(self.min_batch_size, int(size * t.lower_floor),
                    min(top - 1, cost.largest_within(t.batch_share * self.slo_p99_ms)))
        if lower >= top:
            return None
        if saturated and not (cost.sizes >= 2 and cost.capacity_rps(lower)
                              >= (1.0 - t.worse) * cost.capacity_rps(size)):
            return None
        rate = self._arrival_rps(obs)
        if cost.sizes >= 2 and rate > 0:  # and it must still serve the arrivals, with room
            # (or, where even this size cannot, lose at most ``worse`` of its capacity)
            need = min((1.0 + t.headroom) * rate, (1.0 - t.worse) * cost.capacity_rps(size))
            while lower < size and cost.capacity_rps(lower) < need:
                lower += 1
            if lower >= size:
                return None
        return self._move(obs, replace(obs.knobs, max_batch_size=lower), "batch_down",
                          LOWERING, f"{head}, a batch of {top} takes about "
                                    f"{cost.ms(top):.0f} ms:")

    def _under(self, obs: Observation, p99: float) -> Decision | None:
        t = self.tuning
        knobs, slo, w = obs.knobs, self.slo_p99_ms, obs.window
        head = f"p99 {p99:.0f} ms < {t.room:g} x SLO {slo:g} ms"
        cost = self._cost(obs)
        size = min(knobs.max_batch_size, obs.effective_max_batch_size)
        if self._saturated(obs) and self._can_raise(obs) and cost is not None:
            bigger = self._raised(knobs)
            if cost.ms(bigger) <= t.batch_share * slo and (
                    cost.sizes < 2
                    or cost.capacity_rps(bigger) >= (1.0 + t.gain) * cost.capacity_rps(size)):
                return self._move(obs, replace(knobs, max_batch_size=bigger), "batch_up",
                                  RAISING, f"{head} with {obs.queue_depth} queued and full "
                                           f"batches{self._capacity(cost, size, bigger)}:")
        ready = self._ready(obs, head, cost, size)
        if ready is not None:
            return ready
        mean = w.mean_batch_size or 0.0
        if not (obs.utilization >= t.busy_share and obs.queue_depth > 0 and 0 < mean
                and mean < t.full_share * size and cost is not None and cost.sizes >= 2
                and cost.per_batch_ms > 0 and self._allowed("delay_up", obs.now_s)):
            return None
        delay = knobs.max_queue_delay_ms or 0.0
        new = min(t.delay_share * slo, delay + max(t.min_delay_ms, t.delay_step_share * slo))
        if new <= delay + 1e-9:
            return None
        fuller = min(float(size), mean + w.settled_rps * (new - delay) / 1000.0)
        now_ms, then_ms = cost.per_request_ms(mean), cost.per_request_ms(fuller)
        if then_ms > (1.0 - t.delay_saving) * now_ms:
            return None
        saving = 1.0 - then_ms / now_ms
        return self._move(obs, replace(knobs, max_queue_delay_ms=round(new, 3)), "delay_up",
                          RAISING, f"{head}, {obs.queue_depth} queued, device "
                                   f"{obs.utilization:.0%} busy with batches of {mean:.1f} "
                                   f"(about {fuller:.1f} would take {saving:.0%} "
                                   "less device time per request):", promised=saving)

    def _ready(self, obs: Observation, head: str, cost: BatchCost | None,
               size: int) -> Decision | None:
        """A larger ``max_batch_size`` ahead of a burst (module docstring, rule 2)."""
        t = self.tuning
        mean = obs.window.mean_batch_size or 0.0
        if cost is None or cost.sizes < t.ready_sizes or cost.per_batch_ms <= 0 \
                or mean >= t.full_share * size or not self._can_raise(obs):
            return None
        bigger = min(self._raised(obs.knobs), int(t.extrapolate * self._times.largest()))
        if bigger <= obs.knobs.max_batch_size \
                or cost.ms(bigger) > t.ready_share * self.slo_p99_ms \
                or cost.capacity_rps(bigger) < (1.0 + t.gain) * cost.capacity_rps(size):
            return None
        return self._move(obs, replace(obs.knobs, max_batch_size=bigger), "batch_up", RAISING,
                          f"{head}, batches of {mean:.1f}: ready for a burst"
                          f"{self._capacity(cost, size, bigger)}, a full batch about "
                          f"{cost.ms(bigger):.0f} ms:")

    def _cost(self, obs: Observation) -> BatchCost | None:
        """The fitted batch cost, else a guess in proportion to the recent mean batch."""
        cost = self._times.cost()
        if cost is not None:
            return cost
        mean, compute = obs.window.mean_batch_size, obs.batch_compute_ms
        if not mean or compute is None:
            return None
        return BatchCost(compute / mean, 0.0, 1)

    @staticmethod
    def _capacity(cost: BatchCost | None, size: int, bigger: int) -> str:
        if cost is None or cost.sizes < 2:
            return ""
        return (f" (capacity about {cost.capacity_rps(size):.0f} -> "
                f"{cost.capacity_rps(bigger):.0f} req/s)")

    # -- helpers ------------------------------------------------------------------------------
    def _saturated(self, obs: Observation) -> bool:
        """Batches run full and a full one waits: more per batch would serve more."""
        size = min(obs.knobs.max_batch_size, obs.effective_max_batch_size)
        mean = obs.window.mean_batch_size or 0.0
        return mean >= self.tuning.full_share * size and obs.queue_depth >= size

    def _start_serves_less(self, obs: Observation) -> bool:
        """Saturated, and the fitted line says the starting settings serve ``worse`` less
        than these: going back would only make the backlog grow faster."""
        cost = self._cost(obs)
        if not self._saturated(obs) or cost is None or cost.sizes < 2:
            return False
        now = min(obs.knobs.max_batch_size, obs.effective_max_batch_size)
        start = min(self.start.max_batch_size, obs.effective_max_batch_size)
        return cost.capacity_rps(start) < (1.0 - self.tuning.worse) * cost.capacity_rps(now)

    def _can_raise(self, obs: Observation) -> bool:
        knobs = obs.knobs
        return (knobs.max_batch_size < self.ceiling
                and obs.effective_max_batch_size >= knobs.max_batch_size
                and self._allowed("batch_up", obs.now_s))

    def _raised(self, knobs: Knobs, cost: BatchCost | None = None,
                need_rps: float = 0.0) -> int:
        """The next larger ``max_batch_size``: ``raise_factor`` times this one, or up to
        ``max_raise_factor`` times where the fitted line says that much is needed to serve
        ``need_rps``."""
        t = self.tuning
        size = knobs.max_batch_size
        bigger = max(size + 1, int(size * t.raise_factor))
        if cost is not None and cost.sizes >= 2 and need_rps > 0:
            most = max(bigger, int(size * t.max_raise_factor))
            while bigger < most and cost.capacity_rps(bigger) < need_rps:
                bigger += 1
        return min(self.ceiling, bigger)

    def _arrival_rps(self, obs: Observation) -> float:
        """Requests arriving per second: those settled in the window plus the queue's
        growth since the last judged window (a saturated model settles only its capacity)."""
        rate = obs.window.settled_rps
        if self._last_depth is not None and self._last_at is not None \
                and obs.now_s > self._last_at:
            rate += max(0, obs.queue_depth - self._last_depth) / (obs.now_s - self._last_at)
        return rate

    def _allowed(self, direction: str, now: float) -> bool:
        return self._blocked.get(direction, -math.inf) <= now

    def _worse(self, probe: _Probe, obs: Observation) -> bool:
        """The window after a move is worse than the one before it (module docstring)."""
        t = self.tuning
        before, after = probe.window, obs.window
        if probe.direction == "delay_down":
            # a delay that came down over the SLO can only have cost capacity: then the
            # rate served falls while the queue grows (by ``worse`` of that rate) and the
            # p99 does not come down. A p99 that keeps rising at the same rate is the
            # backlog the window before left, not the move
            grew = obs.queue_depth - probe.depth
            return (after.throughput_rps < (1.0 - t.worse) * before.throughput_rps
                    and grew >= t.worse * before.throughput_rps * after.duration_s
                    and self._p99(after) >= self._p99(before))
        if probe.direction == "delay_up" and self._p99(after) > self.slo_p99_ms:
            # a longer delay trades latency for device time, never past the SLO (whatever
            # the load did meanwhile)
            return True
        if probe.saturated:
            served = before.throughput_rps
            if after.throughput_rps < (1.0 - t.worse) * served:
                return True
            return (probe.direction == "batch_up" and self._saturated(obs)
                    and after.throughput_rps < (1.0 + t.gain) * served)
        load = before.settled_rps
        if load <= 0 or abs(after.settled_rps - load) > t.same_load * load:
            return False
        # the share of requests within the SLO, not the goodput itself: at about the same
        # load, the arrivals of a short window vary by more than ``worse`` on their own
        if after.goodput_rps < (1.0 - t.worse) * before.goodput_rps * (
                after.settled_rps / load):
            return True
        p99_before, p99_after = self._p99(before), self._p99(after)
        if p99_after > self.slo_p99_ms and p99_after > (1.0 + t.worse) * p99_before:
            return True
        # a longer delay is worth its latency only if it saves device time per request: at
        # least half what it promised (and ``gain`` / 2)
        saving = max(t.gain, probe.promised) / 2.0
        return probe.direction == "delay_up" and \
            self._device_ms(obs) > (1.0 - saving) * probe.device_ms

    @staticmethod
    def _device_ms(obs: Observation) -> float:
        w = obs.window
        return 1000.0 * obs.utilization * w.duration_s / w.ok if w.ok else math.inf

    @staticmethod
    def _figures(w: WindowFigures) -> str:
        p99 = "-" if w.p99_ms is None else f"{w.p99_ms:.0f} ms"
        return f"p99 {p99}, goodput {w.goodput_rps:.0f}/s"

    def _move(self, obs: Observation, new: Knobs, direction: str, state: str,
              why: str, promised: float = 0.0) -> Decision | None:
        if new == obs.knobs:
            return None
        self._probe = _Probe(obs.knobs, direction, obs.window, self._saturated(obs),
                             self._device_ms(obs), obs.queue_depth, promised)
        return self._decide(obs.knobs, new, state, why)

    def _decide(self, old: Knobs, new: Knobs, state: str, why: str) -> Decision | None:
        changes = old.changes_to(new)
        if not changes:
            return None
        words = ", ".join(f"{k} {_word(k, getattr(old, k))} -> {_word(k, v)}"
                          for k, v in changes.items())
        return Decision(changes, new, f"{why} {words}", state)
