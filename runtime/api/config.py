"""Typed, validated settings with units in their names.

``BatchingConfig`` is per model and may be replaced while the server runs; the
batcher reads it once per batch, so a change takes effect at the next batch
boundary. Every check names the field, the value given and what would be valid.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Literal

from runtime.api.errors import ConfigError

Policy = Literal["static", "dynamic", "adaptive"]
POLICIES: tuple[str, ...] = ("static", "dynamic", "adaptive")
PadTo = Literal["bucket", "batch_max"]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(float(value)))


def collector(problems: list[str]) -> Callable[[bool, str], bool]:
    """``need(cond, msg)``: records ``msg`` in ``problems`` when ``cond`` is false."""

    def need(cond: bool, msg: str) -> bool:
        if not cond:
            problems.append(msg)
        return cond

    return need


def check_queueing(config: Any, need: Callable[[bool, str], bool]) -> None:
    """Checks of the queueing fields every settings class shares: ``max_queue_size``,
    ``priority_levels``, ``default_priority`` and ``default_timeout_ms``."""
    need(_is_int(config.max_queue_size) and 1 <= config.max_queue_size <= 1_000_000,
         f"max_queue_size={config.max_queue_size!r} must be an integer from 1 to 1000000")
    levels = config.priority_levels
    if need(_is_int(levels) and 1 <= levels <= 16,
            f"priority_levels={levels!r} must be an integer from 1 to 16"):
        need(_is_int(config.default_priority) and 0 <= config.default_priority < levels,
             f"default_priority={config.default_priority!r} must be an integer from 0 to "
             f"{levels - 1} (priority_levels={levels})")
    timeout = config.default_timeout_ms
    need(timeout is None or (_is_number(timeout) and 0 < timeout <= 3_600_000),
         f"default_timeout_ms={timeout!r} must be null or a number of milliseconds above 0 "
         "and at most 3600000")


def apply_changes(config: Any, changes: Any, *, list_fields: tuple[str, ...] = (),
                  float_fields: tuple[str, ...] = ()) -> Any:
    """A copy of the frozen dataclass ``config`` with ``changes`` applied and validated.

    Shared by every settings class: refuses a non-object and unknown field names
    (listing the known ones), turns JSON lists of ``list_fields`` into tuples and
    integers of ``float_fields`` into floats, then lets the class validate the result.
    Raises ``ConfigError``; ``config`` itself never changes.
    """
    if not isinstance(changes, dict):
        raise ConfigError("settings must be a JSON object of field: value pairs, e.g. "
                          '{"max_batch_size": 16}. Nothing was changed.')
    known = [f.name for f in fields(config)]
    unknown = sorted(set(changes) - set(known))
    if unknown:
        raise ConfigError(f"unknown setting(s) {unknown}; known settings are {known}. "
                          "Nothing was changed.")
    clean = dict(changes)
    for key in list_fields:
        if key in clean:
            value = clean[key]
            if not isinstance(value, (list, tuple)):
                raise ConfigError(f"{key}={value!r} must be a list of integers. "
                                  "Nothing was changed.")
            clean[key] = tuple(value)
    for key in float_fields:
        if _is_int(clean.get(key)):
            clean[key] = float(clean[key])
    return dataclasses.replace(config, **clean)


@dataclass(frozen=True)
class BatchingConfig:
    """How one model's requests are grouped into batches."""

    #: static: wait for exactly ``max_batch_size`` (bounded by ``static_max_wait_ms``);
    #: dynamic: dispatch at ``max_batch_size`` or when the oldest request has waited
    #: ``max_queue_delay_ms``; adaptive: like dynamic, with the delay following
    #: ``max(adaptive_floor_ms, adaptive_factor * recent mean batch compute time)``.
    policy: Policy = "dynamic"
    max_batch_size: int = 32
    #: None means work-conserving: dispatch at once while the model is idle and let
    #: batches form while it is busy. A number is an explicit upper bound on how long
    #: the oldest request waits for companions, applied even when the model is idle.
    max_queue_delay_ms: float | None = None
    #: batch sizes the model runs best at; the batcher cuts to the largest one that
    #: fits when it has to dispatch a partial batch.
    preferred_batch_sizes: tuple[int, ...] = ()
    #: static policy: the longest a partial batch waits before it runs anyway.
    static_max_wait_ms: float = 100.0
    adaptive_floor_ms: float = 1.0
    adaptive_factor: float = 2.0
    adaptive_ceiling_ms: float = 200.0
    #: length bucketing for variable-length inputs: one queue per bucket edge; a
    #: request longer than the last edge goes to an overflow bucket.
    bucketing: bool = True
    bucket_edges: tuple[int, ...] = (32, 64, 128, 256)
    #: pad a batch to its bucket's edge or only to the longest request in it.
    pad_to: PadTo = "batch_max"
    #: backpressure: requests beyond this many waiting are refused with 429.
    max_queue_size: int = 1024
    #: priorities run from 0 (most urgent) to ``priority_levels - 1``.
    priority_levels: int = 3
    default_priority: int = 1
    #: per-request timeout applied when a request gives none; None = no timeout.
    default_timeout_ms: float | None = None
    #: let requests marked real-time skip the batching window.
    allow_bypass: bool = True
    #: OOM recovery: split failing batches and lower the effective max batch size.
    oom_recovery: bool = True
    #: clean batches in a row before the effective max batch size probes back up.
    oom_probe_after_batches: int = 50
    #: a memory budget enforced on the CPU (an estimate above it counts as OOM).
    memory_budget_mb: float | None = None
    #: capture CUDA graphs for the batch sizes seen (GPU only; ignored on the CPU).
    cuda_graphs: bool = False

    def __post_init__(self) -> None:
        self.validate()

    # -- validation -----------------------------------------------------------------
    def validate(self) -> None:
        problems: list[str] = []
        need = collector(problems)
        need(self.policy in POLICIES,
             f"policy={self.policy!r} is not one of {', '.join(POLICIES)}")
        need(_is_int(self.max_batch_size) and 1 <= self.max_batch_size <= 4096,
             f"max_batch_size={self.max_batch_size!r} must be an integer from 1 to 4096")
        need(self.max_queue_delay_ms is None or (_is_number(self.max_queue_delay_ms)
                                                 and 0 <= self.max_queue_delay_ms <= 60_000),
             f"max_queue_delay_ms={self.max_queue_delay_ms!r} must be null (work-conserving) "
             "or a number of milliseconds from 0 to 60000")
        prefs = self.preferred_batch_sizes
        need(isinstance(prefs, tuple) and all(_is_int(p) and p >= 1 for p in prefs),
             f"preferred_batch_sizes={prefs!r} must be a list of positive integers")
        if isinstance(prefs, tuple) and all(_is_int(p) for p in prefs) and _is_int(self.max_batch_size):
            too_big = [p for p in prefs if p > self.max_batch_size]
            need(not too_big, f"preferred_batch_sizes {too_big} exceed max_batch_size="
                              f"{self.max_batch_size}; lower them or raise max_batch_size")
        for name in ("static_max_wait_ms", "adaptive_floor_ms", "adaptive_ceiling_ms"):
            v = getattr(self, name)
            need(_is_number(v) and 0 <= v <= 60_000,
                 f"{name}={v!r} must be a number of milliseconds from 0 to 60000")
        if _is_number(self.adaptive_floor_ms) and _is_number(self.adaptive_ceiling_ms):
            need(self.adaptive_floor_ms <= self.adaptive_ceiling_ms,
                 f"adaptive_floor_ms={self.adaptive_floor_ms} is above adaptive_ceiling_ms="
                 f"{self.adaptive_ceiling_ms}; the floor must not exceed the ceiling")
        need(_is_number(self.adaptive_factor) and 0 < self.adaptive_factor <= 100,
             f"adaptive_factor={self.adaptive_factor!r} must be a number above 0 and at most 100")
        need(isinstance(self.bucketing, bool), f"bucketing={self.bucketing!r} must be true or false")
        edges = self.bucket_edges
        ok_edges = isinstance(edges, tuple) and len(edges) >= 1 and all(
            _is_int(e) and e >= 1 for e in edges)
        need(ok_edges, f"bucket_edges={edges!r} must be a non-empty list of positive integers")
        if ok_edges:
            need(list(edges) == sorted(set(edges)),
                 f"bucket_edges={list(edges)} must be strictly increasing, e.g. [32, 64, 128, 256]")
        need(self.pad_to in ("bucket", "batch_max"),
             f"pad_to={self.pad_to!r} must be 'bucket' or 'batch_max'")
        check_queueing(self, need)
        for name in ("allow_bypass", "oom_recovery", "cuda_graphs"):
            v = getattr(self, name)
            need(isinstance(v, bool), f"{name}={v!r} must be true or false")
        need(_is_int(self.oom_probe_after_batches) and 1 <= self.oom_probe_after_batches <= 1_000_000,
             f"oom_probe_after_batches={self.oom_probe_after_batches!r} must be a positive integer")
        need(self.memory_budget_mb is None or (_is_number(self.memory_budget_mb)
                                               and self.memory_budget_mb > 0),
             f"memory_budget_mb={self.memory_budget_mb!r} must be null or a positive number")
        if problems:
            raise ConfigError("invalid batching settings: " + "; ".join(problems)
                              + ". Nothing was changed.")

    # -- conversions ----------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        for key in ("preferred_batch_sizes", "bucket_edges"):
            out[key] = list(out[key])
        return out

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    def with_changes(self, changes: dict[str, Any]) -> "BatchingConfig":
        """A new validated config with ``changes`` applied; raises ConfigError."""
        return apply_changes(self, changes, list_fields=("preferred_batch_sizes", "bucket_edges"),
                             float_fields=("max_queue_delay_ms", "static_max_wait_ms",
                                           "adaptive_floor_ms", "adaptive_ceiling_ms",
                                           "adaptive_factor", "default_timeout_ms",
                                           "memory_budget_mb"))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "BatchingConfig":
        return cls().with_changes(data)


