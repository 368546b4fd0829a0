"""Which LoRA adapters a generation step runs: the slot cache and the step's limits for
sequences that live over many steps.

Synchronous, time passed in, as the scheduler that calls it. It reuses the request
batcher's parts (``runtime.adapters.slots``): the ``SlotCache`` (device slots, LRU
eviction, cold adapters waiting first in line with a reserved slot) and one ``BatchPick``
per step (``adapter_mixing``, ``max_adapters_per_batch``). What differs is that a
sequence keeps its adapter over all its steps (prefill chunks, decodes, verification of
proposed tokens), so the pins are held by the running set rather than by one batch:

* an adapter's slot is pinned once while at least one running sequence names it, and
  released when the last of them stops running (finished, cancelled, expired, failed or
  preempted); a preempted sequence asks again when it is readmitted;
* each step, the running sequences are taken in the scheduler's order (priority,
  arrival) through the step's ``BatchPick`` without new pins (``take``): after a
  settings change lowered the limits (or turned mixing off), the newest ones sit out
  until the older ones end;
* a waiting sequence joins through the same pick: an adapter the running set holds
  joins unless its slot is reserved for a cold adapter waiting (so that slot comes free
  once its sequences end); a new adapter needs the limits and a slot (``accept``, which
  pins it: a free slot, else the least recently used one no running sequence holds).
  As ``max_adapters_per_batch`` is at most ``adapter_slots`` and only the running set
  pins, an adapter within the limits always finds one; the cache's queue of waiters
  (a reserved slot, nobody held up) is reached only while its slots shrink at run time;
* once a running sequence sits out or a waiting one is refused by the limits, no later
  one naming an adapter joins in that step (nor, without mixing, any later one at all):
  the running set's adapters then drain instead of being renewed for ever, and the
  refused sequence gets its turn. Sequences of the base always fit while mixing is on.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable

from runtime.adapters.lora import AdapterRef
from runtime.adapters.slots import AdapterPlan, BatchPick, SlotCache, SlotChange


class StepAdapters:
    """The adapter side of a generation scheduler (see the module docstring)."""

    def __init__(self, capacity: int, refs: Callable[[str], AdapterRef | None]) -> None:
        self.cache = SlotCache(capacity)
        self._refs = refs
        #: adapter -> running sequences naming it, and the slot they hold pinned
        self._users: Counter[str] = Counter()
        self._slot: dict[str, int] = {}
        #: adapter -> live sequences (waiting or running) naming it
        self.depth: Counter[str] = Counter()
        self._pick: BatchPick | None = None
        self._mixing = True
        self._blocked = False

    # -- a sequence's life ---------------------------------------------------------------
    def added(self, adapter: str | None) -> None:
        if adapter is not None:
            self.depth[adapter] += 1

    def left(self, adapter: str | None) -> None:
        """A running sequence naming ``adapter`` stopped running (ended or preempted)."""
        if adapter is None or adapter not in self._users:
            return
        self._users[adapter] -= 1
        if self._users[adapter] <= 0:
            del self._users[adapter]
            self.cache.release([self._slot.pop(adapter)])

    def ended(self, adapter: str | None) -> None:
        """A sequence naming ``adapter`` left the scheduler (after ``left`` if it ran)."""
        if adapter is None:
            return
        self.depth[adapter] -= 1
        if self.depth[adapter] <= 0:
            del self.depth[adapter]
            self.cache.forget_waiter(adapter)  # nobody asks for it any more

    # -- one step ------------------------------------------------------------------------
    def begin(self, config: Any, now: float) -> None:
        self._mixing = bool(config.adapter_mixing)
        self._pick = BatchPick(self.cache, self._refs, now, mixing=self._mixing,
                               max_adapters=config.max_adapters_per_batch)
        self._blocked = False

    def keep(self, adapter: str | None) -> bool:
        """Whether a running sequence naming ``adapter`` computes this step (one that
        sits out blocks new adapters from joining, as a refused waiting one does)."""
        if self._pick.take(adapter, self._slot.get(adapter, -1) if adapter else -1):
            return True
        self._blocked = True
        return False

    def join(self, adapter: str | None) -> bool:
        """Whether a waiting sequence naming ``adapter`` joins the running set now (its
        slot pinned when it does); call only when it then starts running."""
        pick = self._pick
        if self._blocked and (adapter is not None or not self._mixing):
            return False
        if not pick.fits(adapter):
            self._blocked = True
            return False
        if adapter is None:
            return pick.take(None, -1)
        if adapter in self._users:
            if self.cache.reserved_for_other(adapter):
                return False
            pick.take(adapter, self._slot[adapter])
            self._users[adapter] += 1
            return True
        if adapter in pick.chosen:  # its sequences left during this step: ask next step
            return False
        if not pick.accept(adapter):
            return False  # cold with every slot pinned (it waits in line), or unloaded
        self._slot[adapter] = pick.chosen[adapter]
        self._users[adapter] = 1
        return True

    def slot_of(self, adapter: str | None) -> int:
        """The slot of a running sequence's adapter (-1: the base model)."""
        return -1 if adapter is None else self._slot.get(adapter, -1)

    def plan(self, slots: set[int]) -> tuple[AdapterPlan | None, list[SlotChange]]:
        """The step's ``AdapterPlan`` for the ``slots`` its chunks use (None: only base
        rows) and the loads and evictions the step caused."""
        changes = list(self._pick.changes) if self._pick is not None else []
        refs = {s: self.cache.ref_at(s) for s in sorted(slots) if s >= 0}
        refs = {s: r for s, r in refs.items() if r is not None}
        return (AdapterPlan((), refs, changes) if refs else None), changes

    # -- figures -------------------------------------------------------------------------
    def running(self) -> dict[str, int]:
        """Adapter -> running sequences naming it."""
        return dict(self._users)

    def pins(self) -> int:
        """Slots pinned now (0 once no sequence with an adapter runs)."""
        return sum(self.cache.pinned(name) for name in self.cache.resident())
