"""Trace export under storage faults and odd rows: ``batchscope trace`` never crashes or
hangs, and says in one line what was wrong and what to do; what it writes passes
``batchscope.trace.check``; a snapshot keeps its other parts when its trace cannot be
made. Real files, the real command, real SQLite; faults of a whole file system use a
small tmpfs, where this user may mount one."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import socket
import sqlite3
import subprocess
import sys
import tempfile
import zipfile

import pytest
from sqlalchemy.orm import Session

from batchscope.analysis.queries.window import Window
from batchscope.presentation import snapshot
from batchscope.storage.db import make_engine
from batchscope.trace.exits import EXIT_NO_ROOM
from batchscope.storage.schema import BatchRecord, GenerationStep, RequestRecord
from batchscope.testing import synthetic
from batchscope.trace.check import read_chrome, read_perfetto
from tests.factories import WAIT_S, database_at, free_port, recorded_sqlite

pytestmark = pytest.mark.slow

END = 2_000_000_000.0
CLI = [sys.executable, "-m", "runtime.tools.cli", "trace"]
WINDOW = ["--start", str(END - 20), "--end", str(END + 1)]
INF = float("inf")


def _cli(*args: str, stdin=None) -> subprocess.CompletedProcess:
    return subprocess.run(CLI + list(args), capture_output=True, text=True, timeout=120,
                          stdin=stdin, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _one_line(r: subprocess.CompletedProcess, status: int = 2) -> str:
    """The one line a refused export prints (exit ``status``, no traceback, nothing on
    stdout)."""
    assert r.returncode == status and r.stdout == "", (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("batchscope trace: "), r.stderr
    return lines[0]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> str:
    """A SQLite file of 10 s of one instance: a trace of some megabytes."""
    return recorded_sqlite(tmp_path_factory.mktemp("faults") / "rec.db", END, batches_per_s=20)


@contextlib.contextmanager
def _tmpfs(folder, size: str, *, read_only_with=None):
    """A tmpfs of ``size`` mounted on ``folder`` (skips the test where this user may not
    mount one); ``read_only_with``: files copied in before it is made read-only."""
    folder.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                       capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()})")
    try:
        for path in read_only_with or ():
            shutil.copy(path, folder)
        if read_only_with is not None:
            subprocess.run(["mount", "-o", "remount,ro", str(folder)], check=True, timeout=30)
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], capture_output=True, timeout=30)


# -- rows that are not what a runtime writes ----------------------------------------------
def _batch(seq: int, start: float, end: float, instance: str = "rt-1", **kw) -> BatchRecord:
    return BatchRecord(instance_id=instance, model="m", seq=seq, policy="dynamic",
                       settings_version=1, max_batch_size=8, batch_size=2, real_elements=2,
                       padded_elements=2, queue_wait_min_s=0.0, queue_wait_mean_s=0.0,
                       queue_wait_max_s=0.0, compute_s=0.01, started_at=start, ended_at=end,
                       **kw)


def _request(seq, arrived: float, finished: float, instance: str = "rt-1", model: str = "m",
             **kw) -> RequestRecord:
    fields = dict(priority=1, latency_s=finished - arrived, outcome="ok", queue_wait_s=0.001)
    return RequestRecord(instance_id=instance, model=model, batch_seq=seq, arrived_at=arrived,
                         finished_at=finished, **{**fields, **kw})


def _step(seq: int, at: float, step_s: float, **kw) -> GenerationStep:
    fields = dict(mode="continuous", running=1, waiting=0, prefill_tokens=0, decode_tokens=0,
                  blocks_used=0, blocks_free=8, preemptions=0)
    return GenerationStep(instance_id="rt-1", model="gen", seq=seq, at=at, step_s=step_s,
                          **{**fields, **kw})


def _odd_database(path, *, finite: bool = False) -> str:
    """Rows a runtime does not write: starts at -inf and before 1970 (a clock gone
    wrong), a step that took for ever, a batch that ends before it starts, a request of
    a batch never recorded, the same batch seq on two instances, steps with no tokens,
    whole-number columns holding infinity and text (SQLite keeps anything anywhere).
    ``finite``: only finite numbers (a snapshot's tables hold no infinity)."""
    url = f"sqlite:///{path}"
    engine = make_engine(url)
    t = END - 10
    never = -100.0 if finite else -INF
    with Session(engine) as s:
        s.add_all([
            _batch(1, t, t + 0.01),
            _batch(2, never, t + 1.01),
            _batch(3, -100.0, t + 2.01),
            _batch(4, t + 3, t + 2.5),
            _batch(1, t + 4, t + 4.01, instance="rt-2"),
            _request(1, t - 0.01, t + 0.01),
            _request(2, never, t + 1.01),
            _request(99, t + 5, t + 5.02),
            _request(1, t + 3.99, t + 4.01, instance="rt-2",
                     priority=1e300 if finite else INF, length="long"),
            _step(1, t + 6, 0.01),
            _step(2, t + 7, 1e12 if finite else INF, prefill_tokens=0, decode_tokens=0),
            _request(1, t + 5.99, t + 6.5, model="gen", prompt_tokens=0, output_tokens=0),
        ])
        s.commit()
    engine.dispose()
    return url


def _assert_valid(data: bytes, fmt: str):
    got = (read_perfetto if fmt == "perfetto" else read_chrome)(data)
    assert got.ok, got.problems
    assert all(s.start_ns >= 0 and s.end_ns >= s.start_ns for s in got.slices)
    return got


@pytest.mark.parametrize("fmt, name", [("perfetto", "odd.pftrace"), ("json", "odd.json")])
def test_rows_whose_times_are_no_time_still_export_a_valid_trace(tmp_path, fmt, name):
    """Before: the Perfetto export died with a traceback (``Value out of range: -1``, a
    negative timestamp), the JSON one wrote times before 1970, and an infinity in a
    whole-number column (priority) was an ``OverflowError``."""
    db = _odd_database(tmp_path / "odd.db")
    out = tmp_path / name
    r = _cli("--db", db, *WINDOW, "-o", str(out))
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert "5 batches, 5 requests, 3 flows, 2 steps" in r.stdout, r.stdout
    assert ("note: 2 batch(s) and 1 request(s) and 1 step(s) have a time that is no time "
            "(infinite, or before 1970)") in r.stdout
    got = _assert_valid(out.read_bytes(), fmt)
    cats = got.by_category()
    assert cats["batch"] == 5 and cats["request"] == 5 and cats["step"] == 2
    # the batch that started at -inf: no length, at its end
    clock = next(s for s in got.slices if s.category == "batch" and s.args["seq"] == 2)
    assert clock.start_ns == clock.end_ns == round((END - 10 + 1.01) * 1e9)


def test_a_row_of_the_wrong_type_fails_the_export_in_one_line_and_skips_a_snapshot_trace(
        tmp_path):
    """Text where a number belongs (another program wrote it: SQLite keeps it) broke the
    window's reading with a ``TypeError`` traceback, and the whole snapshot with it."""
    url = f"sqlite:///{tmp_path / 'text.db'}"
    engine = make_engine(url)
    synthetic.generate(engine, synthetic.SCENARIOS["healthy"].with_(duration_s=5,
                                                                    batches_per_s=2), end_s=END)
    with engine.begin() as conn:
        conn.exec_driver_sql("UPDATE requests SET queue_wait_s = 'soon' WHERE id = 1")
    try:
        line = _one_line(_cli("--db", url, *WINDOW, "-o", str(tmp_path / "t.json")))
        assert "cannot make a trace of this window: TypeError" in line
        assert "export a window without it" in line
        assert not (tmp_path / "t.json").exists()
        # the snapshot is written; its manifest says why it has no trace
        data = snapshot.export_bytes(engine, Window(END - 20, END + 1))
    finally:
        engine.dispose()
    manifest = json.loads(zipfile.ZipFile(io.BytesIO(data)).read("manifest.json"))
    assert manifest["trace"]["member"] is None
    assert manifest["trace"]["skipped"].startswith("the trace could not be made (TypeError")


def test_a_snapshot_trace_of_rows_whose_times_are_no_time_is_valid(tmp_path):
    """Before: ``export_snapshot`` died on the trace's negative timestamps."""
    engine = make_engine(_odd_database(tmp_path / "odd.db", finite=True))
    try:
        data = snapshot.export_bytes(engine, Window(END - 20, END + 1))
    finally:
        engine.dispose()
    entry = json.loads(zipfile.ZipFile(io.BytesIO(data)).read("manifest.json"))["trace"]
    assert entry["member"] == snapshot.TRACE and entry["batch_slices"] == 5
    assert any("no time" in note for note in entry["notes"])
    _assert_valid(snapshot.trace_bytes(data), "perfetto")


def test_a_snapshot_whose_temporary_folder_is_full_leaves_its_trace_out(recorded, tmp_path,
                                                                        monkeypatch):
    """Before: ``OSError: No space left on device`` from the trace's temporary file
    ended the snapshot (and the command blamed its --out folder)."""
    engine = make_engine(recorded, create=False)
    try:
        with _tmpfs(tmp_path / "tmp", "64k") as small:
            monkeypatch.setattr(tempfile, "tempdir", str(small))
            data = snapshot.export_bytes(engine, Window(END - 12, END + 1))
            assert os.listdir(small) == []  # its temporary file went
    finally:
        engine.dispose()
    entry = json.loads(zipfile.ZipFile(io.BytesIO(data)).read("manifest.json"))["trace"]
    assert entry["member"] is None and "No space left on device" in entry["skipped"]
    assert "free space there (or set TMPDIR)" in entry["skipped"]


# -- where the trace goes -----------------------------------------------------------------
def test_a_named_pipe_no_program_reads_fails_at_once_instead_of_waiting(recorded, tmp_path):
    """Before: the export waited for ever for a reader (``open`` of a FIFO)."""
    fifo = tmp_path / "pipe.json"
    os.mkfifo(fifo)
    line = _one_line(_cli("--db", recorded, *WINDOW, "-o", str(fifo)))
    assert line.endswith("it is a named pipe that no program is reading; start the program "
                         "that reads it first, or give -o a file")


def test_the_trace_goes_to_stdout_alone(recorded):
    """``-o /dev/stdout`` into a pipe: before, ``No such file or directory`` (the link
    was resolved to ``pipe:[...]``), and the summary would have followed the trace."""
    if not os.path.exists("/dev/stdout"):
        pytest.skip("no /dev/stdout here")
    r = _cli("--db", recorded, *WINDOW, "--format", "json", "-o", "/dev/stdout")
    assert r.returncode == 0, r.stderr
    _assert_valid(r.stdout.encode(), "json")
    assert r.stderr.startswith("wrote /dev/stdout (json, ") and "200 batches" in r.stderr


def test_a_link_to_a_folder_that_is_not_there_is_refused_before_reading(recorded, tmp_path):
    """Before: ``cannot write run.json: No such file or directory``, after reading the
    whole window, for a name whose own folder is there."""
    link = tmp_path / "run.json"
    link.symlink_to(tmp_path / "gone" / "run.json")
    line = _one_line(_cli("--db", recorded, *WINDOW, "-o", str(link)))
    assert line.endswith(f"-o '{link}' is a link to '{tmp_path}/gone/run.json', in a "
                         "directory that is not there; give -o a file in a directory that "
                         "exists, or mend the link")


def test_a_full_disk_says_what_to_do_and_leaves_no_part_file(recorded, tmp_path):
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    line = _one_line(_cli("--db", recorded, *WINDOW, "--format", "json", "-o", "/dev/full"),
                     EXIT_NO_ROOM)
    assert line == ("batchscope trace: cannot write /dev/full: No space left on device: free "
                    "some space there, or give -o a file on another disk")
    with _tmpfs(tmp_path / "disk", "64k") as disk:
        kept = disk / "run.pftrace"
        kept.write_bytes(b"an older trace")
        line = _one_line(_cli("--db", recorded, *WINDOW, "-o", str(kept)), EXIT_NO_ROOM)
        assert "No space left on device: free some space there" in line
        assert os.listdir(disk) == ["run.pftrace"] and kept.read_bytes() == b"an older trace"


def test_a_read_only_disk_says_what_to_do(recorded, tmp_path):
    with _tmpfs(tmp_path / "ro", "64k", read_only_with=()) as ro:
        line = _one_line(_cli("--db", recorded, *WINDOW, "-o", str(ro / "run.json")))
    assert line.endswith("Read-only file system: give -o a file on a writable disk")


# -- the database -------------------------------------------------------------------------
def test_damaged_and_foreign_database_files_fail_in_one_line_saying_what_to_do(recorded,
                                                                             tmp_path):
    src = recorded.removeprefix("sqlite:///")
    not_db = tmp_path / "notes.db"
    not_db.write_bytes(b"these are my notes, not a database\n" * 200)
    cut = tmp_path / "cut.db"
    with open(src, "rb") as fh:
        cut.write_bytes(fh.read()[:100_000])
    cases = [
        (not_db, f"{not_db} is not a SQLite database ((sqlite3.DatabaseError) file is not a "
                 "database); give --db the database file a runtime records to"),
        (cut, f"the database file {cut} is damaged ((sqlite3.DatabaseError) database disk "
              f"image is malformed); export from a backup, or save what is left with: "
              f"sqlite3 {cut} .recover"),
    ]
    for path, expected in cases:
        before = path.read_bytes()
        line = _one_line(_cli("--db", f"sqlite:///{path}", *WINDOW, "-o",
                              str(tmp_path / "t.json")))
        assert line == f"batchscope trace: {expected}"
        assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cut.db", "notes.db"]


#: a batch as a release of schema version 6 (revision 0005) wrote it
REVISION_0005_BATCH = f"""
INSERT INTO batches (instance_id, model, seq, policy, settings_version, max_batch_size, bucket,
  batch_size, real_elements, padded_elements, queue_wait_min_s, queue_wait_mean_s,
  queue_wait_max_s, compute_s, started_at, ended_at, outcome, peak_memory_bytes, cuda_graph,
  queue_depth) VALUES ('rt-1', 'mlp', 1, 'dynamic', 1, 8, NULL, 4, 4, 4, 0.0, 0.001, 0.002,
  0.01, {END - 5}, {END - 4.99}, 'ok', NULL, FALSE, 3)
"""


def test_a_database_of_an_older_schema_says_how_to_upgrade_it(tmp_path):
    """Before: ``cannot read the database: ... no such column:
    peak_memory_increase_bytes``, with nothing to do about it."""
    url = f"sqlite:///{tmp_path / 'old.db'}"
    database_at(url, "0005", REVISION_0005_BATCH)
    line = _one_line(_cli("--db", url, *WINDOW, "-o", str(tmp_path / "t.json")))
    assert "written by an older BatchScope (schema version 6; this one reads" in line
    assert "no such column: peak_memory_increase_bytes" in line
    assert line.endswith("upgrade it by opening it once with this BatchScope (batchscope "
                         "serve --db URL, or the dashboard), then export again")


def test_a_database_locked_by_a_writer_fails_after_the_busy_wait(recorded, tmp_path):
    """A rollback-journal database (another tool's, or a copy) whose writer holds an
    exclusive transaction: readers wait SQLite's busy timeout, then say so."""
    path = tmp_path / "locked.db"
    shutil.copy(recorded.removeprefix("sqlite:///"), path)
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA journal_mode=DELETE")
    conn.close()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sqlite3, sys\n"
         f"c = sqlite3.connect({str(path)!r}, isolation_level=None)\n"
         "c.execute('BEGIN EXCLUSIVE')\nc.execute('DELETE FROM batches WHERE id < 0')\n"
         "print('locked', flush=True)\nsys.stdin.read()\n"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        line = _one_line(_cli("--db", f"sqlite:///{path}", *WINDOW, "-o",
                              str(tmp_path / "t.json")))
    finally:
        holder.stdin.close()
        holder.wait(timeout=WAIT_S)
    assert line == ("batchscope trace: another program held a lock on the database for "
                    "longer than the 5 s this waits ((sqlite3.OperationalError) database is "
                    "locked); export again once it is done")


def test_a_wal_database_in_a_read_only_folder_says_to_copy_it(recorded, tmp_path):
    """Before: ``cannot read the database: unable to open database file``."""
    src = recorded.removeprefix("sqlite:///")
    with _tmpfs(tmp_path / "ro", "4m", read_only_with=[src]) as ro:
        line = _one_line(_cli("--db", f"sqlite:///{ro / os.path.basename(src)}", *WINDOW,
                              "-o", str(tmp_path / "t.json")))
    assert "unable to open database file" in line
    assert line.endswith("its folder must be writable; copy the file (with its -wal) to a "
                         "writable folder and export from the copy")


def test_a_postgresql_server_that_refuses_or_never_answers_fails_fast(tmp_path):
    """A closed port is refused at once; a port that takes the connection and never
    answers (a stuck server, a proxy) hung the export for ever before: now it gives up
    after ``connect_timeout``. The password stays out of the message."""
    pytest.importorskip("psycopg")
    closed = free_port()
    line = _one_line(_cli("--db", f"postgresql+psycopg://u:secret@127.0.0.1:{closed}/db",
                          "-o", str(tmp_path / "t.json")))
    assert line.startswith(f"batchscope trace: cannot connect to the database at "
                           f"postgresql+psycopg://u:***@127.0.0.1:{closed}/db (")
    assert "Connection refused" in line and "secret" not in line
    assert line.endswith("check that its server is running and that the URL names its host "
                         "and port")
    with socket.socket() as silent:  # listens, never accepts, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        line = _one_line(_cli("--db", f"postgresql+psycopg://u@127.0.0.1:{port}/db",
                              "-o", str(tmp_path / "t.json")))
    assert "cannot connect to the database" in line and "timeout expired" in line
    assert not (tmp_path / "t.json").exists()


