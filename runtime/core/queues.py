"""Priority-ordered FIFO queues, one per length bucket, and the bucket edges.

Order inside one queue: lower priority number first; within a priority, arrival
order (a deque per priority level, so no sorting ever happens). Requests that
expire or are cancelled while queued stay in their deque marked dead and are
dropped when they reach its head, so removal is O(1) and ``count`` is exact.

Bucket edges are either given or derived from the lengths that arrived
(``LengthCounts``, ``derive_edges``): the ``k`` edges that minimize the expected
padding, each request padded up to its bucket's edge, over the observed length
distribution. That is a one-dimensional partition problem, solved exactly by
dynamic programming over the distinct lengths (``O(k n^2)`` with numpy, ``n`` at
most ``MAX_CANDIDATES``).
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from typing import Callable, Iterator, Mapping

import numpy as np

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

    def take(self, n: int, max_tokens: int | None = None,
             accept: Callable[[PendingRequest], bool] | None = None) -> list[PendingRequest]:
        """Up to ``n`` live requests, most urgent first, in arrival order per priority.

        ``max_tokens``: also stop before the first request that would take the batch,
        padded to its longest request, past this many tokens (the first is always taken).
        ``accept``: asked of each request in that order; those it refuses stay queued in
        their place (adapter limits, ``runtime.adapters.slots``).
        """
        out: list[PendingRequest] = []
        longest = 0
        for lane in self._lanes:
            kept: list[PendingRequest] = []
            while lane and len(out) < n:
                req = lane[0]
                if req.state != QUEUED:
                    lane.popleft()
                    continue
                if max_tokens is not None and out:
                    wider = req.length if req.length > longest else longest
                    if wider * (len(out) + 1) > max_tokens:
                        n = len(out)
                        break
                lane.popleft()
                if accept is not None and not accept(req):
                    kept.append(req)
                    continue
                out.append(req)
                if req.length > longest:
                    longest = req.length
            if kept:
                lane.extendleft(reversed(kept))
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


# -- edges derived from the observed lengths ------------------------------------------------
#: lengths up to this are counted exactly; longer ones in bins about ``BIN_GROWTH`` wide
EXACT_LENGTHS = 256
BIN_GROWTH = 1.02
#: the most distinct lengths the edge search considers (neighbours are merged beyond it)
MAX_CANDIDATES = 256


def length_bin(length: int) -> int:
    """The bin a length is counted in, named by its upper end (a possible edge): the
    length itself up to ``EXACT_LENGTHS``, then bins about 2 % wide."""
    if length <= EXACT_LENGTHS:
        return max(1, int(length))
    k = math.ceil(math.log(length / EXACT_LENGTHS) / math.log(BIN_GROWTH))
    upper = math.ceil(EXACT_LENGTHS * BIN_GROWTH ** k)
    while upper < length:  # float rounding
        k += 1
        upper = math.ceil(EXACT_LENGTHS * BIN_GROWTH ** k)
    return upper


class LengthCounts:
    """How many requests of each length (bin) arrived, with older counts fading:
    ``decay`` scales every count, so edges derived later follow the recent lengths.
    Memory is bounded by the number of bins (about 700 up to a million tokens)."""

    __slots__ = ("counts", "total")

    def __init__(self) -> None:
        self.counts: dict[int, float] = {}
        self.total = 0.0

    def add(self, length: int) -> None:
        key = length if 0 < length <= EXACT_LENGTHS else length_bin(length)
        counts = self.counts
        counts[key] = counts.get(key, 0.0) + 1.0
        self.total += 1.0

    def decay(self, factor: float) -> None:
        """Scale every count by ``factor``; bins that fade below 0.01 are dropped."""
        self.counts = {k: v * factor for k, v in self.counts.items() if v * factor >= 0.01}
        self.total = sum(self.counts.values())


def expected_padding(edges: tuple[int, ...], counts: Mapping[int, float]) -> float:
    """Padding per request (tokens) when each length is padded up to its bucket's edge;
    lengths past the last edge are counted as padded to the longest of them."""
    if not counts:
        return 0.0
    longest = max(counts)
    total = weight = 0.0
    for length, w in counts.items():
        i = bisect.bisect_left(edges, length)
        edge = edges[i] if i < len(edges) else longest
        total += w * (edge - length)
        weight += w
    return total / weight if weight else 0.0


def derive_edges(counts: Mapping[int, float], k: int) -> tuple[int, ...]:
    """The at most ``k`` bucket edges with the least expected padding for ``counts``
    (length -> how many): each edge is an observed length, the last the longest one.
    Exact for up to ``MAX_CANDIDATES`` distinct lengths; beyond that neighbouring
    lengths are merged first (each merged group weighs as its longest member)."""
    if k < 1:
        raise ValueError(f"k={k!r} must be at least 1")
    items = sorted((int(x), float(w)) for x, w in counts.items() if w > 0)
    if not items:
        return ()
    while len(items) > MAX_CANDIDATES:  # merge pairs, keeping the longer length
        items = [(items[i + 1][0] if i + 1 < len(items) else items[i][0],
                  items[i][1] + (items[i + 1][1] if i + 1 < len(items) else 0.0))
                 for i in range(0, len(items), 2)]
    xs = np.array([x for x, _ in items], dtype=np.float64)
    ws = np.array([w for _, w in items], dtype=np.float64)
    n = len(xs)
    if n <= k:
        return tuple(int(x) for x in xs)
    weight = np.concatenate(([0.0], np.cumsum(ws)))
    tokens = np.concatenate(([0.0], np.cumsum(ws * xs)))
    # cost[i, j]: padding of one bucket holding lengths i..j, its edge at xs[j] (inf: i > j)
    i_idx = np.arange(n)[:, None]
    j_idx = np.arange(n)[None, :]
    cost = xs[None, :] * (weight[j_idx + 1] - weight[i_idx]) - (tokens[j_idx + 1] - tokens[i_idx])
    cost = np.where(i_idx <= j_idx, np.maximum(cost, 0.0), np.inf)
    best = cost[0].copy()  # best[j]: lengths 0..j in one bucket
    choices = []
    for _ in range(1, k):
        # a new last bucket starts at p + 1 after the best cover of 0..p
        total = best[:-1, None] + cost[1:, :]
        arg = np.argmin(total, axis=0)
        step = total[arg, np.arange(n)]
        take = step < best
        choices.append(np.where(take, arg, -1))
        best = np.where(take, step, best)
    edges = [n - 1]
    j = n - 1
    for back in reversed(choices):
        p = int(back[j])
        if p >= 0:
            edges.append(p)
            j = p
    return tuple(int(xs[e]) for e in sorted(set(edges)))
