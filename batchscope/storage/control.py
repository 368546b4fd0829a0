"""The shared store between runtimes and the dashboard: instances, settings, commands.

Runtimes register themselves, send heartbeats, publish the settings each model runs
with, and poll ``control_commands`` for changes asked for by the dashboard. Everything
here is a short transaction; with SQLite in WAL mode and a busy timeout the runtime can
poll while the dashboard writes.

Commands addressed to every instance (``instance_id`` None)
-----------------------------------------------------------
Such a command is handled once per instance. An instance acknowledges it by passing its
own ``instance_id`` to :func:`ack_command` / :func:`refuse_command`; that writes a row in
``command_acks`` and, for the first instance only, the outcome on the command row itself
(so ``command_status`` shows a result as soon as one instance handled it). For an
instance the command stays pending until it acknowledged it, with one limit: once some
instance handled it, it is offered only to instances that were already running when it
was requested — a runtime started later begins with its own configuration and does not
replay old changes. Acknowledging without ``instance_id`` closes the command for everyone
(the single-runtime case).
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from typing import Optional

from sqlalchemy import Engine, and_, exists, or_, select, update
from sqlalchemy.orm import Session

from batchscope.storage.schema import CommandAck, ControlCommand, EventRecord, ModelSettings, RuntimeInstance

PENDING = "pending"
APPLIED = "applied"
REFUSED = "refused"


@dataclass(frozen=True, slots=True)
class Instance:
    id: str
    host: str
    pid: int
    models: tuple[str, ...]
    url: Optional[str]
    device: Optional[str]
    version: Optional[str]
    started_at: float
    last_seen_at: float
    stopped_at: Optional[float]
    records_dropped: int


@dataclass(frozen=True, slots=True)
class Ack:
    """How one instance handled a broadcast command."""

    instance_id: str
    status: str
    reason: Optional[str]
    applied_version: Optional[int]
    handled_at: float


@dataclass(frozen=True, slots=True)
class Command:
    id: int
    instance_id: Optional[str]
    model: str
    changes: dict
    requested_by: str
    requested_at: float
    status: str
    reason: Optional[str]
    applied_version: Optional[int]
    handled_at: Optional[float]
    #: per-instance outcomes of a broadcast command (empty for a targeted one)
    acks: tuple[Ack, ...] = ()


@dataclass(frozen=True, slots=True)
class SettingsChange:
    """One ``settings_change`` event, decoded for the history view and revert."""

    id: int
    at: float
    instance_id: str
    model: Optional[str]
    old: dict
    new: dict
    requested_by: Optional[str]
    version: Optional[int]
    message: str


# --------------------------------------------------------------------------- instances

def register_instance(engine: Engine, *, instance_id: str, host: str, pid: int, models: list[str],
                      url: Optional[str], device: Optional[str], version: Optional[str],
                      now: float, cpu_count: Optional[int] = None) -> None:
    """Insert or refresh the row of a starting runtime (its start time becomes ``now``).
    ``cpu_count``: the host's logical CPUs (default ``os.cpu_count()`` of this process,
    which runs on the instance's host)."""
    with Session(engine) as session, session.begin():
        row = session.get(RuntimeInstance, instance_id)
        if row is None:
            row = RuntimeInstance(id=instance_id)
            session.add(row)
        row.host = host
        row.pid = pid
        row.models_json = json.dumps(list(models))
        row.url = url
        row.device = device
        row.version = version
        row.started_at = now
        row.last_seen_at = now
        row.stopped_at = None
        row.records_dropped = 0
        row.cpu_count = cpu_count if cpu_count is not None else os.cpu_count()


def heartbeat(engine: Engine, instance_id: str, now: float, records_dropped: int = 0) -> bool:
    """Mark the instance alive at ``now``. Returns False when it is not registered
    (e.g. the database was replaced); call :func:`register_instance` again then."""
    with engine.begin() as conn:
        result = conn.execute(
            update(RuntimeInstance).where(RuntimeInstance.id == instance_id)
            .values(last_seen_at=now, records_dropped=records_dropped))
        return result.rowcount > 0


def mark_stopped(engine: Engine, instance_id: str, now: float) -> None:
    with engine.begin() as conn:
        conn.execute(update(RuntimeInstance).where(RuntimeInstance.id == instance_id)
                     .values(stopped_at=now, last_seen_at=now))


