"""Trace export (``batchscope.trace``): the Perfetto and Chrome JSON files hold exactly the
window's rows, at their recorded times, nested the way the viewers need; the
``batchscope trace`` command; the trace inside a snapshot."""

from __future__ import annotations

import json
import os
import re
import sqlite3
import subprocess
import sys
from collections import Counter, defaultdict
from decimal import Decimal

import pytest
from sqlalchemy.orm import Session

from batchscope.analysis.queries.timeline import WindowTooLarge, timeline_rows
from batchscope.trace.exits import EXIT_TOO_MANY_ROWS
from batchscope.analysis.queries.window import Window
from batchscope.presentation import snapshot
from batchscope.storage.db import make_engine
from batchscope.storage.schema import BatchRecord, RequestRecord
from batchscope.testing import synthetic
from batchscope.trace import ExportSummary, UnknownName, check_names, export_trace, format_for
from batchscope.trace.check import read_chrome, read_perfetto
from batchscope.trace.perfetto import protos
from batchscope.trace import timespec
from batchscope.trace.timespec import (DEFAULT_LAST_S, check_window, parse_seconds, parse_time,
                                       utc_text, window_from)
from tests.factories import recorded_sqlite

END = 2_000_000_000.0
WINDOW = Window(END - 21, END + 1)
CLI = [sys.executable, "-m", "runtime.tools.cli"]


def _ns(t: float) -> int:
    return round(t * 1e9)


@pytest.fixture(scope="module")
def filled(backend, new_database_url):
    """Two instances: ``mlp`` (overlapping batches, refused and expired requests, an
    OOM, a settings change) and the generation model ``decoder`` with its steps."""
    engine = make_engine(new_database_url(backend))
    synthetic.generate(engine, synthetic.SCENARIOS["healthy"].with_(
        duration_s=20, batches_per_s=8, rejected_per_s=1, expired_per_s=0.5, oom_events=1,
        settings_changes=((0.5, {"max_batch_size": 16}),)), end_s=END)
    synthetic.generate(engine, synthetic.SCENARIOS["generation"].with_(
        duration_s=20, batches_per_s=2, gen_steps_per_s=10, instance_id="synthetic-2"),
        end_s=END, seed=5)
    yield engine, timeline_rows(engine, WINDOW)
    engine.dispose()


def _export(engine, fmt: str, tmp_path, window: Window = WINDOW, **kw) -> tuple[bytes, ExportSummary]:
    path = tmp_path / ("t.pftrace" if fmt == "perfetto" else "t.json")
    summary = export_trace(engine, window, path, fmt, **kw)
    data = path.read_bytes()
    assert summary.bytes_written == len(data)
    return data, summary


def _batched(rows) -> list[int]:
    """Indexes of the requests whose batch is among the window's batches."""
    seqs = {(i, m, int(s)) for i, m, s in zip(rows.batches["instance_id"], rows.batches["model"],
                                              rows.batches["seq"])}
    r = rows.requests
    return [k for k in range(len(r)) if r["outcome"].iloc[k] not in ("rejected", "expired")
            and r["batch_seq"].iloc[k] == r["batch_seq"].iloc[k]
            and (r["instance_id"].iloc[k], r["model"].iloc[k], int(r["batch_seq"].iloc[k])) in seqs]


def _assert_nested(slices) -> None:
    """No two slices of one track overlap unless one holds the other."""
    by_track = defaultdict(list)
    for s in slices:
        by_track[s.track].append(s)
    for track, items in by_track.items():
        items.sort(key=lambda s: (s.start_ns, -s.end_ns))
        open_: list = []
        for s in items:
            while open_ and open_[-1].end_ns <= s.start_ns:
                open_.pop()
            assert not open_ or s.end_ns <= open_[-1].end_ns, (track, s, open_[-1])
            open_.append(s)


