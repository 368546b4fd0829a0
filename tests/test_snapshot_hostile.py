"""Hostile and damaged snapshot files: each is refused with a ``SnapshotError`` that says
what was wrong (never another exception), and leaves no temporary database behind."""

from __future__ import annotations

import io
import json
import struct
import zipfile

import pytest

from batchscope.analysis import queries
from batchscope.presentation import snapshot
from batchscope.presentation.snapshot import INSERT_BATCH, Limits, SnapshotError
from batchscope.storage.db import make_engine
from batchscope.storage.schema import Base
from batchscope.testing import synthetic

END = 2_000_000_000.0
EVENT_COLUMNS = ["id", "instance_id", "model", "at", "kind", "severity", "message", "details_json"]


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> bytes:
    engine = make_engine(f"sqlite:///{tmp_path_factory.mktemp('h') / 'h.db'}")
    synthetic.generate(engine, synthetic.SCENARIOS["oom"].with_(duration_s=60, batches_per_s=4),
                       end_s=END)
    data = snapshot.export_bytes(engine, queries.Window(END - 60, END + 1, "mlp"))
    engine.dispose()
    return data


def members(data: bytes) -> dict[str, bytes]:
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        return {info.filename: zf.read(info) for info in zf.infolist()}


def build(parts: dict[str, bytes | str], method: int = zipfile.ZIP_DEFLATED) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", method) as zf:
        for name, payload in parts.items():
            zf.writestr(name, payload)
    return out.getvalue()


def manifest_of(data: bytes) -> dict:
    return json.loads(members(data)["manifest.json"])


def with_member(data: bytes, name: str, payload: bytes | str, method=zipfile.ZIP_DEFLATED) -> bytes:
    parts = members(data)
    parts[name] = payload
    return build(parts, method)


def with_manifest(data: bytes, change) -> bytes:
    manifest = manifest_of(data)
    change(manifest)
    return with_member(data, "manifest.json", json.dumps(manifest))


def events_table(rows: list) -> str:
    return json.dumps({"columns": EVENT_COLUMNS, "rows": rows})


def event(i: int, message: str = "m") -> list:
    return [i, "synthetic-1", "mlp", END - 10 + i * 1e-3, "oom", "warning", message, "{}"]


# -- damaged archives -------------------------------------------------------------------
def bad_crc(data: bytes) -> bytes:
    """A stored member whose bytes no longer match its CRC (the JSON stays valid)."""
    parts = members(data)
    parts["tables/events.json"] = events_table([event(1, "AAAAAAAA")])
    raw = build(parts, zipfile.ZIP_STORED)
    return raw.replace(b"AAAAAAAA", b"AAAAAAAB", 1)


def damaged_deflate(data: bytes) -> bytes:
    """Garbage in the middle of a deflated member."""
    parts = members(data)
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, payload in parts.items():
            zf.writestr(name, payload)
    raw = bytearray(out.getvalue())
    with zipfile.ZipFile(io.BytesIO(bytes(raw))) as zf:
        info = zf.getinfo("tables/requests.json")
    start = info.header_offset + 30 + len(info.filename) + len(info.extra)
    for i in range(start + 40, start + min(info.compress_size - 8, 400)):
        raw[i] ^= 0x5A
    return bytes(raw)


def method_99(data: bytes) -> bytes:
    """The manifest's compression method changed to one no zip reader knows."""
    raw = bytearray(build(members(data), zipfile.ZIP_STORED))
    for signature, offset in ((b"PK\x01\x02", 10), (b"PK\x03\x04", 8)):
        at = raw.index(signature)  # the first entry is the manifest
        raw[at + offset:at + offset + 2] = struct.pack("<H", 99)
    return bytes(raw)


def zip_bomb(_data: bytes) -> bytes:
    return build({"manifest.json": "{}", "tables/requests.json": b" " * (40 * 1024 ** 2)})


def deep(depth: int = 200_000) -> str:
    return "[" * depth + "]" * depth


