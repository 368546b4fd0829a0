"""``Batcher``: the synchronous batching state machine of one model.

Time is always passed in; nothing here sleeps, reads a clock or touches asyncio,
so every rule is tested with a fake clock. A shell (``runtime.engine.dispatch``) calls:

* ``submit(req, now)`` when a request arrives (raises ``QueueFull``/``ValidationError``);
  ``is_full()``/``queue_full()`` say the same refusal without a request;
* ``expire(now)`` for requests whose deadline passed while queued (never executed),
  and ``earliest_deadline()`` for when to call it next;
* ``next_batch(now, model_busy=..., lead_s=...)`` for the dispatch decision;
* ``due_at(now)``/``next_wakeup(now)`` to know how long it may sleep before a
  decision can change;
* ``complete(batch, now, compute_s)`` after a batch ran (feeds the adaptive window
  and the drain rate).

Admission by predicted wait: a request with a deadline is refused at once (``QueueFull``,
429 with ``Retry-After``) when the requests queued ahead of it would take longer to
drain than its timeout leaves, so it is not parsed, queued and then expired unrun.
The drain time per request is measured from recent batches (``complete``): while the
queue stayed non-empty from one batch's return to the next, the time between the two
returns (what the whole path achieves, device and event loop together) divided by the
batch size the queue could have filled (the bucket's cap: under a backlog batches grow
to it, and the time between returns hardly grows with them); otherwise the batch's own
compute time per request. Before any batch has returned nothing is refused on that
ground, nor is a request without a deadline.
``drain_refusal`` gives the same answer without a request, and ``head_refusal`` the
one for a request whose timeout is not known yet (its body is not read): it is judged
by the longest timeout among the recent requests (the last ``TIMEOUT_EPOCH`` to
``2 * TIMEOUT_EPOCH`` submitted) and the model's default, and never refused while a
recent request came without a timeout.

Deadlines: a queued request whose deadline has passed is never dispatched. A
request is not dispatched either when its batch could not end before its deadline:
``next_batch`` takes ``lead_s``, the time the shell expects the batch to take until
it is back (from ``mean_compute_s``), and first expires every request whose
deadline falls before ``now + lead_s``; the shell answers them (``expire``) instead
of running them uselessly. A request that was dispatched is the shell's: it is
answered when its batch ends, even if that is past its deadline.

Bucket edges: with ``bucket_edges`` null (the default) the edges of a variable-length
model are derived from the lengths submitted (``runtime.core.edges.EdgeLearner``: learned
within the first second of traffic, then following it); when they change, the queued
requests are re-bucketed, as for a settings change. ``bucket_edges``/``bucket_keys()``
tell the edges in use, ``edge_changes`` how often they moved.

Order of service:

* Bypass (real-time) requests come first: they skip the batching window and run
  at the next opportunity, batched only with other waiting bypass requests of the
  same bucket, so no companion delays them.
* Inside a queue, lower priority number first, then arrival order.
* Across length buckets, among the buckets whose batch is due: the bucket holding
  the most urgent priority; then a bucket holding a full batch (throughput); then
  the bucket whose oldest request has waited longest (fairness).

Adapters (``enable_adapters``, for a model with LoRA adapters): while requests naming
an adapter are queued, a batch is formed request by request in the order above through
a ``runtime.adapters.slots.BatchPick``: with ``adapter_mixing`` it holds up to
``max_adapters_per_batch`` distinct adapters whose slots it could pin in the slot cache
(``adapter_slots``), without it only the adapter (or the base) of its first request.
Requests it leaves stay queued in their place. When it can take none (every adapter
queued waits for a slot that in-flight batches pin), the batcher is ``blocked``: no
batch is due until one comes back (``complete`` releases its slots) or a request
arrives. ``Batch.adapters`` carries the rows' slots to the device.
"""

from __future__ import annotations

import heapq
from collections import Counter
from dataclasses import dataclass
from typing import Callable

from runtime.adapters.lora import AdapterRef
from runtime.adapters.slots import AdapterPlan, BatchPick, SlotCache
from runtime.api.config import BatchingConfig
from runtime.core import policy
from runtime.core.edges import INITIAL_EDGES, EdgeLearner
from runtime.core.queues import OVERFLOW, BucketMap, PriorityFifo
from runtime.core.request import CANCELLED, DISPATCHED, EXPIRED, QUEUED, PendingRequest
from runtime.api.errors import QueueFull, ValidationError