@pytest.mark.both_backends
def test_perfetto_trace_holds_every_row_at_its_recorded_time(filled, tmp_path):
    engine, rows = filled
    data, summary = _export(engine, "perfetto", tmp_path)
    pb = protos()
    trace = pb.Trace()
    trace.ParseFromString(data)
    packets = list(trace.packet)
    assert all(p.trusted_packet_sequence_id == 1 for p in packets)
    first = next(p for p in packets if p.sequence_flags)
    assert first.sequence_flags & pb.TracePacket.SEQ_INCREMENTAL_STATE_CLEARED
    processes = [p.track_descriptor for p in packets
                 if p.HasField("track_descriptor") and p.track_descriptor.HasField("process")]
    assert len(processes) == 2 and len({d.process.pid for d in processes}) == 2
    assert all("cpu" in d.process.process_name for d in processes)

    got = read_perfetto(data)
    assert got.ok, got.problems
    _assert_nested([s for s in got.slices if s.end_ns > s.start_ns])
    cats = got.by_category()

    # one batch slice per batch row, from its start to its end
    batches = {s.args["batch_id"]: s for s in got.slices if s.category == "batch"}
    assert cats["batch"] == len(batches) == len(rows.batches) == summary.batch_slices
    for row in rows.batches.itertuples():
        s = batches[row.id]
        assert (s.start_ns, s.end_ns) == (_ns(row.started_at), _ns(row.ended_at))
        assert s.name == f"batch {row.seq} n={row.batch_size}/{row.max_batch_size}" + (
            "" if row.outcome == "ok" else f" {row.outcome}")
        assert s.args["seq"] == row.seq and s.args["policy"] == row.policy
        # a batch of no bucket says so, rather than leaving the argument out
        assert s.args["bucket"] == ("none" if row.bucket is None or row.bucket != row.bucket
                                    else row.bucket)
    # batches of one model overlap here, so they need more than one lane
    assert any("· batches · lane 2" in name for name in got.track_names.values())

    # one request slice per request row; a batched one holds its queue and compute
    requests = {s.args["request_id"]: s for s in got.slices if s.category == "request"}
    assert cats["request"] == len(requests) == len(rows.requests) == summary.request_slices
    batched = _batched(rows)
    assert cats["queue"] == cats["compute"] == len(batched)
    for row in rows.requests.itertuples():
        s = requests[row.id]
        assert (s.start_ns, s.end_ns) == (_ns(row.arrived_at), _ns(row.finished_at))
        assert s.depth == 0 and s.args["outcome"] == row.outcome
        if row.outcome in ("rejected", "expired"):
            assert s.name == row.outcome
    outcomes = Counter(rows.requests["outcome"])
    assert outcomes["rejected"] and outcomes["expired"]  # the scenario made some

    # one flow per batched request: its queue slice -> its batch's slice
    assert len(got.flows) == len(batched) == summary.flows
    seq_of = {(s.track, s.start_ns): s.args.get("batch_seq") for s in requests.values()}
    for src, dst in got.flows.values():
        assert src.category == "queue" and dst.category == "batch" and src.depth == 1
        assert seq_of[(src.track, src.start_ns)] == dst.args["seq"]
        assert src.start_ns <= dst.start_ns
    for s in batches.values():
        assert len(s.flows_in) == s.args["requests_in_trace"]
    queues = {(q.track, q.start_ns): q for q in got.slices if q.category == "queue"}
    computes = {(c.track, c.end_ns): c for c in got.slices if c.category == "compute"}
    for k in batched:
        row = rows.requests.iloc[k]
        track = requests[row.id].track
        queue = queues[(track, _ns(row.arrived_at))]
        start = min(max(_ns(row.started_at), _ns(row.arrived_at)), _ns(row.finished_at))
        assert queue.end_ns == start == computes[(track, _ns(row.finished_at))].start_ns

    # generation steps, and the events as instants on their instance's own track
    assert cats["step"] == len(rows.steps) == summary.step_slices > 0
    steps = sorted((s.start_ns, s.end_ns, s.args["running"]) for s in got.slices
                   if s.category == "step")
    assert steps == sorted(zip(map(_ns, rows.steps["started_at"]), map(_ns, rows.steps["at"]),
                               rows.steps["running"]))
    assert cats["event"] == len(rows.events) == summary.events
    kinds = Counter(s.name for s in got.slices if s.category == "event")
    assert kinds["oom"] == 1 and kinds["settings_change"] == 1


def test_json_trace_nests_and_pairs_every_event(filled, tmp_path):
    engine, rows = filled
    data, summary = _export(engine, "json", tmp_path)
    doc = json.loads(data)
    assert doc["displayTimeUnit"] == "ms"
    events = doc["traceEvents"]
    phases = Counter(e["ph"] for e in events)
    assert phases["b"] == phases["e"]  # none written; any would come in pairs
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
             if e["ph"] == "M" and e["name"] == "thread_name"}

    # complete events: on a batch or step thread none overlap; on a request thread only
    # a request's own queue and compute sit inside it
    by_tid = defaultdict(list)
    for e in events:
        if e["ph"] == "X":
            start = int(Decimal(str(e["ts"])) * 1000)
            by_tid[(e["pid"], e["tid"])].append((start, start + int(Decimal(str(e["dur"])) * 1000),
                                                 e["cat"]))
    for key, items in by_tid.items():
        items.sort()
        if "requests" not in names[key]:
            assert all(a[1] <= b[0] for a, b in zip(items, items[1:])), names[key]

    got = read_chrome(data)
    assert got.ok, got.problems
    cats = got.by_category()
    assert cats["batch"] == len(rows.batches) and cats["step"] == len(rows.steps) > 0
    assert cats["request"] == len(rows.requests)
    assert cats["queue"] == cats["compute"] == len(_batched(rows)) == len(got.flows)
    assert phases["s"] == phases["f"] == summary.flows
    for src, dst in got.flows.values():
        assert src.category == "queue" and dst.category == "batch"
    # times are exact decimals of the recorded nanoseconds
    raw = json.loads(data, parse_float=Decimal)["traceEvents"]
    starts = {e["args"]["batch_id"]: int(e["ts"] * 1000) for e in raw
              if e["ph"] == "X" and e["cat"] == "batch"}
    assert starts == {r.id: _ns(r.started_at) for r in rows.batches.itertuples()}


