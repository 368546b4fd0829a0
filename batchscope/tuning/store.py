"""Tuning sessions in the database (``tuning_sessions`` and ``tuning_trials``).

``SessionWriter`` writes one session while it runs: its row when it starts
(``SessionWriter.begin``), a trial's row as the trial ends (``trial``), the result when
the session is over (``end``). Each write is one short transaction. A write that fails
(the database went away, stayed locked past its busy timeout ...) is logged and ends the
writing, not the session: ``problem`` says from where on it is not stored.
``open_database`` gives the engine of a database URL, or ``StoreUnavailable`` saying why
there is none (the runner then refuses the session before it sends anything).

Reading, for the Tuning page, snapshots and the offline report: ``sessions`` (newest
first) and ``trials_of``. ``instance_for_url`` and ``hardware_of`` find what a session
tunes from the runtime's registration (``runtime_instances``) and its device telemetry
(``device_samples``).

Times are wall-clock seconds. A session's own clock (its load's, monotonic) becomes
wall time through the offset ``SessionWriter`` takes when it starts. What is read back
from a database (a snapshot's, say) is checked as it is decoded: settings that are not
a JSON object read as ``{}``.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any, Iterable, Optional

from sqlalchemy import Engine, func, insert, select, update
from sqlalchemy.exc import SQLAlchemyError

from batchscope.storage.db import DatabaseNotFound, SchemaTooNew, init_schema, make_engine
from batchscope.storage.schema import (DeviceSample, RuntimeInstance, TuningSessionRecord,
                                       TuningTrialRecord)
from batchscope.tuning.space import changes_between, format_point
from batchscope.tuning.trials import CANCELLED, RUNNING, Trial, TuningResult

log = logging.getLogger("batchscope.tuning")

# session states
SESSION_RUNNING = "running"
SESSION_FINISHED = "finished"
SESSION_CANCELLED = "cancelled"
SESSION_FAILED = "failed"
#: the most sessions one listing returns
MAX_SESSIONS = 500
GIB = 1024 ** 3


class StoreUnavailable(RuntimeError):
    """No database to store sessions in; the message says why, in one line
    (``batchscope.storage.db.shown_url`` gives the URL to name with it, its password
    hidden)."""


def _first_line(exc: BaseException) -> str:
    """The driver's own first line of a database error (no SQLAlchemy background link)."""
    reason = getattr(exc, "orig", None) or exc
    lines = str(reason).strip().splitlines()
    return (lines[0].strip() if lines else "")[:300] or type(reason).__name__


def open_database(url: str) -> Engine:
    """The engine of an existing database at ``url``, its schema brought up to date (the
    tuning tables added to an older one). A missing SQLite file is not created: a
    mistyped path should not leave an empty database behind. ``StoreUnavailable`` when
    there is no usable database there."""
    try:
        engine = make_engine(url, create=False)
    except DatabaseNotFound as exc:
        raise StoreUnavailable(str(exc)) from None
    except Exception as exc:  # a URL SQLAlchemy cannot use, a missing driver
        raise StoreUnavailable(f"cannot open it ({type(exc).__name__}: {_first_line(exc)})"
                               ) from None
    try:
        init_schema(engine)
    except SchemaTooNew as exc:
        engine.dispose()
        raise StoreUnavailable(str(exc)) from None
    except (SQLAlchemyError, OSError) as exc:
        engine.dispose()
        raise StoreUnavailable(f"the database cannot be reached ({_first_line(exc)}); check "
                               "the URL, and that its server runs") from None
    return engine


# -- what a session tunes ---------------------------------------------------------------
@dataclass(frozen=True)
class Hardware:
    """The device an instance serves on, from its registration and its telemetry."""

    text: str
    #: gpu | cpu (the telemetry's kind), None without samples
    kind: Optional[str] = None
    #: the device's total memory (the GPU's, or the host's for the CPU), bytes
    memory_bytes: Optional[int] = None


def _models(raw: Optional[str]) -> list[str]:
    try:
        found = json.loads(raw or "[]")
    except ValueError:
        return []
    return [str(m) for m in found] if isinstance(found, list) else []


def instance_for_url(engine: Engine, url: str, model: str) -> Optional[str]:
    """The instance registered at ``url`` (trailing slash or not) that serves ``model``:
    a running one before a stopped one, the latest started first; None when none is."""
    base = url.rstrip("/")
    query = (select(RuntimeInstance.id, RuntimeInstance.models_json)
             .where(RuntimeInstance.url.in_([base, base + "/"]))
             .order_by(RuntimeInstance.stopped_at.is_not(None), RuntimeInstance.started_at.desc()))
    with engine.connect() as conn:
        rows = conn.execute(query).all()
    return next((str(r.id) for r in rows if model in _models(r.models_json)), None)


