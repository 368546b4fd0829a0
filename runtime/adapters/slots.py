"""Which adapters a batch may hold: the device-resident slot cache and the batch limits.

Synchronous and pure Python, time passed in, as the batcher it serves:

* ``SlotCache``: ``adapter_slots`` slots on the device, each holding one adapter. A
  batch pins the slots of its adapters until it is back (``release``). A cold adapter
  takes a free slot, else the least recently used slot nothing pins (LRU eviction);
  every load and eviction is reported (``SlotChange``). When every slot is pinned, the
  cold adapter waits in a FIFO of waiters, and the least recently used slot is reserved
  for the first of them: nothing new pins it, so it comes free when its batches are back,
  and the waiter gets it before any adapter that asked later. Adapters already resident
  keep being batched meanwhile, so a cold adapter blocks nobody and is never starved.
* ``BatchPick``: one batch's choice, asked request by request in the queue's order
  (``accept``): rows without an adapter always fit; with ``adapter_mixing`` a batch takes
  up to ``max_adapters_per_batch`` distinct adapters, without it only the adapter (or
  the base) of its first request. ``finish`` gives the ``AdapterPlan`` the device needs.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from runtime.adapters.lora import AdapterRef


@dataclass(frozen=True, slots=True)
class SlotChange:
    """An adapter put in a slot (``evicted``: the one it replaced, if any)."""

    slot: int
    name: str
    evicted: str | None
    at_s: float


@dataclass(slots=True)
class AdapterPlan:
    """A batch's adapters: each row's slot (-1: the base model) and what each slot used
    must hold; travels with the batch to the device."""

    rows: tuple[int, ...]
    slots: dict[int, AdapterRef]
    #: loads (and evictions) this batch caused, for the records; not needed on the device
    changes: list[SlotChange] = field(default_factory=list)

    @property
    def adapters(self) -> int:
        """How many distinct adapters the batch mixed (the base not counted)."""
        return len(self.slots)

    def names(self) -> list[str | None]:
        return [self.slots[s].name if s >= 0 else None for s in self.rows]

    def part(self, lo: int, hi: int) -> "AdapterPlan":
        rows = self.rows[lo:hi]
        return AdapterPlan(rows, {s: r for s, r in self.slots.items() if s in rows})


@dataclass(slots=True)
class _Slot:
    name: str | None = None
    ref: AdapterRef | None = None
    pins: int = 0
    used_s: float = 0.0
    #: ticks of use, so ties in time keep the order of use
    used_tick: int = 0
    #: reserved for this waiting adapter: nothing new pins it
    reserved_for: str | None = None


class SlotCache:
    """``capacity`` device slots of adapters with LRU eviction (see the module docstring)."""

    def __init__(self, capacity: int) -> None:
        self._slots = [_Slot() for _ in range(max(1, int(capacity)))]
        self._where: dict[str, int] = {}
        self._waiting: deque[str] = deque()
        self._tick = 0
        #: batches that found an adapter resident (hits), loaded it (``loads``: misses),
        #: and adapters taken out of their slot (``evictions``)
        self.hits = 0
        self.loads = 0
        self.evictions = 0

    @property
    def capacity(self) -> int:
        return len(self._slots)

    def resize(self, capacity: int) -> None:
        """More slots at once; fewer as the highest slots come unpinned (then emptied)."""
        capacity = max(1, int(capacity))
        while len(self._slots) < capacity:
            self._slots.append(_Slot())
        self._target = capacity
        self._shrink()

    def _shrink(self) -> None:
        target = getattr(self, "_target", len(self._slots))
        while len(self._slots) > target and self._slots[-1].pins == 0:
            gone = self._slots.pop()
            if gone.name is not None:
                self._where.pop(gone.name, None)

    def resident(self) -> dict[str, int]:
        """Adapter name -> slot, for the adapters on the device now."""
        return dict(self._where)

    def slot_of(self, name: str) -> int | None:
        return self._where.get(name)

    def pinned(self, name: str) -> int:
        slot = self._where.get(name)
        return 0 if slot is None else self._slots[slot].pins

    def waiting(self) -> list[str]:
        return list(self._waiting)

    def ref_at(self, slot: int) -> AdapterRef | None:
        """What ``slot`` holds now (None: nothing)."""
        return self._slots[slot].ref if 0 <= slot < len(self._slots) else None

    def reserved_for_other(self, name: str) -> bool:
        """Whether ``name``'s slot is reserved for a waiting adapter: nothing new may join
        it (a holder that keeps taking requests must not keep the waiter out)."""
        slot = self._where.get(name)
        reserved = None if slot is None else self._slots[slot].reserved_for
        return reserved is not None and reserved != name

    def _touch(self, index: int, now: float) -> None:
        self._tick += 1
        slot = self._slots[index]
        slot.used_s, slot.used_tick = now, self._tick

    def _victim(self, name: str) -> int | None:
        """A slot ``name`` may take now: a free one, the one reserved for it, else the
        least recently used one that is neither pinned nor reserved for another."""
        best = None
        for i, slot in enumerate(self._slots):
            if slot.pins:
                continue
            if slot.reserved_for is not None and slot.reserved_for != name:
                continue
            if slot.name is None or slot.reserved_for == name:
                return i
            if best is None or slot.used_tick < self._slots[best].used_tick:
                best = i
        return best

    def acquire(self, ref: AdapterRef, now: float) -> tuple[int, SlotChange | None] | None:
        """Pin a slot holding ``ref`` for a batch: ``(slot, the load it took or None)``,
        or None when the adapter must wait (it is then queued among the waiters)."""
        name = ref.name
        index = self._where.get(name)
        if index is not None:
            slot = self._slots[index]
            if slot.ref != ref:  # registered again: same slot, new weights
                slot.ref = ref
            if slot.reserved_for is not None and slot.reserved_for != name:
                return None
            slot.pins += 1
            self.hits += 1
            self._touch(index, now)
            return index, None
        # cold: adapters that asked earlier go first
        if self._waiting and name not in self._waiting:
            self._waiting.append(name)
        if self._waiting and self._waiting[0] != name and not self._spare_for(name):
            return None
        index = self._victim(name)
        if index is None:
            if name not in self._waiting:
                self._waiting.append(name)
            self._reserve_for(self._waiting[0])
            return None
        slot = self._slots[index]
        evicted = slot.name
        if evicted is not None:
            del self._where[evicted]
            self.evictions += 1
        slot.name, slot.ref, slot.pins, slot.reserved_for = name, ref, 1, None
        self._where[name] = index
        self._touch(index, now)
        self.loads += 1
        if name in self._waiting:
            self._waiting.remove(name)
        return index, SlotChange(index, name, evicted, now)

    def _spare_for(self, name: str) -> bool:
        """Whether more slots are takeable now than the waiters ahead of ``name`` need."""
        ahead = list(self._waiting).index(name) if name in self._waiting else len(self._waiting)
        takeable = sum(1 for s in self._slots if not s.pins and s.reserved_for is None)
        return takeable > ahead

    def _reserve_for(self, name: str) -> None:
        """Hold the least recently used slot for the first waiter (once)."""
        if any(s.reserved_for == name for s in self._slots):
            return
        candidates = [i for i, s in enumerate(self._slots) if s.reserved_for is None]
        if candidates:
            index = min(candidates, key=lambda i: self._slots[i].used_tick)
            self._slots[index].reserved_for = name

    def release(self, slots: list[int] | set[int] | tuple[int, ...]) -> None:
        """A batch that pinned ``slots`` is back."""
        for index in slots:
            if index < len(self._slots) and self._slots[index].pins > 0:
                self._slots[index].pins -= 1
        self._shrink()

    def evict(self, name: str) -> int | None:
        """Take ``name`` out of its slot (an unloaded adapter; its batches are back).
        Returns the slot it left."""
        index = self._where.pop(name, None)
        if index is not None:
            slot = self._slots[index]
            slot.name = slot.ref = None
            self.evictions += 1
        self.forget_waiter(name)
        return index

    def forget_waiter(self, name: str) -> None:
        """``name`` waits no more (no request names it): it holds no reservation."""
        if name in self._waiting:
            self._waiting.remove(name)
        for slot in self._slots:
            if slot.reserved_for == name:
                slot.reserved_for = None


class BatchPick:
    """One batch's adapter choice, asked request by request (see the module docstring)."""

    def __init__(self, cache: SlotCache, refs: Callable[[str], AdapterRef | None], now: float,
                 *, mixing: bool, max_adapters: int) -> None:
        self._cache = cache
        self._refs = refs
        self._now = now
        self._mixing = mixing
        self._max = max(1, int(max_adapters))
        #: adapter name -> slot, for the adapters this batch holds
        self.chosen: dict[str, int] = {}
        self.changes: list[SlotChange] = []
        #: without mixing: the group of the first request (an adapter name, or "" for the base)
        self._group: str | None = None

    def fits(self, adapter: str | None) -> bool:
        """Whether the batch's limits (mixing, ``max_adapters_per_batch``) let a request
        naming ``adapter`` in, before any slot is asked for; changes nothing."""
        if not self._mixing and self._group is not None and (adapter or "") != self._group:
            return False
        return adapter is None or adapter in self.chosen or len(self.chosen) < self._max

    def take(self, adapter: str | None, slot: int) -> bool:
        """``accept`` for a request whose adapter already has its slot pinned by the
        caller (``slot``; a running sequence's): the limits only, no pin taken."""
        if not self.fits(adapter):
            return False
        if self._group is None:
            self._group = adapter or ""
        if adapter is not None:
            self.chosen.setdefault(adapter, slot)
        return True

    def accept(self, adapter: str | None) -> bool:
        if not self._mixing:
            group = adapter or ""
            if self._group is None:
                self._group = group
            elif group != self._group:
                return False
        if adapter is None or adapter in self.chosen:
            return True
        if len(self.chosen) >= self._max:
            return False
        ref = self._refs(adapter)
        if ref is None:  # unloaded while queued: runs on its last slot, or not at all
            return False
        got = self._cache.acquire(ref, self._now)
        if got is None:
            return False
        slot, change = got
        self.chosen[adapter] = slot
        if change is not None:
            self.changes.append(change)
        return True

    def finish(self, adapters: list[str | None]) -> AdapterPlan | None:
        """The plan of the batch of requests with ``adapters`` (in order); None when no
        row has one."""
        if not self.chosen:
            return None
        chosen = self.chosen
        rows = tuple(-1 if a is None else chosen[a] for a in adapters)
        slots = {slot: self._cache._slots[slot].ref for slot in chosen.values()}
        return AdapterPlan(rows, slots, self.changes)