def test_empty_window_gives_a_valid_trace_with_one_note(filled, tmp_path):
    engine, _ = filled
    empty = Window(END - 5000, END - 4000)
    data, summary = _export(engine, "perfetto", tmp_path, empty)
    got = read_perfetto(data)
    assert got.ok, got.problems
    assert summary.empty and len(got.slices) == 1 and got.slices[0].category == "note"
    assert got.slices[0].name.startswith("no data")
    assert summary.notes == [got.slices[0].name]
    data, _ = _export(engine, "json", tmp_path, empty)
    doc = json.loads(data)
    assert [e["ph"] for e in doc["traceEvents"]] == ["i"]
    assert doc["otherData"]["notes"].startswith("no data")


def test_contradictory_rows_still_make_a_valid_trace(tmp_path):
    """A queue wait longer than the latency, a batch ending before it starts, a request
    pointing at a batch not recorded, an instance never registered: clamped, noted."""
    engine = make_engine(f"sqlite:///{tmp_path / 'bad.db'}")
    t = END - 10
    batch = dict(instance_id="ghost", model="m", policy="dynamic", settings_version=1,
                 max_batch_size=8, batch_size=2, real_elements=2, padded_elements=2,
                 queue_wait_min_s=0.0, queue_wait_mean_s=0.0, queue_wait_max_s=0.0,
                 compute_s=0.01)
    request = dict(instance_id="ghost", model="m", priority=1, latency_s=0.02, outcome="ok")
    with Session(engine) as s:
        s.add_all([
            BatchRecord(seq=1, started_at=t, ended_at=t - 0.5, **batch),
            BatchRecord(seq=2, started_at=t + 1, ended_at=t + 1.01, **batch),
            RequestRecord(batch_seq=1, arrived_at=t - 0.01, finished_at=t + 0.01,
                          queue_wait_s=5.0, **request),
            RequestRecord(batch_seq=2, arrived_at=t + 1.5, finished_at=t + 1.52,
                          queue_wait_s=0.01, **request),
            RequestRecord(batch_seq=99, arrived_at=t + 2, finished_at=t + 2.02,
                          queue_wait_s=0.01, **request),
            RequestRecord(batch_seq=None, arrived_at=t + 3, finished_at=t + 2,
                          queue_wait_s=0.0, **{**request, "outcome": "rejected"}),
        ])
        s.commit()
    w = Window(END - 20, END)
    for fmt, read in (("perfetto", read_perfetto), ("json", read_chrome)):
        data, summary = _export(engine, fmt, tmp_path, w)
        got = read(data)
        assert got.ok, got.problems
        assert summary.batch_slices == 2 and summary.request_slices == 4
        assert summary.flows == 1  # the first one; the second arrived after its batch began
        assert any("arriving after their batch started" in n for n in summary.notes)
        assert any("outside the window" in n for n in summary.notes)
    engine.dispose()


def test_window_too_large_is_refused_before_writing(filled, tmp_path):
    engine, rows = filled
    path = tmp_path / "big.pftrace"
    with pytest.raises(WindowTooLarge) as err:
        export_trace(engine, WINDOW, path, "perfetto", max_rows=10)
    assert err.value.rows == len(rows.batches) + len(rows.requests)
    assert not path.exists()


def test_an_export_replaces_a_file_whole_keeping_its_mode_and_writes_through_a_link(
        filled, tmp_path):
    engine, _ = filled
    target = tmp_path / "kept.pftrace"
    target.write_bytes(b"old")
    target.chmod(0o600)
    link = tmp_path / "link.pftrace"
    link.symlink_to(target)
    summary = export_trace(engine, WINDOW, link, "perfetto")
    assert link.is_symlink() and target.stat().st_size == summary.bytes_written
    assert (target.stat().st_mode & 0o777) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept.pftrace", "link.pftrace"]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(CLI + ["trace", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})


