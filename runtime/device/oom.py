"""Out-of-memory recovery: detection, split-and-retry, effective batch-size backoff.

* ``is_oom(exc)`` recognises ``torch.OutOfMemoryError`` (``torch.cuda.OutOfMemoryError``),
  RuntimeErrors whose text names an allocation failure (``OOM_MESSAGES``: CUDA's "out
  of memory", cuBLAS/cuDNN/cuFFT/cuSOLVER/cuSPARSE failing to allocate a workspace or
  handle), and ``MemoryBudgetExceeded`` (a CPU memory budget: the model's
  ``estimate_batch_bytes`` above ``memory_budget_mb`` counts as OOM before running);
  also an error raised while handling one of those (the end of a CUDA-graph capture
  that an OOM interrupted fails in its turn).
* ``run_splitting`` runs a batch and, when an attempt runs out of memory, splits it
  in halves and retries each half, recursively, down to single requests. With
  ``isolate`` it does the same when an attempt raises a model error, so that one bad
  request (a "poison" input) fails alone instead of failing its whole batch; see
  ``IsolationBudget`` for when it gives up.
* ``SizeGovernor`` is the pure state machine of the effective max batch size per
  bucket: an OOM lowers it to the size of the halves (the largest size the split
  will try), and after ``probe_after_batches`` clean batches it doubles back
  toward the configured maximum.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch


class MemoryBudgetExceeded(RuntimeError):
    """A batch's estimated memory is above the configured budget (treated as OOM)."""


#: lower-case texts of a RuntimeError that mean the device ran out of memory. The CUDA
#: libraries allocate their handles and workspaces themselves and report a failure as
#: a status, not as ``torch.OutOfMemoryError``. ``CUDNN_STATUS_NOT_SUPPORTED`` is also
#: what cuDNN answers when no algorithm's workspace fits, and when a batch is larger
#: than a kernel takes: both go away in smaller batches, which is what an OOM gets.
OOM_MESSAGES = (
    "out of memory",                 # the caching allocator; "CUDA error: out of memory"
    "cublas_status_alloc_failed",
    "cudnn_status_alloc_failed",
    "cudnn_status_not_supported",
    "cufft_alloc_failed",
    "cusolver_status_alloc_failed",
    "cusparse_status_alloc_failed",
)

#: how far back ``is_oom`` follows ``__cause__``/``__context__``
_CHAIN_DEPTH = 4


def is_oom(exc: BaseException) -> bool:
    """Whether ``exc``, or an exception it was raised from or while handling, is an
    out-of-memory error (see the module docstring and ``OOM_MESSAGES``)."""
    seen = 0
    while exc is not None and seen < _CHAIN_DEPTH:
        if isinstance(exc, (torch.OutOfMemoryError, MemoryBudgetExceeded)):
            return True
        if isinstance(exc, RuntimeError):
            text = str(exc).lower()
            if any(m in text for m in OOM_MESSAGES):
                return True
        cause = exc.__cause__
        if cause is None and not exc.__suppress_context__:
            cause = exc.__context__
        exc = cause
        seen += 1
    return False


def check_budget(model: Any, batch_size: int, padded_length: int | None,
                 budget_mb: float | None) -> None:
    """Raise ``MemoryBudgetExceeded`` when the model's estimate exceeds the budget."""
    if budget_mb is None:
        return
    estimate = model.estimate_batch_bytes(batch_size, padded_length or 1)
    if estimate is not None and estimate > budget_mb * 1024 * 1024:
        raise MemoryBudgetExceeded(
            f"out of memory budget: a batch of {batch_size} (length {padded_length or 1}) "
            f"needs about {estimate / 2**20:.1f} MiB, memory_budget_mb={budget_mb:g}")


@dataclass(slots=True)
class Attempt:
    """One run of a slice ``[start, stop)`` of a batch."""

    start: int
    stop: int
    #: ok | error | oom | timeout (ran past execution_timeout_ms) | refused (never ran:
    #: the model is stuck in an earlier batch, or its device process cannot start) | lost
    #: (the device process running it exited, or the server stopped, before it answered)
    outcome: str
    started_s: float
    ended_s: float
    compute_s: float
    outputs: list | None = None
    #: short "Type: message" of what the attempt raised (no traceback kept: an OOM's
    #: frames would pin the very tensors that have to be freed before the retry)
    error: str | None = None
    #: the formatted traceback of a model error, for the server log
    trace: str | None = None
    #: an attempt (OOM, or a model error being isolated) that was split into halves:
    #: its requests got another chance
    split: bool = False
    #: the device's peak allocated bytes during the attempt (CUDA only), and what the
    #: attempt added at its peak to what was allocated when it started
    peak_memory_bytes: int | None = None
    peak_memory_increase_bytes: int | None = None
    #: the forward pass replayed a captured CUDA graph
    cuda_graph: bool = False
    #: a ``timeout`` attempt: the execution timeout it ran past, in seconds
    timeout_s: float | None = None
    #: memory figures at the moment of an OOM
    memory: dict = field(default_factory=dict)
    #: of ``compute_s``: the time in ``collate`` (with the memory-budget check) and in
    #: ``split``; the rest is ``predict`` (on CUDA each phase waits for its kernels)
    input_s: float = 0.0
    output_s: float = 0.0
    #: seconds of torch.compile work in this attempt (``compile`` setting): the warm-up
    #: before it, or a new shape compiled inside its predict; ``compile_error``: why
    #: compiling failed (the model then runs eagerly)
    compile_s: float = 0.0
    compile_error: str | None = None

    @property
    def size(self) -> int:
        return self.stop - self.start


