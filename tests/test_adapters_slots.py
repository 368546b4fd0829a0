"""The adapter slot cache (LRU, pins, waiters) and mixed-adapter batch formation in the
``Batcher``, with a fake clock: outcomes depend on counts only."""

from __future__ import annotations

import random

from runtime.adapters.lora import AdapterRef
from runtime.adapters.slots import BatchPick, SlotCache
from runtime.api.config import BatchingConfig
from runtime.core.batcher import Batcher
from runtime.core.clock import FakeClock
from runtime.core.request import PendingRequest


def ref(name: str) -> AdapterRef:
    return AdapterRef(name, f"/adapters/{name}", 1)


def test_lru_eviction_follows_the_scripted_sequence():
    """64 adapters, 8 slots, Zipf-like traffic: every load and eviction is the one an LRU
    model of the same sequence predicts."""
    cache = SlotCache(8)
    rng = random.Random(7)
    weights = [1.0 / (k + 1) for k in range(64)]
    sequence = rng.choices([f"a{k}" for k in range(64)], weights, k=2000)
    lru: list[str] = []  # most recent last
    predicted_evictions = 0
    for t, name in enumerate(sequence):
        expected_evicted = None
        if name in lru:
            lru.remove(name)
        elif len(lru) == 8:
            expected_evicted = lru.pop(0)
            predicted_evictions += 1
        lru.append(name)
        slot, change = cache.acquire(ref(name), float(t))
        cache.release([slot])
        if change is None:
            assert expected_evicted is None
        else:
            assert change.evicted == expected_evicted and change.name == name
        assert set(cache.resident()) == set(lru)
    assert cache.evictions == predicted_evictions and cache.loads == predicted_evictions + 8


def test_pinned_slots_are_not_evicted_and_a_cold_adapter_waits_first_in_line():
    cache = SlotCache(2)
    assert cache.acquire(ref("a"), 0)[0] == 0
    assert cache.acquire(ref("b"), 1)[0] == 1
    assert cache.acquire(ref("c"), 2) is None  # both pinned: c waits
    assert cache.waiting() == ["c"]
    # the least recently used slot (a's) is reserved for c: a is not pinned again
    assert cache.acquire(ref("a"), 3) is None
    assert cache.acquire(ref("b"), 4) is not None  # b still serves
    assert cache.acquire(ref("d"), 5) is None  # d asked later: behind c
    cache.release([0])
    slot, change = cache.acquire(ref("c"), 6)
    assert (slot, change.evicted) == (0, "a") and cache.waiting() == ["d"]


def make(**changes) -> tuple[Batcher, FakeClock]:
    b = Batcher("enc", BatchingConfig().with_changes(changes), variable_length=False)
    b.enable_adapters(ref)
    return b, FakeClock()


def add(b: Batcher, clock: FakeClock, adapter: str | None) -> PendingRequest:
    req = PendingRequest(adapter, arrived_s=clock.now(), adapter=adapter)
    b.submit(req, clock.now())
    return req


def test_mixing_puts_several_adapters_and_the_base_in_one_batch():
    b, clock = make(max_batch_size=16)
    names = [None, "a", "b", "a", None, "c"]
    for name in names:
        add(b, clock, name)
    batch = b.next_batch(clock.now())
    assert [r.adapter for r in batch.requests] == names
    plan = batch.adapters
    assert plan.adapters == 3 and plan.names() == names
    assert [c.name for c in plan.changes] == ["a", "b", "c"]
    assert not b.adapter_depth


def test_without_mixing_a_batch_holds_one_adapter():
    b, clock = make(max_batch_size=16, adapter_mixing=False)
    for name in ["a", None, "b", "a", None]:
        add(b, clock, name)
    groups = []
    while b.depth:
        batch = b.next_batch(clock.now())
        groups.append([r.adapter for r in batch.requests])
        b.complete(batch, clock.now(), 0.001)
    assert groups == [["a", "a"], [None, None], ["b"]]


def test_max_adapters_per_batch_leaves_the_rest_queued_in_order():
    b, clock = make(max_batch_size=16, max_adapters_per_batch=2, adapter_slots=4)
    for name in ["a", "b", "c", "a", "d", "b"]:
        add(b, clock, name)
    first = b.next_batch(clock.now())
    assert [r.adapter for r in first.requests] == ["a", "b", "a", "b"]
    second = b.next_batch(clock.now())
    assert [r.adapter for r in second.requests] == ["c", "d"]


def test_a_cold_adapter_waits_without_blocking_resident_ones_and_is_not_starved():
    b, clock = make(max_batch_size=4, max_adapters_per_batch=1, adapter_slots=1)
    add(b, clock, "a")
    running = b.next_batch(clock.now())  # pins the only slot
    add(b, clock, "b")  # cold: must wait for the slot
    add(b, clock, None)  # the base needs no slot
    batch = b.next_batch(clock.now())
    assert [r.adapter for r in batch.requests] == [None]
    add(b, clock, "a")  # a's slot is reserved for b now: a waits too
    assert b.next_batch(clock.now()) is None and b.blocked
    assert b.due_at(clock.now()) is None
    b.complete(running, clock.now(), 0.001)
    b.complete(batch, clock.now(), 0.001)
    nxt = b.next_batch(clock.now())
    assert [r.adapter for r in nxt.requests] == ["b"]
    assert nxt.adapters.changes[0].evicted == "a"


def test_pick_refuses_an_adapter_that_was_unloaded():
    cache = SlotCache(2)
    pick = BatchPick(cache, lambda name: None, 0.0, mixing=True, max_adapters=2)
    assert not pick.accept("gone") and pick.accept(None)
    assert pick.finish([None]) is None
