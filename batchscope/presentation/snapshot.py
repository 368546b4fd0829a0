"""Diagnostic snapshots: one zip file holding a window of recorded data.

Layout of the file::

    manifest.json            format, version, window, row counts, environment, flags
    tables/<table>.json      {"columns": [...], "rows": [[...], ...]}
    report.html              the offline report (Plotly inlined)

``export_snapshot`` writes one; ``load_snapshot`` checks one thoroughly (size
limits, member names, compression ratio, manifest format/version, column names
and value types; JSON only, nothing is executed) and loads it into a temporary
SQLite database with the live schema, so the dashboard's queries run on it
unchanged. ``cli_export`` backs ``batchscope snapshot export``.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import weakref
import platform
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import BinaryIO

from sqlalchemy import Boolean, Engine, Float, Integer, String, Text, text

from batchscope.analysis import diagnosis, queries
from batchscope.presentation import report
from batchscope.storage.db import make_engine
from batchscope.analysis.queries import Window
from batchscope.storage.schema import SCHEMA_VERSION, Base

FORMAT = "batchscope-snapshot"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
REPORT = "report.html"

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
}


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

    def close(self) -> None:
        self._finalizer()


def _discard(engine: Engine, path: str) -> None:
    engine.dispose()
    for suffix in ("", "-wal", "-shm"):
        try:
            os.remove(path + suffix)
        except OSError:
            pass


# -- export ---------------------------------------------------------------------------
def environment(engine: Engine) -> dict:
    """Versions of the platform and libraries, and the devices the instances reported."""
    versions = {}
    for pkg in ("batchscope", "torch", "numpy", "pandas", "sqlalchemy", "plotly", "streamlit"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = None
    with engine.connect() as conn:
        devices = sorted({r[0] for r in conn.execute(text(
            "SELECT DISTINCT device FROM runtime_instances WHERE device IS NOT NULL"))})
    return {"python": sys.version.split()[0], "platform": platform.platform(),
            "machine": platform.machine(), "versions": versions, "devices": devices}


def _table_rows(engine: Engine, name: str, w: Window) -> tuple[list[str], list[list]]:
    time_col, by_model = TABLES[name]
    columns = [c.name for c in Base.metadata.tables[name].columns]
    parts, params = [], {}
    if time_col:
        parts += [f"{time_col} >= :t0", f"{time_col} < :t1"]
        params.update(t0=w.start_s, t1=w.end_s)
    if by_model and w.model is not None:
        parts.append("(model = :model OR model IS NULL)" if name == "events" else "model = :model")
        params["model"] = w.model
    if w.instance_id is not None:
        parts.append(("id" if name == "runtime_instances" else "instance_id") + " = :inst")
        params["inst"] = w.instance_id
    where = (" WHERE " + " AND ".join(parts)) if parts else ""
    with engine.connect() as conn:
        rows = conn.execute(text(f"SELECT {', '.join(columns)} FROM {name}{where}"), params)
        return columns, [list(r) for r in rows]


def export_snapshot(engine: Engine, w: Window, out: str | Path | BinaryIO, *,
                    slo_ms: float | None = None, now: float | None = None) -> dict:
    """Write the window ``w`` of ``engine``'s data to ``out``; returns the manifest."""
    bundle = queries.live_bundle(engine, w)
    flags = diagnosis.diagnose(bundle)
    manifest = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "schema_version": SCHEMA_VERSION,
        "created_at": time.time() if now is None else now,
        "window": {"start_s": w.start_s, "end_s": w.end_s, "model": w.model,
                   "instance_id": w.instance_id},
        "slo_ms": slo_ms, "tables": {}, "environment": environment(engine),
        "flags": [f.to_dict() for f in flags],
    }
    payloads = {}
    for name in TABLES:
        columns, rows = _table_rows(engine, name, w)
        manifest["tables"][name] = {"rows": len(rows), "columns": columns}
        payloads[f"tables/{name}.json"] = json.dumps({"columns": columns, "rows": rows},
                                                     separators=(",", ":"), allow_nan=False)
    html = report.render_html(bundle, flags, manifest=manifest, slo_ms=slo_ms)
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=6) as zf:
        zf.writestr(MANIFEST, json.dumps(manifest, indent=1, allow_nan=False))
        for name, payload in payloads.items():
            zf.writestr(name, payload)
        zf.writestr(REPORT, html)
    return manifest