def test_a_snapshot_of_rows_holding_infinities_is_made_and_opens(tmp_path):
    """Before: ``export_snapshot`` failed whole ("Out of range float values are not JSON
    compliant") on a table row holding an infinity, which JSON cannot write: now such a
    value is null where the column may be NULL, else its row is left out, counted."""
    engine = make_engine(_odd_database(tmp_path / "odd.db"))
    try:
        data = snapshot.export_bytes(engine, Window(END - 20, END + 1))
    finally:
        engine.dispose()
    manifest = json.loads(zipfile.ZipFile(io.BytesIO(data)).read("manifest.json"))
    fixed = {name: (t["not_numbers_as_null"], t["rows_left_out"])
             for name, t in manifest["tables"].items() if "rows_left_out" in t}
    # a start of -inf and a step_s of inf (values are required) leave their rows out
    assert fixed["batches"][1] >= 1 and fixed["generation_steps"][1] >= 1, fixed
    assert manifest["tables"]["batches"]["rows"] == 5 - fixed["batches"][1]
    path = tmp_path / "odd.zip"
    path.write_bytes(data)
    snap = snapshot.load_snapshot(path)  # checks every row against the schema
    snap.close()


@pytest.mark.both_backends
def test_a_postgresql_table_locked_by_another_program_fails_in_seconds(backend,
                                                                        new_database_url,
                                                                        tmp_path):
    """A migration's ALTER TABLE holds an exclusive lock on its table; an export behind it
    waited for ever. It now gives up after ``lock_timeout`` and says why. (SQLite's busy
    wait: ``test_a_database_locked_by_a_writer_fails_after_the_busy_wait``.)"""
    if backend != "postgresql":
        pytest.skip("PostgreSQL's table locks; SQLite's are tested above")
    url = new_database_url("postgresql")
    engine = make_engine(url)
    synthetic.generate(engine, synthetic.SCENARIOS["healthy"].with_(duration_s=5,
                                                                    batches_per_s=2), end_s=END)
    try:
        with engine.connect() as holder:
            holder.exec_driver_sql("BEGIN")
            holder.exec_driver_sql("LOCK TABLE batches IN ACCESS EXCLUSIVE MODE")
            line = _one_line(_cli("--db", url, *WINDOW, "-o", str(tmp_path / "t.json")))
            holder.exec_driver_sql("ROLLBACK")
    finally:
        engine.dispose()
    assert "another program held a lock on the database for longer than the 5 s" in line
    assert "lock timeout" in line and not (tmp_path / "t.json").exists()
    r = _cli("--db", url, *WINDOW, "-o", str(tmp_path / "t.json"))  # once it is released
    assert r.returncode == 0, r.stderr


