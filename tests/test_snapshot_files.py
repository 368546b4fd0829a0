"""Snapshot export/import round trip and rejection of malformed or hostile files."""

from __future__ import annotations

import gc
import io
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pandas as pd
import pytest

from sqlalchemy import text

from batchscope.analysis import queries
from batchscope.presentation import snapshot
from batchscope.testing import synthetic
from batchscope.storage.db import make_engine, schema_revision, schema_version
from batchscope.storage.schema import SCHEMA_VERSION
from batchscope.presentation.snapshot import Limits, SnapshotError
from batchscope.tuning import store
from batchscope.tuning.figures import Objective, Window
from batchscope.tuning.trials import COUNTED, REFUSED, Trial, TuningResult

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


def test_copies_left_by_a_killed_process_go_with_the_next_opening(source, tmp_path):
    """A dashboard killed with SIGKILL cannot remove its snapshots' databases: the next
    process to open a snapshot there removes them; a living process's copies stay."""
    _, _, data = source
    (tmp_path / "s.zip").write_bytes(data)
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\n"
         "from batchscope.presentation import snapshot\n"
         "s = snapshot.load_snapshot(sys.argv[1], workdir=sys.argv[2])\n"
         "with s.engine.connect() as c: c.exec_driver_sql('SELECT COUNT(*) FROM batches')\n"
         "print(s.path, flush=True)\n"
         "time.sleep(600)\n", str(tmp_path / "s.zip"), str(tmp_path)],
        stdout=subprocess.PIPE, text=True)
    try:
        left = Path(child.stdout.readline().strip())
        assert left.exists() and left.name.startswith(f"batchscope-snapshot-{child.pid}-")
        living = snapshot.load_snapshot(data, workdir=tmp_path)  # the child is alive: kept
        assert left.exists()
    finally:
        child.kill()
        child.wait(30)
    assert left.exists()  # killed: nothing ran to remove it
    opened = snapshot.load_snapshot(data, workdir=tmp_path)
    assert not any(p.name.startswith(f"batchscope-snapshot-{child.pid}-")
                   for p in tmp_path.iterdir())
    assert living.path.exists() and opened.path.exists()  # this process's own stay
    (tmp_path / "batchscope-snapshot-notapid-x.db").write_bytes(b"")  # not ours by name
    assert snapshot.load.sweep(tmp_path) == []
    living.close()
    opened.close()


# -- tuning sessions, fleet flags and resource recommendations ---------------------------------
START = {"policy": "dynamic", "max_batch_size": 8, "max_queue_delay_ms": None}


def stored_session(engine, *, model: str, started_at: float, trials: int) -> int:
    """A finished session of ``trials`` trials (the last one refused), the best the one
    with the largest max batch size that was measured."""
    writer = store.SessionWriter.begin(engine, store.SessionStart(
        model=model, url="http://h:8000", instance_id="synthetic-1", objective="goodput",
        slo_p99_ms=50.0, budget_s=60.0, load_kind="synthetic", start_settings=START,
        requested_by="cli", started_at=started_at,
        hardware=store.hardware_of(engine, "synthetic-1")))
    done = []
    for i in range(trials):
        point = {**START, "max_batch_size": 8 * 2 ** i}
        refused = i == trials - 1 and i > 0
        figures = None if refused else Window(duration_s=3.0, ok=300 * (i + 1), good=300 * (i + 1),
                                              failed=0, p50_ms=5.0 + i, p99_ms=10.0 + i)
        trial = Trial(number=i, point=point, changes={"max_batch_size": point["max_batch_size"]},
                      started_s=started_at + 4 * i, status=REFUSED if refused else COUNTED,
                      windows=[] if refused else [figures], figures=figures,
                      problem="refused by the server: too big" if refused else None,
                      ended_s=started_at + 4 * i + 3)
        writer.trial(trial, START)
        done.append(trial)
    best = [t for t in done if t.feasible][-1]
    writer.end(TuningResult(model=model, objective=Objective(50.0), start=START, trials=done,
                            best=best, baseline=done[0], elapsed_s=4.0 * trials,
                            stop_reason="the budget of 60 s was used",
                            outcome="restored the starting settings"),
               state=store.SESSION_FINISHED, now=started_at + 4 * trials)
    return writer.session_id