def hardware_of(engine: Engine, instance_id: str) -> Optional[Hardware]:
    """What ``instance_id`` serves on: its newest device sample (kind, device, memory) and
    its registration (host, device, CPU count); None for an unknown instance."""
    with engine.connect() as conn:
        inst = conn.execute(select(RuntimeInstance.host, RuntimeInstance.device,
                                   RuntimeInstance.cpu_count)
                            .where(RuntimeInstance.id == instance_id)).first()
        sample = conn.execute(select(DeviceSample.device, DeviceSample.kind,
                                     DeviceSample.memory_total_bytes)
                              .where(DeviceSample.instance_id == instance_id)
                              .order_by(DeviceSample.at.desc()).limit(1)).first()
    if inst is None and sample is None:
        return None
    host = inst.host if inst is not None else None
    device = (sample.device if sample is not None else None) or (inst.device if inst else None)
    kind = sample.kind if sample is not None else None
    memory = int(sample.memory_total_bytes) if sample is not None and \
        sample.memory_total_bytes is not None else None
    cpus = inst.cpu_count if inst is not None else None
    if kind == "gpu" or (kind is None and device and device.startswith("cuda")):
        text = f"GPU {device}" + (f", {memory / GIB:.0f} GiB" if memory else "")
    else:
        text = "CPU" + (f", {cpus} cores" if cpus else "") + \
            (f", {memory / GIB:.0f} GiB" if memory else "")
    if host:
        text += f" on {host}"
    return Hardware(text=text[:255], kind=kind, memory_bytes=memory)


# -- writing --------------------------------------------------------------------------------
def _json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), default=str)


def _finite(value: Optional[float]) -> Optional[float]:
    """A figure as a float the database and a snapshot's JSON take (None for NaN/inf)."""
    if value is None:
        return None
    value = float(value)
    return value if value == value and abs(value) != float("inf") else None


@dataclass(frozen=True)
class SessionStart:
    """What a session is, known when it starts."""

    model: str
    url: str
    objective: str
    slo_p99_ms: float
    budget_s: float
    load_kind: str
    start_settings: dict
    requested_by: str
    started_at: float
    instance_id: Optional[str] = None
    target_rps: Optional[float] = None
    load_description: Optional[str] = None
    hardware: Optional[Hardware] = None


