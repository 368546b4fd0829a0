"""The autopilot's ``Controller`` on a fake clock with synthetic window figures, and the
``OutcomeWindow`` it is fed from."""

from __future__ import annotations

import math
import random

import pytest

from runtime.autopilot.controller import (FALLBACK, LOWERING, RAISING, REVERTED, SETTLING,
                                          VIOLATING, WATCHING, Controller, Knobs, Observation,
                                          Tuning)
from runtime.autopilot.cost import BatchTimes, fit
from runtime.autopilot.window import (BOUNDS_S, OutcomeWindow, WindowFigures, count_within,
                                      figures, quantile_s)

SLO = 100.0
START = Knobs(max_batch_size=16, max_queue_delay_ms=None)
#: batch times by size, (batches, summed ms): 1 ms per item + 4 ms per batch
OVERHEAD = {1: (50.0, 250.0), 8: (50.0, 600.0)}
#: 0.5 ms per item + 4 ms per batch
CHEAP = {1: (50.0, 225.0), 8: (50.0, 400.0)}
#: 10 ms per item, nothing per batch: bigger batches save nothing
PER_ITEM = {1: (50.0, 500.0), 8: (50.0, 4000.0)}
#: the same, with full batches of 32 in the window too (a smaller maximum shortens them)
PER_ITEM_FULL = {**PER_ITEM, 32: (10.0, 3200.0)}
OVERHEAD_FULL = {**OVERHEAD, 32: (10.0, 360.0)}
#: 1 ms per item + 20 ms per batch, timed at three sizes
FIXED_COST = {1: (50.0, 1050.0), 4: (50.0, 1200.0), 8: (50.0, 1400.0)}


def window(p99_ms: float | None, *, ok: int = 200, failed: int = 0, duration_s: float = 1.0,
           mean_batch: float = 4.0, good: int | None = None) -> WindowFigures:
    if good is None:
        good = ok if p99_ms is not None and p99_ms <= SLO else int(ok * 0.9)
    return WindowFigures(duration_s, ok, failed, max(1, round(ok / mean_batch)),
                         None if p99_ms is None else p99_ms / 2, p99_ms, good)


def obs(now: float, knobs: Knobs, p99_ms: float | None, *, depth: int = 0, util: float = 0.3,
        compute_ms: float | None = 5.0, effective: int | None = None, times=OVERHEAD,
        padding: float | None = None, **kw) -> Observation:
    return Observation(now, window(p99_ms, **kw), depth, util, compute_ms,
                       knobs.max_batch_size if effective is None else effective, knobs, times,
                       padding)


class Run:
    """A controller and its fake clock; ``step`` advances time and feeds one window."""

    def __init__(self, start: Knobs = START, **tuning) -> None:
        self.now = 100.0
        self.knobs = start
        self.c = Controller(SLO, start, self.now, tuning=Tuning(**tuning))

    def step(self, p99_ms, dt: float = 1.0, **kw):
        self.now += dt
        step = self.c.observe(obs(self.now, self.knobs, p99_ms, **kw))
        if step.decision is not None:
            self.knobs = step.decision.knobs
        return step


# -- when to judge -------------------------------------------------------------------------
def test_a_window_with_too_few_samples_is_not_judged_and_is_dropped_when_too_long():
    run = Run()
    step = run.step(500.0, ok=50)
    assert not step.window_done and step.decision is None
    step = run.step(500.0, dt=10.0, ok=50, duration_s=10.0)
    assert step.window_done and step.decision is None and "too few" in run.c.note
    assert run.knobs == START


def test_a_short_window_waits_even_with_enough_samples():
    step = Run().step(500.0, ok=500, duration_s=0.5)
    assert not step.window_done and step.decision is None


def test_a_window_of_few_long_batches_waits_for_more_unless_most_requests_fail():
    run = Run()
    step = run.step(500.0, ok=200, mean_batch=32.0)  # 6 batches of 32
    assert not step.window_done and step.decision is None
    step = run.step(500.0, ok=20, failed=180, mean_batch=10.0)  # 2 batches, 90 % failed
    assert step.window_done