def test_cli_writes_traces_and_refuses_clearly(tmp_path):
    db = recorded_sqlite(tmp_path / "cli.db", END, batches_per_s=4)
    out = tmp_path / "run.pftrace"
    r = _cli("--db", db, "--end", str(END + 1), "--last", "12", "-o", str(out))
    assert r.returncode == 0, r.stderr
    assert "wrote" in r.stdout and "batches" in r.stdout
    assert read_perfetto(out.read_bytes()).ok

    r = _cli("--db", db, "--start", str(END - 11), "--end", str(END + 1), "--format", "json",
             "-o", str(tmp_path / "run.trace"))
    assert r.returncode == 0, r.stderr
    assert read_chrome((tmp_path / "run.trace").read_bytes()).ok

    too_big = tmp_path / "big.pftrace"
    r = _cli("--db", db, "--end", str(END + 1), "--last", "12", "--max-rows", "50",
             "-o", str(too_big))
    assert r.returncode == EXIT_TOO_MANY_ROWS and not too_big.exists()  # the server's 413
    line = r.stderr.strip()
    assert "\n" not in line and "Traceback" not in line
    assert "more than 50" in line and "batches and requests" in line and "--max-rows" in line

    r = _cli("--db", db, "-o", str(tmp_path / "now.json"))  # the last 10 s: nothing then
    assert r.returncode == 0 and "no batch, request or step" in r.stdout
    assert json.loads((tmp_path / "now.json").read_bytes())["traceEvents"]
    r = _cli("--db", db, "--start", "-30s", "--end", "-20s", "-o", str(tmp_path / "then.json"))
    assert r.returncode == 0 and "no batch, request or step" in r.stdout, r.stderr

    kept = tmp_path / "kept.pftrace"
    kept.write_bytes(b"an older file")
    for bad in (["--start", "yesterday"], ["--start", "-5s", "--last", "3"],
                ["--last", "1e12"], ["--start", "9300000000", "--end", "9300000010"],
                ["--max-rows", "0"]):
        for out in (tmp_path / "x.json", kept):
            r = _cli("--db", db, *bad, "-o", str(out))
            assert r.returncode == 2 and r.stderr.count("\n") == 1, (bad, r.stderr)
            assert "Traceback" not in r.stderr
    assert kept.read_bytes() == b"an older file" and not (tmp_path / "x.json").exists()
    # another program's database: refused, and left byte for byte as it was
    foreign = tmp_path / "foreign.db"
    conn = sqlite3.connect(foreign)
    conn.execute("CREATE TABLE foo (x)")
    conn.commit()
    conn.close()
    before = foreign.read_bytes()
    r = _cli("--db", f"sqlite:///{foreign}", "-o", str(tmp_path / "f.json"))
    assert r.returncode == 2 and "no BatchScope tables" in r.stderr, r.stderr
    assert foreign.read_bytes() == before and not (tmp_path / "foreign.db-wal").exists()
    r = _cli("--db", db, "-o", str(tmp_path / "x.bin"))
    assert r.returncode == 2 and "cannot tell the trace format" in r.stderr


@pytest.fixture(scope="module")
def small_db(tmp_path_factory) -> str:
    """The URL of a SQLite file of 10 s of one instance (``synthetic-1``) serving ``mlp``."""
    return recorded_sqlite(tmp_path_factory.mktemp("trace-cli") / "small.db", END,
                           batches_per_s=2)


ISO = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d{3})?Z"