def _instance(row: RuntimeInstance) -> Instance:
    return Instance(id=row.id, host=row.host, pid=row.pid, models=tuple(json.loads(row.models_json or "[]")),
                    url=row.url, device=row.device, version=row.version, started_at=row.started_at,
                    last_seen_at=row.last_seen_at, stopped_at=row.stopped_at,
                    records_dropped=row.records_dropped or 0)


def live_instances(engine: Engine, *, now: float, stale_after_s: float = 10.0) -> list[Instance]:
    """Instances not stopped whose heartbeat is newer than ``now - stale_after_s``."""
    with Session(engine) as session:
        rows = session.scalars(
            select(RuntimeInstance)
            .where(RuntimeInstance.last_seen_at > now - stale_after_s, RuntimeInstance.stopped_at.is_(None))
            .order_by(RuntimeInstance.started_at, RuntimeInstance.id))
        return [_instance(r) for r in rows]


def all_instances(engine: Engine) -> list[Instance]:
    """Every instance ever registered, most recently seen first."""
    with Session(engine) as session:
        rows = session.scalars(select(RuntimeInstance).order_by(RuntimeInstance.last_seen_at.desc()))
        return [_instance(r) for r in rows]


# --------------------------------------------------------------------------- settings

def publish_settings(engine: Engine, *, instance_id: str, model: str, version: int, settings: dict,
                     kind: str, now: float) -> None:
    """Record the settings ``model`` now runs with on ``instance_id`` (insert or replace)."""
    payload = json.dumps(settings, sort_keys=True)
    with Session(engine) as session, session.begin():
        row = session.get(ModelSettings, (instance_id, model))
        if row is None:
            row = ModelSettings(instance_id=instance_id, model=model)
            session.add(row)
        row.version = version
        row.settings_json = payload
        row.kind = kind
        row.updated_at = now


def current_settings(engine: Engine, instance_id: str, model: str) -> tuple[int, dict] | None:
    with Session(engine) as session:
        row = session.get(ModelSettings, (instance_id, model))
        if row is None:
            return None
        return row.version, json.loads(row.settings_json)


def settings_history(engine: Engine, model: str, instance_id: Optional[str] = None,
                     limit: int = 100) -> list[SettingsChange]:
    """The latest ``settings_change`` events of ``model``, newest first."""
    query = select(EventRecord).where(EventRecord.kind == "settings_change", EventRecord.model == model)
    if instance_id is not None:
        query = query.where(EventRecord.instance_id == instance_id)
    query = query.order_by(EventRecord.at.desc(), EventRecord.id.desc()).limit(limit)
    with Session(engine) as session:
        return [_settings_change(row) for row in session.scalars(query)]


def _settings_change(row: EventRecord) -> SettingsChange:
    try:
        details = json.loads(row.details_json or "{}")
    except ValueError:
        details = {}
    if not isinstance(details, dict):
        details = {}
    old, new = details.get("old"), details.get("new")
    version = details.get("version")
    return SettingsChange(id=row.id, at=row.at, instance_id=row.instance_id, model=row.model,
                          old=old if isinstance(old, dict) else {}, new=new if isinstance(new, dict) else {},
                          requested_by=details.get("requested_by"),
                          version=version if isinstance(version, int) else None, message=row.message)


# --------------------------------------------------------------------------- commands

def _check_changes(changes: object) -> str:
    if not isinstance(changes, dict):
        raise ValueError(f"changes must be a JSON object mapping setting names to values, "
                         f"got {type(changes).__name__}")
    if not changes:
        raise ValueError("changes is empty: name at least one setting to change")
    bad = [k for k in changes if not isinstance(k, str)]
    if bad:
        raise ValueError(f"changes must use strings as setting names, got {bad!r}")
    try:
        return json.dumps(changes, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"changes must hold only JSON values (numbers, strings, booleans, lists, "
                         f"objects, null; no NaN/inf): {exc}") from None


def request_change(engine: Engine, *, model: str, changes: dict, requested_by: str,
                   instance_id: Optional[str] = None, now: Optional[float] = None) -> int:
    """Queue a settings change for ``model`` (on ``instance_id``, or on every instance
    serving it when None). Returns the command id to poll with :func:`command_status`."""
    payload = _check_changes(changes)
    if not isinstance(model, str) or not model:
        raise ValueError("model must be a non-empty model name")
    at = time.time() if now is None else now
    if not math.isfinite(at):
        raise ValueError(f"now must be a finite wall-clock time, got {at!r}")
    with Session(engine) as session, session.begin():
        row = ControlCommand(instance_id=instance_id, model=model, changes_json=payload,
                             requested_by=requested_by, requested_at=at, status=PENDING)
        session.add(row)
        session.flush()
        return row.id