# -- the moves -----------------------------------------------------------------------------
def test_raises_the_delay_when_under_the_slo_and_the_queue_builds_with_small_batches():
    run = Run(room_windows=2, busy_share=0.4)  # busy still as each delay saves device time
    # the first window with room: no move yet
    assert run.step(20.0, util=0.9, mean_batch=2.0, depth=3).decision is None
    step = run.step(20.0, util=0.9, mean_batch=2.0, depth=3)
    d = step.decision
    assert d is not None and d.state == RAISING
    assert d.changes == {"max_queue_delay_ms": 5.0}  # 5 % of the SLO per step
    assert "max_queue_delay_ms null -> 5" in d.reason and "3 queued, device 90% busy" in d.reason
    assert "about 3.0 would take 22% less device time per request" in d.reason
    # it keeps raising in bounded steps up to a quarter of the SLO, never beyond, while
    # each longer delay saves at least half the device time per request it promised
    util, delays = 0.9 * 0.85, []
    for _ in range(40):
        step = run.step(20.0, dt=2.0, util=util, mean_batch=2.0, depth=3)
        if step.decision is not None:
            delays.append(step.decision.knobs.max_queue_delay_ms)
            util *= 0.85
    assert delays == [10.0, 15.0, 20.0, 25.0] and run.knobs.max_queue_delay_ms == 25.0


def test_a_longer_delay_that_saves_less_than_half_its_promise_is_undone():
    run = Run(room_windows=1)
    d = run.step(20.0, util=0.9, mean_batch=2.0, depth=3).decision
    assert d is not None and "22% less device time per request" in d.reason
    # the next window: 5 % less device time per request, not the 11 % half the promise is
    step = run.step(20.0, dt=2.0, util=0.9 * 0.95, mean_batch=2.0, depth=3)
    assert step.decision is not None and step.decision.state == REVERTED
    assert step.decision.changes == {"max_queue_delay_ms": None}
    assert "after delay up" in step.decision.reason


def test_does_not_raise_the_delay_when_bigger_batches_save_no_device_time():
    run = Run()
    for _ in range(6):
        assert run.step(20.0, util=0.9, mean_batch=2.0, depth=3, times=PER_ITEM).decision is None


def test_a_longer_delay_that_saves_no_device_time_is_undone():
    run = Run()
    run.step(20.0, util=0.9, mean_batch=2.0, depth=3)
    assert run.step(20.0, util=0.9, mean_batch=2.0, depth=3).decision is not None
    step = run.step(25.0, dt=2.0, util=0.9, mean_batch=2.0, depth=3)  # the same device time
    assert step.decision.state == REVERTED and step.decision.changes == {"max_queue_delay_ms": None}


def test_does_not_raise_the_delay_for_a_device_that_is_mostly_idle_or_an_empty_queue():
    run = Run()
    for _ in range(5):
        assert run.step(20.0, util=0.1, mean_batch=1.0, depth=3).decision is None
        assert run.step(20.0, util=0.9, mean_batch=1.0, depth=0).decision is None
    assert run.c.state == WATCHING


def test_raises_the_batch_size_when_batches_run_full_and_a_full_one_waits():
    run = Run()
    run.step(20.0, depth=40, mean_batch=16.0, util=0.95, times=CHEAP)
    d = run.step(20.0, depth=40, mean_batch=16.0, util=0.95, times=CHEAP).decision
    assert d is not None and d.changes == {"max_batch_size": 24} and d.state == RAISING
    assert "40 queued and full batches (capacity about 1333 -> 1500 req/s)" in d.reason
    # not when a batch of the new size would take more than a quarter of the SLO
    run = Run()
    for _ in range(3):
        assert run.step(20.0, depth=40, mean_batch=16.0, util=0.95).decision is None


def test_with_room_it_raises_the_batch_size_ahead_of_a_burst_while_a_full_batch_fits():
    run = Run(Knobs(8, None))
    assert run.step(20.0, mean_batch=2.0, times=FIXED_COST).decision is None  # one window
    d = run.step(20.0, mean_batch=2.0, times=FIXED_COST).decision
    assert d is not None and d.state == RAISING and d.changes == {"max_batch_size": 12}
    assert "batches of 2.0: ready for a burst (capacity about 286 -> 375 req/s), a full " \
           "batch about 32 ms" in d.reason
    # fewer arrivals in the next window (12 %), all within the SLO: the goodput is down by
    # as much, but not its share of the load, so the move stays
    step = run.step(20.0, dt=2.0, ok=176, mean_batch=2.0, times=FIXED_COST)
    assert step.decision is None and run.c.state != REVERTED
    # a full batch of 18 would take 38 ms, over 35 % of the SLO: no further
    for _ in range(6):
        assert run.step(20.0, dt=2.0, mean_batch=2.0, times=FIXED_COST).decision is None
    assert run.knobs == Knobs(12, None)


