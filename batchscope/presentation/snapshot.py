"""Diagnostic snapshots: one zip file holding a window of recorded data.

Layout of the file::

    manifest.json            format, version, the BatchScope version that wrote it,
                             window, row counts, environment, flags, fleet flags,
                             resource recommendations
    tables/<table>.json      {"columns": [...], "rows": [[...], ...]}
    report.html              the offline report (Plotly inlined)
    trace.pftrace            the window's batches and requests as a Perfetto trace
                             (``batchscope.trace``), when it holds at most
                             ``TRACE_MAX_ROWS`` of them; the manifest's ``trace`` entry
                             says what it holds, or why it was left out

The tables are the window's rows (``TABLES``), the tuning sessions started in it and
their trials among them. The manifest also holds what the fleet rules
(``analysis.fleet_rules``) found over the window and the resource recommendations
(``analysis.recommend.for_snapshot``, CPU in cores when the instances registered one
CPU count).

``export_snapshot`` writes one; ``load_snapshot`` checks one thoroughly (size
limits, member names, compression method and ratio, manifest format/version and
field types, column names and value types; strict UTF-8 JSON only, nothing is
executed) and loads it into a temporary SQLite database with the live schema, so
the dashboard's queries run on it unchanged. Tables are streamed: read in chunks,
parsed many rows at a time, checked column by column and inserted in batches, so
opening a large snapshot takes memory for a chunk, not for the file (a 60 MB
snapshot: about 15 MB over the interpreter, against 1.5 GB when whole members were
parsed; ``benchmarks/reliability/snapshot_import.py``). Whatever is wrong with a
file (damaged, cut off, hostile, or not a snapshot) is a ``SnapshotError`` saying
what. ``trace_bytes`` gives the stored trace back (after the same member checks), to
open in ui.perfetto.dev. ``cli_export`` backs ``batchscope snapshot export``.
"""

from __future__ import annotations

import argparse
import codecs
import io
import json
import math
import os
import platform
import re
import shutil
import sqlite3
import sys
import tempfile
import time
import weakref
import zipfile
import zlib
from dataclasses import dataclass, field
from functools import partial
from importlib import metadata
from operator import is_not
from pathlib import Path
from typing import BinaryIO

from sqlalchemy import Boolean, Engine, Float, Integer, String, Text, text
from sqlalchemy.schema import CreateIndex, CreateTable

from batchscope.analysis import diagnosis, fleet, fleet_rules, queries, recommend
from batchscope.presentation import report
from batchscope.storage.db import make_engine, stamp_schema
from batchscope.analysis.queries import Window
from batchscope.storage.schema import SCHEMA_VERSION, Base
from batchscope.tuning import store
from batchscope.version import version as batchscope_version

FORMAT = "batchscope-snapshot"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
REPORT = "report.html"
TRACE = "trace.pftrace"
#: a window holding more batches and requests gets no trace (about 250 bytes of trace
#: each, 4 s of writing per 60,000; ``batchscope trace`` exports any window on its own)
TRACE_MAX_ROWS = 200_000
#: nor does one whose trace comes out larger than this (generation steps and events
#: are not counted in the rows)
TRACE_MAX_BYTES = 96 * 1024 ** 2

#: table -> (time column used to cut the window, whether the model filter applies)
TABLES: dict[str, tuple[str | None, bool]] = {
    "batches": ("ended_at", True),
    "requests": ("finished_at", True),
    "events": ("at", True),
    "device_samples": ("at", False),
    "generation_steps": ("at", True),
    "model_settings": (None, True),
    "runtime_instances": (None, False),
    "control_commands": ("requested_at", True),
    "tuning_sessions": ("started_at", True),
    #: the trials of the sessions above (see ``CHILDREN``)
    "tuning_trials": (None, False),
}
#: table -> (its column naming the parent row, the parent table, the parent's key): the
#: rows of the parents exported, whatever the window
CHILDREN: dict[str, tuple[str, str, str]] = {
    "tuning_trials": ("session_id", "tuning_sessions", "id"),
}
#: manifest keys that hold lists of objects
LISTS = ("flags", "fleet_flags", "recommendations")


