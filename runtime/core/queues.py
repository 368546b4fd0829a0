"""Priority-ordered FIFO queues, one per length bucket.

Order inside one queue: lower priority number first; within a priority, arrival
order (a deque per priority level, so no sorting ever happens). Requests that
expire or are cancelled while queued stay in their deque marked dead and are
dropped when they reach its head, so removal is O(1) and ``count`` is exact.
"""

from __future__ import annotations

import bisect
from collections import deque
from typing import Iterator

from runtime.core.request import QUEUED, PendingRequest

#: bucket key of requests longer than the last bucket edge
OVERFLOW = -1


class PriorityFifo:
    """One queue: a deque per priority level; ``count`` counts live requests only."""

    __slots__ = ("_lanes", "count")

    def __init__(self, levels: int) -> None:
        self._lanes: list[deque[PendingRequest]] = [deque() for _ in range(levels)]
        self.count = 0

    def push(self, req: PendingRequest) -> None:
        self._lanes[req.priority].append(req)
        self.count += 1

    def forget(self) -> None:
        """One of the queued requests was marked dead (expired/cancelled) elsewhere."""
        self.count -= 1

    def _head(self, lane: deque[PendingRequest]) -> PendingRequest | None:
        while lane:
            req = lane[0]
            if req.state == QUEUED:
                return req
            lane.popleft()
        return None

    def oldest(self) -> PendingRequest | None:
        """The live request that arrived first, whatever its priority."""
        best = None
        for lane in self._lanes:
            head = self._head(lane)
            if head is not None and (best is None or head.seq < best.seq):
                best = head
        return best

    def best_priority(self) -> int | None:
        for level, lane in enumerate(self._lanes):
            if self._head(lane) is not None:
                return level
        return None

    def take(self, n: int) -> list[PendingRequest]:
        """Up to ``n`` live requests, most urgent first, in arrival order per priority."""
        out: list[PendingRequest] = []
        for lane in self._lanes:
            while lane and len(out) < n:
                req = lane.popleft()
                if req.state == QUEUED:
                    out.append(req)
            if len(out) >= n:
                break
        self.count -= len(out)
        return out

    def live(self) -> Iterator[PendingRequest]:
        for lane in self._lanes:
            for req in lane:
                if req.state == QUEUED:
                    yield req

    def clear(self) -> None:
        for lane in self._lanes:
            lane.clear()
        self.count = 0


class BucketMap:
    """Maps a request length to its bucket key (an edge, ``OVERFLOW`` or None)."""

    __slots__ = ("edges", "enabled")

    def __init__(self, edges: tuple[int, ...], enabled: bool) -> None:
        self.edges = edges
        self.enabled = enabled

    def keys(self) -> list[int | None]:
        if not self.enabled:
            return [None]
        return [*self.edges, OVERFLOW]

    def bucket_of(self, length: int) -> int | None:
        if not self.enabled:
            return None
        i = bisect.bisect_left(self.edges, length)
        return self.edges[i] if i < len(self.edges) else OVERFLOW