def test_a_full_temporary_folder_for_sqlite_s_sorts_is_told_as_no_room(tmp_path):
    """Before: ``cannot read the database: database or disk is full`` (exit 2, and a 503
    from the server's export) when SQLite's sort of a large window found its temporary
    folder full, though the database and the output's disk were fine."""
    big = recorded_sqlite(tmp_path / "big.db", END, batches_per_s=600)
    with _tmpfs(tmp_path / "small", "4k") as small:
        r = subprocess.run(CLI + ["--db", big, *WINDOW, "-o", str(tmp_path / "t.pftrace")],
                           capture_output=True, text=True, timeout=120,
                           env={**os.environ, "SQLITE_TMPDIR": str(small)})
        line = _one_line(r, EXIT_NO_ROOM)
    assert "SQLite found no room for its temporary files" in line
    assert f"they go to {small}: free some space there, set SQLITE_TMPDIR" in line
    assert not (tmp_path / "t.pftrace").exists()


@pytest.mark.parametrize("args, words", [
    (["--max-rows", "99999999999999999999"], "is not between 1 and 1,000,000,000"),
    (["--max-rows", "0"], "is not between 1 and 1,000,000,000"),
    (["--max-rows", "many"], "'many' is not a whole number"),
])
def test_max_rows_out_of_bounds_is_refused_before_reading(recorded, tmp_path, args, words):
    """Before: a huge ``--max-rows`` reached SQLite and was blamed on the database."""
    r = _cli("--db", recorded, *WINDOW, *args, "-o", str(tmp_path / "t.json"))
    assert r.returncode == 2 and words in r.stderr and "Traceback" not in r.stderr


