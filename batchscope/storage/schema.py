"""The recorded data model (SQLAlchemy 2.0, typed).

Times are wall-clock seconds since the epoch (float) so that rows from several
processes line up; durations are seconds, sizes are bytes. Names carry units.

Sizes in bytes, row ids and counts that grow without bound are 64-bit (``BigInteger``;
a GPU's memory passes 2**31 bytes, a fleet's request ids pass 2**31 in weeks). Ids are
``ID``: ``BIGINT`` on PostgreSQL, ``INTEGER`` on SQLite, where only an ``INTEGER PRIMARY
KEY`` is the 64-bit rowid that numbers rows by itself.

A change to a table or column is a new migration in ``batchscope/storage/migrations``
(``tests/test_migrations.py`` checks that the migrations build exactly these tables) and
a new ``SCHEMA_VERSION``.
"""

from __future__ import annotations

from typing import Optional

from sqlalchemy import BigInteger, Boolean, Float, Index, Integer, String, Text, text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

SCHEMA_VERSION = 13

#: an autoincrementing row id: 64-bit everywhere (SQLite's rowid is 64-bit already)
ID = BigInteger().with_variant(Integer(), "sqlite")


class Base(DeclarativeBase):
    pass


class SchemaMeta(Base):
    """Key/value facts about the database itself (``schema_version``)."""

    __tablename__ = "schema_meta"
    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[str] = mapped_column(Text)


class RuntimeInstance(Base):
    """One running runtime process; ``last_seen_at`` is its heartbeat."""

    __tablename__ = "runtime_instances"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    host: Mapped[str] = mapped_column(String(255))
    pid: Mapped[int] = mapped_column(Integer)
    models_json: Mapped[str] = mapped_column(Text, default="[]")
    url: Mapped[Optional[str]] = mapped_column(String(255))
    device: Mapped[Optional[str]] = mapped_column(String(255))
    version: Mapped[Optional[str]] = mapped_column(String(64))
    started_at: Mapped[float] = mapped_column(Float)
    last_seen_at: Mapped[float] = mapped_column(Float, index=True)
    stopped_at: Mapped[Optional[float]] = mapped_column(Float)
    #: recorder drops reported with the heartbeat (cumulative since start)
    records_dropped: Mapped[int] = mapped_column(BigInteger, default=0)
    #: the host's logical CPUs when the instance registered (``os.cpu_count()``)
    cpu_count: Mapped[Optional[int]] = mapped_column(Integer)


class BatchRecord(Base):
    """One executed batch (or one attempt, when an OOM split it)."""

    __tablename__ = "batches"
    id: Mapped[int] = mapped_column(ID, primary_key=True, autoincrement=True)
    instance_id: Mapped[str] = mapped_column(String(64))
    model: Mapped[str] = mapped_column(String(128))
    #: per-instance sequence number; requests point at it with ``batch_seq``
    seq: Mapped[int] = mapped_column(BigInteger)
    policy: Mapped[str] = mapped_column(String(16))
    settings_version: Mapped[int] = mapped_column(Integer)
    max_batch_size: Mapped[int] = mapped_column(Integer)
    #: bucket edge the batch came from; None for fixed-size inputs; -1 = overflow
    bucket: Mapped[Optional[int]] = mapped_column(Integer)
    batch_size: Mapped[int] = mapped_column(Integer)
    #: real elements (sum of request lengths) and elements after padding
    real_elements: Mapped[int] = mapped_column(Integer)
    padded_elements: Mapped[int] = mapped_column(Integer)
    queue_wait_min_s: Mapped[float] = mapped_column(Float)
    queue_wait_mean_s: Mapped[float] = mapped_column(Float)
    queue_wait_max_s: Mapped[float] = mapped_column(Float)
    compute_s: Mapped[float] = mapped_column(Float)
    started_at: Mapped[float] = mapped_column(Float)
    ended_at: Mapped[float] = mapped_column(Float)
    #: ok | error | oom (the attempt that ran out of memory and was split)
    outcome: Mapped[str] = mapped_column(String(16), default="ok")
    #: the device's peak allocated bytes during the batch (weights and caches included)
    peak_memory_bytes: Mapped[Optional[int]] = mapped_column(BigInteger)
    cuda_graph: Mapped[bool] = mapped_column(Boolean, default=False)
    queue_depth: Mapped[Optional[int]] = mapped_column(Integer)
    #: what the batch added at its peak to what was allocated when it started (its own
    #: memory need); None: not a CUDA device, or recorded before schema version 7
    peak_memory_increase_bytes: Mapped[Optional[int]] = mapped_column(BigInteger)
    #: distinct LoRA adapters the batch mixed (0: base rows only); None: a model served
    #: without adapters, or recorded before schema version 9
    adapters: Mapped[Optional[int]] = mapped_column(Integer)

    __table_args__ = (
        Index("ix_batches_model_ended", "model", "ended_at"),
        Index("ix_batches_instance_ended", "instance_id", "ended_at"),
        # a batch found by its number (the timeline's box): seq first, so that SQLite's
        # planner prefers it to (model, ended_at) for "seq = ? AND model = ?"
        Index("ix_batches_seq", "seq", "model", "ended_at"),
    )