class SnapshotError(ValueError):
    """The file is not a snapshot this version can open; the message says why."""


@dataclass(frozen=True)
class Limits:
    max_file_bytes: int = 256 * 1024 ** 2
    max_member_bytes: int = 1024 ** 3
    max_total_bytes: int = 2 * 1024 ** 3
    max_ratio: float = 200.0
    max_rows_per_table: int = 20_000_000
    max_text_chars: int = 100_000
    max_manifest_bytes: int = 16 * 1024 ** 2
    #: the stored trace, expanded (twice what an export writes at most)
    max_trace_bytes: int = 2 * TRACE_MAX_BYTES


@dataclass
class Snapshot:
    """A snapshot opened into a temporary SQLite database."""

    engine: Engine
    manifest: dict
    path: Path
    window: Window = field(init=False)

    def __post_init__(self) -> None:
        w = self.manifest["window"]
        self.window = Window(float(w["start_s"]), float(w["end_s"]), w.get("model"),
                             w.get("instance_id"))
        # the temporary database goes away with the object (or at exit), even when
        # nobody calls close(): a dashboard session that ends just drops its snapshots
        self._finalizer = weakref.finalize(self, _discard, self.engine, str(self.path))

    @property
    def written_by(self) -> str | None:
        """The BatchScope version that wrote the file (``0.1.0``); None when it does not say."""
        return written_by(self.manifest)

    def close(self) -> None:
        self._finalizer()


def _discard(engine: Engine | None, path: str) -> None:
    if engine is not None:
        engine.dispose()
    for suffix in ("", "-wal", "-shm"):
        try:
            os.remove(path + suffix)
        except OSError:
            pass