def test_a_date_too_early_for_the_time_zone_is_told_to_be_before_1970(recorded, tmp_path):
    """Before: ``year 0 is out of range``, with no hint."""
    line = _one_line(_cli("--db", recorded, "--start", "0001-01-01", "--end", "1970-01-02",
                          "-o", str(tmp_path / "t.json")))
    assert "'0001-01-01' is before 1970; give a later time" in line


def test_a_dash_writes_the_trace_to_stdout_and_wants_its_format(recorded):
    r = _cli("--db", recorded, *WINDOW, "--format", "json", "-o", "-")
    assert r.returncode == 0, r.stderr
    _assert_valid(r.stdout.encode(), "json")
    assert r.stderr.startswith("wrote standard output (json, ")
    line = _one_line(_cli("--db", recorded, *WINDOW, "-o", "-"))
    assert line.endswith("name its format too: --format perfetto or --format json")


def test_a_dash_into_a_redirected_file_appends_rather_than_replaces(recorded, tmp_path):
    """``-o -`` writes a stream: ``>> file`` keeps what the file held (``-o /dev/stdout``
    wrote a new file and renamed it over the one redirected to)."""
    kept = tmp_path / "log.txt"
    kept.write_bytes(b"before\n")
    with open(kept, "ab") as out:
        r = subprocess.run(CLI + ["--db", recorded, *WINDOW, "--format", "json", "-o", "-"],
                           stdout=out, stderr=subprocess.PIPE, text=False, timeout=120)
    assert r.returncode == 0, r.stderr
    data = kept.read_bytes()
    assert data.startswith(b"before\n")
    _assert_valid(data[len(b"before\n"):], "json")