@dataclass(frozen=True)
class ServerConfig:
    """Process-wide settings of ``batchscope serve``."""

    host: str = "127.0.0.1"
    port: int = 8000
    #: any SQLAlchemy URL; the default is a SQLite file in WAL mode.
    database_url: str = "sqlite:///data/batchscope.db"
    record: bool = True
    #: torch intra-op threads; None leaves torch's default.
    torch_threads: int | None = None
    heartbeat_interval_s: float = 2.0
    control_poll_interval_s: float = 0.5
    #: raw per-request and per-batch rows older than this are rolled up and deleted.
    retention_raw_s: float = 24 * 3600.0
    rollup_interval_s: float = 60.0
    device_sample_interval_s: float = 1.0
    recorder_buffer_size: int = 100_000
    models: tuple[str, ...] = field(default_factory=lambda: ("mlp", "encoder"))
    #: run request models in a child process with its own GIL (loaded from ``models``)
    device_process: bool = False
    #: run the recorder's database inserts in a child process (``batchscope.storage.writer_process``)
    recorder_process: bool = False

    def __post_init__(self) -> None:
        problems = []
        if not (_is_int(self.port) and 0 <= self.port <= 65535):
            problems.append(f"port={self.port!r} must be an integer from 0 to 65535")
        if self.torch_threads is not None and not (_is_int(self.torch_threads) and self.torch_threads >= 1):
            problems.append(f"torch_threads={self.torch_threads!r} must be a positive integer")
        for name in ("heartbeat_interval_s", "control_poll_interval_s", "retention_raw_s",
                     "rollup_interval_s", "device_sample_interval_s"):
            v = getattr(self, name)
            if not (_is_number(v) and v > 0):
                problems.append(f"{name}={v!r} must be a positive number of seconds")
        for name in ("device_process", "recorder_process"):
            if not isinstance(getattr(self, name), bool):
                problems.append(f"{name}={getattr(self, name)!r} must be true or false")
        if not (_is_int(self.recorder_buffer_size) and self.recorder_buffer_size >= 1):
            problems.append(f"recorder_buffer_size={self.recorder_buffer_size!r} must be a positive integer")
        if problems:
            raise ConfigError("invalid server settings: " + "; ".join(problems))