def test_no_raise_ahead_of_a_burst_without_a_line_to_trust_or_a_capacity_to_gain():
    line_of_two = {1: (50.0, 1050.0), 8: (50.0, 1400.0)}
    per_item = {1: (50.0, 500.0), 2: (50.0, 1000.0), 3: (50.0, 1500.0)}
    for times in (line_of_two, per_item):
        run = Run(Knobs(8, None))
        for _ in range(4):
            assert run.step(20.0, dt=2.0, mean_batch=2.0, times=times).decision is None
    # never past four times the largest batch timed: batches of 1..3 say nothing of 18
    small = {1: (50.0, 1050.0), 2: (50.0, 1100.0), 3: (50.0, 1150.0)}
    run = Run(Knobs(12, None))
    for _ in range(4):
        assert run.step(20.0, dt=2.0, mean_batch=2.0, times=small).decision is None


def test_never_raises_the_batch_size_while_the_oom_governor_holds_it_lower():
    run = Run()
    for _ in range(4):
        step = run.step(20.0, dt=2.0, depth=40, mean_batch=8.0, util=0.95, effective=8,
                        times=CHEAP)
        assert step.decision is None or "max_batch_size" not in step.decision.changes
    # the same figures with the governor out of the way do raise it
    run = Run()
    steps = [run.step(20.0, dt=2.0, depth=40, mean_batch=16.0, util=0.95, times=CHEAP)
             for _ in range(2)]
    assert steps[1].decision.changes == {"max_batch_size": 24}


def test_backs_off_on_violation_a_visible_delay_first_then_the_batch_size():
    run = Run(Knobs(32, 40.0), fallback_after=100)
    d = run.step(150.0, times=PER_ITEM_FULL).decision
    assert d.state == LOWERING and d.changes == {"max_queue_delay_ms": 20.0}
    assert d.reason.startswith("p99 150 ms > SLO 100 ms")
    # 20 ms is still a tenth of the p99 or more: halved again
    assert run.step(150.0, dt=2.0, times=PER_ITEM_FULL).decision.changes == {"max_queue_delay_ms": 10.0}
    # a 10 ms delay is not what holds a p99 of 150 ms up while a full batch takes 320 ms:
    # the batch shrinks, by at most half a step, while it is still 0.3 of the p99 or more
    # (a batch of 4 takes 40 ms: the rest of the p99 is waiting, which a smaller batch
    # does not shorten); then the delay is halved down to work-conserving
    changes = []
    for _ in range(20):
        if run.knobs.max_queue_delay_ms is None:
            break
        changes.append(run.step(150.0, dt=2.0, times=PER_ITEM_FULL).decision.changes)
    assert changes == [{"max_batch_size": n} for n in (16, 8, 4)] + [
        {"max_queue_delay_ms": d} for d in (5.0, 2.5, 1.25, 0.625, None)]
    assert run.step(150.0, dt=2.0, times=PER_ITEM_FULL).decision is None  # no step left
    # with a per-batch cost the line says where to stop at once: 1 ms x 21 + 4 <= 25
    # (a batch of 32 takes 36 ms: at least 0.3 of a p99 of 110 ms, not of 150 ms)
    run = Run(Knobs(32, None))
    assert run.step(110.0, times=OVERHEAD_FULL).decision.changes == {"max_batch_size": 21}
    assert Run(Knobs(32, None)).step(150.0, times=OVERHEAD_FULL).decision is None


def test_violation_with_a_saturated_model_grows_the_batch_for_throughput():
    run = Run(Knobs(8, 10.0))
    d = run.step(300.0, depth=100, mean_batch=8.0, util=1.0).decision
    assert d.changes == {"max_batch_size": 12} and d.state == RAISING
    assert "(capacity about 667 -> 750 req/s)" in d.reason


def test_a_saturated_model_far_behind_its_arrivals_grows_by_up_to_twice_at_once():
    run = Run(Knobs(8, None))
    assert run.step(80.0, depth=100, mean_batch=8.0, ok=600, util=1.0).decision is None
    # 600 settled and the queue grew by 600 in a second: about 1200 arrive per second,
    # which 1.5 x (12: 750 req/s) would not serve; 2 x (16: 800 req/s) is the most allowed
    d = run.step(300.0, depth=700, mean_batch=8.0, ok=600, util=1.0).decision
    assert d.changes == {"max_batch_size": 16} and d.state == RAISING
    assert "about 1200 arrivals/s (capacity about 667 -> 800 req/s)" in d.reason


