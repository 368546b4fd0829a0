"""Writing a snapshot: ``export_snapshot`` puts a window's rows, the manifest (flags,
fleet flags, recommendations, environment), the offline report and the Perfetto trace
into one zip file."""

from __future__ import annotations

import io
import json
import math
import platform
import shutil
import sys
import tempfile
import time
import zipfile
from importlib import metadata
from pathlib import Path
from typing import BinaryIO

from sqlalchemy import Engine, inspect, text

from batchscope.analysis import diagnosis, fleet, fleet_rules, queries, recommend
from batchscope.presentation import report
from batchscope.presentation.snapshot.layout import (CHILDREN, FORMAT, FORMAT_VERSION, MANIFEST,
                                                   READ_CHUNK, REPORT, TABLES, TRACE,
                                                   TRACE_MAX_BYTES, TRACE_MAX_ROWS)
from batchscope.analysis.queries import Window
from batchscope.storage.schema import SCHEMA_VERSION, Base
from batchscope.tuning import store
from batchscope.version import version as batchscope_version


def environment(engine: Engine) -> dict:
    """Versions of the platform and libraries, and the devices the instances reported."""
    versions = {"batchscope": batchscope_version()}
    for pkg in ("torch", "numpy", "pandas", "sqlalchemy", "plotly", "streamlit"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = None
    with engine.connect() as conn:
        devices = sorted({r[0] for r in conn.execute(text(
            "SELECT DISTINCT device FROM runtime_instances WHERE device IS NOT NULL"))})
    return {"python": sys.version.split()[0], "platform": platform.platform(),
            "machine": platform.machine(), "versions": versions, "devices": devices}


def _where(name: str, w: Window) -> tuple[str, dict]:
    """The ``WHERE`` clause (with its leading space, or empty) that cuts ``name`` to ``w``."""
    if name in CHILDREN:
        column, parent, key = CHILDREN[name]
        where, params = _where(parent, w)
        return f" WHERE {column} IN (SELECT {key} FROM {parent}{where})", params
    time_col, by_model = TABLES[name]
    parts, params = [], {}
    if time_col:
        in_window = f"{time_col} >= :t0 AND {time_col} < :t1"
        # what serves each model is said once, at start: keep it whenever it was said
        parts.append(f"({in_window} OR kind = 'model_loaded')" if name == "events" else in_window)
        params.update(t0=w.start_s, t1=w.end_s)
    if by_model and w.model is not None:
        parts.append("(model = :model OR model IS NULL)" if name == "events" else "model = :model")
        params["model"] = w.model
    if w.instance_id is not None:
        parts.append(("id" if name == "runtime_instances" else "instance_id") + " = :inst")
        params["inst"] = w.instance_id
    return ((" WHERE " + " AND ".join(parts)) if parts else ""), params


def _table_rows(engine: Engine, name: str, w: Window) -> tuple[list[str], list[list]]:
    """Table ``name``'s rows in ``w``, every column of this schema: a column that a
    database of an older schema version lacks (it is read as it is, not upgraded) is
    NULL, as it reads once upgraded."""
    columns = [c.name for c in Base.metadata.tables[name].columns]
    where, params = _where(name, w)
    with engine.connect() as conn:
        have = {c["name"] for c in inspect(conn).get_columns(name)}
        picked = ", ".join(c if c in have else f"NULL AS {c}" for c in columns)
        rows = conn.execute(text(f"SELECT {picked} FROM {name}{where}"), params)
        return columns, [list(r) for r in rows]


def _json_safe(value):
    """``value`` with every float that JSON cannot hold (NaN, infinities) as null."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def _finite_rows(table: str, columns: list[str],
                 rows: list[list]) -> tuple[list[list], int, int]:
    """``rows`` of ``table`` without the NaNs and infinities JSON cannot hold (a program
    other than BatchScope wrote them): one in a column that may be NULL becomes null; a
    row holding one where a value is required is left out. The rows, how many values
    became null and how many rows were left out."""
    spec = Base.metadata.tables[table].columns
    required = [not spec[c].nullable for c in columns]
    nulled = dropped = 0
    out = []
    for row in rows:
        bad = [isinstance(v, float) and not math.isfinite(v) for v in row]
        if any(bad):
            if any(b and r for b, r in zip(bad, required)):
                dropped += 1
                continue
            nulled += sum(bad)
            row = [None if b else v for v, b in zip(row, bad)]
        out.append(row)
    return out, nulled, dropped


def fleet_flags(engine: Engine, w: Window, now: float) -> list[dict]:
    """What the fleet rules find over ``w`` (instances compared), as manifest entries."""
    return [_json_safe(f.to_dict()) for f in fleet_rules.diagnose(fleet.bundle(engine, w, now=now))]


def recommendations(engine: Engine, w: Window) -> list[dict]:
    """The resource recommendations over ``w``, as manifest entries."""
    return _json_safe(recommend.for_snapshot(engine, w, host_cpus=recommend.registered_host_cpus(engine, w.instance_id)))


def tuning_sessions(engine: Engine, w: Window) -> tuple[list, dict]:
    """The stored tuning sessions started in ``w`` (newest first) and their trials."""
    found = store.sessions(engine, model=w.model, instance_id=w.instance_id, since=w.start_s,
                           until=w.end_s, limit=store.MAX_SESSIONS)
    return found, store.trials_of(engine, [s.id for s in found])


def window_trace(engine: Engine, w: Window) -> tuple[dict, BinaryIO | None]:
    """The Perfetto trace of ``w`` in a temporary file (read from its start), and the
    manifest's ``trace`` entry; no file, and the entry saying why, for a window past
    ``TRACE_MAX_ROWS`` or ``TRACE_MAX_BYTES``, and when the trace cannot be made (no
    room for its temporary file, a database error, a row no BatchScope writes): the
    trace is a part of the snapshot that the rest does not need."""
    from sqlalchemy.exc import SQLAlchemyError

    from batchscope.trace import WindowTooLarge, export_trace

    tmp = None
    try:
        tmp = tempfile.TemporaryFile(prefix="batchscope-trace-")
        summary = export_trace(engine, w, tmp, "perfetto", max_rows=TRACE_MAX_ROWS)
        tmp.flush()  # a full disk says so here, not when the file is read back
    except WindowTooLarge as exc:
        _discard(tmp)
        return {"member": None, "rows": exc.rows,
                "skipped": f"the window holds {exc.rows:,} batches and requests, more than "
                           f"the {TRACE_MAX_ROWS:,} a snapshot's trace takes; export a "
                           "shorter window with: batchscope trace"}, None
    except ImportError as exc:  # the perfetto package (a dependency) missing
        _discard(tmp)
        return {"member": None, "skipped": f"{exc.name} is not installed"}, None
    except OSError as exc:  # the temporary folder full or read-only
        _discard(tmp)
        return {"member": None,
                "skipped": f"the trace found no room in the temporary folder "
                           f"{tempfile.gettempdir()} ({exc.strerror or exc}); free space "
                           "there (or set TMPDIR), or export it with: batchscope trace"}, None
    except (SQLAlchemyError, ValueError, TypeError, ArithmeticError) as exc:
        _discard(tmp)
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        return {"member": None,
                "skipped": f"the trace could not be made ({type(exc).__name__}: {first}); "
                           "export it with: batchscope trace, which says more"}, None
    except BaseException:
        _discard(tmp)
        raise
    entry = {"member": TRACE, "format": "perfetto", "bytes": summary.bytes_written,
             "rows": summary.rows, "batch_slices": summary.batch_slices,
             "request_slices": summary.request_slices, "flows": summary.flows,
             "step_slices": summary.step_slices, "notes": summary.notes}
    if summary.bytes_written > TRACE_MAX_BYTES:
        _discard(tmp)
        return {"member": None, "rows": summary.rows,
                "skipped": f"the window's trace is {summary.bytes_written:,} bytes, more than "
                           f"the {TRACE_MAX_BYTES:,} a snapshot takes; export a shorter "
                           "window with: batchscope trace"}, None
    tmp.seek(0)
    return entry, tmp


def _discard(tmp: BinaryIO | None) -> None:
    """Close a temporary file that is given up (what it could not write is lost anyway)."""
    if tmp is None:
        return
    try:
        tmp.close()
    except OSError:  # its last buffer, on a full disk
        pass


def served_models(engine: Engine, w: Window) -> list[dict]:
    """What served each model of the window (backend and source), from the instances'
    start-up ``model_loaded`` events."""
    df = queries.model_sources(engine, w.instance_id)
    if w.model is not None:
        df = df[df["model"] == w.model]
    return df.to_dict("records")


def export_snapshot(engine: Engine, w: Window, out: str | Path | BinaryIO, *,
                    slo_ms: float | None = None, now: float | None = None) -> dict:
    """Write the window ``w`` of ``engine``'s data to ``out``; returns the manifest."""
    bundle = queries.live_bundle(engine, w)
    flags = diagnosis.diagnose(bundle)
    created = time.time() if now is None else now
    manifest = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "schema_version": SCHEMA_VERSION,
        "batchscope_version": batchscope_version(), "created_at": created,
        "window": {"start_s": w.start_s, "end_s": w.end_s, "model": w.model,
                   "instance_id": w.instance_id},
        "slo_ms": slo_ms, "tables": {}, "environment": environment(engine),
        "flags": [f.to_dict() for f in flags],
        "fleet_flags": fleet_flags(engine, w, created),
        "recommendations": recommendations(engine, w),
        "models": served_models(engine, w),
    }
    payloads = {}
    for name in TABLES:
        columns, rows = _table_rows(engine, name, w)
        entry = manifest["tables"][name] = {"rows": len(rows), "columns": columns}
        try:
            payload = json.dumps({"columns": columns, "rows": rows}, separators=(",", ":"),
                                 allow_nan=False)
        except ValueError:  # NaN or an infinity, which no BatchScope writes and JSON lacks
            rows, nulled, dropped = _finite_rows(name, columns, rows)
            entry.update(rows=len(rows), not_numbers_as_null=nulled, rows_left_out=dropped)
            payload = json.dumps({"columns": columns, "rows": rows}, separators=(",", ":"),
                                 allow_nan=False)
        payloads[f"tables/{name}.json"] = payload
    sessions, trials = tuning_sessions(engine, w)
    html = report.render_html(bundle, flags, manifest=manifest, slo_ms=slo_ms,
                              sessions=sessions, trials=trials)
    manifest["trace"], trace = window_trace(engine, w)
    manifest = _json_safe(manifest)  # a figure made of rows holding an infinity is null
    try:
        with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=6) as zf:
            zf.writestr(MANIFEST, json.dumps(manifest, indent=1, allow_nan=False))
            for name, payload in payloads.items():
                zf.writestr(name, payload)
            zf.writestr(REPORT, html)
            if trace is not None:  # streamed from its temporary file into the archive
                with zf.open(TRACE, "w") as member:
                    shutil.copyfileobj(trace, member, READ_CHUNK)
    finally:
        if trace is not None:
            trace.close()
    return manifest


def export_bytes(engine: Engine, w: Window, **kwargs) -> bytes:
    buf = io.BytesIO()
    export_snapshot(engine, w, buf, **kwargs)
    return buf.getvalue()