# -- export ---------------------------------------------------------------------------
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
    columns = [c.name for c in Base.metadata.tables[name].columns]
    where, params = _where(name, w)
    with engine.connect() as conn:
        rows = conn.execute(text(f"SELECT {', '.join(columns)} FROM {name}{where}"), params)
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
    ``TRACE_MAX_ROWS`` or ``TRACE_MAX_BYTES``."""
    from batchscope.trace import WindowTooLarge, export_trace

    tmp = tempfile.TemporaryFile(prefix="batchscope-trace-")
    try:
        summary = export_trace(engine, w, tmp, "perfetto", max_rows=TRACE_MAX_ROWS)
    except WindowTooLarge as exc:
        tmp.close()
        return {"member": None, "rows": exc.rows,
                "skipped": f"the window holds {exc.rows:,} batches and requests, more than "
                           f"the {TRACE_MAX_ROWS:,} a snapshot's trace takes; export a "
                           "shorter window with: batchscope trace"}, None
    except ImportError as exc:  # the perfetto package (a dependency) missing
        tmp.close()
        return {"member": None, "skipped": f"{exc.name} is not installed"}, None
    except BaseException:
        tmp.close()
        raise
    entry = {"member": TRACE, "format": "perfetto", "bytes": summary.bytes_written,
             "rows": summary.rows, "batch_slices": summary.batch_slices,
             "request_slices": summary.request_slices, "flows": summary.flows,
             "step_slices": summary.step_slices, "notes": summary.notes}
    if summary.bytes_written > TRACE_MAX_BYTES:
        tmp.close()
        return {"member": None, "rows": summary.rows,
                "skipped": f"the window's trace is {summary.bytes_written:,} bytes, more than "
                           f"the {TRACE_MAX_BYTES:,} a snapshot takes; export a shorter "
                           "window with: batchscope trace"}, None
    tmp.seek(0)
    return entry, tmp


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
        manifest["tables"][name] = {"rows": len(rows), "columns": columns}
        payloads[f"tables/{name}.json"] = json.dumps({"columns": columns, "rows": rows},
                                                     separators=(",", ":"), allow_nan=False)
    sessions, trials = tuning_sessions(engine, w)
    html = report.render_html(bundle, flags, manifest=manifest, slo_ms=slo_ms,
                              sessions=sessions, trials=trials)
    manifest["trace"], trace = window_trace(engine, w)
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


# -- import ---------------------------------------------------------------------------
#: bytes read from a member at a time while streaming it
READ_CHUNK = 1024 ** 2
#: rows inserted into the temporary database per ``executemany``
INSERT_BATCH = 5000
#: compression methods BatchScope writes (and so the only ones read)
COMPRESSIONS = {zipfile.ZIP_STORED: "stored", zipfile.ZIP_DEFLATED: "deflated"}
_WS = re.compile(r"[ \t\n\r]*")
_NONE = partial(is_not, None)


def _reject_constant(name: str):
    raise SnapshotError(f"the snapshot holds {name}, which is not a valid number; "
                        "it was not written by BatchScope or was altered")


_DECODER = json.JSONDecoder(parse_constant=_reject_constant)


def _corrupt(member: str, exc: BaseException) -> SnapshotError:
    return SnapshotError(f"{member} cannot be read ({type(exc).__name__}: {exc}); the file is "
                         "damaged (a bad checksum or a cut-off download) or was not written by "
                         "BatchScope")


#: what reading a damaged member raises (bad CRC, broken deflate stream, cut-off data)
_READ_ERRORS = (zipfile.BadZipFile, zlib.error, EOFError, OSError, ValueError)


def _read_member(zf: zipfile.ZipFile, info: zipfile.ZipInfo, limits: Limits,
                 max_bytes: int | None = None) -> bytes:
    """A whole (small) member, at most ``max_bytes`` (default: the member limit)."""
    cap = limits.max_member_bytes if max_bytes is None else max_bytes
    if info.file_size > cap:
        raise SnapshotError(f"{info.filename} is {info.file_size} bytes, more than the limit of "
                            f"{cap}")
    try:
        with zf.open(info) as fh:
            data = fh.read(cap + 1)
    except _READ_ERRORS as exc:
        raise _corrupt(info.filename, exc) from None
    if len(data) > cap or len(data) > info.file_size:
        raise SnapshotError(f"{info.filename} expands beyond its declared or allowed size; "
                            "the file is corrupt or hostile")
    return data


def _check_members(zf: zipfile.ZipFile, limits: Limits) -> dict[str, zipfile.ZipInfo]:
    allowed = {MANIFEST, REPORT, TRACE} | {f"tables/{t}.json" for t in TABLES}
    members: dict[str, zipfile.ZipInfo] = {}
    total = 0
    for info in zf.infolist():
        name = info.filename
        if name not in allowed:
            raise SnapshotError(f"unexpected entry {name!r} in the snapshot; a snapshot holds only "
                                f"{MANIFEST}, {REPORT}, {TRACE} and tables/<table>.json")
        if name in members:
            raise SnapshotError(f"the entry {name!r} appears twice in the snapshot")
        if info.flag_bits & 0x1:
            raise SnapshotError(f"{name} is encrypted; snapshots are never encrypted")
        if info.compress_type not in COMPRESSIONS:
            raise SnapshotError(f"{name} uses compression method {info.compress_type}; snapshots "
                                "are stored or deflated (re-export it with BatchScope)")
        cap = limits.max_trace_bytes if name == TRACE else limits.max_member_bytes
        if info.file_size > cap:
            raise SnapshotError(f"{name} would expand to {info.file_size} bytes, more than the "
                                f"limit of {cap}")
        ratio = info.file_size / max(1, info.compress_size)
        if ratio > limits.max_ratio and info.file_size > 1024 ** 2:
            raise SnapshotError(f"{name} expands {ratio:.0f}× (limit {limits.max_ratio:.0f}×): "
                                "refusing a likely zip bomb")
        total += info.file_size
        members[name] = info
    if total > limits.max_total_bytes:
        raise SnapshotError(f"the snapshot would expand to {total} bytes, more than the limit of "
                            f"{limits.max_total_bytes}")
    if MANIFEST not in members:
        raise SnapshotError(f"the file has no {MANIFEST}; it is not a BatchScope snapshot")
    return members


def _parse_json(raw: bytes, member: str):
    """JSON only (no NaN/Infinity); anything else is a SnapshotError naming the member."""
    try:
        return _DECODER.decode(raw.decode("utf-8"))
    except SnapshotError:
        raise
    except UnicodeDecodeError as exc:
        raise SnapshotError(f"{member} is not UTF-8 text: {exc}") from None
    except ValueError as exc:
        raise SnapshotError(f"{member} is not valid JSON: {exc}") from None
    except RecursionError:
        raise SnapshotError(f"{member} nests its values too deeply; snapshots are flat "
                            "tables") from None


def _number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _check_manifest(raw: bytes, limits: Limits) -> dict:
    manifest = _parse_json(raw, MANIFEST)
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise SnapshotError(f"{MANIFEST} does not describe a {FORMAT!r} file")
    version = manifest.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise SnapshotError(f"format_version {version!r} in {MANIFEST} must be a positive integer")
    if version > FORMAT_VERSION:
        raise SnapshotError(f"the snapshot has format version {version}, newer than this BatchScope "
                            f"reads ({FORMAT_VERSION}); upgrade BatchScope to open it")
    schema = manifest.get("schema_version")
    if not isinstance(schema, int) or isinstance(schema, bool) or schema > SCHEMA_VERSION:
        raise SnapshotError(f"schema_version {schema!r} is not one this BatchScope reads "
                            f"(up to {SCHEMA_VERSION})")
    w = manifest.get("window")
    if not isinstance(w, dict) or not _number(w.get("start_s")) or not _number(w.get("end_s")) \
            or not all(w.get(k) is None or isinstance(w.get(k), str) for k in ("model", "instance_id")):
        raise SnapshotError(f"{MANIFEST} has no valid window (start_s, end_s numbers; model, "
                            "instance_id strings or null)")
    for key in LISTS:
        entries = manifest.get(key, [])
        if not isinstance(entries, list) or not all(isinstance(f, dict) for f in entries):
            raise SnapshotError(f"{key} in {MANIFEST} must be a list of objects")
    for key in ("environment", "tables", "trace"):
        if not isinstance(manifest.get(key, {}), dict):
            raise SnapshotError(f"{key} in {MANIFEST} must be an object")
    for name, entry in manifest.get("tables", {}).items():
        rows = entry.get("rows", 0) if isinstance(entry, dict) else None
        if not isinstance(rows, int) or isinstance(rows, bool) or rows < 0:
            raise SnapshotError(f"tables.{name!s:.40} in {MANIFEST} must be an object with a "
                                "non-negative row count")
        if rows > limits.max_rows_per_table:
            raise SnapshotError(f"{MANIFEST} says tables/{name!s:.40}.json has {rows} rows, more "
                                f"than the limit of {limits.max_rows_per_table}")
    for key in ("slo_ms", "created_at"):
        if manifest.get(key) is not None and not _number(manifest[key]):
            raise SnapshotError(f"{key} in {MANIFEST} must be a number or null")
    written = manifest.get("batchscope_version")
    if written is not None and not (isinstance(written, str) and len(written) <= 64):
        raise SnapshotError(f"batchscope_version in {MANIFEST} must be a short string or null")
    return manifest


def written_by(manifest: dict) -> str | None:
    """The BatchScope version that wrote a snapshot: the manifest's ``batchscope_version``,
    else (files written before it was there) its environment's; None when neither says."""
    found = manifest.get("batchscope_version")
    if found is None:
        versions = (manifest.get("environment") or {}).get("versions")
        found = versions.get("batchscope") if isinstance(versions, dict) else None
    return found if isinstance(found, str) else None