def test_a_saturated_model_whose_batches_cost_per_item_is_not_grown():
    # bigger batches serve no more: shrink the batches instead, which costs no capacity
    # and lowers the latency, while a batch is still a visible part of the p99 (0.3 of
    # it); then halve the delay
    run = Run(Knobs(32, 10.0), fallback_after=100)
    d = run.step(300.0, depth=100, mean_batch=32.0, ok=400, util=1.0, times=PER_ITEM_FULL).decision
    assert d.changes == {"max_batch_size": 16}
    assert "a batch of 32 takes about 320 ms" in d.reason
    decisions = [run.step(300.0, dt=2.0, depth=100, mean_batch=32.0, ok=400, util=1.0,
                          times=PER_ITEM_FULL).decision for _ in range(2)]
    # 16 -> 8; a batch of 8 takes 80 ms, under 0.3 of the 300 ms p99: the delay goes next
    assert [d.changes for d in decisions] == [{"max_batch_size": 8}, {"max_queue_delay_ms": 5.0}]


def test_a_smaller_batch_must_still_serve_the_arrivals():
    # 2 ms per item + 10 ms per batch, batches of up to 32 in the window
    heavy = {1: (50.0, 600.0), 8: (50.0, 1300.0), 32: (10.0, 740.0)}
    # at 100 req/s half a step is fine: 32 -> 16 (capacity 381 req/s)
    run = Run(Knobs(32, None))
    assert run.step(150.0, ok=100, times=heavy).decision.changes == {"max_batch_size": 16}
    # at 350 req/s, 16 would leave no room; 18 is the smallest that serves 0.9 x the
    # capacity of 32 (432 req/s), since 1.2 x 350 is more than that
    run = Run(Knobs(32, None))
    assert run.step(150.0, ok=350, times=heavy).decision.changes == {"max_batch_size": 18}


def test_a_maximum_the_batches_never_reach_is_not_lowered():
    # work-conserving batches of 1..8 under a maximum of 32: the line says a batch of 32
    # would take 320 ms, but none ran, and half a step down (16) shortens no batch
    run = Run(Knobs(32, None), fallback_after=100)
    d = run.step(150.0, times=PER_ITEM).decision
    assert d is None and run.c.state == VIOLATING
    # batches of up to 20 are shortened, by at most half a step: 32 -> 16
    up_to_20 = {**PER_ITEM, 20: (10.0, 2000.0)}
    d = Run(Knobs(32, None)).step(150.0, times=up_to_20).decision
    assert d.changes == {"max_batch_size": 16} and "a batch of 20 takes about 200 ms" in d.reason
    # batches that stay within a quarter of the SLO are not what holds the p99 up
    small = {1: (50.0, 500.0), 2: (50.0, 1000.0)}
    assert Run(Knobs(32, None)).step(150.0, times=small).decision is None


def test_no_move_inside_the_hysteresis_band():
    run = Run(Knobs(16, 10.0))
    for p99 in (75.0, 95.0, 71.0, 99.0):
        step = run.step(p99, dt=2.0, util=0.9, mean_batch=2.0, depth=40)
        assert step.window_done and step.decision is None
    assert run.c.state == WATCHING and run.knobs == Knobs(16, 10.0)


def test_never_below_the_smallest_batch_size_allowed():
    run = Run(Knobs(4, None))
    run.c = Controller(SLO, Knobs(4, None), run.now, min_batch_size=4)
    step = run.step(300.0, compute_ms=90.0)
    assert step.decision is None and run.c.state == VIOLATING


# -- guard rails -----------------------------------------------------------------------------
def test_cooldown_after_a_move_discards_the_windows_that_start_during_it():
    run = Run(Knobs(16, 40.0), cooldown_s=3.0)
    assert run.step(150.0).decision is not None
    for _ in range(2):
        step = run.step(150.0)
        assert step.window_done and step.decision is None and run.c.state == SETTLING
    assert run.step(150.0).decision is not None  # 3 s later


