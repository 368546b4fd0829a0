"""Batching rules of ``Batcher`` driven with a fake clock (no sleeping, no asyncio)."""

from __future__ import annotations

import pytest

from runtime.core.clock import FakeClock
from runtime.api.config import BatchingConfig
from runtime.core.batcher import Batcher
from runtime.core.request import PendingRequest
from runtime.api.errors import QueueFull, ValidationError


def make(variable_length: bool = False, **changes) -> tuple[Batcher, FakeClock]:
    return Batcher("toy", BatchingConfig().with_changes(changes),
                   variable_length=variable_length), FakeClock()


def add(b: Batcher, clock: FakeClock, item=None, *, length: int = 1, priority: int = 1,
        bypass: bool = False, timeout_s: float | None = None) -> PendingRequest:
    now = clock.now()
    req = PendingRequest(item, length=length, priority=priority, bypass=bypass, arrived_s=now,
                         deadline_s=None if timeout_s is None else now + timeout_s)
    b.submit(req, now)
    return req


def items(batch) -> list:
    return [r.item for r in batch.requests]


# -- dynamic, work-conserving (max_queue_delay_ms None) ---------------------------------
def test_dynamic_work_conserving_lone_request_dispatches_at_once_when_idle():
    b, clock = make()
    add(b, clock, "a")
    batch = b.next_batch(clock.now(), model_busy=False)
    assert items(batch) == ["a"] and batch.bucket is None and batch.pad_to is None
    assert b.next_batch(clock.now()) is None and b.depth == 0


def test_dynamic_work_conserving_fills_while_busy_then_takes_up_to_max():
    b, clock = make(max_batch_size=4)
    for i in range(6):
        add(b, clock, i)
    # busy and not full? there is a full batch of 4: due even while busy
    assert items(b.next_batch(clock.now(), model_busy=True)) == [0, 1, 2, 3]
    # 2 left, busy: not due, and no timer to wake for
    assert b.next_batch(clock.now(), model_busy=True) is None
    assert b.next_wakeup(clock.now(), model_busy=True) is None
    add(b, clock, 6)
    assert items(b.next_batch(clock.now(), model_busy=False)) == [4, 5, 6]


def test_dynamic_explicit_delay_waits_even_when_idle():
    b, clock = make(max_batch_size=4, max_queue_delay_ms=10.0)
    add(b, clock, "a")
    assert b.next_batch(clock.now(), model_busy=False) is None
    assert b.next_wakeup(clock.now()) == pytest.approx(clock.now() + 0.010)
    clock.advance(0.004)
    add(b, clock, "b")
    assert b.next_batch(clock.now()) is None
    clock.advance(0.006)
    assert items(b.next_batch(clock.now())) == ["a", "b"]


def test_dynamic_full_batch_dispatches_before_delay():
    b, clock = make(max_batch_size=3, max_queue_delay_ms=50.0)
    for i in range(3):
        add(b, clock, i)
    assert items(b.next_batch(clock.now())) == [0, 1, 2]


def test_preferred_batch_sizes_cut_partial_batch():
    b, clock = make(max_batch_size=16, max_queue_delay_ms=1.0, preferred_batch_sizes=[4, 8])
    for i in range(11):
        add(b, clock, i)
    clock.advance(0.001)
    assert len(b.next_batch(clock.now())) == 8
    # 3 left: no preferred size fits, so the remaining 3 run as they are
    assert len(b.next_batch(clock.now())) == 3


# -- static ---------------------------------------------------------------------------
def test_static_waits_for_exactly_max_batch_size():
    b, clock = make(policy="static", max_batch_size=3, static_max_wait_ms=100.0)
    for i in range(5):
        add(b, clock, i)
    assert items(b.next_batch(clock.now())) == [0, 1, 2]
    assert b.next_batch(clock.now()) is None  # 2 left, idle model: still waits


