"""Typed, validated settings with units in their names.

``BatchingConfig`` is per model and may be replaced while the server runs; the
batcher reads it once per batch, so a change takes effect at the next batch
boundary. Every check names the field, the value given and what would be valid.

Each field's type, bounds, unit and meaning live in one place, the schema in
``batchscope.settings``; the classes here apply it and add the rules that relate
several fields. ``ServerConfig`` holds the process-wide settings of ``batchscope serve``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from batchscope.settings import BATCHING, Setting
from runtime.api.errors import ConfigError

Policy = Literal["static", "dynamic", "adaptive"]
PadTo = Literal["bucket", "batch_max"]
CompileMode = Literal["off", "default", "reduce-overhead", "max-autotune"]
POLICIES: tuple[str, ...] = next(s.choices for s in BATCHING if s.name == "policy")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(float(value)))


def field_problems(config: Any, settings: tuple[Setting, ...]) -> dict[str, str]:
    """What is wrong with each field of ``config`` on its own, by field name, following
    the schema in ``batchscope.settings``; the rules between fields are the caller's.

    ``default_priority`` is judged against ``priority_levels`` here when that is valid,
    so its message says the range that actually applies.
    """
    problems: dict[str, str] = {}
    for setting in settings:
        problem = setting.problem(getattr(config, setting.name))
        if problem is not None:
            problems[setting.name] = problem
    if "priority_levels" not in problems:
        levels, value = config.priority_levels, config.default_priority
        if not (_is_int(value) and 0 <= value < levels):
            problems["default_priority"] = (f"default_priority={value!r} must be an integer "
                                            f"from 0 to {levels - 1} (priority_levels={levels})")
    return problems


def apply_changes(config: Any, changes: Any, settings: tuple[Setting, ...]) -> Any:
    """A copy of the frozen dataclass ``config`` with ``changes`` applied and validated.

    Shared by every settings class: refuses a non-object and unknown field names
    (listing the known ones), puts each value in its setting's Python form (JSON lists
    become tuples, integers of float settings become floats), then lets the class
    validate the result. Raises ``ConfigError``; ``config`` itself never changes.
    """
    if not isinstance(changes, dict):
        raise ConfigError("settings must be a JSON object of field: value pairs, e.g. "
                          '{"max_batch_size": 16}. Nothing was changed.')
    known = [f.name for f in fields(config)]
    unknown = sorted(set(changes) - set(known))
    if unknown:
        raise ConfigError(f"unknown setting(s) {unknown}; known settings are {known}. "
                          "Nothing was changed.")
    by_name = {s.name: s for s in settings}
    clean = {key: by_name[key].coerce(value) if key in by_name else value
             for key, value in changes.items()}
    return dataclasses.replace(config, **clean)


#: the most items one request may hold (never more than the model's ``max_queue_size``)
MAX_REQUEST_ITEMS = 65536


@dataclass(frozen=True)
class BatchingConfig:
    """How one model's requests are grouped into batches.

    What each field means, its unit and its valid values are in
    ``batchscope.settings.BATCHING`` (also the table in docs/batching.md and
    ``batchscope serve --help``); the defaults here must equal the schema's, which a test checks.
    """

    policy: Policy = "dynamic"
    max_batch_size: int = 32
    max_queue_delay_ms: float | None = None  # None: work-conserving
    preferred_batch_sizes: tuple[int, ...] = ()
    static_max_wait_ms: float = 100.0
    adaptive_floor_ms: float = 1.0
    adaptive_factor: float = 2.0
    adaptive_ceiling_ms: float = 200.0
    bucketing: bool = True
    bucket_edges: tuple[int, ...] | None = None  # None: derived from the observed lengths
    auto_bucket_count: int = 8
    max_batch_tokens: int | None = None  # None: no limit
    pad_to: PadTo = "batch_max"
    max_queue_size: int = 1024
    priority_levels: int = 3
    default_priority: int = 1
    default_timeout_ms: float | None = None  # None: no timeout
    allow_bypass: bool = True
    oom_recovery: bool = True
    oom_probe_after_batches: int = 50
    memory_budget_mb: float | None = None  # None: no budget
    cuda_graphs: bool = False
    compile: CompileMode = "off"
    isolate_errors: bool = True
    execution_timeout_ms: float | None = 30_000.0  # None: no execution timeout
    execution_timeout_auto: bool = True  # follow the model's recent batch times
    adapter_mixing: bool = True  # mixed-adapter batches (models with adapters)
    max_adapters_per_batch: int = 8
    adapter_slots: int = 16  # adapters resident on the device
    adapter_memory_mb: float = 512.0  # registered adapters' memory together
    autopilot_slo_p99_ms: float | None = None  # None: autopilot off

    def __post_init__(self) -> None:
        self.validate()

    # -- validation -----------------------------------------------------------------
    def validate(self) -> None:
        """Raises ``ConfigError`` listing every problem. Each field's own type, bounds and
        message come from ``batchscope.settings.BATCHING``; the rules between fields are
        here."""
        bad = field_problems(self, BATCHING)
        problems = list(bad.values())
        if not {"preferred_batch_sizes", "max_batch_size"} & bad.keys():
            too_big = [p for p in self.preferred_batch_sizes if p > self.max_batch_size]
            if too_big:
                problems.append(f"preferred_batch_sizes {too_big} exceed max_batch_size="
                                f"{self.max_batch_size}; lower them or raise max_batch_size")
        if not {"adaptive_floor_ms", "adaptive_ceiling_ms"} & bad.keys() \
                and self.adaptive_floor_ms > self.adaptive_ceiling_ms:
            problems.append(f"adaptive_floor_ms={self.adaptive_floor_ms} is above "
                            f"adaptive_ceiling_ms={self.adaptive_ceiling_ms}; the floor must not "
                            "exceed the ceiling")
        edges = self.bucket_edges
        if "bucket_edges" not in bad and edges is not None and list(edges) != sorted(set(edges)):
            problems.append(f"bucket_edges={list(edges)} must be strictly increasing, "
                            "e.g. [32, 64, 128, 256]")
        if not {"autopilot_slo_p99_ms", "policy"} & bad.keys() \
                and self.autopilot_slo_p99_ms is not None and self.policy != "dynamic":
            problems.append(f"autopilot_slo_p99_ms={self.autopilot_slo_p99_ms:g} needs "
                            f"policy='dynamic' (policy={self.policy!r}): the autopilot moves "
                            "max_queue_delay_ms and max_batch_size of the dynamic policy; set "
                            "policy to dynamic or autopilot_slo_p99_ms to null")
        if not {"max_adapters_per_batch", "adapter_slots"} & bad.keys() \
                and self.max_adapters_per_batch > self.adapter_slots:
            problems.append(f"max_adapters_per_batch={self.max_adapters_per_batch} exceeds "
                            f"adapter_slots={self.adapter_slots}: a batch's adapters must all be "
                            "on the device; raise adapter_slots or lower max_adapters_per_batch")
        if problems:
            raise ConfigError("invalid batching settings: " + "; ".join(problems)
                              + ". Nothing was changed.")

    # -- conversions ----------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        for key in ("preferred_batch_sizes", "bucket_edges"):
            if out[key] is not None:
                out[key] = list(out[key])
        return out

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    def with_changes(self, changes: dict[str, Any]) -> "BatchingConfig":
        """A new validated config with ``changes`` applied; raises ConfigError."""
        return apply_changes(self, changes, BATCHING)

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
    #: with ``device_process`` on the CPU: a batch that finds its process idle and is
    #: expected to take at most this long runs in the serving process, a lone longer one
    #: that finds it busy on a thread there (``runtime.engine.direct``)
    direct_max_compute_ms: float = 2.0
    #: how many levels nicer than the serving process the device process runs (0 to 19);
    #: None: the same, and on a CPU device 10 nicer once its model is measured to cost
    #: less per request than the event loop (``runtime.device.priority``)
    device_nice: int | None = None
    #: run the recorder's database inserts in a child process (``batchscope.storage.writer_process``)
    recorder_process: bool = False
    #: also serve the KServe v2 / Triton gRPC API on this port (0: a free one; None: no gRPC)
    grpc_port: int | None = None
    #: the drain timeout: from SIGTERM/SIGINT until the server has stopped, at most this
    #: many seconds; new requests are refused 503 meanwhile, those taken in are answered
    #: (``runtime.server.drain``)
    drain_timeout_s: float = 5.0
    #: send the spans of traced requests and their batches over OTLP to this endpoint
    #: (``runtime.engine.otel``); None: no OpenTelemetry export
    otlp_traces_endpoint: str | None = None
    #: trace settings at start (Triton's ``--trace-config``): (key, value) pairs with the
    #: keys of ``/v2/trace/setting`` (``trace_rate``...) or Triton's short ones (``rate``),
    #: values as strings (``runtime.core.tracing.config_changes``)
    trace_config: tuple[tuple[str, str], ...] = ()
    #: NVTX ranges around each batch's and generation step's device work
    #: (``runtime.device.nvtx``)
    nvtx: bool = False

    def __post_init__(self) -> None:
        problems = []
        if not (_is_int(self.port) and 0 <= self.port <= 65535):
            problems.append(f"port={self.port!r} must be an integer from 0 to 65535")
        if self.torch_threads is not None and not (_is_int(self.torch_threads) and self.torch_threads >= 1):
            problems.append(f"torch_threads={self.torch_threads!r} must be a positive integer")
        for name in ("heartbeat_interval_s", "control_poll_interval_s", "retention_raw_s",
                     "rollup_interval_s", "device_sample_interval_s", "drain_timeout_s"):
            v = getattr(self, name)
            if not (_is_number(v) and v > 0):
                problems.append(f"{name}={v!r} must be a positive number of seconds")
        if self.otlp_traces_endpoint is not None and not (
                isinstance(self.otlp_traces_endpoint, str) and self.otlp_traces_endpoint.strip()):
            problems.append(f"otlp_traces_endpoint={self.otlp_traces_endpoint!r} must be a "
                            "URL such as http://127.0.0.1:4317")
        if not (_is_number(self.direct_max_compute_ms) and 0 <= self.direct_max_compute_ms
                <= 1000):
            problems.append(f"direct_max_compute_ms={self.direct_max_compute_ms!r} must be a "
                            "number of milliseconds from 0 (never direct) to 1000")
        if self.device_nice is not None and not (_is_int(self.device_nice)
                                                 and 0 <= self.device_nice <= 19):
            problems.append(f"device_nice={self.device_nice!r} must be an integer from 0 "
                            "(the serving process's priority) to 19, or None for the default")
        for name in ("device_process", "recorder_process", "nvtx"):
            if not isinstance(getattr(self, name), bool):
                problems.append(f"{name}={getattr(self, name)!r} must be true or false")
        if self.grpc_port is not None and not (_is_int(self.grpc_port) and 0 <= self.grpc_port <= 65535):
            problems.append(f"grpc_port={self.grpc_port!r} must be an integer from 0 to 65535, "
                            "or None for no gRPC server")
        if not (_is_int(self.recorder_buffer_size) and self.recorder_buffer_size >= 1):
            problems.append(f"recorder_buffer_size={self.recorder_buffer_size!r} must be a positive integer")
        if problems:
            raise ConfigError("invalid server settings: " + "; ".join(problems))