def pending_commands(engine: Engine, instance_id: str, models: list[str]) -> list[Command]:
    """Commands ``instance_id`` still has to handle for ``models``, oldest first."""
    if not models:
        return []
    cmd = ControlCommand
    mine_acked = exists().where(CommandAck.command_id == cmd.id, CommandAck.instance_id == instance_id)
    anyone_acked = exists().where(CommandAck.command_id == cmd.id)
    running_since = (select(RuntimeInstance.started_at).where(RuntimeInstance.id == instance_id)
                     .scalar_subquery())
    targeted = and_(cmd.instance_id == instance_id, cmd.status == PENDING)
    broadcast = and_(
        cmd.instance_id.is_(None), ~mine_acked,
        or_(cmd.status == PENDING, and_(anyone_acked, running_since <= cmd.requested_at)))
    query = (select(cmd).where(cmd.model.in_(list(models)), or_(targeted, broadcast))
             .order_by(cmd.requested_at, cmd.id))
    with Session(engine) as session:
        return [_command(row, ()) for row in session.scalars(query)]


def _command(row: ControlCommand, acks: tuple[Ack, ...]) -> Command:
    return Command(id=row.id, instance_id=row.instance_id, model=row.model,
                   changes=json.loads(row.changes_json), requested_by=row.requested_by,
                   requested_at=row.requested_at, status=row.status, reason=row.reason,
                   applied_version=row.applied_version, handled_at=row.handled_at, acks=acks)


def _handle(engine: Engine, command_id: int, *, status: str, reason: Optional[str],
            applied_version: Optional[int], now: float, instance_id: Optional[str]) -> None:
    with Session(engine) as session, session.begin():
        row = session.get(ControlCommand, command_id)
        if row is None:
            raise ValueError(f"no control command with id {command_id}; "
                             f"use an id returned by pending_commands")
        if row.instance_id is None and instance_id is not None:
            if session.get(CommandAck, (command_id, instance_id)) is not None:
                return  # this instance already handled it: the first outcome stands
            session.add(CommandAck(command_id=command_id, instance_id=instance_id, status=status,
                                   reason=reason, applied_version=applied_version, handled_at=now))
        if row.status == PENDING:
            row.status = status
            row.reason = reason
            row.applied_version = applied_version
            row.handled_at = now


def ack_command(engine: Engine, command_id: int, *, applied_version: int, now: float,
                instance_id: Optional[str] = None) -> None:
    """Mark a command applied (the model now runs settings version ``applied_version``).

    Pass ``instance_id`` so a command addressed to every instance stays pending for the
    others. A command already handled keeps its first outcome.
    """
    _handle(engine, command_id, status=APPLIED, reason=None, applied_version=applied_version,
            now=now, instance_id=instance_id)


def refuse_command(engine: Engine, command_id: int, *, reason: str, now: float,
                   instance_id: Optional[str] = None) -> None:
    """Mark a command refused with ``reason`` (e.g. the validation error's message)."""
    _handle(engine, command_id, status=REFUSED, reason=reason, applied_version=None,
            now=now, instance_id=instance_id)


def command_status(engine: Engine, command_id: int) -> Command:
    with Session(engine) as session:
        row = session.get(ControlCommand, command_id)
        if row is None:
            raise ValueError(f"no control command with id {command_id}")
        acks = session.scalars(select(CommandAck).where(CommandAck.command_id == command_id)
                               .order_by(CommandAck.handled_at, CommandAck.instance_id))
        return _command(row, tuple(Ack(instance_id=a.instance_id, status=a.status, reason=a.reason,
                                       applied_version=a.applied_version, handled_at=a.handled_at)
                                   for a in acks))


def recent_commands(engine: Engine, *, model: Optional[str] = None, limit: int = 50) -> list[Command]:
    """The latest commands (any status), newest first, for the dashboard."""
    query = select(ControlCommand)
    if model is not None:
        query = query.where(ControlCommand.model == model)
    query = query.order_by(ControlCommand.requested_at.desc(), ControlCommand.id.desc()).limit(limit)
    with Session(engine) as session:
        return [_command(row, ()) for row in session.scalars(query)]