def test_a_move_that_made_things_worse_is_undone_and_not_tried_again_for_a_while():
    run = Run(block_s=30.0)
    run.step(20.0, util=0.9, mean_batch=2.0, depth=3)
    d = run.step(20.0, util=0.9, mean_batch=2.0, depth=3).decision
    assert d.changes == {"max_queue_delay_ms": 5.0}
    # same load, goodput down by a quarter: back to work-conserving
    step = run.step(60.0, dt=2.0, util=0.9, mean_batch=2.0, depth=3, good=150)
    assert step.decision.state == REVERTED and step.decision.changes == {"max_queue_delay_ms": None}
    assert "after delay up" in step.decision.reason
    # the direction is blocked: windows with room do not raise the delay again for 30 s
    for _ in range(10):
        assert run.step(20.0, dt=2.0, util=0.9, mean_batch=2.0, depth=3).decision is None
    later = [run.step(20.0, dt=2.0, util=0.9, mean_batch=2.0, depth=3).decision for _ in range(6)]
    assert any(d is not None and d.changes == {"max_queue_delay_ms": 5.0} for d in later)


def test_a_shorter_delay_is_not_blamed_for_a_backlog_that_keeps_growing():
    # over the SLO in a burst: p99 keeps rising at the same rate served (the backlog of the
    # windows before), so each halving stands and the delay goes on down to work-conserving
    run = Run(Knobs(16, 12.0), fallback_after=10)  # (it started here: no fallback wanted)
    delays, p99 = [], 150.0
    for _ in range(8):
        step = run.step(p99, dt=2.0, util=0.95, mean_batch=4.0, depth=40, good=20)
        if step.decision is not None:
            assert step.decision.state != REVERTED, step.decision.reason
            delays.append(step.decision.knobs.max_queue_delay_ms)
        p99 *= 1.4
    assert delays == [6.0, 3.0, 1.5, 0.75, None]


def test_a_shorter_delay_that_cost_capacity_is_undone():
    run = Run(Knobs(16, 12.0))
    d = run.step(150.0, util=1.0, mean_batch=4.0, depth=40, good=20).decision
    assert d.changes == {"max_queue_delay_ms": 6.0}
    # a fifth less served while the queue grew: the delay comes back
    step = run.step(200.0, dt=2.0, ok=160, util=1.0, mean_batch=3.0, depth=80, good=10)
    assert step.decision.state == REVERTED and step.decision.changes == {"max_queue_delay_ms": 12.0}
    assert "after delay down" in step.decision.reason
    # the same fall in the rate served with the queue emptying is the load going away
    run = Run(Knobs(16, 12.0))
    run.step(150.0, util=1.0, mean_batch=4.0, depth=40, good=20)
    step = run.step(200.0, dt=2.0, ok=160, util=0.8, mean_batch=3.0, depth=10, good=10)
    assert step.decision is None or step.decision.state != REVERTED


def test_a_longer_delay_followed_by_a_violation_is_undone_and_blocked_longer_each_time():
    run = Run(room_windows=1)
    tries = []
    for _ in range(120):
        step = run.step(20.0, util=0.9, mean_batch=2.0, depth=3)
        if step.decision is None or step.decision.state != RAISING:
            continue
        tries.append(run.now)
        # the window after: over the SLO at a fifth more load (a load change does not
        # excuse a longer delay that ends past the SLO)
        undo = run.step(130.0, ok=240, util=0.9, mean_batch=2.0, depth=3).decision
        assert undo.state == REVERTED and undo.changes == {"max_queue_delay_ms": None}
    gaps = [round(b - a) for a, b in zip(tries, tries[1:])]
    # blocked 10, 20, 40 s after each undo (plus the 1 s window the undo was judged on)
    assert gaps[:3] == [11, 21, 41], gaps


def test_a_move_is_not_judged_worse_when_the_load_changed():
    run = Run()
    run.step(20.0, util=0.9, mean_batch=2.0, depth=3)
    assert run.step(20.0, util=0.9, mean_batch=2.0, depth=3).decision is not None
    step = run.step(60.0, dt=2.0, ok=100, util=0.9, mean_batch=2.0, depth=3)  # half the load
    assert step.decision is None or step.decision.state != REVERTED


def test_growing_a_saturated_model_that_serves_no_more_is_undone():
    run = Run(Knobs(16, None))
    d = run.step(300.0, depth=100, mean_batch=16.0, util=1.0).decision
    assert d.changes == {"max_batch_size": 24}
    step = run.step(320.0, dt=2.0, ok=404, duration_s=2.0, depth=120, mean_batch=24.0,
                    util=1.0)
    assert step.decision.state == REVERTED and step.decision.changes == {"max_batch_size": 16}