HOSTILE = [
    ("bad CRC", bad_crc, "cannot be read .*CRC"),
    ("damaged deflate data", damaged_deflate, "cannot be read"),
    ("truncated download", lambda d: d[: len(d) // 2], "not a zip archive"),
    ("cut in the directory", lambda d: d[:-10], "not a zip archive"),
    ("empty file", lambda d: b"", "not a zip archive"),
    ("zip bomb by ratio", zip_bomb, "zip bomb"),
    ("unknown compression method", method_99, "compression method 99"),
    ("bzip2 compression", lambda d: build(members(d), zipfile.ZIP_BZIP2), "compression method 12"),
    ("deep nesting in the manifest", lambda d: with_member(d, "manifest.json", deep()),
     "nests its values too deeply"),
    ("deep nesting in a row", lambda d: with_member(
        d, "tables/events.json", '{"columns":%s,"rows":[%s]}' % (json.dumps(EVENT_COLUMNS), deep())),
     "nest too deeply"),
    ("deep nesting as a table", lambda d: with_member(d, "tables/events.json", deep()),
     "must be an object"),
    ("non-UTF-8 manifest", lambda d: with_member(d, "manifest.json", b'{"format":"caf\xe9"}'),
     "not UTF-8"),
    ("non-UTF-8 table", lambda d: with_member(
        d, "tables/events.json", events_table([event(1, "cafe")]).encode().replace(b"cafe", b"caf\xe9")),
     "not UTF-8"),
    ("table is a list", lambda d: with_member(d, "tables/events.json", "[1, 2]"), "must be an object"),
    ("columns not a list", lambda d: with_member(d, "tables/events.json", '{"columns": 3, "rows": []}'),
     "must be an object"),
    ("rows not a list", lambda d: with_member(
        d, "tables/events.json", '{"columns": %s, "rows": {}}' % json.dumps(EVENT_COLUMNS)),
     "must be an object"),
    ("rows before columns", lambda d: with_member(
        d, "tables/events.json", '{"rows": [], "columns": %s}' % json.dumps(EVENT_COLUMNS)),
     "'rows' comes before 'columns'"),
    ("a row that is an object", lambda d: with_member(
        d, "tables/events.json", events_table([{"id": 1}])), "is not a list of 8 values"),
    ("a string for a number", lambda d: with_member(
        d, "tables/events.json", events_table([event(1)[:3] + ["noon"] + event(1)[4:]])),
     "row 0: at='noon' has the wrong type"),
    ("an overflowing float", lambda d: with_member(
        d, "tables/events.json", events_table([event(1)]).replace(str(END - 10 + 1e-3), "1e999")),
     "wrong type"),
    ("an integer beyond 64 bits", lambda d: with_member(
        d, "tables/events.json", events_table([[2 ** 70] + event(1)[1:]])), "wrong type"),
    ("a text over the limit", lambda d: with_member(
        d, "tables/events.json", events_table([event(1, "x" * 100_001)])), "wrong type"),
    ("a value over the size limit", lambda d: with_member(
        d, "tables/events.json", '{"columns": %s, "rows": ["%s' % (json.dumps(EVENT_COLUMNS),
                                                               "x" * 9_000_000),
        zipfile.ZIP_STORED),
     "a value longer than"),
    ("a cut-off table", lambda d: with_member(
        d, "tables/events.json", events_table([event(1), event(2)])[:-20]), "bad JSON"),
    ("data after the table", lambda d: with_member(
        d, "tables/events.json", events_table([]) + "[]"), "more data after"),
    ("a repeated key", lambda d: with_member(
        d, "tables/events.json", '{"columns": %s, "columns": [], "rows": []}' % json.dumps(EVENT_COLUMNS)),
     "appears twice"),
    ("NaN in a row", lambda d: with_member(
        d, "tables/events.json", events_table([event(1)]).replace(str(END - 10 + 1e-3), "NaN")),
     "not a valid number"),
    ("duplicate primary keys", lambda d: with_member(
        d, "tables/events.json", events_table([event(1), event(1)])), "do not fit the schema"),
    ("manifest tables not an object", lambda d: with_manifest(d, lambda m: m.update(tables=[1])),
     "tables in manifest.json must be an object"),
    ("manifest flags of numbers", lambda d: with_manifest(d, lambda m: m.update(flags=[1, 2])),
     "list of objects"),
    ("manifest environment a string", lambda d: with_manifest(
        d, lambda m: m.update(environment="x")), "environment in manifest.json"),
    ("manifest slo a string", lambda d: with_manifest(d, lambda m: m.update(slo_ms="fast")),
     "slo_ms in manifest.json"),
    ("manifest row count a string", lambda d: with_manifest(
        d, lambda m: m["tables"]["batches"].update(rows="many")), "non-negative row count"),
    ("huge row count in the manifest", lambda d: with_manifest(
        d, lambda m: m["tables"]["requests"].update(rows=10 ** 12)), "rows, more than the limit"),
    ("oversized manifest", lambda d: with_member(d, "manifest.json", " " * (17 * 1024 ** 2),
                                                        zipfile.ZIP_STORED),
     "manifest.json is .* bytes, more than the limit"),
]


@pytest.mark.parametrize("label, make, message", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_files_are_refused_with_the_reason(good, tmp_path, label, make, message):
    bad = make(good)
    with pytest.raises(SnapshotError, match=message):
        snapshot.load_snapshot(bad, workdir=tmp_path)
    assert list(tmp_path.iterdir()) == []   # the temporary database went with the failure


def test_a_damaged_file_on_disk_is_refused_too(good, tmp_path):
    path = tmp_path / "bad.zip"
    path.write_bytes(bad_crc(good))
    work = tmp_path / "work"
    work.mkdir()
    with pytest.raises(SnapshotError, match="CRC"):
        snapshot.load_snapshot(path, workdir=work)
    assert list(work.iterdir()) == []


def test_more_rows_than_the_limit_across_insert_batches(good, tmp_path):
    n = INSERT_BATCH + 500
    bad = with_member(good, "tables/events.json", events_table([event(i) for i in range(n)]))
    with pytest.raises(SnapshotError, match="rows, more than the limit"):
        snapshot.load_snapshot(bad, limits=Limits(max_rows_per_table=n - 1), workdir=tmp_path)
    assert list(tmp_path.iterdir()) == []
    snap = snapshot.load_snapshot(bad, limits=Limits(max_rows_per_table=n), workdir=tmp_path)
    try:
        with snap.engine.connect() as conn:
            assert conn.exec_driver_sql("SELECT COUNT(*) FROM events").scalar() == n
    finally:
        snap.close()


def test_a_bad_row_in_a_later_batch_is_named(good, tmp_path):
    rows = [event(i) for i in range(INSERT_BATCH + 10)]
    rows[INSERT_BATCH + 3][5] = 7   # severity must be text
    bad = with_member(good, "tables/events.json", events_table(rows))
    with pytest.raises(SnapshotError, match=f"row {INSERT_BATCH + 3}: severity=7 has the wrong type"):
        snapshot.load_snapshot(bad, workdir=tmp_path)


def test_streaming_reads_rows_cut_by_chunk_edges(good, tmp_path, monkeypatch):
    """Tiny read chunks: every row, number and escape is cut somewhere; the result is
    the same as with whole members."""
    monkeypatch.setattr(snapshot.tables, "READ_CHUNK", 7)  # where the reader reads it
    rows = [event(i, "caf\u00e9 \\\"quoted\\\" \u2603") for i in range(300)]
    data = with_member(good, "tables/events.json",
                       json.dumps({"columns": EVENT_COLUMNS, "rows": rows}, indent=2))
    snap = snapshot.load_snapshot(data, workdir=tmp_path)
    try:
        with snap.engine.connect() as conn:
            got = [list(r) for r in conn.exec_driver_sql(
                f"SELECT {', '.join(EVENT_COLUMNS)} FROM events ORDER BY id")]
        assert got == rows
        assert snap.manifest["tables"] == manifest_of(good)["tables"]
    finally:
        snap.close()


def test_every_column_type_is_checked_alike_in_bulk_and_per_value():
    """The batch check and the per-value check agree on every kind of value."""
    limits = Limits()
    samples = [None, True, False, 0, 1, 2, -3, 2 ** 63, -(2 ** 63), 1.5, float("inf"), "x",
               "y" * 100_001, [], {}]
    for table in Base.metadata.tables.values():
        for column in table.columns:
            one = snapshot._value_checker(column, limits)
            bulk = snapshot._column_checker(column, limits)
            for v in samples:
                assert bulk((v,)) == one(v), (table.name, column.name, v)
                assert bulk((v, None, v)) == (one(v) and one(None)), (table.name, column.name, v)