@pytest.mark.parametrize("args, pattern", [
    # names the database never saw: the known ones listed
    (["--last", "10", "--model", "nosuch"], r"unknown model 'nosuch' \(known: mlp\)$"),
    (["--instance", "nosuch"], r"unknown instance 'nosuch' \(known: synthetic-1\)$"),
    (["--model", "mlpp", "--instance", "synthetic-9"],
     r"unknown model 'mlpp' \(known: mlp\); unknown instance 'synthetic-9' "
     r"\(known: synthetic-1\)$"),
    # a path for --db: the command's prefix like every other mistake
    (["--db", "{tmp}/x.db"], r"^batchscope trace: --db '.*/x\.db' is a path, not a database "
                             r"URL; write sqlite:///.*/x\.db"),
    # an end before the start: both as UTC dates
    (["--start", "2000000010", "--end", "2000000000"],
     r"starts \(2033-05-18T03:33:30Z\) at or after its end \(2033-05-18T03:33:20Z\)"),
    (["--start", "-1s", "--end", "-2s"], rf"starts \({ISO}\) at or after its end \({ISO}\)"),
    # before 1970: the hint names the options given
    (["--start", "1960-01-01T00:00:00Z", "--end", "1960-01-02T00:00:00Z"],
     r"before 1970 \(1960-01-01T00:00:00Z\); give --start and --end after 1970$"),
    (["--start", "1960-01-01T00:00:00Z"], r"before 1970 \(1960-01-01T00:00:00Z\); give a later "
                                          r"--start$"),
    (["--end", "1000", "--last", "2000"], r"\(1969-12-31T23:43:20Z\); give a shorter --last or "
                                          r"a later --end$"),
    (["--end", "5"], r"before 1970 \(1969-12-31T23:59:55Z\); give a later --end"),
    # --last as typed
    (["--last", "1e400"], r"argument --last: '1e400' is not a finite number of seconds"),
    (["--last", "nan"], r"argument --last: 'nan' is not a finite number of seconds"),
    (["--last", "soon"], r"argument --last: 'soon' is not a number of seconds"),
    (["--last", "-3"], r"argument --last: '-3' must be a positive number of seconds"),
    # where the trace goes
    (["-o", "{tmp}"], r"-o '.*' is a directory; give a file name, e.g. .*/run\.pftrace$"),
    (["-o", "{tmp}/no/such/run.json"], r"there is no directory '.*/no/such' to write it in$"),
    (["--format", "json", "-o", "{tmp}/x.pftrace"],
     r"the format json contradicts the name '.*/x\.pftrace' \(a perfetto file name\): end the "
     r"name in \.json, or leave the format to the name$"),
    (["--format", "perfetto", "-o", "{tmp}/x.JSON"], r"end the name in \.pftrace or "),
])
def test_cli_refuses_each_mistake_in_one_line(small_db, tmp_path, args, pattern):
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    if "--db" not in args:
        args = ["--db", small_db, *args]
    if "-o" not in args:
        args += ["-o", str(tmp_path / "x.pftrace")]
    r = _cli(*args)
    assert r.returncode == 2 and r.stdout == "", (args, r.stdout, r.stderr)
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("batchscope trace: "), r.stderr
    assert re.search(pattern, lines[0]), lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing written


def test_cli_takes_known_names_a_format_for_another_name_and_describes_itself(small_db,
                                                                             tmp_path):
    out = tmp_path / "run.trace"  # a name of no format: --format says which
    r = _cli("--db", small_db, "--end", str(END + 1), "--last", "12", "--model", "mlp",
             "--instance", "synthetic-1", "--format", "json", "-o", str(out))
    assert r.returncode == 0, r.stderr
    assert read_chrome(out.read_bytes()).ok and " 0 batches" not in r.stdout
    out = tmp_path / "run.pftrace"  # a format that agrees with the name
    r = _cli("--db", small_db, "--end", str(END + 1), "--format", "perfetto", "-o", str(out))
    assert r.returncode == 0 and read_perfetto(out.read_bytes()).ok, r.stderr
    r = _cli("--help")
    assert r.returncode == 0
    description = r.stdout.split("\n\n")[1]
    assert "Write the batches, requests" in description and "trace file" in description


@pytest.mark.both_backends
def test_names_are_checked_against_the_database(filled, db):
    engine, _ = filled
    for model, instance in ((None, None), ("mlp", None), ("decoder", "synthetic-2"),
                            (None, "synthetic-1")):
        check_names(engine, Window(WINDOW.start_s, WINDOW.end_s, model, instance))
    with pytest.raises(UnknownName) as info:
        check_names(engine, Window(WINDOW.start_s, WINDOW.end_s, "MLP", "synthetic-3"))
    assert str(info.value) == ("unknown model 'MLP' (known: decoder, mlp); unknown instance "
                               "'synthetic-3' (known: synthetic-1, synthetic-2)")
    # a model and instance with rows but no registration (pruned, or an older recorder)
    with Session(db) as s:
        s.add(BatchRecord(instance_id="ghost", model="m", seq=1, policy="dynamic",
                          settings_version=1, max_batch_size=8, batch_size=1,
                          real_elements=1, padded_elements=1, queue_wait_min_s=0.0,
                          queue_wait_mean_s=0.0, queue_wait_max_s=0.0, compute_s=0.01,
                          started_at=END - 1, ended_at=END))
        s.commit()
    check_names(db, Window(END - 10, END, "m", "ghost"))
    with pytest.raises(UnknownName, match=r"^unknown model 'x' \(the database has no model "
                                          r"registered\)$"):
        check_names(db, Window(END - 10, END, "x"))