class IsolationBudget:
    """When a model error in a batch of ``n`` stops being split (``isolate_errors``).

    A failing slice of more than one request is split in halves and each half run
    again, down to single requests, while both hold:

    * the splits of this batch for model errors are fewer than ``3 * ceil(log2 n)``,
      so at most ``6 * ceil(log2 n)`` extra attempts (a batch of 32: 15 splits, enough
      to isolate four bad requests wherever they sit, more when they sit together;
      one bad request takes ``log2 n`` splits);
    * the model is not broken: it is taken to be when two requests have failed alone
      before any retried part of the batch succeeded. A model that fails on every
      input gets there in ``1 + 2 * ceil(log2 n)`` attempts, the cost of isolating one
      bad request; with bad requests among good ones, the half beside the first bad
      one almost always succeeds first.

    Once either stops it, a failing slice fails whole, as without isolation (halves
    already scheduled still run).
    """

    __slots__ = ("splits_left", "failed_alone", "retried_ok")

    def __init__(self, n: int) -> None:
        self.splits_left = 3 * math.ceil(math.log2(n)) if n > 1 else 0
        self.failed_alone = 0
        #: whether a retried part of the batch succeeded
        self.retried_ok = False

    def ran(self, attempt: "Attempt") -> None:
        """Count a retried attempt."""
        if attempt.outcome == "ok":
            self.retried_ok = True
        elif attempt.outcome == "error" and attempt.stop - attempt.start == 1:
            self.failed_alone += 1

    def allows_split(self) -> bool:
        """Whether a failing slice may be split now (and take one split if so)."""
        if self.splits_left <= 0 or (self.failed_alone >= 2 and not self.retried_ok):
            return False
        self.splits_left -= 1
        return True


def run_splitting(n: int, attempt: Callable[[int, int], Attempt], *, recover: bool,
                  free: Callable[[], None], isolate: bool = False) -> list[Attempt]:
    """Run ``attempt(0, n)``; on OOM (and ``recover``) free cached memory and retry
    each half, depth first; on a model error (and ``isolate``) retry each half too,
    within an ``IsolationBudget``. Returns every attempt in the order it ran. A
    request's outcome is that of the last attempt covering it that was not split."""
    done: list[Attempt] = []
    todo = [(0, n)]
    budget: IsolationBudget | None = None
    while todo:
        lo, hi = todo.pop()
        result = attempt(lo, hi)
        done.append(result)
        if budget is not None:
            budget.ran(result)
        outcome = result.outcome
        if outcome == "ok" or hi - lo == 1:
            continue
        if outcome == "oom" and recover:
            free()
        elif outcome == "error" and isolate:
            if budget is None:
                budget = IsolationBudget(n)
            if not budget.allows_split():
                continue
        else:
            continue
        result.split = True
        mid = lo + (hi - lo + 1) // 2
        todo.append((mid, hi))
        todo.append((lo, mid))
    return done


def _rank(bucket: int | None) -> float:
    if bucket is None:
        return 0.0
    return float("inf") if bucket < 0 else float(bucket)


class SizeGovernor:
    """Effective max batch size per bucket after out-of-memory errors."""

    def __init__(self, configured_max: int, probe_after_batches: int) -> None:
        self.configured_max = configured_max
        self.probe_after_batches = probe_after_batches
        self.caps: dict[int | None, int] = {}
        self._clean: dict[int | None, int] = {}

    def limit(self, bucket: int | None) -> int:
        cap = self.caps.get(bucket, self.configured_max)
        return cap if cap < self.configured_max else self.configured_max

    def reconfigure(self, configured_max: int, probe_after_batches: int) -> None:
        self.configured_max = configured_max
        self.probe_after_batches = probe_after_batches
        for bucket in [b for b, cap in self.caps.items() if cap >= configured_max]:
            del self.caps[bucket]

    def on_oom(self, bucket: int | None, failed_size: int,
               longer: Iterable[int | None] = ()) -> int:
        """A batch of ``failed_size`` ran out of memory in ``bucket``. The cap of that
        bucket, and of the ``longer`` buckets given (longer items need more memory),
        drops to the halves' size. Returns the bucket's new cap."""
        new = max(1, (failed_size + 1) // 2)
        for key in {bucket, *[b for b in longer if _rank(b) >= _rank(bucket)]}:
            if new < self.limit(key):
                self.caps[key] = new
            self._clean[key] = 0
        return self.limit(bucket)

    def on_success(self, bucket: int | None) -> int | None:
        """A batch ran without OOM. Returns the new cap when this probes back up."""
        if bucket not in self.caps:
            return None
        clean = self._clean.get(bucket, 0) + 1
        if clean < self.probe_after_batches:
            self._clean[bucket] = clean
            return None
        self._clean[bucket] = 0
        raised = self.caps[bucket] * 2
        if raised >= self.configured_max:
            del self.caps[bucket]
            return self.configured_max
        self.caps[bucket] = raised
        return raised

    def smallest_limit(self) -> int:
        return min(self.caps.values(), default=self.configured_max)