# -- bucket edges of a variable-length model -------------------------------------------------
DERIVED = Knobs(max_batch_size=16, max_queue_delay_ms=None, bucket_edges=None,
                auto_bucket_count=8)


def test_a_busy_model_whose_batches_are_mostly_padding_gets_finer_derived_edges():
    run = Run(DERIVED)
    d = run.step(300.0, util=0.9, depth=20, mean_batch=6.0, padding=0.3).decision
    assert d.changes == {"auto_bucket_count": 16} and d.state == LOWERING
    assert "30% of the padded tokens padding" in d.reason and "auto_bucket_count 8 -> 16" in d.reason
    d = run.step(300.0, util=0.9, depth=20, mean_batch=6.0, padding=0.3).decision
    assert d.changes == {"auto_bucket_count": 32}
    # at the most edges allowed, the usual moves take over (a visible delay, a long batch)
    d = run.step(300.0, dt=2.0, util=0.9, depth=20, mean_batch=6.0, padding=0.3).decision
    assert d is None or "auto_bucket_count" not in d.changes


def test_fixed_edges_become_derived_ones_at_least_twice_as_many():
    fixed = Knobs(16, None, bucket_edges=(32, 64, 128, 256), auto_bucket_count=4)
    d = Run(fixed).step(300.0, util=0.9, depth=20, mean_batch=6.0, padding=0.4).decision
    assert d.changes == {"bucket_edges": None, "auto_bucket_count": 8}
    assert "bucket_edges 32,64,128,256 -> null" in d.reason


def test_edges_stay_while_padding_is_low_the_device_idle_or_the_model_fixed_length():
    for knobs, kw in ((DERIVED, dict(util=0.9, depth=20, padding=0.05)),
                      (DERIVED, dict(util=0.2, depth=20, padding=0.4)),
                      (DERIVED, dict(util=0.9, depth=0, padding=0.4)),
                      (DERIVED, dict(util=0.9, depth=20, padding=None)),
                      (START, dict(util=0.9, depth=20, padding=0.4))):
        d = Run(knobs).step(300.0, mean_batch=6.0, **kw).decision
        assert d is None or not {"auto_bucket_count", "bucket_edges"} & set(d.changes), (knobs, kw)


def test_finer_edges_that_made_things_worse_are_undone():
    run = Run(DERIVED, block_s=30.0)
    assert run.step(300.0, util=0.9, depth=20, mean_batch=6.0, padding=0.3,
                    ok=200).decision.changes == {"auto_bucket_count": 16}
    # same load, far fewer served within the SLO
    step = run.step(400.0, util=0.9, depth=20, mean_batch=6.0, padding=0.2, good=100)
    assert step.decision.state == REVERTED and step.decision.changes == {"auto_bucket_count": 8}
    nxt = run.step(300.0, dt=2.0, util=0.9, depth=20, mean_batch=6.0, padding=0.3).decision
    assert nxt is None or "auto_bucket_count" not in nxt.changes


def test_falls_back_to_the_starting_settings_when_it_cannot_hold_the_slo():
    run = Run(Knobs(16, 40.0), fallback_after=3, hold_s=20.0)
    run.step(150.0)  # delay 40 -> 20: p99 150 -> 150, no better
    assert run.knobs == Knobs(16, 20.0)
    run.step(150.0, dt=2.0)
    d = run.step(150.0, dt=2.0).decision
    assert d.state == FALLBACK and d.knobs == Knobs(16, 40.0)
    assert "back to the starting settings" in d.reason
    # held: no move for hold_s, however bad the windows
    for _ in range(8):
        step = run.step(400.0, dt=2.0)
        assert step.decision is None and run.c.state == FALLBACK
    assert run.step(400.0, dt=6.0).decision is not None  # the hold is over


def test_improving_windows_do_not_fall_back():
    run = Run(Knobs(16, 40.0), fallback_after=2)
    for p99 in (400.0, 320.0, 256.0, 205.0, 164.0, 131.0, 105.0):
        step = run.step(p99, dt=2.0)
        assert step.decision is None or step.decision.state != FALLBACK
    # the queue going down counts as improving too
    for depth in (100, 80, 60, 45, 30):
        step = run.step(150.0, dt=2.0, depth=depth)
        assert step.decision is None or step.decision.state != FALLBACK