class RequestRecord(Base):
    """One request's single outcome and latency."""

    __tablename__ = "requests"
    id: Mapped[int] = mapped_column(ID, primary_key=True, autoincrement=True)
    instance_id: Mapped[str] = mapped_column(String(64))
    model: Mapped[str] = mapped_column(String(128))
    batch_seq: Mapped[Optional[int]] = mapped_column(BigInteger)
    priority: Mapped[int] = mapped_column(Integer)
    bypass: Mapped[bool] = mapped_column(Boolean, default=False)
    length: Mapped[Optional[int]] = mapped_column(Integer)
    arrived_at: Mapped[float] = mapped_column(Float)
    finished_at: Mapped[float] = mapped_column(Float)
    queue_wait_s: Mapped[float] = mapped_column(Float)
    latency_s: Mapped[float] = mapped_column(Float)
    #: ok | rejected | expired | error | oom | cancelled
    outcome: Mapped[str] = mapped_column(String(16))
    # generation requests only
    ttft_s: Mapped[Optional[float]] = mapped_column(Float)
    tpot_s: Mapped[Optional[float]] = mapped_column(Float)
    prompt_tokens: Mapped[Optional[int]] = mapped_column(Integer)
    output_tokens: Mapped[Optional[int]] = mapped_column(Integer)
    #: JSON {input name: shape} of one request (no batch dimension): the model's declared
    #: shapes with each variable dimension at the request's ``length``; None: not recorded
    input_shape_json: Mapped[Optional[str]] = mapped_column(Text)
    #: the timeout the request ran under (its own, or the model's default), ms; None: none
    timeout_ms: Mapped[Optional[float]] = mapped_column(Float)
    #: the LoRA adapter the request named; None: the base model (or before schema version 9)
    adapter: Mapped[Optional[str]] = mapped_column(String(64))

    __table_args__ = (
        Index("ix_requests_model_finished", "model", "finished_at"),
        Index("ix_requests_instance_finished", "instance_id", "finished_at"),
    )


class RequestTraceRecord(Base):
    """One traced request (Triton's trace extension, ``runtime.core.tracing``): the
    timestamps Triton's trace has, wall-clock seconds, NULL where the request did not
    get there or the server does not see it. A request is traced when its model's trace
    settings sample it, or when it carried a W3C ``traceparent`` marked sampled."""

    __tablename__ = "request_traces"
    id: Mapped[int] = mapped_column(ID, primary_key=True, autoincrement=True)
    instance_id: Mapped[str] = mapped_column(String(64))
    model: Mapped[str] = mapped_column(String(128))
    #: per-instance trace number (Triton's trace ``id``), from 1
    trace_id: Mapped[int] = mapped_column(BigInteger)
    #: http | grpc: which transport the ``recv_*``/``send_*`` timestamps are of
    protocol: Mapped[str] = mapped_column(String(8))
    #: the request's outcome, as in ``requests`` (ok | rejected | expired | error | ...)
    outcome: Mapped[str] = mapped_column(String(16))
    #: the ``id`` the client sent with the request (KServe), at most 256 characters
    request_id: Mapped[Optional[str]] = mapped_column(String(256))
    #: the batch it ran in (``batches.seq``; the first one, for a request of several items)
    batch_seq: Mapped[Optional[int]] = mapped_column(BigInteger)
    #: HTTP_RECV_START / GRPC_WAITREAD_START and HTTP_RECV_END / GRPC_WAITREAD_END
    recv_start_at: Mapped[Optional[float]] = mapped_column(Float)
    recv_end_at: Mapped[Optional[float]] = mapped_column(Float)
    request_start_at: Mapped[float] = mapped_column(Float)
    queue_start_at: Mapped[Optional[float]] = mapped_column(Float)
    compute_start_at: Mapped[Optional[float]] = mapped_column(Float)
    compute_input_end_at: Mapped[Optional[float]] = mapped_column(Float)
    compute_output_start_at: Mapped[Optional[float]] = mapped_column(Float)
    compute_end_at: Mapped[Optional[float]] = mapped_column(Float)
    request_end_at: Mapped[float] = mapped_column(Float)
    #: HTTP_SEND_START / GRPC_SEND_START and HTTP_SEND_END / GRPC_SEND_END
    send_start_at: Mapped[Optional[float]] = mapped_column(Float)
    send_end_at: Mapped[Optional[float]] = mapped_column(Float)
    #: the W3C trace of the request's spans: the one its ``traceparent`` named, or the
    #: one the server began for it when spans are exported (then with no parent span)
    w3c_trace_id: Mapped[Optional[str]] = mapped_column(String(32))
    w3c_parent_span_id: Mapped[Optional[str]] = mapped_column(String(16))

    #: every read selects by time (the trace export's window, retention); an index on
    #: (model, time) as well only slowed the writer (migration 0010)
    __table_args__ = (Index("ix_request_traces_end", "request_end_at"),)


