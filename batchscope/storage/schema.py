"""The recorded data model (SQLAlchemy 2.0, typed).

Times are wall-clock seconds since the epoch (float) so that rows from several
processes line up; durations are seconds, sizes are bytes. Names carry units.
Bump ``SCHEMA_VERSION`` whenever a table or column changes.
"""

from __future__ import annotations

from typing import Optional

from sqlalchemy import Boolean, Float, Index, Integer, String, Text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

SCHEMA_VERSION = 2


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
    records_dropped: Mapped[int] = mapped_column(Integer, default=0)


class BatchRecord(Base):
    """One executed batch (or one attempt, when an OOM split it)."""

    __tablename__ = "batches"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    instance_id: Mapped[str] = mapped_column(String(64))
    model: Mapped[str] = mapped_column(String(128))
    #: per-instance sequence number; requests point at it with ``batch_seq``
    seq: Mapped[int] = mapped_column(Integer)
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
    peak_memory_bytes: Mapped[Optional[int]] = mapped_column(Integer)
    cuda_graph: Mapped[bool] = mapped_column(Boolean, default=False)
    queue_depth: Mapped[Optional[int]] = mapped_column(Integer)

    __table_args__ = (
        Index("ix_batches_model_ended", "model", "ended_at"),
        Index("ix_batches_instance_ended", "instance_id", "ended_at"),
    )


class RequestRecord(Base):
    """One request's single outcome and latency."""

    __tablename__ = "requests"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    instance_id: Mapped[str] = mapped_column(String(64))
    model: Mapped[str] = mapped_column(String(128))
    batch_seq: Mapped[Optional[int]] = mapped_column(Integer)
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

    __table_args__ = (
        Index("ix_requests_model_finished", "model", "finished_at"),
        Index("ix_requests_instance_finished", "instance_id", "finished_at"),
    )


class EventRecord(Base):
    """Something worth a marker on the timeline."""

    __tablename__ = "events"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
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
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    instance_id: Mapped[str] = mapped_column(String(64))
    at: Mapped[float] = mapped_column(Float, index=True)
    #: "cuda:0", "cpu"...
    device: Mapped[str] = mapped_column(String(64))
    #: gpu | cpu
    kind: Mapped[str] = mapped_column(String(8))
    utilization_pct: Mapped[Optional[float]] = mapped_column(Float)
    memory_used_bytes: Mapped[Optional[int]] = mapped_column(Integer)
    memory_total_bytes: Mapped[Optional[int]] = mapped_column(Integer)
    power_w: Mapped[Optional[float]] = mapped_column(Float)
    sm_clock_mhz: Mapped[Optional[float]] = mapped_column(Float)
    temperature_c: Mapped[Optional[float]] = mapped_column(Float)
    torch_allocated_bytes: Mapped[Optional[int]] = mapped_column(Integer)
    torch_reserved_bytes: Mapped[Optional[int]] = mapped_column(Integer)
    process_rss_bytes: Mapped[Optional[int]] = mapped_column(Integer)


class GenerationStep(Base):
    """One scheduler step of a continuous-batching (generation) model."""

    __tablename__ = "generation_steps"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
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

    __table_args__ = (Index("ix_gensteps_model_at", "model", "at"),)


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
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
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
    command_id: Mapped[int] = mapped_column(Integer, primary_key=True)
    instance_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    #: applied | refused
    status: Mapped[str] = mapped_column(String(16))
    reason: Mapped[Optional[str]] = mapped_column(Text)
    applied_version: Mapped[Optional[int]] = mapped_column(Integer)
    handled_at: Mapped[float] = mapped_column(Float)


class Rollup(Base):
    """Per-interval summary of raw rows older than the retention window."""

    __tablename__ = "rollups"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    instance_id: Mapped[str] = mapped_column(String(64))
    model: Mapped[str] = mapped_column(String(128))
    interval_start: Mapped[float] = mapped_column(Float)
    interval_s: Mapped[float] = mapped_column(Float)
    requests: Mapped[int] = mapped_column(Integer, default=0)
    requests_ok: Mapped[int] = mapped_column(Integer, default=0)
    requests_failed: Mapped[int] = mapped_column(Integer, default=0)
    batches: Mapped[int] = mapped_column(Integer, default=0)
    batch_size_sum: Mapped[int] = mapped_column(Integer, default=0)
    real_elements: Mapped[int] = mapped_column(Integer, default=0)
    padded_elements: Mapped[int] = mapped_column(Integer, default=0)
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
    )
