"""``EdgeLearner``: the bucket edges of a variable-length model, derived from the lengths
it is sent.

With ``bucket_edges`` null (the default) a variable-length model's ``Batcher`` counts
every submitted length here and uses ``INITIAL_EDGES`` until ``FIRST_DERIVATION_AFTER``
requests were counted, or ``DERIVATION_INTERVAL_S`` passed with at least
``DERIVATION_MIN_NEW`` of them (a short or light run gets learned edges within its first
second). From then on the ``auto_bucket_count`` edges with the least expected padding
(``runtime.core.queues.derive_edges``) are searched again after every
``DERIVATION_EVERY`` further requests or, at a lighter rate, every
``DERIVATION_INTERVAL_S`` with at least ``DERIVATION_MIN_NEW`` new ones. Older counts fade
by half per ``DERIVATION_EVERY`` new requests however often the search runs, so the edges
follow the traffic. New edges replace the current ones only when they pad at least
``MIN_GAIN`` less (no churn on noise); the batcher then re-buckets its queued requests,
as for a settings change.

Synchronous, time passed in, as the batcher itself.
"""

from __future__ import annotations

from runtime.core.queues import LengthCounts, derive_edges, expected_padding

#: the edges of derived bucketing before any were derived
INITIAL_EDGES = (32, 64, 128, 256)
#: derived edges: first searched after this many requests, then after this many more
FIRST_DERIVATION_AFTER = 256
DERIVATION_EVERY = 1024
#: ... or searched when this long passed since the last search (the first: since the first
#: length) and at least ``DERIVATION_MIN_NEW`` lengths were counted meanwhile
DERIVATION_INTERVAL_S = 1.0
DERIVATION_MIN_NEW = 64
#: derived edges replace the current ones only when they pad at least this much less
MIN_GAIN = 0.05
#: after each search the length counts are scaled by this (recent traffic weighs most)
LENGTH_DECAY = 0.5


class EdgeLearner:
    """The lengths seen by one model and when to search new edges from them."""

    __slots__ = ("lengths", "_until_search", "_since_search", "_last_search_s")

    def __init__(self) -> None:
        self.lengths = LengthCounts()
        self._until_search = FIRST_DERIVATION_AFTER
        #: lengths counted since the last search, and when it ran (None: none counted yet)
        self._since_search = 0
        self._last_search_s: float | None = None

    def count(self, length: int, now: float, current: tuple[int, ...],
              bucket_count: int) -> tuple[int, ...] | None:
        """Count a submitted length; the ``bucket_count`` edges to use instead of
        ``current`` when a search is due and finds ones that pad enough less, else None."""
        lengths = self.lengths
        lengths.add(length)
        self._until_search -= 1
        self._since_search += 1
        if self._last_search_s is None:
            self._last_search_s = now
        if self._until_search > 0 and (self._since_search < DERIVATION_MIN_NEW or
                                       now - self._last_search_s < DERIVATION_INTERVAL_S):
            return None
        self._until_search = DERIVATION_EVERY
        counts = lengths.counts
        edges = derive_edges(counts, bucket_count)
        lengths.decay(LENGTH_DECAY ** (self._since_search / DERIVATION_EVERY))
        self._since_search, self._last_search_s = 0, now
        if edges and edges != current and expected_padding(edges, counts) < \
                (1.0 - MIN_GAIN) * expected_padding(current, counts):
            return edges
        return None

    def derive(self, bucket_count: int) -> tuple[int, ...] | None:
        """``bucket_count`` edges for the lengths counted so far (a changed
        ``auto_bucket_count``); None before any length was counted."""
        counts = self.lengths.counts
        return (derive_edges(counts, bucket_count) or None) if counts else None