class EventRecord(Base):
    """Something worth a marker on the timeline."""

    __tablename__ = "events"
    id: Mapped[int] = mapped_column(ID, primary_key=True, autoincrement=True)
    instance_id: Mapped[str] = mapped_column(String(64))
    model: Mapped[Optional[str]] = mapped_column(String(128))
    at: Mapped[float] = mapped_column(Float, index=True)
    #: settings_change | rejected | expired | model_error | oom | oom_failed | oom_probe |
    #: preemption | recorder_drops | started | stopped (see docs/architecture.md)
    kind: Mapped[str] = mapped_column(String(32))
    severity: Mapped[str] = mapped_column(String(16), default="info")
    message: Mapped[str] = mapped_column(Text)
    details_json: Mapped[str] = mapped_column(Text, default="{}")


class DeviceSample(Base):
    """A periodic sample of the device (GPU through NVML, or the CPU fallback)."""

    __tablename__ = "device_samples"
    id: Mapped[int] = mapped_column(ID, primary_key=True, autoincrement=True)
    instance_id: Mapped[str] = mapped_column(String(64))
    at: Mapped[float] = mapped_column(Float, index=True)
    #: "cuda:0", "cpu"...
    device: Mapped[str] = mapped_column(String(64))
    #: gpu | cpu
    kind: Mapped[str] = mapped_column(String(8))
    utilization_pct: Mapped[Optional[float]] = mapped_column(Float)
    memory_used_bytes: Mapped[Optional[int]] = mapped_column(BigInteger)
    memory_total_bytes: Mapped[Optional[int]] = mapped_column(BigInteger)
    power_w: Mapped[Optional[float]] = mapped_column(Float)
    sm_clock_mhz: Mapped[Optional[float]] = mapped_column(Float)
    temperature_c: Mapped[Optional[float]] = mapped_column(Float)
    torch_allocated_bytes: Mapped[Optional[int]] = mapped_column(BigInteger)
    torch_reserved_bytes: Mapped[Optional[int]] = mapped_column(BigInteger)
    process_rss_bytes: Mapped[Optional[int]] = mapped_column(BigInteger)


