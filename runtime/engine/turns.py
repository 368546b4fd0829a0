"""``DeviceTurns``: the asyncio side of ``FairArbiter``, shared by every dispatch loop.

The arbiter (``runtime.core.arbiter``) decides synchronously whose batch goes to
the device next. A dispatch loop that is not granted the device at once awaits
its turn here; whoever releases the device hands the turn to the next model by
resolving that model's future. A loop cancelled while it waits gives its place up
(or, if it was granted in the meantime, passes the turn on), so the device is
never left held by a loop that stopped.
"""

from __future__ import annotations

import asyncio

from runtime.core.arbiter import FairArbiter


class DeviceTurns:
    """Turns on the one device, for models named by the dispatch loops."""

    def __init__(self, arbiter: FairArbiter) -> None:
        self.arbiter = arbiter
        #: the loops waiting for a turn the arbiter did not grant at once
        self._grants: dict[str, asyncio.Future] = {}

    def ask(self, name: str, *, urgent: bool = False) -> bool:
        """Ask for the device: True when granted now, else await ``wait(name)``."""
        return self.arbiter.request(name, urgent=urgent)

    async def wait(self, name: str) -> None:
        """Wait for the turn that ``ask`` did not grant at once."""
        fut = asyncio.get_running_loop().create_future()
        self._grants[name] = fut
        try:
            await fut
        except asyncio.CancelledError:
            self._grants.pop(name, None)
            if self.arbiter.holder == name:
                self.release(name, 0.0)
            else:
                self.arbiter.withdraw(name)
            raise

    def release(self, name: str, device_s: float) -> None:
        """``name`` is done with the device after ``device_s`` seconds of it; the next
        model's waiting loop, if any, gets the turn."""
        arbiter = self.arbiter
        nxt = arbiter.release(name, device_s)
        while nxt is not None:
            fut = self._grants.pop(nxt, None)
            if fut is not None and not fut.done():
                fut.set_result(None)
                return
            # that loop was cancelled while it waited: pass its turn on
            nxt = arbiter.release(nxt, 0.0)

    def is_waiting(self, name: str) -> bool:
        """Whether ``name``'s loop is awaiting its turn."""
        return name in self._grants

    def others_waiting(self) -> bool:
        """Whether any model asked for the device and waits for it."""
        return bool(self.arbiter.waiting)

    def is_free(self) -> bool:
        """Nobody holds the device and nobody waits for it."""
        arbiter = self.arbiter
        return arbiter.holder is None and not arbiter.waiting
