"""``runtime.device.priority.LoopBound``: a device process goes nicer than the serving
process once, when its model's device time per request is below the event loop's CPU
per request over a window of enough requests; times and counters are passed in."""

from __future__ import annotations

from runtime.device.priority import LoopBound, RequestTally


def bound(nice: int = 10, min_requests: int = 100) -> tuple[LoopBound, RequestTally]:
    tally = RequestTally()
    return LoopBound(nice, tally, check_every_s=1.0, min_requests=min_requests), tally


def test_a_model_cheaper_than_the_loop_makes_its_process_nicer_once():
    b, tally = bound()
    assert b.due(0.0) and not b.decide(0.0, 10.0, 20e-6)  # the first look opens a window
    assert not b.due(0.5) and b.due(1.0)
    tally.n += 1000
    # 1,000 requests cost the loop 0.05 s: 50 us each, against 20 us of device time
    assert b.decide(1.0, 10.05, 20e-6)
    assert b.applied and abs(b.loop_s_per_request - 50e-6) < 1e-12
    tally.n += 1000
    assert not b.due(5.0) and not b.decide(5.0, 20.0, 1e-6)  # decided once, for good


def test_a_model_dearer_than_the_loop_keeps_its_priority_and_is_looked_at_again():
    b, tally = bound()
    b.decide(0.0, 0.0, 5e-3)
    for second in range(1, 6):
        tally.n += 500
        assert b.due(float(second))
        assert not b.decide(float(second), 0.02 * second, 5e-3)  # 40 us against 5 ms
    assert not b.applied and abs(b.loop_s_per_request - 40e-6) < 1e-12
    # the load changes: the model's batches fill up and it becomes the cheaper part
    tally.n += 500
    assert b.decide(6.0, 0.14, 10e-6) and b.applied


def test_a_window_of_too_few_requests_is_extended_not_judged():
    b, tally = bound(min_requests=100)
    b.decide(0.0, 0.0, 1e-6)
    tally.n += 99
    assert not b.decide(1.0, 1.0, 1e-6) and b.loop_s_per_request is None
    tally.n += 1  # the window still runs from 0: 100 requests, 1.2 s of loop CPU
    assert b.decide(2.0, 1.2, 1e-6) and abs(b.loop_s_per_request - 0.012) < 1e-12


def test_nothing_is_decided_at_nice_zero_or_without_a_device_time():
    b, tally = bound(nice=0)
    assert not b.due(0.0) and not b.decide(0.0, 0.0, 1e-9)
    b, tally = bound()
    b.decide(0.0, 0.0, None)
    tally.n += 1000
    assert not b.decide(1.0, 1.0, None) and not b.applied