def export_bytes(engine: Engine, w: Window, **kwargs) -> bytes:
    buf = io.BytesIO()
    export_snapshot(engine, w, buf, **kwargs)
    return buf.getvalue()


# -- import ---------------------------------------------------------------------------
def _reject_constant(name: str):
    raise SnapshotError(f"the snapshot holds {name}, which is not a valid number; "
                        "it was not written by BatchScope or was altered")


def _read_member(zf: zipfile.ZipFile, info: zipfile.ZipInfo, limits: Limits) -> bytes:
    with zf.open(info) as fh:
        data = fh.read(limits.max_member_bytes + 1)
    if len(data) > limits.max_member_bytes or len(data) > info.file_size:
        raise SnapshotError(f"{info.filename} expands beyond its declared or allowed size; "
                            "the file is corrupt or hostile")
    return data


def _check_members(zf: zipfile.ZipFile, limits: Limits) -> dict[str, zipfile.ZipInfo]:
    allowed = {MANIFEST, REPORT} | {f"tables/{t}.json" for t in TABLES}
    members: dict[str, zipfile.ZipInfo] = {}
    total = 0
    for info in zf.infolist():
        name = info.filename
        if name not in allowed:
            raise SnapshotError(f"unexpected entry {name!r} in the snapshot; a snapshot holds only "
                                f"{MANIFEST}, {REPORT} and tables/<table>.json")
        if name in members:
            raise SnapshotError(f"the entry {name!r} appears twice in the snapshot")
        if info.flag_bits & 0x1:
            raise SnapshotError(f"{name} is encrypted; snapshots are never encrypted")
        if info.file_size > limits.max_member_bytes:
            raise SnapshotError(f"{name} would expand to {info.file_size} bytes, more than the "
                                f"limit of {limits.max_member_bytes}")
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
        return json.loads(raw, parse_constant=_reject_constant)
    except SnapshotError:
        raise
    except (ValueError, UnicodeDecodeError) as exc:
        raise SnapshotError(f"{member} is not valid JSON: {exc}") from None


def _check_manifest(raw: bytes) -> dict:
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
    ok_num = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    if not isinstance(w, dict) or not ok_num(w.get("start_s")) or not ok_num(w.get("end_s")) \
            or not all(w.get(k) is None or isinstance(w.get(k), str) for k in ("model", "instance_id")):
        raise SnapshotError(f"{MANIFEST} has no valid window (start_s, end_s numbers; model, "
                            "instance_id strings or null)")
    if not isinstance(manifest.get("flags", []), list):
        raise SnapshotError(f"flags in {MANIFEST} must be a list")
    return manifest


def _value_checker(column, limits: Limits):
    kind = column.type
    nullable = column.nullable or column.primary_key and isinstance(kind, Integer)
    if isinstance(kind, Boolean):
        good = lambda v: isinstance(v, bool) or (isinstance(v, int) and v in (0, 1))
    elif isinstance(kind, Integer):
        good = lambda v: isinstance(v, int) and not isinstance(v, bool) and abs(v) < 2 ** 63
    elif isinstance(kind, Float):
        good = lambda v: (isinstance(v, (int, float)) and not isinstance(v, bool)
                          and math.isfinite(v))
    elif isinstance(kind, (String, Text)):
        good = lambda v: isinstance(v, str) and len(v) <= limits.max_text_chars
    else:  # pragma: no cover - every column of the schema is one of the above
        raise SnapshotError(f"column {column.name} has an unsupported type")
    return lambda v: (v is None and nullable) or (v is not None and good(v))