def _value_checker(column, limits: Limits):
    """One value of ``column``: ok or not (used to name the first bad value)."""
    kind = column.type
    nullable = column.nullable or column.primary_key and isinstance(kind, Integer)
    if isinstance(kind, Boolean):
        good = lambda v: isinstance(v, bool) or (isinstance(v, int) and v in (0, 1))
    elif isinstance(kind, Integer):
        good = lambda v: isinstance(v, int) and not isinstance(v, bool) and abs(v) < 2 ** 63
    elif isinstance(kind, Float):
        good = _number
    elif isinstance(kind, (String, Text)):
        good = lambda v: isinstance(v, str) and len(v) <= limits.max_text_chars
    else:  # pragma: no cover - every column of the schema is one of the above
        raise SnapshotError(f"column {column.name} has an unsupported type")
    return lambda v: (v is None and nullable) or (v is not None and good(v))


def _column_checker(column, limits: Limits):
    """All values of ``column`` in one batch at once, with C-level loops: ok or not.
    Exactly as strict as ``_value_checker``, which then finds the row to blame."""
    kind = column.type
    nullable = column.nullable or column.primary_key and isinstance(kind, Integer)
    if isinstance(kind, Boolean):
        types, tail = {bool, int}, lambda vs: set(vs) <= {0, 1}
    elif isinstance(kind, Integer):
        types, tail = {int}, lambda vs: -(2 ** 63) < min(vs) and max(vs) < 2 ** 63
    elif isinstance(kind, Float):
        types, tail = {int, float}, lambda vs: all(map(math.isfinite, vs))
    else:
        cap = limits.max_text_chars
        types, tail = {str}, lambda vs: max(map(len, vs)) <= cap
    if nullable:
        types = types | {type(None)}

    def check(values: tuple) -> bool:
        found = set(map(type, values))
        if not found <= types:
            return False
        present = list(filter(_NONE, values)) if type(None) in found else values
        return not present or tail(present)
    return check