#: the shortest Retry-After suggested to a refused client
MIN_RETRY_AFTER_S = 0.05
#: per-request service time assumed before any batch has run
DEFAULT_SERVICE_S = 0.005
#: the timeouts ``head_refusal`` goes by are those of the last this many to twice this
#: many requests submitted
TIMEOUT_EPOCH = 1024


@dataclass(slots=True)
class Batch:
    """Requests dispatched together, with what the run and the records need."""

    requests: list[PendingRequest]
    #: bucket edge (None for fixed-size inputs or bucketing off; -1 = overflow)
    bucket: int | None
    #: length every item is padded to (None for fixed-size inputs)
    pad_to: int | None
    settings_version: int
    config: BatchingConfig
    real_elements: int
    padded_elements: int
    #: requests waiting when the batch was formed, the batch included
    queue_depth: int
    dispatched_s: float
    bypass: bool = False
    #: the batch id its first recorded attempt gets (``Booking.reserve``, when it is sent
    #: to the device, so the device work can be labelled with it: NVTX ranges)
    seq: int | None = None
    #: the rows' adapter slots (None: no row names an adapter)
    adapters: AdapterPlan | None = None

    def __len__(self) -> int:
        return len(self.requests)


def pad_length(lengths: list[int], bucket: int | None, config: BatchingConfig,
               variable_length: bool) -> int | None:
    """The length a batch of items with ``lengths`` is padded to."""
    if not variable_length:
        return None
    if bucket is not None and bucket != OVERFLOW and config.pad_to == "bucket":
        return bucket
    return max(lengths)