def _check_table(name: str, raw: bytes, limits: Limits) -> tuple[list[str], list[list]]:
    doc = _parse_json(raw, f"tables/{name}.json")
    if not isinstance(doc, dict) or not isinstance(doc.get("columns"), list) \
            or not isinstance(doc.get("rows"), list):
        raise SnapshotError(f"tables/{name}.json must be an object with 'columns' and 'rows' lists")
    table = Base.metadata.tables[name]
    columns = doc["columns"]
    unknown = [c for c in columns if not isinstance(c, str) or c not in table.columns]
    if unknown or len(set(columns)) != len(columns):
        raise SnapshotError(f"tables/{name}.json has unknown or repeated columns {unknown!r}; "
                            f"known columns are {[c.name for c in table.columns]}")
    required = [c.name for c in table.columns
                if not c.nullable and not c.primary_key and c.default is None
                and c.name not in columns]
    if required:
        raise SnapshotError(f"tables/{name}.json lacks required columns {required}")
    rows = doc["rows"]
    if len(rows) > limits.max_rows_per_table:
        raise SnapshotError(f"tables/{name}.json has {len(rows)} rows, more than the limit of "
                            f"{limits.max_rows_per_table}")
    checks = [_value_checker(table.columns[c], limits) for c in columns]
    width = len(columns)
    for i, row in enumerate(rows):
        if not isinstance(row, list) or len(row) != width:
            raise SnapshotError(f"tables/{name}.json row {i} is not a list of {width} values")
        for col, check, value in zip(columns, checks, row):
            if not check(value):
                raise SnapshotError(f"tables/{name}.json row {i}: {col}={value!r:.60} has the "
                                    f"wrong type for a {table.columns[col].type} column")
    return columns, rows


def load_snapshot(source: str | Path | bytes | BinaryIO, *, limits: Limits | None = None,
                  workdir: str | Path | None = None) -> Snapshot:
    """Check ``source`` and load it into a temporary SQLite database (see ``Snapshot``)."""
    limits = limits or Limits()
    if isinstance(source, (str, Path)):
        size = os.path.getsize(source)
        if size > limits.max_file_bytes:
            raise SnapshotError(f"the file is {size} bytes, more than the limit of "
                                f"{limits.max_file_bytes}")
        data = Path(source).read_bytes()
    elif isinstance(source, (bytes, bytearray)):
        data = bytes(source)
    else:
        data = source.read(limits.max_file_bytes + 1)
    if len(data) > limits.max_file_bytes:
        raise SnapshotError(f"the file is larger than the limit of {limits.max_file_bytes} bytes")
    try:
        zf = zipfile.ZipFile(io.BytesIO(data))
    except zipfile.BadZipFile:
        raise SnapshotError("the file is not a zip archive; a BatchScope snapshot is a .zip "
                            "written by 'batchscope snapshot export' or the dashboard") from None
    with zf:
        members = _check_members(zf, limits)
        manifest = _check_manifest(_read_member(zf, members[MANIFEST], limits))
        tables = {}
        for name in TABLES:
            info = members.get(f"tables/{name}.json")
            if info is not None:
                tables[name] = _check_table(name, _read_member(zf, info, limits), limits)
    fd, path = tempfile.mkstemp(prefix="batchscope-snapshot-", suffix=".db", dir=workdir)
    os.close(fd)
    engine = make_engine(f"sqlite:///{path}")
    raw = engine.raw_connection()
    try:
        cur = raw.cursor()
        for name, (columns, rows) in tables.items():
            marks = ", ".join("?" for _ in columns)
            cur.executemany(f"INSERT INTO {name} ({', '.join(columns)}) VALUES ({marks})", rows)
        raw.commit()
    except Exception as exc:  # e.g. duplicate primary keys
        raw.close()
        engine.dispose()
        os.remove(path)
        raise SnapshotError(f"the snapshot's rows do not fit the schema: {exc}") from None
    raw.close()
    return Snapshot(engine=engine, manifest=manifest, path=Path(path))


def report_html(source: bytes) -> str:
    """The stored offline report of a snapshot (after the same member checks)."""
    limits = Limits()
    with zipfile.ZipFile(io.BytesIO(source)) as zf:
        members = _check_members(zf, limits)
        if REPORT not in members:
            raise SnapshotError(f"the snapshot has no {REPORT}")
        return _read_member(zf, members[REPORT], limits).decode("utf-8")


# -- command line ---------------------------------------------------------------------
def cli_export(argv: list[str] | None = None) -> int:
    """``batchscope snapshot export --db URL --model M --minutes 15 --out file.zip``."""
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