def test_snapshot_carries_the_trace_of_its_window(filled, tmp_path, monkeypatch):
    engine, rows = filled
    data = snapshot.export_bytes(engine, WINDOW)
    snap = snapshot.load_snapshot(data)
    try:
        entry = snap.manifest["trace"]
        assert entry["member"] == snapshot.TRACE and entry["format"] == "perfetto"
        assert entry["batch_slices"] == len(rows.batches)
    finally:
        snap.close()
    trace = snapshot.trace_bytes(data)
    assert len(trace) == entry["bytes"]
    got = read_perfetto(trace)
    assert got.ok and got.by_category()["request"] == len(rows.requests)
    # a trace over the reader's limit is refused like any oversized member
    with pytest.raises(snapshot.SnapshotError, match="trace.pftrace would expand"):
        snapshot.trace_bytes(data, limits=snapshot.Limits(max_trace_bytes=1000))

    # a window too large for a snapshot's trace: left out, the manifest says why
    monkeypatch.setattr(snapshot.export, "TRACE_MAX_ROWS", 10)
    data = snapshot.export_bytes(engine, WINDOW)
    snap = snapshot.load_snapshot(data)
    try:
        assert snap.manifest["trace"]["member"] is None
        assert "batchscope trace" in snap.manifest["trace"]["skipped"]
    finally:
        snap.close()
    assert snapshot.trace_bytes(data) is None


def test_time_options():
    now = 1_800_000_000.0
    assert parse_time("now", now=now) == now
    assert parse_time("-10s", now=now) == now - 10
    assert parse_time("-1.5m", now=now) == now - 90
    assert parse_time("-250ms", now=now) == now - 0.25
    assert parse_time("1700000000.5", now=now) == 1_700_000_000.5
    assert parse_time("2027-01-15T08:00:00Z", now=now) == parse_time(
        "2027-01-15T10:00:00+02:00", now=0) == 1_800_000_000.0
    assert parse_time("1970-01-01T00:01:00Z", now=now) == 60.0
    for bad in ("yesterday", "-10", "nan", "-5x"):
        with pytest.raises(ValueError, match="not a time"):
            parse_time(bad, now=now)
    # a start in the last second before the default end says why it is refused
    with pytest.raises(ValueError, match="not before the default end, 1 s ago.*--end now"):
        window_from("-500ms", None, None, now=now)
    # by default it ends 1 s back, when the runtime's rows are surely written
    lag = timespec.WRITTEN_LAG_S
    assert window_from(None, None, None, now=now) == Window(now - lag - DEFAULT_LAST_S,
                                                            now - lag)
    assert window_from(None, "-5s", 20, now=now, model="m") == Window(now - 25, now - 5, "m")
    with pytest.raises(ValueError, match="not both"):
        window_from("-5s", None, 3, now=now)
    with pytest.raises(ValueError, match="start must come first"):
        window_from("-1s", "-2s", None, now=now)
    assert utc_text(1_800_000_000.0) == "2027-01-15T08:00:00Z"
    assert utc_text(1_800_000_000.25) == "2027-01-15T08:00:00.250Z"
    assert utc_text(-1.0) == "1969-12-31T23:59:59Z"
    assert utc_text(-1e12) == "-1,000,000,000,000.000 epoch seconds"  # no date shows it
    with pytest.raises(ValueError, match=r"starts \(2027-01-15T08:00:00Z\) at or after its end "
                                         r"\(2027-01-15T07:59:59Z\)"):
        window_from(str(now), str(now - 1), None, now=now)
    # the hint names what was given; the server's own words by default
    for start, end, last, fix in (("1960-01-01T00:00:00Z", "1960-01-02T00:00:00Z", None,
                                   "--start and --end after 1970"),
                                  ("1960-01-01T00:00:00Z", None, None, "a later --start"),
                                  (None, None, 2e9, "a shorter --last"),
                                  (None, "100", 200, "a shorter --last or a later --end"),
                                  (None, "5", None, "a later --end")):
        with pytest.raises(ValueError, match=f"give {fix}"):
            window_from(start, end, last, now=now)
    with pytest.raises(ValueError, match="give a later start or a shorter window$"):
        check_window(-5, 5)
    assert parse_seconds("12") == 12.0 and parse_seconds(" 1.5e1 ") == 15.0
    for text, words in (("1e400", "'1e400' is not a finite number"), ("inf", "not a finite"),
                        ("0", "must be a positive"), ("ten", "'ten' is not a number")):
        with pytest.raises(ValueError, match=words):
            parse_seconds(text)
    assert format_for("a.pftrace") == format_for("b.perfetto-trace") == "perfetto"
    assert format_for("RUN.JSON") == "json"
    assert format_for("run.json", "json") == "json" and format_for("run.trace", "json") == "json"
    with pytest.raises(ValueError, match="cannot tell"):
        format_for("run.bin")
    with pytest.raises(ValueError, match="the format perfetto contradicts the name 'run.json'"):
        format_for("run.json", "perfetto")


def test_importing_the_exporter_leaves_the_protos_unloaded():
    code = ("import sys, batchscope, batchscope.trace, batchscope.trace.perfetto; "
            "print('perfetto_trace_pb2' in ' '.join(sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stderr


# -- from the running server ------------------------------------------------------------------
DOUBLE_BODY = {"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32",
                            "data": [1, 2, 3, 4]}]}