def test_static_partial_batch_runs_after_static_max_wait():
    b, clock = make(policy="static", max_batch_size=8, static_max_wait_ms=100.0)
    add(b, clock, "a")
    clock.advance(0.099)
    assert b.next_batch(clock.now()) is None
    assert b.next_wakeup(clock.now()) == pytest.approx(clock.now() + 0.001)
    clock.advance(0.001)
    assert items(b.next_batch(clock.now())) == ["a"]


# -- adaptive ---------------------------------------------------------------------------
def test_adaptive_window_follows_recent_compute_time_within_floor_and_ceiling():
    b, clock = make(policy="adaptive", max_batch_size=8, adaptive_floor_ms=1.0,
                    adaptive_factor=2.0, adaptive_ceiling_ms=20.0)
    assert b.window_s() == pytest.approx(0.001)          # no history: the floor
    add(b, clock, "a")
    clock.advance(0.001)
    batch = b.next_batch(clock.now())
    b.complete(batch, clock.now(), compute_s=0.005)       # 2 x 5 ms = 10 ms
    assert b.window_s() == pytest.approx(0.010)
    add(b, clock, "b")
    clock.advance(0.009)
    assert b.next_batch(clock.now()) is None
    clock.advance(0.001)
    assert items(b.next_batch(clock.now())) == ["b"]
    for _ in range(40):
        b.complete(batch, clock.now(), compute_s=0.5)     # 1 s, above the ceiling
    assert b.window_s() == pytest.approx(0.020)


# -- priorities -------------------------------------------------------------------------
def test_priority_lower_number_first_ties_by_arrival():
    b, clock = make(max_batch_size=3, max_queue_delay_ms=0.0)
    for name, prio in [("low1", 2), ("mid1", 1), ("high1", 0), ("low2", 2), ("high2", 0)]:
        add(b, clock, name, priority=prio)
    assert items(b.next_batch(clock.now())) == ["high1", "high2", "mid1"]
    assert items(b.next_batch(clock.now())) == ["low1", "low2"]
    assert b.depth_by_priority() == {0: 0, 1: 0, 2: 0}


def test_priority_out_of_range_is_refused_naming_the_range():
    b, clock = make(priority_levels=3)
    with pytest.raises(ValidationError, match="0 .most urgent. to 2"):
        add(b, clock, "x", priority=3)
    assert b.depth == 0


# -- deadlines ----------------------------------------------------------------------------
def test_expired_requests_are_returned_and_never_dispatched():
    b, clock = make(max_batch_size=8, max_queue_delay_ms=50.0)
    short = add(b, clock, "short", timeout_s=0.010)
    add(b, clock, "long", timeout_s=1.0)
    add(b, clock, "none")
    assert b.next_wakeup(clock.now()) == pytest.approx(clock.now() + 0.010)
    clock.advance(0.010)
    assert b.expire(clock.now()) == [short]
    assert b.depth == 2
    clock.advance(0.040)
    assert items(b.next_batch(clock.now())) == ["long", "none"]


def test_next_batch_skips_expired_and_hands_them_to_expire():
    b, clock = make(max_batch_size=8)
    late = add(b, clock, "late", timeout_s=0.005)
    add(b, clock, "ok")
    clock.advance(0.006)
    assert items(b.next_batch(clock.now())) == ["ok"]
    assert b.expire(clock.now()) == [late]


# -- backpressure -------------------------------------------------------------------------
def test_queue_full_raises_with_retry_after_from_service_time():
    b, clock = make(max_queue_size=3, max_batch_size=2)
    for i in range(2):
        add(b, clock, i)
    b.complete(b.next_batch(clock.now()), clock.now(), compute_s=0.4)  # 0.2 s per request
    for i in range(3):
        add(b, clock, i)
    with pytest.raises(QueueFull, match="max_queue_size=3") as info:
        add(b, clock, "x")
    assert info.value.retry_after_s == pytest.approx(3 * 0.2)
    assert info.value.http_status == 429