class GenerationStep(Base):
    """One scheduler step of a continuous-batching (generation) model."""

    __tablename__ = "generation_steps"
    id: Mapped[int] = mapped_column(ID, primary_key=True, autoincrement=True)
    instance_id: Mapped[str] = mapped_column(String(64))
    model: Mapped[str] = mapped_column(String(128))
    at: Mapped[float] = mapped_column(Float)
    mode: Mapped[str] = mapped_column(String(16))  # continuous | static
    running: Mapped[int] = mapped_column(Integer)
    waiting: Mapped[int] = mapped_column(Integer)
    prefill_tokens: Mapped[int] = mapped_column(Integer)
    decode_tokens: Mapped[int] = mapped_column(Integer)
    blocks_used: Mapped[int] = mapped_column(Integer)
    blocks_free: Mapped[int] = mapped_column(Integer)
    preemptions: Mapped[int] = mapped_column(Integer)
    step_s: Mapped[float] = mapped_column(Float)
    #: speculative decoding: proposed tokens (also in decode_tokens) and those accepted;
    #: NULL where no speculation was set up (and in rows older than schema version 8)
    spec_draft_tokens: Mapped[Optional[int]] = mapped_column(Integer, nullable=True)
    spec_accepted_tokens: Mapped[Optional[int]] = mapped_column(Integer, nullable=True)
    #: sequences that had proposed tokens verified in the step; NULL where no speculation
    #: was set up (and in rows older than schema version 10)
    spec_sequences: Mapped[Optional[int]] = mapped_column(Integer, nullable=True)
    #: distinct LoRA adapters the step's sequences named (0: base sequences only); NULL: a
    #: model without adapters, or recorded before schema version 10
    adapters: Mapped[Optional[int]] = mapped_column(Integer, nullable=True)
    #: the step's number in its model's engine (1, 2, ...): what a request that was first
    #: scheduled in it has as ``batch_seq``; NULL in rows older than schema version 12
    seq: Mapped[Optional[int]] = mapped_column(BigInteger, nullable=True)

    __table_args__ = (Index("ix_gensteps_model_at", "model", "at"),
                      Index("ix_gensteps_seq", "seq", "model", "at"))


class ModelSettings(Base):
    """The settings each live model currently runs with (written by the runtime)."""

    __tablename__ = "model_settings"
    instance_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    model: Mapped[str] = mapped_column(String(128), primary_key=True)
    version: Mapped[int] = mapped_column(Integer)
    settings_json: Mapped[str] = mapped_column(Text)
    kind: Mapped[str] = mapped_column(String(16), default="request")
    updated_at: Mapped[float] = mapped_column(Float)


class ControlCommand(Base):
    """A settings change asked for through the database (e.g. by the dashboard).

    The runtime polls ``pending`` rows for its instance (or ``instance_id`` NULL =
    every instance serving the model), applies them at the next batch boundary and
    writes back ``applied`` with the new version, or ``refused`` with the reason.
    """

    __tablename__ = "control_commands"
    id: Mapped[int] = mapped_column(ID, primary_key=True, autoincrement=True)
    instance_id: Mapped[Optional[str]] = mapped_column(String(64))
    model: Mapped[str] = mapped_column(String(128))
    changes_json: Mapped[str] = mapped_column(Text)
    requested_by: Mapped[str] = mapped_column(String(128))
    requested_at: Mapped[float] = mapped_column(Float)
    #: pending | applied | refused
    status: Mapped[str] = mapped_column(String(16), default="pending", index=True)
    reason: Mapped[Optional[str]] = mapped_column(Text)
    applied_version: Mapped[Optional[int]] = mapped_column(Integer)
    handled_at: Mapped[Optional[float]] = mapped_column(Float)


class CommandAck(Base):
    """How one instance handled a command addressed to every instance (``instance_id`` NULL).

    A broadcast command is handled once per instance: each instance that applies or
    refuses it writes its own row here; the command row itself keeps the first outcome.
    """

    __tablename__ = "command_acks"
    command_id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    instance_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    #: applied | refused
    status: Mapped[str] = mapped_column(String(16))
    reason: Mapped[Optional[str]] = mapped_column(Text)
    applied_version: Mapped[Optional[int]] = mapped_column(Integer)
    handled_at: Mapped[float] = mapped_column(Float)


class Rollup(Base):
    """Per-interval summary of raw rows older than the retention window."""

    __tablename__ = "rollups"
    id: Mapped[int] = mapped_column(ID, primary_key=True, autoincrement=True)
    instance_id: Mapped[str] = mapped_column(String(64))
    model: Mapped[str] = mapped_column(String(128))
    interval_start: Mapped[float] = mapped_column(Float)
    interval_s: Mapped[float] = mapped_column(Float)
    requests: Mapped[int] = mapped_column(BigInteger, default=0)
    requests_ok: Mapped[int] = mapped_column(BigInteger, default=0)
    requests_failed: Mapped[int] = mapped_column(BigInteger, default=0)
    batches: Mapped[int] = mapped_column(BigInteger, default=0)
    batch_size_sum: Mapped[int] = mapped_column(BigInteger, default=0)
    real_elements: Mapped[int] = mapped_column(BigInteger, default=0)
    padded_elements: Mapped[int] = mapped_column(BigInteger, default=0)
    queue_wait_sum_s: Mapped[float] = mapped_column(Float, default=0.0)
    compute_sum_s: Mapped[float] = mapped_column(Float, default=0.0)
    latency_sum_s: Mapped[float] = mapped_column(Float, default=0.0)
    #: JSON {upper_bound_s: count} of request latencies; {size: count} of batch sizes
    latency_hist_json: Mapped[str] = mapped_column(Text, default="{}")
    batch_size_hist_json: Mapped[str] = mapped_column(Text, default="{}")
    #: JSON {outcome: count} of the requests (ok, rejected, expired, error, ...)
    outcomes_json: Mapped[str] = mapped_column(Text, default="{}")

    __table_args__ = (
        Index("ix_rollups_model_start", "model", "interval_start"),
        Index("ix_rollups_key", "instance_id", "model", "interval_s", "interval_start"),
        #: where the raw rows begin (the newest roll-up), read by every dashboard refresh
        Index("ix_rollups_start", "interval_start"),
    )