def _doubling(url: str, instance_id: str):
    """A real server of the toy model ``a`` recording into ``url`` (a context manager)."""
    from runtime.api.config import ServerConfig
    from runtime.models.toys import DoubleModel
    from runtime.server.service import Service, ServiceThread

    return ServiceThread(Service({"a": DoubleModel()}, None, ServerConfig(database_url=url),
                                 instance_id=instance_id))


@pytest.mark.slow
def test_the_running_server_exports_its_recent_window(tmp_path, monkeypatch):
    import httpx

    from runtime.server import trace_api

    from runtime.api.config import ServerConfig
    from runtime.models.toys import DoubleModel
    from runtime.server.service import Service, ServiceThread
    from tests.factories import wait_until

    url = f"sqlite:///{tmp_path / 'served.db'}"
    with _doubling(url, "export") as runner, \
            httpx.Client(base_url=runner.url, timeout=120) as http:
        for _ in range(20):
            assert http.post("/v2/models/a/infer", json=DOUBLE_BODY).status_code == 200
        engine = make_engine(url)
        assert wait_until(lambda: timeline_rows(engine, Window(0, 4e9)).requests_in_window >= 20,
                          limit=400)
        # the rows are written (waited for above): a window ending now holds them (by
        # default it ends 1 s back, where the recorder has surely written its rows)
        import time
        now = {"last": "120", "end": repr(time.time())}
        got = http.get("/v2/trace/export", params=now)
        assert got.status_code == 200, got.text
        assert got.headers["content-disposition"].endswith('.pftrace"')
        read = read_perfetto(got.content)
        assert read.ok, read.problems
        assert sum(s.category == "request" for s in read.slices) >= 20
        as_json = http.get("/v2/trace/export", params={**now, "format": "json"})
        assert as_json.status_code == 200 and read_chrome(as_json.content).ok
        for params, status, words in (({"last": "0"}, 400, "a window of 0.001 to 600"),
                                      ({"format": "svg"}, 400, "perfetto or json"),
                                      ({"since": "1"}, 400, "unknown parameter"),
                                      ({"model": "nope"}, 404, "unknown model"),
                                      # windows no trace can hold: the client's mistake
                                      ({"end": "nan"}, 400, "finite numbers"),
                                      ({"end": "-5"}, 400, "before 1970"),
                                      ({"end": "1e17"}, 400, "the year 2255"),
                                      ({"last": "1e-300"}, 400, "a window of 0.001")):
            r = http.get("/v2/trace/export", params=params)
            assert r.status_code == status and words in r.json()["error"], (params, r.text)
        monkeypatch.setattr(trace_api, "EXPORT_MAX_ROWS", 5)  # the window holds 20 requests
        r = http.get("/v2/trace/export", params=now)
        assert r.status_code == 413, r.text
        said = r.json()["error"]
        assert "more than 5" in said and "--max-rows" not in said, said
        engine.dispose()
    with ServiceThread(Service({"a": DoubleModel()}, None, ServerConfig(record=False))) as bare, \
            httpx.Client(base_url=bare.url, timeout=30) as http:
        r = http.get("/v2/trace/export")
        assert r.status_code == 404 and "records nothing" in r.json()["error"]