def test_retry_after_has_a_floor():
    b, clock = make(max_queue_size=1)
    add(b, clock, 0)
    with pytest.raises(QueueFull) as info:
        add(b, clock, 1)
    assert info.value.retry_after_s >= 0.05


# -- bypass -------------------------------------------------------------------------------
def test_bypass_skips_the_window_and_goes_first():
    b, clock = make(max_batch_size=8, max_queue_delay_ms=100.0)
    add(b, clock, "n1")
    add(b, clock, "n2")
    add(b, clock, "rt", bypass=True, priority=2)
    batch = b.next_batch(clock.now())
    assert items(batch) == ["rt"] and batch.bypass
    assert b.next_batch(clock.now()) is None  # the normal queue still waits its window
    assert b.depth == 2


def test_bypass_requests_batch_together_only_with_each_other():
    b, clock = make(max_batch_size=8, max_queue_delay_ms=100.0)
    add(b, clock, "rt1", bypass=True)
    add(b, clock, "n1")
    add(b, clock, "rt2", bypass=True)
    assert items(b.next_batch(clock.now())) == ["rt1", "rt2"]


# -- length bucketing ---------------------------------------------------------------------
def test_buckets_keep_lengths_apart_and_pad_to_batch_max():
    b, clock = make(variable_length=True, max_batch_size=4, bucket_edges=[8, 16])
    add(b, clock, "s3", length=3)
    add(b, clock, "l12", length=12)
    add(b, clock, "s5", length=5)
    add(b, clock, "o40", length=40)
    assert b.depth_by_bucket() == {8: 2, 16: 1, -1: 1}
    first = b.next_batch(clock.now())
    assert items(first) == ["s3", "s5"] and first.bucket == 8 and first.pad_to == 5
    assert first.real_elements == 8 and first.padded_elements == 10
    second = b.next_batch(clock.now())
    assert items(second) == ["l12"] and second.bucket == 16
    third = b.next_batch(clock.now())
    assert items(third) == ["o40"] and third.bucket == -1 and third.pad_to == 40


def test_pad_to_bucket_edge():
    b, clock = make(variable_length=True, bucket_edges=[8, 16], pad_to="bucket")
    add(b, clock, "a", length=3)
    add(b, clock, "b", length=5)
    batch = b.next_batch(clock.now())
    assert batch.pad_to == 8 and batch.padded_elements == 16 and batch.real_elements == 8


def test_full_bucket_goes_before_older_partial_bucket():
    b, clock = make(variable_length=True, max_batch_size=2, bucket_edges=[8, 16])
    add(b, clock, "old-long", length=12)
    clock.advance(0.001)
    add(b, clock, "s1", length=2)
    add(b, clock, "s2", length=2)
    assert items(b.next_batch(clock.now())) == ["s1", "s2"]
    assert items(b.next_batch(clock.now())) == ["old-long"]


def test_longest_waiting_bucket_goes_first_when_none_is_full():
    b, clock = make(variable_length=True, max_batch_size=4, bucket_edges=[8, 16])
    add(b, clock, "short", length=2)
    clock.advance(0.001)
    add(b, clock, "long", length=12)
    assert items(b.next_batch(clock.now())) == ["short"]


def test_bucket_with_most_urgent_priority_goes_first():
    b, clock = make(variable_length=True, max_batch_size=2, bucket_edges=[8, 16])
    add(b, clock, "s1", length=2, priority=2)
    add(b, clock, "s2", length=2, priority=2)
    add(b, clock, "urgent-long", length=12, priority=0)
    assert items(b.next_batch(clock.now())) == ["urgent-long"]


def test_bucketing_off_shares_one_queue_and_pads_to_batch_max():
    b, clock = make(variable_length=True, bucketing=False)
    add(b, clock, "a", length=3)
    add(b, clock, "b", length=300)
    batch = b.next_batch(clock.now())
    assert items(batch) == ["a", "b"] and batch.bucket is None and batch.pad_to == 300
    assert batch.padded_elements == 600 and batch.real_elements == 303