# -- summaries kept up to date as rows arrive (batchscope.storage.summaries) -------------
def _count() -> Mapped[int]:
    return mapped_column(BigInteger, nullable=False, server_default=text("0"))


def _sum() -> Mapped[float]:
    return mapped_column(Float, nullable=False, server_default=text("0"))


def _span() -> Mapped[int]:
    """How long the row's time span is, seconds: the fine span or the minute."""
    return mapped_column(Integer, primary_key=True)


def _start() -> Mapped[int]:
    """The span's first second (epoch; a multiple of ``span_s``)."""
    return mapped_column(BigInteger, primary_key=True)


class StatsSummary(Base):
    """Per second (``span_s`` 1) and per minute (60), instance and model: the counts and
    sums of the requests that finished and the batches that ended in it. What the live
    dashboard counts; written in the same transaction as the rows."""

    __tablename__ = "summary_stats"
    span_s: Mapped[int] = _span()
    start_s: Mapped[int] = _start()
    model: Mapped[str] = mapped_column(String(128), primary_key=True)
    instance_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    requests: Mapped[int] = _count()
    ok: Mapped[int] = _count()
    rejected: Mapped[int] = _count()
    expired: Mapped[int] = _count()
    #: error and oom
    failed: Mapped[int] = _count()
    ok_latency_sum_s: Mapped[float] = _sum()
    ok_queue_wait_sum_s: Mapped[float] = _sum()
    batches: Mapped[int] = _count()
    batch_items: Mapped[int] = _count()
    batch_compute_sum_s: Mapped[float] = _sum()
    #: the sum of the batches' mean queue waits
    batch_queue_wait_sum_s: Mapped[float] = _sum()
    queue_depth_sum: Mapped[int] = _count()
    #: how many batches reported a queue depth
    queue_depth_count: Mapped[int] = _count()
    queue_depth_max: Mapped[Optional[int]] = mapped_column(Integer)
    max_batch_size_max: Mapped[Optional[int]] = mapped_column(Integer)
    oom_batches: Mapped[int] = _count()
    real_elements: Mapped[int] = _count()
    padded_elements: Mapped[int] = _count()

    __table_args__ = {"sqlite_with_rowid": False}


class LatencySummary(Base):
    """Per 5 seconds (``span_s`` 5) and per minute (60), instance, model, priority and
    outcome: how many requests, and for completed ones a latency histogram (``bucket``
    per ``summaries.latency_bucket``; -1 for the other outcomes) with latency and queue
    wait sums per bucket."""

    __tablename__ = "summary_latency"
    span_s: Mapped[int] = _span()
    start_s: Mapped[int] = _start()
    model: Mapped[str] = mapped_column(String(128), primary_key=True)
    instance_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    priority: Mapped[int] = mapped_column(Integer, primary_key=True)
    outcome: Mapped[str] = mapped_column(String(16), primary_key=True)
    bucket: Mapped[int] = mapped_column(Integer, primary_key=True)
    n: Mapped[int] = _count()
    latency_sum_s: Mapped[float] = _sum()
    queue_wait_sum_s: Mapped[float] = _sum()

    __table_args__ = {"sqlite_with_rowid": False}


