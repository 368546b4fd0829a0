"""Snapshot export/import round trip and rejection of malformed or hostile files."""

from __future__ import annotations

import gc
import io
import json
import zipfile

import pandas as pd
import pytest

from batchscope.analysis import queries
from batchscope.presentation import snapshot
from batchscope.testing import synthetic
from batchscope.storage.db import make_engine, schema_revision, schema_version
from batchscope.storage.schema import SCHEMA_VERSION
from batchscope.presentation.snapshot import Limits, SnapshotError

END = 2_000_000_000.0


@pytest.fixture(scope="module")
def source(backend, new_database_url):
    engine = make_engine(new_database_url(backend))
    synthetic.generate(engine, synthetic.SCENARIOS["oom"].with_(
        duration_s=120, batches_per_s=4, settings_changes=((0.5, {"max_batch_size": 16}),)),
        end_s=END)
    synthetic.generate(engine, synthetic.SCENARIOS["generation"].with_(
        duration_s=120, batches_per_s=2, gen_steps_per_s=5), end_s=END, seed=3)
    w = queries.Window(END - 120, END + 1, "mlp")
    data = snapshot.export_bytes(engine, w, slo_ms=25)
    yield engine, w, data
    engine.dispose()


def rebuild(data: bytes, edit) -> bytes:
    """Copy a snapshot, letting ``edit(name, payload)`` change or drop members."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            payload = edit(info.filename, src.read(info))
            if payload is not None:
                dst.writestr(info.filename, payload)
    return out.getvalue()


def edit_json(data: bytes, member: str, change) -> bytes:
    def edit(name, payload):
        if name != member:
            return payload
        doc = json.loads(payload)
        change(doc)
        return json.dumps(doc)
    return rebuild(data, edit)


@pytest.mark.both_backends
def test_round_trip_gives_the_same_query_results(source, backend):
    engine, w, data = source
    snap = snapshot.load_snapshot(data)
    try:
        assert snap.window == w
        assert schema_version(snap.engine) == SCHEMA_VERSION and schema_revision(snap.engine) is not None
        a, b = queries.live_bundle(engine, w), queries.live_bundle(snap.engine, snap.window)
        for key in ("headline", "requests_t", "batches_t", "batch_sizes", "priority"):
            if backend == "sqlite":
                assert a[key].equals(b[key]), key
            else:  # the same numbers; a column's type may differ between the two databases
                pd.testing.assert_frame_equal(a[key], b[key], check_dtype=False, obj=key)
        assert snap.manifest["tables"]["batches"]["rows"] == int(a["headline"].iloc[0]["batches"])
        assert [f["rule"] for f in snap.manifest["flags"]] == ["oom"]
        env = snap.manifest["environment"]
        assert env["python"] and "torch" in env["versions"] and env["platform"]
        # the model filter kept the other model out
        assert snap.manifest["tables"]["generation_steps"]["rows"] == 0
    finally:
        snap.close()
    assert not snap.path.exists()


@pytest.mark.both_backends
def test_report_is_self_contained(source):
    _, _, data = source
    html = snapshot.report_html(data)
    assert html.count("<script") >= 3 and "<script src=" not in html
    assert "Out of memory" in html and 'id="chart-latency"' in html


@pytest.mark.both_backends
def test_cli_export_writes_a_loadable_file(source, tmp_path, capsys):
    engine, _, _ = source
    out = tmp_path / "cli.zip"
    rc = snapshot.cli_export(["--db", str(engine.url), "--model", "decoder", "--minutes", "3",
                              "--end", str(END + 1), "--out", str(out)])
    assert rc == 0 and "wrote" in capsys.readouterr().out
    snap = snapshot.load_snapshot(out)
    try:
        assert snap.manifest["tables"]["generation_steps"]["rows"] > 0
        assert "generation" in queries.live_bundle(snap.engine, snap.window)
    finally:
        snap.close()


@pytest.mark.parametrize("label, make, message", [
    ("not a zip", lambda d: b"just some bytes", "not a zip"),
    ("path traversal", lambda d: rebuild(d, lambda n, p: p) + b"", None),
    ("newer format", lambda d: edit_json(d, "manifest.json",
                                         lambda m: m.update(format_version=99)), "newer"),
    ("wrong format", lambda d: edit_json(d, "manifest.json",
                                         lambda m: m.update(format="other")), "does not describe"),
    ("no manifest", lambda d: rebuild(d, lambda n, p: None if n == "manifest.json" else p),
     "no manifest"),
    ("unknown column", lambda d: edit_json(d, "tables/batches.json",
                                           lambda t: t["columns"].__setitem__(1, "evil")),
     "unknown or repeated columns"),
    ("wrong type", lambda d: edit_json(d, "tables/batches.json",
                                       lambda t: t["rows"][0].__setitem__(
                                           t["columns"].index("batch_size"), "DROP TABLE")),
     "wrong type"),
    ("short row", lambda d: edit_json(d, "tables/requests.json", lambda t: t["rows"][0].pop()),
     "is not a list of"),
    ("bool as int", lambda d: edit_json(d, "tables/batches.json",
                                        lambda t: t["rows"][0].__setitem__(
                                            t["columns"].index("seq"), True)), "wrong type"),
    ("bad window", lambda d: edit_json(d, "manifest.json",
                                       lambda m: m["window"].update(start_s="yesterday")),
     "no valid window"),
])
def test_malformed_files_are_rejected(source, label, make, message):
    _, _, data = source
    bad = make(data)
    if label == "path traversal":
        buf = io.BytesIO(bad)
        with zipfile.ZipFile(buf, "a") as zf:
            zf.writestr("../../etc/evil.json", "{}")
        bad, message = buf.getvalue(), "unexpected entry"
    with pytest.raises(SnapshotError, match=message):
        snapshot.load_snapshot(bad)


def test_nan_values_are_rejected(source):
    _, _, data = source
    bad = rebuild(data, lambda n, p: p.replace(b'"rows":[[', b'"rows":[[NaN,', 1)
                  if n == "tables/events.json" else p)
    with pytest.raises(SnapshotError):
        snapshot.load_snapshot(bad)


def test_zip_bomb_is_refused_before_expanding():
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("manifest.json", "{}")
        zf.writestr("tables/batches.json", b"0" * (50 * 1024 ** 2))
    with pytest.raises(SnapshotError, match="zip bomb"):
        snapshot.load_snapshot(buf.getvalue())


def test_size_limits(source):
    _, _, data = source
    with pytest.raises(SnapshotError, match="larger than the limit"):
        snapshot.load_snapshot(data, limits=Limits(max_file_bytes=1000))
    with pytest.raises(SnapshotError, match="would expand"):
        snapshot.load_snapshot(data, limits=Limits(max_member_bytes=1000))
    with pytest.raises(SnapshotError, match="rows, more than the limit"):
        snapshot.load_snapshot(data, limits=Limits(max_rows_per_table=10))


def test_duplicate_entries_are_rejected(source):
    _, _, data = source
    buf = io.BytesIO(data)
    with pytest.warns(UserWarning), zipfile.ZipFile(buf, "a") as zf:
        zf.writestr("manifest.json", "{}")
    with pytest.raises(SnapshotError, match="appears twice"):
        snapshot.load_snapshot(buf.getvalue())


def test_an_opened_snapshot_leaves_no_temporary_files_behind(source, tmp_path):
    _, _, data = source
    snap = snapshot.load_snapshot(data, workdir=tmp_path)
    path = snap.path
    assert path.exists() and path.parent == tmp_path
    snap.close()
    snap.close()  # twice is harmless
    assert not path.exists()
    dropped = snapshot.load_snapshot(data, workdir=tmp_path)
    path = dropped.path
    with dropped.engine.connect() as conn:  # used, so the WAL files exist too
        conn.exec_driver_sql("SELECT COUNT(*) FROM batches").scalar()
    del dropped   # never closed: a dashboard session that just ended
    gc.collect()
    assert list(tmp_path.iterdir()) == []
