"""Fair sharing of one device between several models.

Each model has its own queue and settings, but their batches run one at a time on
the same device. ``FairArbiter`` decides whose batch goes next:

1. a model asking for the device with a bypass (real-time) batch goes first;
2. otherwise the waiting model with the least *virtual* device time goes next,
   ties by the order they asked.

Virtual time is the device time a model has used, except that a model which was
idle is lifted, when it asks again, to the least virtual time among the models
currently active. Without that lift a model that was idle for an hour would own
the device until it had "caught up"; with it, a model with occasional requests is
served after at most one batch of a model that floods the device, and two busy
models share the device evenly by time. Synchronous and clock-free: the shell
reports the device time each batch took.
"""

from __future__ import annotations

import itertools


class FairArbiter:
    def __init__(self) -> None:
        self.holder: str | None = None
        #: model -> (urgent, ask order)
        self._waiting: dict[str, tuple[bool, int]] = {}
        self._vtime: dict[str, float] = {}
        #: real device seconds used per model
        self.device_s: dict[str, float] = {}
        self.grants: dict[str, int] = {}
        self._order = itertools.count()

    def _activate(self, name: str) -> None:
        active = [self._vtime[m] for m in self._waiting]
        if self.holder is not None:
            active.append(self._vtime[self.holder])
        own = self._vtime.setdefault(name, 0.0)
        if active:
            floor = min(active)
            if own < floor:
                self._vtime[name] = floor

    def request(self, name: str, *, urgent: bool = False) -> bool:
        """Ask for the device. True: granted now. False: wait for ``release`` to name it."""
        if name == self.holder or name in self._waiting:
            raise RuntimeError(f"model {name!r} already holds or waits for the device")
        self._activate(name)
        self.device_s.setdefault(name, 0.0)
        if self.holder is None and not self._waiting:
            self._grant(name)
            return True
        self._waiting[name] = (urgent, next(self._order))
        return False

    def _grant(self, name: str) -> None:
        self.holder = name
        self.grants[name] = self.grants.get(name, 0) + 1

    def release(self, name: str, device_s: float) -> str | None:
        """The holder is done after ``device_s`` seconds; returns the model granted next."""
        if self.holder != name:
            raise RuntimeError(f"model {name!r} released the device it does not hold "
                               f"(holder: {self.holder!r})")
        self.device_s[name] += device_s
        self._vtime[name] += device_s
        self.holder = None
        if not self._waiting:
            return None
        nxt = min(self._waiting, key=self._rank)
        del self._waiting[nxt]
        self._grant(nxt)
        return nxt

    def _rank(self, name: str) -> tuple[int, float, int]:
        urgent, order = self._waiting[name]
        return (0 if urgent else 1, self._vtime[name], order)

    def withdraw(self, name: str) -> None:
        """A waiting model gave up its turn (its worker stopped)."""
        self._waiting.pop(name, None)

    @property
    def waiting(self) -> list[str]:
        return sorted(self._waiting, key=self._rank)