class ShapeSummary(Base):
    """Per 5 seconds (``span_s`` 5) and per minute (60), instance and model: batches by
    size, length bucket (-2 for fixed-size inputs) and outcome, with their compute time
    and elements."""

    __tablename__ = "summary_shapes"
    span_s: Mapped[int] = _span()
    start_s: Mapped[int] = _start()
    model: Mapped[str] = mapped_column(String(128), primary_key=True)
    instance_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    batch_size: Mapped[int] = mapped_column(Integer, primary_key=True)
    bucket: Mapped[int] = mapped_column(Integer, primary_key=True)
    outcome: Mapped[str] = mapped_column(String(16), primary_key=True)
    n: Mapped[int] = _count()
    compute_sum_s: Mapped[float] = _sum()
    real_elements: Mapped[int] = _count()
    padded_elements: Mapped[int] = _count()
    max_batch_size_max: Mapped[Optional[int]] = mapped_column(Integer)

    __table_args__ = {"sqlite_with_rowid": False}


# -- tuning sessions (batchscope.tuning.store) ----------------------------------------------
class TuningSessionRecord(Base):
    """One tuning session (``batchscope tune`` or the dashboard's "Find best settings"):
    what it tuned, how, and what it found. Written when it starts, updated when it ends."""

    __tablename__ = "tuning_sessions"
    id: Mapped[int] = mapped_column(ID, primary_key=True, autoincrement=True)
    #: the runtime instance tuned (None: no registered instance has the session's URL)
    instance_id: Mapped[Optional[str]] = mapped_column(String(64))
    url: Mapped[str] = mapped_column(String(255))
    model: Mapped[str] = mapped_column(String(128))
    started_at: Mapped[float] = mapped_column(Float)
    finished_at: Mapped[Optional[float]] = mapped_column(Float)
    #: running | finished | cancelled | failed
    state: Mapped[str] = mapped_column(String(16))
    #: goodput | latency
    objective: Mapped[str] = mapped_column(String(16))
    slo_p99_ms: Mapped[float] = mapped_column(Float)
    #: the latency objective's target rate, requests per second
    target_rps: Mapped[Optional[float]] = mapped_column(Float)
    budget_s: Mapped[float] = mapped_column(Float)
    #: synthetic | replay | live, and the load in words ("closed loop, 64 connections")
    load_kind: Mapped[str] = mapped_column(String(16))
    load_description: Mapped[Optional[str]] = mapped_column(Text)
    #: the tuned settings the session started from, and the best feasible point found
    start_settings_json: Mapped[str] = mapped_column(Text)
    best_settings_json: Mapped[Optional[str]] = mapped_column(Text)
    best_trial: Mapped[Optional[int]] = mapped_column(Integer)
    #: the result sentence, why the session stopped, and what became of the settings
    sentence: Mapped[Optional[str]] = mapped_column(Text)
    stop_reason: Mapped[Optional[str]] = mapped_column(Text)
    outcome: Mapped[Optional[str]] = mapped_column(Text)
    #: the device it ran on, in words, from the instance's registration and its device
    #: telemetry; the telemetry's kind (gpu | cpu) and the device's total memory, bytes
    hardware: Mapped[Optional[str]] = mapped_column(String(255))
    device_kind: Mapped[Optional[str]] = mapped_column(String(8))
    device_memory_bytes: Mapped[Optional[int]] = mapped_column(BigInteger)
    #: cli | dashboard
    requested_by: Mapped[str] = mapped_column(String(32))

    __table_args__ = (Index("ix_tuning_sessions_model_started", "model", "started_at"),
                      Index("ix_tuning_sessions_started", "started_at"))


class TuningTrialRecord(Base):
    """One trial of a tuning session: the point measured and its figures; written as the
    trial ends."""

    __tablename__ = "tuning_trials"
    session_id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    #: the trial's number in its session (0: the starting settings)
    number: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    #: the point (the tuned settings) and what differs from the starting ones
    settings_json: Mapped[str] = mapped_column(Text)
    changed_json: Mapped[str] = mapped_column(Text)
    #: counted | unstable | refused | aborted | cancelled
    status: Mapped[str] = mapped_column(String(16))
    feasible: Mapped[bool] = mapped_column(Boolean)
    throughput_rps: Mapped[Optional[float]] = mapped_column(Float)
    goodput_rps: Mapped[Optional[float]] = mapped_column(Float)
    p50_ms: Mapped[Optional[float]] = mapped_column(Float)
    p99_ms: Mapped[Optional[float]] = mapped_column(Float)
    #: why the point is infeasible (None: feasible, or not decided)
    reason: Mapped[Optional[str]] = mapped_column(Text)
    windows: Mapped[int] = mapped_column(Integer)
    started_at: Mapped[float] = mapped_column(Float)
    finished_at: Mapped[Optional[float]] = mapped_column(Float)