def test_fixed_size_model_ignores_bucketing():
    b, clock = make(variable_length=False, bucketing=True)
    add(b, clock, "a", length=1)
    batch = b.next_batch(clock.now())
    assert batch.bucket is None and batch.pad_to is None
    assert batch.real_elements == batch.padded_elements == 1


# -- settings, caps, accounting -----------------------------------------------------------
def test_set_config_applies_at_next_batch_and_keeps_queue():
    b, clock = make(max_batch_size=8, max_queue_delay_ms=100.0)
    for i in range(3):
        add(b, clock, i)
    assert b.next_batch(clock.now()) is None
    b.set_config(b.config.with_changes({"max_batch_size": 2}), version=2)
    batch = b.next_batch(clock.now())
    assert items(batch) == [0, 1] and batch.settings_version == 2
    assert batch.config.max_batch_size == 2


def test_set_config_rebuckets_and_clamps_priorities():
    b, clock = make(variable_length=True, bucket_edges=[8], priority_levels=4)
    add(b, clock, "p3", length=20, priority=3)
    add(b, clock, "p0", length=5, priority=0)
    b.set_config(b.config.with_changes({"bucket_edges": [32], "priority_levels": 2,
                                        "default_priority": 0}), version=2)
    assert b.depth_by_bucket() == {32: 2, -1: 0}
    assert b.depth_by_priority() == {0: 1, 1: 1}
    assert items(b.next_batch(clock.now())) == ["p0", "p3"]


def test_size_cap_limits_batches_and_counts_as_full():
    b, clock = make(max_batch_size=8, max_queue_delay_ms=100.0)
    b.set_size_cap(None, 3)
    for i in range(4):
        add(b, clock, i)
    assert b.cap(None) == 3
    assert items(b.next_batch(clock.now())) == [0, 1, 2]
    b.set_size_cap(None, None)
    assert b.cap(None) == 8


def test_cancelled_request_is_skipped():
    b, clock = make()
    gone = add(b, clock, "gone")
    add(b, clock, "stay")
    assert b.cancel(gone) and not b.cancel(gone)
    assert items(b.next_batch(clock.now())) == ["stay"]


def test_draining_makes_every_queue_due_and_drain_all_empties():
    b, clock = make(policy="static", max_batch_size=8, static_max_wait_ms=1000.0)
    add(b, clock, "a")
    assert b.next_batch(clock.now()) is None
    b.start_draining()
    assert items(b.next_batch(clock.now())) == ["a"]
    left = [add(b, clock, i) for i in range(3)]
    assert b.drain_all() == left and b.depth == 0


def test_queue_depth_recorded_at_dispatch_includes_the_batch():
    b, clock = make(max_batch_size=2)
    for i in range(5):
        add(b, clock, i)
    assert b.next_batch(clock.now()).queue_depth == 5
    assert b.next_batch(clock.now()).queue_depth == 3


def test_submit_wake_hint_is_false_only_when_nothing_can_change():
    b, clock = make(max_batch_size=4, max_queue_delay_ms=10.0)
    now = clock.now()
    assert b.submit(PendingRequest("a", arrived_s=now), now) is True   # new oldest
    assert b.submit(PendingRequest("b", arrived_s=now), now) is False  # same window
    assert b.submit(PendingRequest("c", arrived_s=now), now) is False
    assert b.submit(PendingRequest("d", arrived_s=now), now) is True   # full batch


def test_bypass_lane_survives_a_rebucketing_settings_change():
    b, clock = make(variable_length=True, bucket_edges=[8], max_queue_delay_ms=100.0)
    add(b, clock, "n", length=5)
    add(b, clock, "rt", length=20, bypass=True)
    b.set_config(b.config.with_changes({"bucket_edges": [16, 32]}), version=2)
    assert b.has_bypass()
    batch = b.next_batch(clock.now())
    assert items(batch) == ["rt"] and batch.bypass and batch.bucket == 32
    assert not b.has_bypass() and b.next_batch(clock.now()) is None