def test_the_slo_must_be_positive():
    with pytest.raises(ValueError, match="slo_p99_ms"):
        Controller(0.0, START, 0.0)


# -- the outcome window ---------------------------------------------------------------------
def test_window_percentiles_are_within_the_bucket_width():
    rng = random.Random(3)
    win = OutcomeWindow()
    before = win.snapshot()
    latencies = [rng.lognormvariate(math.log(0.02), 0.6) for _ in range(5000)]
    for i in range(0, len(latencies), 10):
        win.add_ok(100.0, [100.0 - x for x in latencies[i:i + 10]])
    win.add_request("expired", 100.0, 99.0)
    win.add_request("cancelled", 100.0, 99.0)
    after = win.snapshot()
    exact = sorted(latencies)
    f = figures(before, after, 2.0, slo_ms=30.0)
    assert f.ok == 5000 and f.failed == 1 and f.batches == 500 and f.mean_batch_size == 10.0
    assert f.p99_ms == pytest.approx(exact[int(0.99 * 5000)] * 1000, rel=0.05)
    assert f.p50_ms == pytest.approx(exact[2500] * 1000, rel=0.05)
    within = sum(1 for x in latencies if x <= 0.030)
    assert f.good == pytest.approx(within, rel=0.02)
    assert f.goodput_rps == pytest.approx(f.good / 2.0) and f.settled_rps == 5001 / 2.0
    # the memory is fixed: the same histogram after many more requests
    assert len(after.latency_counts) == len(BOUNDS_S) + 1


def test_window_of_nothing_and_of_the_extremes():
    win = OutcomeWindow()
    snap = win.snapshot()
    f = figures(snap, snap, 1.0, 50.0)
    assert (f.ok, f.p99_ms, f.good, f.mean_batch_size) == (0, None, 0, None)
    win.add_ok(10.0, [10.0, 10.0 - 1e-6, 10.0 - 10_000.0])  # 0 s, 1 us, 10000 s
    f = figures(snap, win.snapshot(), 1.0)
    assert f.ok == 3 and f.good == 3 and f.p99_ms > 600_000.0
    assert quantile_s([0] * 5, 0.5) is None and count_within([0, 0], 1.0) == 0
    # a request settled on its own counts with its latency, once
    before = win.snapshot()
    win.add_request("ok", 11.0, 10.99)
    f = figures(before, win.snapshot(), 1.0, 50.0)
    assert (f.ok, f.good, f.batches) == (1, 1, 0) and f.p99_ms == pytest.approx(10.0, rel=0.05)


# -- the batch cost line ----------------------------------------------------------------------
def test_the_batch_cost_line_fits_the_measured_batch_times():
    cost = fit({1: (10, 10 * 5.0), 4: (10, 10 * 8.0), 16: (5, 5 * 20.0)})
    assert cost.per_item_ms == pytest.approx(1.0) and cost.per_batch_ms == pytest.approx(4.0)
    assert cost.sizes == 3 and cost.ms(32) == pytest.approx(36.0)
    assert cost.capacity_rps(4) == pytest.approx(500.0) and cost.per_request_ms(4) == 2.0
    assert cost.largest_within(25.0) == 21 and cost.largest_within(3.0) == 0
    # one size seen: only "in proportion" can be said
    one = fit({8: (3, 3 * 40.0)})
    assert (one.per_item_ms, one.per_batch_ms, one.sizes) == (5.0, 0.0, 1)
    # a line that would cross below zero goes through the origin; a falling one is flat
    assert fit({1: (5, 5.0), 10: (5, 5 * 30.0)}).per_batch_ms == 0.0
    flat = fit({1: (5, 5 * 9.0), 10: (5, 5 * 8.0)})
    assert flat.per_item_ms == 0.0 and flat.per_batch_ms == pytest.approx(8.5)
    assert flat.largest_within(10.0) > 1000 and flat.largest_within(5.0) == 0
    assert fit({}) is None


def test_batch_times_fade_so_the_line_follows_the_model():
    times = BatchTimes()
    times.add({1: (100.0, 500.0), 8: (100.0, 4000.0)})  # 5 ms per item
    assert times.cost().per_item_ms == pytest.approx(5.0)
    for _ in range(20):  # the model got twice as fast
        times.add({1: (100.0, 250.0), 8: (100.0, 2000.0)})
    assert times.cost().per_item_ms == pytest.approx(2.5, rel=0.01)