class Batcher:
    """Queues, priorities, deadlines, buckets and the dispatch decision of one model."""

    def __init__(self, model_name: str, config: BatchingConfig, *, variable_length: bool,
                 version: int = 1) -> None:
        self.model_name = model_name
        self.variable_length = variable_length
        self.version = version
        self.depth = 0
        self.draining = False
        self._config = config
        self._seq = 0
        self._caps: dict[int | None, int] = {}
        self._compute = policy.RecentMean()
        self._per_request = policy.RecentMean()
        #: recent time to drain one request (see the module docstring), seconds
        self._drain = policy.RecentMean()
        #: ``self._drain.mean``, kept as a plain attribute for ``submit``
        self.drain_per_request_s: float | None = None
        #: when the last batch returned, if requests were still queued then (else None)
        self._backlog_since: float | None = None
        #: the last ``drain_refusal`` error and the figures it was made from
        self._slow: tuple[tuple[int, int, int, bool], QueueFull] | None = None
        #: the longest timeout submitted in this epoch and the last, and whether a request
        #: without one was (see ``head_refusal``)
        self._longest_s = 0.0
        self._longest_before_s = 0.0
        self._untimed = False
        self._untimed_before = False
        self._submitted = 0
        self._deadlines: list[tuple[float, int, PendingRequest]] = []
        self._live_deadlines = 0
        self._expired: list[PendingRequest] = []
        #: the last ``queue_full`` error and the figures it was made from
        self._refusal: tuple[tuple[int, int, int], QueueFull] | None = None
        #: derived edges: the lengths seen (None: edges are given, or fixed-size inputs)
        self._learner: EdgeLearner | None = None
        #: how often derived edges replaced the ones in use
        self.edge_changes = 0
        #: adapters (``enable_adapters``): the slot cache, the adapters' current refs and
        #: how many queued requests name each adapter
        self.slots: SlotCache | None = None
        self._adapter_ref: Callable[[str], AdapterRef | None] = lambda name: None
        self.adapter_depth: Counter[str] = Counter()
        #: no batch can be formed until a batch comes back or a request arrives
        self.blocked = False
        self._build_queues(config, self._edges_for(config, None))

    def enable_adapters(self, refs: Callable[[str], AdapterRef | None]) -> None:
        """Serve requests naming adapters; ``refs(name)`` gives a registered adapter's
        ``AdapterRef`` (None: not registered any more)."""
        self.slots = SlotCache(self._config.adapter_slots)
        self._adapter_ref = refs

    # -- structure ----------------------------------------------------------------------
    def _edges_for(self, config: BatchingConfig,
                   current: tuple[int, ...] | None) -> tuple[int, ...]:
        """The edges to use under ``config``: the given ones, or (derived bucketing) the
        ``current`` derived ones, or ``INITIAL_EDGES`` before any were derived."""
        if config.bucket_edges is not None or not (self.variable_length and config.bucketing):
            self._learner = None
            return config.bucket_edges or INITIAL_EDGES
        if self._learner is None:
            self._learner = EdgeLearner()
        return current or INITIAL_EDGES

    def _build_queues(self, config: BatchingConfig, edges: tuple[int, ...]) -> None:
        self._buckets = BucketMap(edges, self.variable_length and config.bucketing)
        keys = self._buckets.keys()
        levels = config.priority_levels
        self._queues: dict[int | None, PriorityFifo] = {k: PriorityFifo(levels) for k in keys}
        self._bypass: dict[int | None, PriorityFifo] = {k: PriorityFifo(levels) for k in keys}
        self._bypass_count = 0
        self._by_priority = [0] * levels

    @property
    def config(self) -> BatchingConfig:
        return self._config

    def set_config(self, config: BatchingConfig, version: int) -> None:
        """Replace the settings; the next ``next_batch`` decides with them. Queued
        requests are kept (re-bucketed and clamped to the priority range if needed)."""
        old = self._config
        self._config = config
        self.version = version
        if self.slots is not None and old.adapter_slots != config.adapter_slots:
            self.slots.resize(config.adapter_slots)
        if (old.bucketing, old.bucket_edges, old.auto_bucket_count, old.priority_levels) != (
                config.bucketing, config.bucket_edges, config.auto_bucket_count,
                config.priority_levels):
            derived = self._learner is not None
            edges = self._edges_for(config, self._buckets.edges if derived else None)
            if self._learner is not None and old.auto_bucket_count != config.auto_bucket_count \
                    and edges != INITIAL_EDGES:
                edges = self._learner.derive(config.auto_bucket_count) or edges
            self._rebucket(config, edges)

    def _rebucket(self, config: BatchingConfig, edges: tuple[int, ...]) -> None:
        """New queues for ``edges``; every queued request moves to its new bucket. Size
        caps are kept for the buckets that remain; a new bucket takes the cap of the old
        bucket its longest length fell in (longer inputs need more memory)."""
        live = sorted(self._all_live(), key=lambda r: r.seq)
        old_buckets, old_caps = self._buckets, self._caps
        self._build_queues(config, edges)
        self._caps = {}
        for key in self._buckets.keys():
            if key in old_caps:
                self._caps[key] = old_caps[key]
            elif key is not None and key != OVERFLOW:
                inherited = old_caps.get(old_buckets.bucket_of(key))
                if inherited is not None:
                    self._caps[key] = inherited
        top = config.priority_levels - 1
        for req in live:
            if req.priority > top:
                req.priority = top
            req.bucket = self._buckets.bucket_of(req.length)
            (self._bypass if req.bypass else self._queues)[req.bucket].push(req)
            self._by_priority[req.priority] += 1
            self._bypass_count += req.bypass

    def _count_length(self, learner: EdgeLearner, length: int, now: float) -> None:
        """Derived bucketing: count a submitted length; new edges when a search found some."""
        edges = learner.count(length, now, self._buckets.edges, self._config.auto_bucket_count)
        if edges is not None:
            self.edge_changes += 1
            self._rebucket(self._config, edges)

    @property
    def bucket_edges(self) -> tuple[int, ...]:
        """The edges in use (given or derived); empty without length bucketing."""
        return self._buckets.edges if self._buckets.enabled else ()

    def bucket_keys(self) -> list[int | None]:
        """The bucket keys in use: each edge and ``OVERFLOW``, or ``[None]``."""
        return self._buckets.keys()

    def set_size_cap(self, bucket: int | None, cap: int | None) -> None:
        """Lower the batch size of one bucket below ``max_batch_size`` (None lifts it)."""
        if cap is None:
            self._caps.pop(bucket, None)
        else:
            self._caps[bucket] = max(1, int(cap))

    def cap(self, bucket: int | None) -> int:
        """The effective max batch size of a bucket: ``max_batch_size``, lowered by the
        OOM governor's cap and, in a bucket with an edge, by ``max_batch_tokens`` over
        the edge (the overflow bucket and unbucketed queues are held to the token limit
        by the lengths themselves, when a batch is formed)."""
        cfg = self._config
        configured = cfg.max_batch_size
        capped = self._caps.get(bucket, configured)
        if capped > configured:
            capped = configured
        tokens = cfg.max_batch_tokens
        if tokens is not None and self.variable_length and bucket is not None \
                and bucket != OVERFLOW:
            by_tokens = tokens // bucket if tokens >= bucket else 1
            if by_tokens < capped:
                capped = by_tokens
        return capped

    def bucket_of(self, length: int) -> int | None:
        return self._buckets.bucket_of(length)

    # -- arrivals -----------------------------------------------------------------------
    def submit(self, req: PendingRequest, now: float) -> bool:
        """Queue a request. Returns False when it cannot change the shell's current
        plan (so a sleeping shell need not be woken), True otherwise."""
        cfg = self._config
        if not 0 <= req.priority < cfg.priority_levels:
            raise ValidationError(
                f"priority={req.priority!r} is out of range for model {self.model_name!r}: "
                f"valid priorities are 0 (most urgent) to {cfg.priority_levels - 1}")
        if self.depth >= cfg.max_queue_size:
            raise self.queue_full()
        self._submitted += 1
        if self._submitted >= TIMEOUT_EPOCH:
            self._new_epoch()
        deadline = req.deadline_s
        if deadline is None:
            self._untimed = True
        else:
            left = deadline - now
            if left > self._longest_s:
                self._longest_s = left
            per = self.drain_per_request_s
            if per is not None and self.depth * per > left:
                error = self.drain_refusal(req.priority, req.bypass, left)
                if error is not None:
                    raise error
        learner = self._learner
        if learner is not None:
            self._count_length(learner, req.length, now)
        if req.adapter is not None:
            self.adapter_depth[req.adapter] += 1
        self.blocked = False
        self._seq += 1
        req.seq = self._seq
        req.state = QUEUED
        bucket = self._buckets.bucket_of(req.length)
        req.bucket = bucket
        queue = (self._bypass if req.bypass else self._queues)[bucket]
        queue.push(req)
        self._bypass_count += req.bypass
        self.depth += 1
        self._by_priority[req.priority] += 1
        earliest = False
        if req.deadline_s is not None:
            heap = self._deadlines
            heapq.heappush(heap, (req.deadline_s, req.seq, req))
            self._live_deadlines += 1
            earliest = heap[0][2] is req
            if len(heap) > 64 and len(heap) > 4 * self._live_deadlines:
                self._deadlines = [e for e in heap if e[2].state == QUEUED]
                heapq.heapify(self._deadlines)
        if req.bypass or earliest or queue.count == 1 or queue.count >= self.cap(bucket):
            return True
        return policy.window_s(cfg, self._compute.mean) is None

    def is_full(self) -> bool:
        """Whether ``submit`` would refuse any request now (the queue is at its limit)."""
        return self.depth >= self._config.max_queue_size

    def queue_full(self) -> QueueFull:
        """The ``QueueFull`` that ``submit`` raises while the queue is at its limit. Under
        overload it is asked for thousands of times a second with the same figures, so
        the same error is handed out again while they stay the same (to 10 ms)."""
        retry = self.retry_after_s()
        key = (self.depth, self._config.max_queue_size, int(retry * 100.0))
        cached = self._refusal
        if cached is not None and cached[0] == key:
            return cached[1]
        error = QueueFull(
            f"model {self.model_name!r} has {self.depth} requests waiting, its "
            f"max_queue_size={self._config.max_queue_size}; retry after about {retry:.2f}s "
            "or raise max_queue_size", retry_after_s=retry)
        self._refusal = (key, error)
        return error

    def _new_epoch(self) -> None:
        self._submitted = 0
        self._longest_before_s, self._longest_s = self._longest_s, 0.0
        self._untimed_before, self._untimed = self._untimed, False

    def head_refusal(self, priority: int, default_timeout_s: float | None) -> QueueFull | None:
        """``drain_refusal`` for a request whose own timeout is not known yet: judged by
        the longest of the recent requests' timeouts and ``default_timeout_s``; None
        while a recent request had no timeout (nor a default), or none was measured."""
        if self.drain_per_request_s is None or self._untimed or self._untimed_before:
            return None
        longest = self._longest_s if self._longest_s > self._longest_before_s \
            else self._longest_before_s
        if default_timeout_s is not None and default_timeout_s > longest:
            longest = default_timeout_s
        if not longest > 0.0:
            return None
        return self.drain_refusal(priority, False, longest, judged_by_recent=True)

    def drain_refusal(self, priority: int, bypass: bool, remaining_s: float, *,
                      judged_by_recent: bool = False) -> QueueFull | None:
        """The ``QueueFull`` for a request of ``priority`` (``bypass``: a real-time one)
        whose timeout leaves ``remaining_s`` when the requests that would run before it
        take longer than that to drain at the recent rate; None when they would not, or
        while no batch has been measured yet. ``judged_by_recent``: ``remaining_s`` is
        the longest timeout of recent requests, not this one's (the message says so)."""
        per = self.drain_per_request_s
        if per is None:
            return None
        if bypass:
            ahead = self._bypass_count
        else:
            ahead = self.depth
            if priority + 1 < len(self._by_priority):
                ahead -= sum(self._by_priority[priority + 1:])
        wait = ahead * per
        if not wait > remaining_s:
            return None
        retry = wait - remaining_s
        if retry < MIN_RETRY_AFTER_S:
            retry = MIN_RETRY_AFTER_S
        # refused thousands of times a second under overload: the same error (and so the
        # same prepared answer) while the figures stay the same to 10 ms
        key = (int(wait * 100.0), int(remaining_s * 1000.0), int(retry * 100.0),
               judged_by_recent)
        cached = self._slow
        if cached is not None and cached[0] == key:
            return cached[1]
        error = QueueFull(
            f"model {self.model_name!r} has about {ahead} requests queued ahead of this one; at "
            f"the recent rate of {1.0 / per:.0f} requests/s they take about {wait * 1000.0:.0f} "
            f"ms to drain, longer than "
            + ("the longest timeout of recent requests and the model's default_timeout_ms, "
               if judged_by_recent else "this request's timeout of ")
            + f"{ms_text(remaining_s * 1000.0)} ms; retry after about {retry:.2f}s, send a longer "
            f"timeout ({TIMEOUT_HOW}) or less load",
            retry_after_s=retry)
        self._slow = (key, error)
        return error

    def cancel(self, req: PendingRequest) -> bool:
        """Withdraw a queued request (its caller went away). False if it already left."""
        if req.state != QUEUED:
            return False
        self._remove(req, CANCELLED)
        return True

    def _remove(self, req: PendingRequest, state: int) -> None:
        req.state = state
        (self._bypass if req.bypass else self._queues)[req.bucket].forget()
        self._bypass_count -= req.bypass
        self.depth -= 1
        self._by_priority[req.priority] -= 1
        if req.deadline_s is not None:
            self._live_deadlines -= 1
        if req.adapter is not None:
            self._adapter_left(req.adapter)

    def _adapter_left(self, name: str) -> None:
        depth = self.adapter_depth
        depth[name] -= 1
        if depth[name] <= 0:
            del depth[name]

    # -- deadlines ----------------------------------------------------------------------
    def _collect_expired(self, now: float) -> None:
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            req = heapq.heappop(heap)[2]
            if req.state == QUEUED:
                self._remove(req, EXPIRED)
                self._expired.append(req)

    def expire(self, now: float) -> list[PendingRequest]:
        """Requests whose deadline passed while they were queued, and those ``next_batch``
        left out because their batch could not have ended in time; they never run."""
        self._collect_expired(now)
        out, self._expired = self._expired, []
        return out

    def earliest_deadline(self) -> float | None:
        """The earliest deadline among the queued requests (None: none has one)."""
        heap = self._deadlines
        while heap and heap[0][2].state != QUEUED:
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    # -- the dispatch decision ----------------------------------------------------------
    def _scan(self, queues: dict[int | None, PriorityFifo], now: float, model_busy: bool,
              always_due: bool) -> tuple[int | None, bool, float | None]:
        """(best due bucket, found one, earliest due time among queues)."""
        window = None if always_due else policy.window_s(self._config, self._compute.mean)
        best_key: int | None = None
        best_rank: tuple[int, int, int] | None = None
        earliest: float | None = None
        for key, queue in queues.items():
            count = queue.count
            if not count:
                continue
            oldest = queue.oldest()
            assert oldest is not None
            cap = self.cap(key)
            if always_due:
                at = oldest.arrived_s
            else:
                at = policy.due_at(window, count, cap, oldest.arrived_s, model_busy)
                if at is None:
                    continue
            if earliest is None or at < earliest:
                earliest = at
            if at > now:
                continue
            rank = (queue.best_priority() or 0, 0 if count >= cap else 1, oldest.seq)
            if best_rank is None or rank < best_rank:
                best_rank, best_key = rank, key
        return best_key, best_rank is not None, earliest

    def next_batch(self, now: float, *, model_busy: bool = False,
                   lead_s: float = 0.0) -> Batch | None:
        """The batch to run now, or None if none is due.

        ``model_busy=True`` asks whether a batch is due although the model is still
        running one (for shells that prepare the next batch ahead): the
        work-conserving rule then only releases full batches.
        ``lead_s``: how long the batch is expected to take until it is back; requests
        whose deadline falls before ``now + lead_s`` are expired first (``expire``
        hands them out) rather than dispatched.
        """
        self._collect_expired(now + lead_s if lead_s > 0.0 else now)
        if not self.depth or self.blocked:
            return None
        if self.has_bypass():
            key, found, _ = self._scan(self._bypass, now, model_busy, True)
            if found:
                return self._form(self._bypass, key, now, bypass=True)
        key, found, _ = self._scan(self._queues, now, model_busy, self.draining)
        if not found:
            return None
        return self._form(self._queues, key, now, bypass=False)

    def due_at(self, now: float, *, model_busy: bool = False) -> float | None:
        """When the next batch is due (at or before ``now``: due now); None = nothing
        becomes due until a request arrives or the model frees up."""
        self._collect_expired(now)
        if not self.depth or self.blocked:
            return None
        if self.has_bypass():
            return now
        return self._scan(self._queues, now, model_busy, self.draining)[2]

    def next_wakeup(self, now: float, *, model_busy: bool = False) -> float | None:
        """The earliest time a decision could change: a batch falls due or a queued
        request's deadline passes. None = only an arrival can change anything."""
        due = self.due_at(now, model_busy=model_busy)
        deadline = self.earliest_deadline()
        if due is None:
            return deadline
        return due if deadline is None or due < deadline else deadline

    def _form(self, queues: dict[int | None, PriorityFifo], key: int | None, now: float,
              *, bypass: bool) -> Batch:
        cfg = self._config
        queue = queues[key]
        cap = self.cap(key)
        if bypass or self.draining:
            n = min(queue.count, cap)
        else:
            n = policy.batch_size(cfg, queue.count, cap)
        tokens = cfg.max_batch_tokens if self.variable_length else None
        if tokens is not None and cfg.pad_to == "bucket" and key is not None and key != OVERFLOW:
            tokens = None  # padded to the edge: cap() has held the batch to the limit
        plan = None
        if self.adapter_depth and self.slots is not None:
            pick = self._pick(now)
            reqs = queue.take(n, tokens, lambda r: pick.accept(r.adapter))
            if not reqs:
                self.blocked = True
                return None
            plan = pick.finish([r.adapter for r in reqs])
        else:
            reqs = queue.take(n, tokens)
        depth_before = self.depth
        by_priority = self._by_priority
        real = 0
        longest = 0
        for req in reqs:
            req.state = DISPATCHED
            by_priority[req.priority] -= 1
            if req.deadline_s is not None:
                self._live_deadlines -= 1
            if req.adapter is not None:
                self._adapter_left(req.adapter)
            length = req.length
            real += length
            if length > longest:
                longest = length
        self.depth -= len(reqs)
        if bypass:
            self._bypass_count -= len(reqs)
        if not self.variable_length:
            pad = None
            padded = real
        else:
            pad = key if (key is not None and key != OVERFLOW and cfg.pad_to == "bucket") else longest
            padded = pad * len(reqs)
        return Batch(reqs, key, pad, self.version, cfg, real, padded, depth_before, now, bypass,
                     adapters=plan)

    def _pick(self, now: float) -> BatchPick:
        """A batch's adapter choice; waiters no queued request names any more are let go."""
        cfg = self._config
        slots = self.slots
        depth = self.adapter_depth
        for name in slots.waiting():
            if not depth.get(name):
                slots.forget_waiter(name)
        return BatchPick(slots, self._adapter_ref, now, mixing=cfg.adapter_mixing,
                         max_adapters=cfg.max_adapters_per_batch)

    # -- feedback -----------------------------------------------------------------------
    def complete(self, batch: Batch, now: float, compute_s: float) -> None:
        """A batch finished after ``compute_s`` of device time."""
        if batch.adapters is not None and self.slots is not None:
            self.slots.release(tuple(batch.adapters.slots))
        self.blocked = False
        self._compute.add(compute_s)
        n = len(batch.requests)
        if n:
            per = compute_s / n
            self._per_request.add(per)
            since = self._backlog_since
            if since is not None and now > since:
                # the queue held work all along since the last return: the gap is what
                # the whole path takes per batch, and a backlog fills batches to the cap
                gap = now - since
                per = (gap if gap > compute_s else compute_s) / self.cap(batch.bucket)
            self._drain.add(per)
            self.drain_per_request_s = self._drain.mean
        self._backlog_since = now if self.depth > 0 else None

    @property
    def mean_compute_s(self) -> float | None:
        return self._compute.mean

    @property
    def mean_compute_per_request_s(self) -> float | None:
        """Recent device time per request (batch time / batch size), None before any batch."""
        return self._per_request.mean

    def window_s(self) -> float | None:
        """The current batching window (None = work-conserving)."""
        return policy.window_s(self._config, self._compute.mean)

    def retry_after_s(self) -> float:
        """Estimated time for the current queue to drain (at least 50 ms)."""
        per = self._per_request.mean
        estimate = self.depth * (per if per is not None else DEFAULT_SERVICE_S)
        return estimate if estimate > MIN_RETRY_AFTER_S else MIN_RETRY_AFTER_S

    # -- shutdown and accounting --------------------------------------------------------
    def start_draining(self) -> None:
        """From now on every queued request is due (used while shutting down)."""
        self.draining = True

    def drain_all(self) -> list[PendingRequest]:
        """Remove every queued request (marked cancelled), in arrival order."""
        live = sorted(self._all_live(), key=lambda r: r.seq)
        for req in live:
            req.state = CANCELLED
        self.adapter_depth.clear()
        for queue in (*self._queues.values(), *self._bypass.values()):
            queue.clear()
        self.depth = 0
        self._bypass_count = 0
        self._by_priority = [0] * self._config.priority_levels
        self._deadlines.clear()
        self._live_deadlines = 0
        return live

    def _all_live(self) -> list[PendingRequest]:
        out: list[PendingRequest] = []
        for queue in (*self._queues.values(), *self._bypass.values()):
            out.extend(queue.live())
        return out

    def has_bypass(self) -> bool:
        """A bypass (real-time) request is waiting."""
        return self._bypass_count > 0

    def depth_by_priority(self) -> dict[int, int]:
        return dict(enumerate(self._by_priority))

    def depth_by_bucket(self) -> dict[int | None, int]:
        return {key: self._queues[key].count + self._bypass[key].count for key in self._queues}


#: how a client sets a request's timeout, whichever protocol it speaks
TIMEOUT_HOW = ("KServe's timeout parameter, in microseconds; timeout_ms on the OpenAI "
               "routes")


def ms_text(value: float) -> str:
    """Milliseconds for a message: whole ones, or three digits below 10 (a timeout of a
    few microseconds does not read as 0 ms)."""
    return f"{value:.0f}" if value >= 10 else f"{value:.3g}"
