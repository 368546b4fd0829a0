"""Where a request's future would stand when its answer goes to a callback instead.

The transports answer from callbacks on the event loop (no Task, no future per
request): ``CallbackOutcome`` hands a request's one outcome to its callback, and
``ItemsOutcome`` gathers the outcomes of a request of several items, each queued as a
request of its own, into one answer.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any, Callable

log = logging.getLogger("batchscope.engine")


class CallbackOutcome:
    """Stands where a request's future would: hands its one outcome to a callback."""

    __slots__ = ("_fn", "_done")

    def __init__(self, fn: Callable[[Any, BaseException | None], None]) -> None:
        self._fn = fn
        self._done = False

    def done(self) -> bool:
        return self._done

    def cancelled(self) -> bool:
        return False

    def set_result(self, result: Any) -> None:
        self._finish(result, None)

    def set_exception(self, error: BaseException) -> None:
        self._finish(None, error)

    def close(self) -> None:
        """Settled without an outcome of its own (the request was withdrawn)."""
        self._done = True

    def _finish(self, result: Any, error: BaseException | None) -> None:
        if self._done:
            return
        self._done = True
        try:
            self._fn(result, error)
        except Exception:  # the answer path must not break the batch that settles it
            log.exception("a request's completion callback failed")


class ItemsOutcome:
    """The one outcome of a request of several items, each queued on its own: the
    items' results in order once every one succeeded, or the first error any of them
    got (the items still queued are then withdrawn). Each item's ``PendingRequest``
    holds one of its ``slot``s where a future would stand."""

    __slots__ = ("_fn", "_results", "_left", "_done", "withdraw")

    def __init__(self, n: int, fn: Callable[[Any, BaseException | None], None]) -> None:
        self._fn = fn
        self._results: list[Any] = [None] * n
        self._left = n
        self._done = False
        #: called once when the request fails or is abandoned: takes the items still
        #: queued out of the queue (set by the engine once they are queued)
        self.withdraw: Callable[[], None] | None = None

    def done(self) -> bool:
        return self._done

    def slot(self, index: int) -> CallbackOutcome:
        """Where item ``index``'s outcome goes."""
        return CallbackOutcome(partial(self._item_done, index))

    def _item_done(self, index: int, result: Any, error: BaseException | None) -> None:
        if self._done:
            return
        if error is None:
            self._results[index] = result
            self._left -= 1
            if not self._left:
                self._done = True
                self._fn(self._results, None)
            return
        self._done = True
        try:
            self._fn(None, error)
        finally:
            if self.withdraw is not None:
                self.withdraw()

    def abandon(self) -> None:
        """The caller went away: no outcome is delivered; the queued items are withdrawn."""
        if not self._done:
            self._done = True
            if self.withdraw is not None:
                self.withdraw()