def test_traced_requests_carry_their_trace_timestamps_into_the_export(tmp_path):
    """A real server tracing one request in two: in its export every traced request spans
    its receive and send around its queue and compute, its compute holds input, infer and
    output, at the times of its ``request_traces`` row; untraced requests keep two parts;
    the timeline page's batch members get the same columns."""
    import httpx
    from sqlalchemy import func, select

    from batchscope.analysis.queries.timeline import with_members
    from batchscope.presentation import timeline_chart
    from batchscope.storage.schema import RequestTraceRecord
    from tests.factories import wait_until

    url = f"sqlite:///{tmp_path / 'traced.db'}"
    with _doubling(url, "traced") as runner, \
            httpx.Client(base_url=runner.url, timeout=120) as http:
        r = http.post("/v2/trace/setting", json={"trace_level": ["TIMESTAMPS"],
                                                 "trace_rate": "2"})
        assert r.status_code == 200, r.text
        for _ in range(20):
            assert http.post("/v2/models/a/infer", json=DOUBLE_BODY).status_code == 200
    engine = make_engine(url)
    try:
        def traces() -> int:
            with Session(engine) as s:
                return s.scalar(select(func.count()).select_from(RequestTraceRecord))
        assert wait_until(lambda: traces() >= 10, limit=400)
        with Session(engine) as s:
            stored = {r.trace_id: r for r in s.scalars(select(RequestTraceRecord))}
        assert len(stored) == 10
        window = Window(0, 4e9)
        rows = timeline_rows(engine, window)
        assert len(rows.requests) == 20 and rows.traced == 10
        traced = rows.requests.dropna(subset=["trace_id"])
        assert sorted(traced["trace_id"].astype(int)) == sorted(stored)
        for data, read in ((_export(engine, "perfetto", tmp_path, window)[0], read_perfetto),
                           (_export(engine, "json", tmp_path, window)[0], read_chrome)):
            check = read(data)
            assert check.ok, check.problems
            requests = [s for s in check.slices if s.category == "request"]
            assert len(requests) == 20
            with_trace = [s for s in requests if "trace_id" in s.args]
            assert sorted(int(s.args["trace_id"]) for s in with_trace) == sorted(stored)
            for req in with_trace:
                t = stored[int(req.args["trace_id"])]
                inside = sorted((s for s in check.slices if s.track == req.track
                                 and req.start_ns <= s.start_ns and s.end_ns <= req.end_ns
                                 and s is not req), key=lambda s: (s.start_ns, s.depth))
                parts = [s.category for s in inside if s.depth == req.depth + 1]
                assert parts == ["receive", "queue", "compute", "send"], parts
                assert [s.category for s in inside if s.depth == req.depth + 2] == \
                    ["input", "infer", "output"]
                receive = next(s for s in inside if s.category == "receive")
                send = next(s for s in inside if s.category == "send")
                if read is read_perfetto:  # nanoseconds exactly (JSON holds microseconds)
                    assert (receive.start_ns, send.end_ns) == (_ns(t.recv_start_at),
                                                               _ns(t.send_end_at))
                    assert (req.start_ns, req.end_ns) == (_ns(t.recv_start_at),
                                                          _ns(t.send_end_at))
                assert req.args["receive_ms"] >= 0 and req.args["send_ms"] >= 0
            for req in requests:
                if "trace_id" not in req.args:
                    parts = [s.category for s in check.slices if s.track == req.track
                             and s.depth == req.depth + 1 and req.start_ns <= s.start_ns
                             and s.end_ns <= req.end_ns]
                    assert parts == ["queue", "compute"], parts
        # the page's rows: marks only, then a picked batch's members with their traces
        page = timeline_rows(engine, window, requests="marks")
        seq = int(traced["batch_seq"].iloc[0])
        picked = with_members(engine, page, ("traced", seq))
        members = picked.members("traced", seq)
        assert members["trace_id"].notna().sum() == (traced["batch_seq"] == seq).sum() >= 1
        assert (members.dropna(subset=["trace_id"])["recv_start_at"]
                <= members.dropna(subset=["trace_id"])["arrived_at"]).all()
        fig, part = timeline_chart.members(picked, ("traced", seq))
        assert [t.name for t in fig.data] == ["receive", "queue", "compute", "send"]
        assert len(part) == len(members)
        # a snapshot keeps the traces' rows: a trace made again from it, as the timeline
        # page of an opened snapshot makes one, draws their receive and send as well
        snap = snapshot.load_snapshot(snapshot.export_bytes(engine, window))
        try:
            again = read_perfetto(_export(snap.engine, "perfetto", tmp_path, window)[0])
            assert again.ok and again.by_category()["receive"] == len(stored)
            assert again.by_category()["send"] == len(stored)
        finally:
            snap.close()
    finally:
        engine.dispose()


def test_a_step_slice_is_named_by_what_it_computed():
    from batchscope.trace.layout import _step_name

    assert _step_name(120, 0) == "prefill"  # a step of new prompts alone
    assert _step_name(120, 3) == "prefill+decode"
    assert _step_name(0, 3) == "decode"
    assert _step_name(None, 3) == "decode"


def test_a_window_that_ends_in_the_last_second_says_its_last_rows_may_be_missing(tmp_path):
    """Before: a window ending at now (the default) silently lacked the rows the recorder
    had not written yet (its last half second or so, and traced requests without their
    timestamps); the default end is 1 s back now, and a window that ends later says so
    in the file and on the command line."""
    from batchscope.trace.timespec import recent_note

    assert recent_note(100.0, 101.0) is None and recent_note(99.0, 101.0) is None
    said = recent_note(100.75, 101.0)
    assert said.startswith("the window ends 0.25 s before it was read") and "last 0.75 s" in said
    engine = make_engine(f"sqlite:///{tmp_path / 'empty.db'}")
    try:
        out = tmp_path / "t.json"
        summary = export_trace(engine, Window(90.0, 100.5), str(out), "json", now=101.0)
        assert any("may be missing" in n for n in summary.notes)
        assert "may be missing" in json.loads(out.read_text())["otherData"]["notes"]
        summary = export_trace(engine, Window(90.0, 99.5), str(out), "json", now=101.0)
        assert not any("may be missing" in n for n in summary.notes)
    finally:
        engine.dispose()
