"""Time sources. The batching core never reads time itself: it is given ``now``."""

from __future__ import annotations

import asyncio
import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Monotonic seconds."""

    def wall(self) -> float:
        """Seconds since the epoch (what gets recorded)."""

    async def sleep(self, seconds: float) -> None: ...


class MonotonicClock:
    def __init__(self) -> None:
        # one fixed offset keeps wall() consistent with now() for the process' life
        self._offset = time.time() - time.monotonic()

    #: ``time.monotonic`` itself: the hot paths call ``clock.now()`` for every request,
    #: and a C function called straight costs a third of a Python method around it
    now = staticmethod(time.monotonic)

    def wall(self) -> float:
        return time.monotonic() + self._offset

    def to_wall(self, monotonic_s: float) -> float:
        return monotonic_s + self._offset

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))


class FakeClock:
    """A clock that only moves when told to. For deterministic tests."""

    def __init__(self, start: float = 1000.0, wall_offset: float = 1_700_000_000.0) -> None:
        self._now = start
        self._offset = wall_offset

    def now(self) -> float:
        return self._now

    def wall(self) -> float:
        return self._now + self._offset

    def to_wall(self, monotonic_s: float) -> float:
        return monotonic_s + self._offset

    def advance(self, seconds: float) -> float:
        if seconds < 0:
            raise ValueError("a clock cannot go backwards")
        self._now += seconds
        return self._now

    async def sleep(self, seconds: float) -> None:
        self.advance(max(0.0, seconds))
        await asyncio.sleep(0)