class _MemberStream:
    """A table member read ``READ_CHUNK`` bytes at a time, decoded as strict UTF-8, with
    the JSON values in it taken one by one: memory stays at a chunk plus one row."""

    def __init__(self, fh: BinaryIO, info: zipfile.ZipInfo, limits: Limits) -> None:
        self.fh, self.name = fh, info.filename
        self.cap = min(info.file_size, limits.max_member_bytes)
        #: the longest one value (a row, the column list) may be
        self.max_value_chars = limits.max_text_chars * 64 + READ_CHUNK
        self.read = 0
        self.buf, self.pos, self.eof = "", 0, False
        self._utf8 = codecs.getincrementaldecoder("utf-8")("strict")

    def fail(self, what: str) -> SnapshotError:
        return SnapshotError(f"{self.name} is not a valid table: {what}")

    def fill(self) -> None:
        if self.eof:
            return
        try:
            chunk = self.fh.read(READ_CHUNK)
        except _READ_ERRORS as exc:
            raise _corrupt(self.name, exc) from None
        self.read += len(chunk)
        if self.read > self.cap:
            raise SnapshotError(f"{self.name} expands beyond its declared or allowed size; "
                                "the file is corrupt or hostile")
        self.eof = not chunk
        try:
            text = self._utf8.decode(chunk, final=self.eof)
        except UnicodeDecodeError as exc:
            raise SnapshotError(f"{self.name} is not UTF-8 text: {exc}") from None
        self.buf = self.buf[self.pos:] + text
        self.pos = 0

    def peek(self) -> str:
        """The next character that is not white space ('' at the end)."""
        while True:
            self.pos = _WS.match(self.buf, self.pos).end()
            if self.pos < len(self.buf) or self.eof:
                return self.buf[self.pos:self.pos + 1]
            self.fill()

    def expect(self, char: str, where: str) -> None:
        found = self.peek()
        if found != char:
            raise self.fail(f"expected {char!r} {where}, found {found or 'the end'!r}")
        self.pos += 1

    def values(self) -> list:
        """The rows from here to the last complete one in the buffer, parsed in one go:
        ``[`` + the text up to a ``]`` + ``]`` parses only when the cut falls between
        two values (a cut inside a string or a row leaves it unbalanced). When it
        does not parse (nor with the ``]`` before, in case the last one closes the list of
        rows), one value is taken, the slow way that names what is wrong."""
        buf, pos = self.buf, self.pos
        cut = len(buf)
        for _ in range(2):  # the last ']' may close the list of rows: then the one before
            cut = buf.rfind("]", pos, cut)
            if cut <= pos:
                break
            try:
                rows = _DECODER.decode("[" + buf[pos:cut + 1] + "]")
            except SnapshotError:
                raise
            except (ValueError, RecursionError):
                continue
            self.pos = cut + 1
            return rows
        return [self.value()]

    def value(self):
        """The next JSON value, read on while it is cut off by the end of the buffer."""
        self.peek()  # raw_decode does not skip white space
        while True:
            try:
                value, end = _DECODER.raw_decode(self.buf, self.pos)
            except SnapshotError:
                raise
            except RecursionError:
                raise self.fail("values nest too deeply; a table is a list of flat rows") from None
            except ValueError as exc:
                if self.eof:
                    raise self.fail(f"bad JSON: {exc}") from None
                if len(self.buf) - self.pos > self.max_value_chars:
                    raise self.fail(f"a value longer than {self.max_value_chars} characters")
                self.fill()
                continue
            if end == len(self.buf) and not self.eof:  # a number may go on in the next chunk
                self.fill()
                continue
            self.pos = end
            return value