class SessionWriter:
    """Writes one session as it runs (see the module docstring)."""

    def __init__(self, engine: Engine, session_id: int, *, wall_offset_s: float = 0.0) -> None:
        self.engine = engine
        self.session_id = session_id
        #: added to the session's clock to give wall time
        self.wall_offset_s = wall_offset_s
        #: why (part of) the session is not stored; None while every write succeeded
        self.problem: Optional[str] = None
        self._written: set[int] = set()

    @classmethod
    def begin(cls, engine: Engine, start: SessionStart, *,
              wall_offset_s: float = 0.0) -> "SessionWriter":
        """Write the session's row (state ``running``); raises what the database raises."""
        hw = start.hardware
        values = dict(instance_id=start.instance_id, url=start.url[:255], model=start.model,
                      started_at=start.started_at, state=SESSION_RUNNING,
                      objective=start.objective, slo_p99_ms=float(start.slo_p99_ms),
                      target_rps=start.target_rps, budget_s=float(start.budget_s),
                      load_kind=start.load_kind, load_description=start.load_description,
                      start_settings_json=_json(start.start_settings),
                      hardware=hw.text if hw else None, device_kind=hw.kind if hw else None,
                      device_memory_bytes=hw.memory_bytes if hw else None,
                      requested_by=start.requested_by)
        table = TuningSessionRecord.__table__
        with engine.begin() as conn:
            session_id = conn.execute(insert(table).returning(table.c.id), values).scalar_one()
        return cls(engine, int(session_id), wall_offset_s=wall_offset_s)

    def _write(self, what: str, statement) -> bool:
        if self.problem is not None:
            return False
        try:
            with self.engine.begin() as conn:
                conn.execute(statement)
            return True
        except (SQLAlchemyError, OSError) as exc:
            self.problem = (f"writing {what} of tuning session #{self.session_id} failed "
                            f"({type(exc).__name__}: {exc}); the rest of it is not stored")[:500]
            log.warning("%s", self.problem)
            return False

    def _wall(self, t: Optional[float]) -> Optional[float]:
        return None if t is None else t + self.wall_offset_s

    def trial(self, trial: Trial, start: dict, *, status: Optional[str] = None) -> None:
        """Write ``trial``'s row once it has ended (a running one waits for ``end``;
        ``status`` overrides the trial's own)."""
        status = status or trial.status
        if status == RUNNING or trial.number in self._written:
            return
        f = trial.figures
        values = dict(session_id=self.session_id, number=trial.number,
                      settings_json=_json(trial.point),
                      changed_json=_json(changes_between(start, trial.point)),
                      status=status, feasible=trial.feasible,
                      throughput_rps=None if f is None else _finite(f.throughput_rps),
                      goodput_rps=None if f is None else _finite(f.goodput_rps),
                      p50_ms=None if f is None else _finite(f.p50_ms),
                      p99_ms=None if f is None else _finite(f.p99_ms),
                      reason=trial.problem, windows=len(trial.windows),
                      started_at=self._wall(trial.started_s), finished_at=self._wall(trial.ended_s))
        if self._write(f"trial {trial.number}", insert(TuningTrialRecord).values(**values)):
            self._written.add(trial.number)

    def end(self, result: Optional[TuningResult], *, state: str, now: float,
            reason: Optional[str] = None) -> None:
        """The session is over: the trials not written yet, then its result and ``state``
        (``reason``: what stopped a failed session, stored as its stop reason)."""
        values: dict[str, Any] = dict(state=state, finished_at=now)
        if result is not None:
            for trial in result.trials:  # one still running when it stopped never ended
                self.trial(trial, result.start,
                           status=CANCELLED if trial.status == RUNNING else None)
            best = result.best
            values.update(best_settings_json=None if best is None else _json(best.point),
                          best_trial=None if best is None else best.number,
                          sentence=result.sentence(), stop_reason=result.stop_reason,
                          outcome=result.outcome or None)
        if reason:
            values.update(stop_reason=reason[:2000])
        self._write("the result", update(TuningSessionRecord)
                    .where(TuningSessionRecord.id == self.session_id).values(**values))

    @property
    def note(self) -> str:
        """Where the session is stored, in words."""
        where = self.engine.url.render_as_string(hide_password=True)
        if self.problem is not None:
            return f"tuning session #{self.session_id} in {where} is stored in part: {self.problem}"
        return f"stored as tuning session #{self.session_id} in {where}"


def state_of(result: TuningResult) -> str:
    """The stored state of a session that ended with ``result``."""
    return SESSION_CANCELLED if result.stop_reason == "cancelled" else SESSION_FINISHED


# -- reading --------------------------------------------------------------------------------
def _object(raw: Optional[str]) -> Optional[dict]:
    """A stored JSON object (None for NULL; ``{}`` for anything that is not an object)."""
    if raw is None:
        return None
    try:
        value = json.loads(raw)
    except (ValueError, TypeError, RecursionError):
        return {}
    return value if isinstance(value, dict) else {}


@dataclass(frozen=True)
class StoredTrial:
    session_id: int
    number: int
    point: dict
    changed: dict
    status: str
    feasible: bool
    throughput_rps: Optional[float]
    goodput_rps: Optional[float]
    p50_ms: Optional[float]
    p99_ms: Optional[float]
    reason: Optional[str]
    windows: int
    started_at: float
    finished_at: Optional[float]

    def row(self) -> dict[str, Any]:
        """The trial as ``Trial.row`` gives it (what the trials chart and table read)."""
        def rounded(v: Optional[float]) -> Optional[float]:
            return None if v is None else round(v, 2)

        duration = (self.finished_at or self.started_at) - self.started_at
        return {"trial": self.number, "status": self.status, "feasible": self.feasible,
                "goodput_rps": rounded(self.goodput_rps),
                "throughput_rps": rounded(self.throughput_rps), "p99_ms": rounded(self.p99_ms),
                "windows": self.windows, "duration_s": round(duration, 2),
                "settings": _point_text(self.point),
                "changed": _point_text(self.changed) or "(starting)",
                "problem": self.reason, "point": self.point}


def _point_text(point: dict) -> str:
    """``format_point`` of stored settings, plain JSON for values it cannot format."""
    try:
        return format_point(point)
    except (TypeError, ValueError):
        return ", ".join(f"{k}={json.dumps(v, default=str)}" for k, v in point.items())