@pytest.mark.both_backends
def test_tuning_sessions_fleet_flags_and_recommendations_round_trip(db):
    synthetic.generate(db, synthetic.SCENARIOS["oom"].with_(duration_s=120, batches_per_s=4),
                       end_s=END)
    with db.begin() as conn:
        conn.execute(text("UPDATE runtime_instances SET cpu_count = 8"))
    inside = [stored_session(db, model="mlp", started_at=END - 100, trials=3),
              stored_session(db, model="mlp", started_at=END - 50, trials=2)]
    stored_session(db, model="mlp", started_at=END - 500, trials=2)      # before the window
    stored_session(db, model="encoder", started_at=END - 60, trials=2)   # another model
    w = queries.Window(END - 120, END + 1, "mlp")
    data = snapshot.export_bytes(db, w, slo_ms=25, now=END + 600)
    snap = snapshot.load_snapshot(data)
    try:
        manifest = snap.manifest
        assert manifest["tables"]["tuning_sessions"]["rows"] == 2
        assert manifest["tables"]["tuning_trials"]["rows"] == 5
        back = store.sessions(snap.engine)
        assert [s.id for s in back] == inside[::-1] == [s.id for s in store.sessions(db, model="mlp",
                                                                                        since=w.start_s)]
        assert back == store.sessions(db, model="mlp", since=w.start_s)
        assert store.trials_of(snap.engine, inside) == store.trials_of(db, inside)
        assert back[1].best_settings["max_batch_size"] == 16 and back[1].hardware.startswith("GPU cuda:0, 16 GiB on ")
        # the fleet's flags: the instance stopped reporting 10 minutes before the export
        assert [f["rule"] for f in manifest["fleet_flags"]] == ["stopped_reporting"]
        assert manifest["fleet_flags"][0]["evidence"]["instance"] == "synthetic-1"
        # recommendations for the model and its instance, CPU counted on 8 CPUs
        recs = {(r["scope"], r["key"]): r for r in manifest["recommendations"]}
        assert set(recs) == {("model", "mlp"), ("instance", "synthetic-1")}
        assert recs[("model", "mlp")]["host_cpus"] == 8
        assert recs[("model", "mlp")]["gpu_memory"]["target"] > 0
        html = snapshot.report_html(data)
        assert "Golden parameters" in html and "Published rules of thumb" in html
        for sid in inside:
            assert f'id="tuning-{sid}"' in html
        assert "Fleet diagnosis" in html and "stopped reporting" in html
        assert "Resource recommendations" in html and "model mlp" in html
    finally:
        snap.close()


def test_a_snapshot_from_before_tuning_sessions_still_opens(source):
    """Written at schema version 4: no tuning tables, no new request columns, no fleet
    flags or recommendations in the manifest."""
    _, _, data = source

    def old(name, payload):
        if name.startswith("tables/tuning_"):
            return None
        doc = json.loads(payload) if name.endswith(".json") else None
        if name == "manifest.json":
            doc.update(schema_version=4)
            for key in ("fleet_flags", "recommendations"):
                doc.pop(key)
            for key in ("tuning_sessions", "tuning_trials"):
                doc["tables"].pop(key)
        elif name == "tables/requests.json":
            keep = [i for i, c in enumerate(doc["columns"]) if c not in ("input_shape_json", "timeout_ms")]
            doc = {"columns": [doc["columns"][i] for i in keep],
                   "rows": [[r[i] for i in keep] for r in doc["rows"]]}
        return payload if doc is None else json.dumps(doc)

    snap = snapshot.load_snapshot(rebuild(data, old))
    try:
        assert store.sessions(snap.engine) == []
        assert snap.manifest["tables"]["requests"]["rows"] > 0
    finally:
        snap.close()


@pytest.mark.parametrize("key", ["fleet_flags", "recommendations"])
def test_manifest_lists_must_hold_objects(source, key):
    _, _, data = source
    with pytest.raises(SnapshotError, match=f"{key} in manifest.json must be a list of objects"):
        snapshot.load_snapshot(edit_json(data, "manifest.json", lambda m: m.update({key: ["x"]})))