class _TableLoader:
    """Checks one table member row batch by row batch and inserts each batch."""

    def __init__(self, name: str, limits: Limits, cursor) -> None:
        self.name, self.limits, self.cursor = name, limits, cursor
        self.member = f"tables/{name}.json"
        self.table = Base.metadata.tables[name]
        self.rows = 0

    def columns(self, columns: object) -> None:
        table = self.table
        if not isinstance(columns, list):
            raise SnapshotError(f"{self.member} must be an object with 'columns' and 'rows' lists")
        unknown = [c for c in columns if not isinstance(c, str) or c not in table.columns]
        if unknown or len(set(columns)) != len(columns):
            raise SnapshotError(f"{self.member} has unknown or repeated columns {unknown!r:.200}; "
                                f"known columns are {[c.name for c in table.columns]}")
        required = [c.name for c in table.columns
                    if not c.nullable and not c.primary_key and c.default is None
                    and c.name not in columns]
        if required:
            raise SnapshotError(f"{self.member} lacks required columns {required}")
        self.names = columns
        self.width = len(columns)
        self.value_checks = [_value_checker(table.columns[c], self.limits) for c in columns]
        self.column_checks = [_column_checker(table.columns[c], self.limits) for c in columns]
        marks = ", ".join("?" for _ in columns)
        self.sql = f"INSERT INTO {self.name} ({', '.join(columns)}) VALUES ({marks})"

    def add(self, batch: list) -> None:
        """Check ``batch`` (the rows after ``self.rows``) and insert it."""
        first = self.rows
        self.rows += len(batch)
        if self.rows > self.limits.max_rows_per_table:
            raise SnapshotError(f"{self.member} has {self.limits.max_rows_per_table + 1} or more "
                                f"rows, more than the limit of {self.limits.max_rows_per_table}")
        if set(map(type, batch)) != {list} or set(map(len, batch)) != {self.width}:
            self._blame(batch, first)
        if self.width and not all(check(values) for check, values
                                  in zip(self.column_checks, zip(*batch))):
            self._blame(batch, first)
        self.cursor.executemany(self.sql, batch)

    def _blame(self, batch: list, first: int) -> None:
        """Raise the error that names the first bad row of ``batch``."""
        width = self.width
        for i, row in enumerate(batch, first):
            if not isinstance(row, list) or len(row) != width:
                raise SnapshotError(f"{self.member} row {i} is not a list of {width} values")
            for col, check, value in zip(self.names, self.value_checks, row):
                if not check(value):
                    raise SnapshotError(f"{self.member} row {i}: {col}={value!r:.60} has the "
                                        f"wrong type for a {self.table.columns[col].type} column")
        raise AssertionError("a batch failed its check but no row in it did")  # pragma: no cover


