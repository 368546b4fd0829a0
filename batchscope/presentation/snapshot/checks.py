"""Checks of a snapshot before its rows are loaded: the archive's members (names,
compression method and ratio, sizes), strict JSON, the manifest's format, version and field
types, and the per-value and per-column type checks the table loader applies."""

from __future__ import annotations

import json
import math
import zipfile
import zlib
from functools import partial
from operator import is_not

from sqlalchemy import Boolean, Float, Integer, String, Text

from batchscope.presentation.snapshot.layout import (FORMAT, FORMAT_VERSION, LISTS, MANIFEST,
                                                   REPORT, TABLES, TRACE, Limits, SnapshotError)
from batchscope.storage.schema import SCHEMA_VERSION

#: compression methods BatchScope writes (and so the only ones read)
COMPRESSIONS = {zipfile.ZIP_STORED: "stored", zipfile.ZIP_DEFLATED: "deflated"}
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