@dataclass(frozen=True)
class StoredSession:
    id: int
    instance_id: Optional[str]
    url: str
    model: str
    started_at: float
    finished_at: Optional[float]
    state: str
    objective: str
    slo_p99_ms: float
    target_rps: Optional[float]
    budget_s: float
    load_kind: str
    load_description: Optional[str]
    start_settings: dict
    best_settings: Optional[dict]
    best_trial: Optional[int]
    sentence: Optional[str]
    stop_reason: Optional[str]
    outcome: Optional[str]
    hardware: Optional[str]
    device_kind: Optional[str]
    device_memory_bytes: Optional[int]
    requested_by: str
    #: how many of its trials are stored
    trials: int = 0

    @property
    def duration_s(self) -> Optional[float]:
        return None if self.finished_at is None else self.finished_at - self.started_at

    @property
    def recommended(self) -> Optional[dict]:
        """The best point's settings that differ from the starting ones (None: no best)."""
        if self.best_settings is None:
            return None
        return changes_between(self.start_settings, self.best_settings)


_SESSION_COLUMNS = [c for c in TuningSessionRecord.__table__.columns]
_TRIAL_COLUMNS = [c for c in TuningTrialRecord.__table__.columns]


def _session(row: Any, trials: int) -> StoredSession:
    m = row._mapping
    values = {c.name: m[c.name] for c in _SESSION_COLUMNS
              if c.name not in ("start_settings_json", "best_settings_json")}
    return StoredSession(**values, start_settings=_object(m["start_settings_json"]) or {},
                         best_settings=_object(m["best_settings_json"]), trials=trials)


def sessions(engine: Engine, *, model: Optional[str] = None, instance_id: Optional[str] = None,
             since: Optional[float] = None, until: Optional[float] = None,
             limit: int = 100) -> list[StoredSession]:
    """Stored sessions, newest first: of ``model`` / ``instance_id`` when given, started
    between ``since`` and ``until`` (wall seconds), at most ``limit`` (up to
    ``MAX_SESSIONS``)."""
    table = TuningSessionRecord.__table__
    query = select(*_SESSION_COLUMNS)
    if model is not None:
        query = query.where(table.c.model == model)
    if instance_id is not None:
        query = query.where(table.c.instance_id == instance_id)
    if since is not None:
        query = query.where(table.c.started_at >= since)
    if until is not None:
        query = query.where(table.c.started_at < until)
    query = query.order_by(table.c.started_at.desc(), table.c.id.desc())
    query = query.limit(max(1, min(int(limit), MAX_SESSIONS)))
    with engine.connect() as conn:
        rows = conn.execute(query).all()
        ids = [r.id for r in rows]
        counts = dict(conn.execute(
            select(TuningTrialRecord.session_id, func.count())
            .where(TuningTrialRecord.session_id.in_(ids))
            .group_by(TuningTrialRecord.session_id)).all()) if ids else {}
    return [_session(r, int(counts.get(r.id, 0))) for r in rows]


def trials_of(engine: Engine, session_ids: Iterable[int]) -> dict[int, list[StoredTrial]]:
    """The stored trials of each session, in trial order (a session without any: [])."""
    ids = list(dict.fromkeys(int(i) for i in session_ids))
    out: dict[int, list[StoredTrial]] = {i: [] for i in ids}
    if not ids:
        return out
    with engine.connect() as conn:
        rows = conn.execute(select(*_TRIAL_COLUMNS)
                            .where(TuningTrialRecord.session_id.in_(ids))
                            .order_by(TuningTrialRecord.session_id, TuningTrialRecord.number)).all()
    for r in rows:
        m = r._mapping
        values = {c.name: m[c.name] for c in _TRIAL_COLUMNS
                  if c.name not in ("settings_json", "changed_json")}
        values["feasible"] = bool(values["feasible"])
        out[int(r.session_id)].append(StoredTrial(**values, point=_object(m["settings_json"]) or {},
                                                  changed=_object(m["changed_json"]) or {}))
    return out


def best_trials(engine: Engine, found: list[StoredSession]) -> dict[int, StoredTrial]:
    """The stored best trial of each session of ``found`` that has one."""
    wanted = {s.id: s.best_trial for s in found if s.best_trial is not None}
    trials = trials_of(engine, wanted)
    return {sid: t for sid, rows in trials.items() for t in rows if t.number == wanted[sid]}