def _load_table(zf: zipfile.ZipFile, info: zipfile.ZipInfo, name: str, limits: Limits,
                cursor) -> int:
    """Stream ``tables/<name>.json`` (``{"columns": [...], "rows": [[...], ...]}``, columns
    first, as BatchScope writes it) into the table; returns the row count."""
    loader = _TableLoader(name, limits, cursor)
    try:
        fh = zf.open(info)
    except _READ_ERRORS as exc:
        raise _corrupt(info.filename, exc) from None
    with fh:
        s = _MemberStream(fh, info, limits)
        s.fill()
        shape = SnapshotError(f"{loader.member} must be an object with 'columns' and 'rows' lists")
        if s.peek() != "{":
            raise shape
        s.pos += 1
        seen: set[str] = set()
        while s.peek() != "}":
            if seen:
                s.expect(",", "between the entries of the object")
            key = s.value()
            if not isinstance(key, str) or key in seen:
                raise s.fail(f"the key {key!r:.40} is not a string or appears twice")
            seen.add(key)
            s.expect(":", f"after {key!r:.40}")
            if key != "rows":
                value = s.value()
                if key == "columns":
                    loader.columns(value)
                continue
            if "columns" not in seen:
                raise s.fail("'rows' comes before 'columns'")
            if s.peek() != "[":
                raise shape
            s.pos += 1
            batch: list = []
            first = True
            while s.peek() != "]":
                if not first:
                    s.expect(",", "between rows")
                first = False
                batch.extend(s.values())
                if len(batch) >= INSERT_BATCH:
                    loader.add(batch)
                    batch = []
            s.pos += 1
            if batch:
                loader.add(batch)
        s.pos += 1
        if "columns" not in seen or "rows" not in seen:
            raise shape
        if s.peek() != "":
            raise s.fail("more data after the end of the object")
    return loader.rows


def _open_zip(source: str | Path | bytes | BinaryIO, limits: Limits) -> zipfile.ZipFile:
    """The archive, after the file size check; a path is read from disk as needed."""
    if isinstance(source, (str, Path)):
        size = os.path.getsize(source)
        if size > limits.max_file_bytes:
            raise SnapshotError(f"the file is {size} bytes, more than the limit of "
                                f"{limits.max_file_bytes}")
        target: str | Path | BinaryIO = source
    else:
        data = bytes(source) if isinstance(source, (bytes, bytearray, memoryview)) \
            else source.read(limits.max_file_bytes + 1)
        if len(data) > limits.max_file_bytes:
            raise SnapshotError(f"the file is larger than the limit of {limits.max_file_bytes} bytes")
        target = io.BytesIO(data)
    try:
        return zipfile.ZipFile(target)
    except (zipfile.BadZipFile, EOFError, ValueError, NotImplementedError) as exc:
        raise SnapshotError(f"the file is not a zip archive ({exc}); a BatchScope snapshot is a "
                            ".zip written by 'batchscope snapshot export' or the dashboard") from None


def load_snapshot(source: str | Path | bytes | BinaryIO, *, limits: Limits | None = None,
                  workdir: str | Path | None = None) -> Snapshot:
    """Check ``source`` and load it into a temporary SQLite database (see ``Snapshot``).

    Tables are streamed: each member is read in chunks, its rows checked and inserted a
    batch at a time, so memory stays bounded whatever the size of the file. Every
    problem with the file (damaged, cut off, hostile, or simply not a snapshot) raises
    ``SnapshotError`` saying what was wrong, and leaves no temporary file behind."""
    limits = limits or Limits()
    with _open_zip(source, limits) as zf:
        members = _check_members(zf, limits)
        manifest = _check_manifest(_read_member(zf, members[MANIFEST], limits,
                                                min(limits.max_manifest_bytes,
                                                    limits.max_member_bytes)), limits)
        fd, path = tempfile.mkstemp(prefix="batchscope-snapshot-", suffix=".db", dir=workdir)
        os.close(fd)
        try:
            engine = make_engine(f"sqlite:///{path}", create=False)
        except Exception:
            _discard(None, path)
            raise
        try:
            _load_tables(zf, members, limits, engine)
        except BaseException as exc:
            _discard(engine, path)
            if isinstance(exc, SnapshotError) or not isinstance(exc, Exception):
                raise
            if isinstance(exc, sqlite3.IntegrityError):  # e.g. duplicate primary keys
                raise SnapshotError(f"the snapshot's rows do not fit the schema: {exc}") from None
            if isinstance(exc, sqlite3.Error):  # the temporary database, not the file
                raise SnapshotError(f"the snapshot could not be loaded into a temporary database "
                                    f"in {Path(path).parent} ({exc}); free some disk space there "
                                    "and open it again") from None
            raise SnapshotError(f"the snapshot could not be read ({type(exc).__name__}: {exc}); "
                                "it is damaged or was not written by BatchScope") from None
    return Snapshot(engine=engine, manifest=manifest, path=Path(path))


