"""FairArbiter: who gets the shared device next (pure, count-based)."""

from __future__ import annotations

import pytest

from runtime.core.arbiter import FairArbiter


def test_free_device_is_granted_at_once():
    arb = FairArbiter()
    assert arb.request("a") is True and arb.holder == "a"
    assert arb.release("a", 0.5) is None and arb.holder is None
    assert arb.device_s == {"a": 0.5}


def test_least_device_time_goes_next():
    arb = FairArbiter()
    arb.request("a")
    arb.release("a", 3.0)            # a has used 3 s
    assert arb.request("b") is True  # device free
    assert arb.request("a") is False
    assert arb.request("c") is False
    assert arb.release("b", 1.0) == "c"   # c (0 s) before a (3 s)
    assert arb.device_s == {"a": 3.0, "b": 1.0, "c": 0.0}


def test_waiting_models_ranked_by_virtual_time_then_order():
    arb = FairArbiter()
    arb.request("x")
    arb.request("slow")
    arb.request("fast")
    assert arb.waiting == ["slow", "fast"]          # equal time: order of asking
    assert arb.release("x", 1.0) == "slow"
    arb.request("x")
    assert arb.release("slow", 5.0) == "fast"       # fast (0 s) before x (1 s)
    arb.request("slow")
    assert arb.waiting == ["x", "slow"]             # x 1 s before slow 5 s


def test_urgent_request_jumps_the_line():
    arb = FairArbiter()
    arb.request("a")
    arb.request("b")
    arb.request("rt", urgent=True)
    assert arb.release("a", 0.1) == "rt"


def test_idle_model_is_lifted_so_it_cannot_monopolise():
    """A model idle for long does not own the device until it catches up."""
    arb = FairArbiter()
    arb.request("old")
    arb.release("old", 100.0)
    arb.request("old")
    arb.request("new")                  # lifted to old's virtual time (100 s)
    order = []
    holder = "old"
    for _ in range(6):
        nxt = arb.release(holder, 1.0)
        arb.request(holder)
        order.append(nxt)
        holder = nxt
    assert order == ["new", "old", "new", "old", "new", "old"]


def test_flooder_cannot_starve_an_occasional_model():
    arb = FairArbiter()
    arb.request("flood")
    for _ in range(5):
        assert arb.request("quiet") is False        # asks while the flooder runs
        assert arb.release("flood", 0.010) == "quiet"
        assert arb.request("flood") is False        # the flooder asks again at once
        assert arb.release("quiet", 0.001) == "flood"
    assert arb.grants == {"flood": 6, "quiet": 5}


def test_double_request_and_foreign_release_are_bugs():
    arb = FairArbiter()
    arb.request("a")
    with pytest.raises(RuntimeError):
        arb.request("a")
    with pytest.raises(RuntimeError):
        arb.release("b", 0.0)


def test_withdrawn_model_is_not_granted():
    arb = FairArbiter()
    arb.request("a")
    arb.request("b")
    arb.withdraw("b")
    assert arb.release("a", 0.1) is None