def _load_tables(zf: zipfile.ZipFile, members: dict[str, zipfile.ZipInfo], limits: Limits,
                 engine: Engine) -> None:
    """The live schema's tables, filled from the members, then its indexes (building an
    index once over loaded rows is faster than keeping it up to date row by row)."""
    raw = engine.raw_connection()
    dialect = engine.dialect
    try:
        cur = raw.cursor()
        cur.execute("PRAGMA synchronous=OFF")  # a throwaway database: nothing to keep safe
        for table in Base.metadata.sorted_tables:
            cur.execute(str(CreateTable(table).compile(dialect=dialect)))
        for name in TABLES:
            info = members.get(f"tables/{name}.json")
            if info is not None:
                _load_table(zf, info, name, limits, cur)
        for table in Base.metadata.sorted_tables:
            for index in table.indexes:
                cur.execute(str(CreateIndex(index).compile(dialect=dialect)))
        raw.commit()
    finally:
        raw.close()
    stamp_schema(engine)


def report_html(source: bytes) -> str:
    """The stored offline report of a snapshot (after the same member checks)."""
    limits = Limits()
    with _open_zip(source, limits) as zf:
        members = _check_members(zf, limits)
        if REPORT not in members:
            raise SnapshotError(f"the snapshot has no {REPORT}")
        try:
            return _read_member(zf, members[REPORT], limits).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise SnapshotError(f"{REPORT} is not UTF-8 text: {exc}") from None


def trace_bytes(source: str | Path | bytes | BinaryIO, *,
                limits: Limits | None = None) -> bytes | None:
    """The stored Perfetto trace of a snapshot (after the same member checks), or None
    when it has none (written before traces, or its window was too large for one; the
    manifest's ``trace`` entry says which)."""
    limits = limits or Limits()
    with _open_zip(source, limits) as zf:
        members = _check_members(zf, limits)
        if TRACE not in members:
            return None
        return _read_member(zf, members[TRACE], limits, limits.max_trace_bytes)


# -- command line ---------------------------------------------------------------------
def export_parser() -> argparse.ArgumentParser:
    """The options of ``batchscope snapshot export``."""
    parser = argparse.ArgumentParser(prog="batchscope snapshot export",
                                     description="Export a window of recorded data to one file.")
    parser.add_argument("--db", default=None, help="database URL (default: $BATCHSCOPE_DB_URL "
                                                   "or sqlite:///data/batchscope.db)")
    parser.add_argument("--model", default=None, help="only this model (default: all)")
    parser.add_argument("--instance", default=None, help="only this runtime instance")
    parser.add_argument("--minutes", type=float, default=15.0, help="window length (default 15)")
    parser.add_argument("--end", type=float, default=None,
                        help="window end, epoch seconds (default: now)")
    parser.add_argument("--slo-ms", type=float, default=None, help="latency SLO for the report")
    parser.add_argument("--out", required=True, help="output .zip path")
    return parser


def cli_export(argv: list[str] | None = None) -> int:
    """``batchscope snapshot export --db URL --model M --minutes 15 --out file.zip``."""
    parser = export_parser()
    args = parser.parse_args(argv)
    if not (args.minutes > 0 and math.isfinite(args.minutes)):
        parser.error(f"--minutes={args.minutes} must be a positive number")
    engine = make_engine(args.db)
    end = args.end if args.end is not None else time.time()
    w = Window.last(args.minutes, now=end, model=args.model, instance_id=args.instance)
    manifest = export_snapshot(engine, w, args.out, slo_ms=args.slo_ms)
    rows = ", ".join(f"{k} {v['rows']}" for k, v in manifest["tables"].items())
    print(f"wrote {args.out}: {rows}; {len(manifest['flags'])} flag(s)")
    return 0
