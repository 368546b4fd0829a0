"""Tuning sessions in the database, the golden-parameter table, and what replay reads
from the request rows besides the length.

A session's trials are driven by the real loop (``runner.drive``) under a fake clock
against a server whose figures are a fixed function of its settings, and written through
``SessionWriter`` into real SQLite and PostgreSQL databases; reading them back must give
the rows the live view shows. A real server then tunes end to end into its own
recording database. The engine's request rows carry each request's input shapes and
timeout, and a replay sends them."""

from __future__ import annotations

import asyncio
import csv
import io
import itertools
import os
import time
from pathlib import Path

import numpy as np
import orjson
import pytest
import torch
from sqlalchemy import text
from streamlit.testing.v1 import AppTest

from batchscope.load.replay import read_traffic, replay_arrivals, shaped_metadata
from batchscope.storage import control
from batchscope.storage.db import make_engine, shown_url
from batchscope.storage.records import (DeviceRow, ListRecorder, RequestBatch, RequestRow,
                                        declared_shapes)
from batchscope.storage.recorder import Recorder
from batchscope.storage.schema import RequestRecord, TuningSessionRecord, TuningTrialRecord
from batchscope.tuning import golden, store
from batchscope.tuning.client import SettingsRefused, TuningError
from batchscope.tuning.figures import Objective, Stability, Window
from batchscope.tuning.runner import TuneOptions, drive, finish, run_tuning
from batchscope.tuning.search import GridSearch
from batchscope.tuning.session import Stopping, TuningSession
from batchscope.tuning.space import SearchSpace, SpaceOptions
from runtime.api.config import BatchingConfig, ServerConfig
from runtime.api.model import ModelAPI, TensorSpec
from runtime.engine.engine import Engine
from runtime.models.toys import DoubleModel
from runtime.server.service import Service, ServiceThread
from tests.factories import count, stored, wait_until

GIB = 1024 ** 3
SLO_MS = 50.0
URL = "http://node-a:8000"
START = {"policy": "dynamic", "max_batch_size": 8, "max_queue_delay_ms": None,
         "preferred_batch_sizes": [], "max_queue_size": 1024}
DOC = {"model": "mlp", "kind": "request", "version": 1, "settings": START}
FIXED = {"name": "mlp", "inputs": [{"name": "X", "datatype": "FP32", "shape": [8]}]}
#: eight points: max batch 4, 8 (the start), 16, 32 x no delay, 2 ms
SPACE = SpaceOptions(policies=("dynamic",), max_batch_sizes=(4, 16, 32), queue_delays_ms=(None, 2.0),
                     preferred=("none",))


def figures(s: dict) -> tuple[float, float]:
    """(req/s, p99 ms): more batch, more throughput and latency; 32 breaks the 50 ms SLO,
    16 without delay is the best feasible point."""
    size = s["max_batch_size"]
    return 100.0 * size * (1.0 - 0.05 * (s["max_queue_delay_ms"] or 0)), 10.0 + 1.5 * size


class Server:
    """Holds the settings; refuses max batch 4 (a 422 would say why)."""

    def __init__(self) -> None:
        self.settings = dict(START)

    def send(self, changes: dict) -> None:
        if changes.get("max_batch_size") == 4:
            raise SettingsRefused("max_batch_size 4 is below this model's minimum")
        self.settings.update(changes)


class Clock:
    def __init__(self) -> None:
        self.t = 500.0

    def __call__(self) -> float:
        return self.t

    def wait(self, seconds: float) -> bool:
        self.t += seconds
        return False


class Meter:
    def __init__(self, server: Server, clock: Clock) -> None:
        self.server, self.clock, self.start = server, clock, clock()

    def mark(self, now: float) -> None:
        self.start = now

    def read(self, now: float) -> Window:
        rps, p99 = figures(self.server.settings)
        duration, self.start = now - self.start, now
        ok = int(rps * duration)
        return Window(duration_s=duration, ok=ok, good=ok if p99 <= SLO_MS else ok // 2,
                      failed=0, p50_ms=p99 / 2, p99_ms=p99)


def tuned_session(db, *, instance_id: str | None = "rt-1"):
    """A grid session over ``SPACE`` driven to its end, written as it runs."""
    space = SearchSpace.for_model(DOC, FIXED, options=SPACE)
    clock, server = Clock(), Server()
    session = TuningSession(space, GridSearch(space), Objective(SLO_MS), now=clock(),
                            stopping=Stopping(budget_s=1000.0, patience=None),
                            stability=Stability())
    hardware = store.hardware_of(db, instance_id) if instance_id else None
    writer = store.SessionWriter.begin(db, store.SessionStart(
        model="mlp", url=URL, instance_id=instance_id, objective="goodput", slo_p99_ms=SLO_MS,
        budget_s=1000.0, load_kind="synthetic", load_description="closed loop, 8 connections",
        start_settings=session.start, requested_by="cli", started_at=2000.0, hardware=hardware),
        wall_offset_s=1500.0)
    stored_midway: list[int] = []

    def done(trial) -> None:
        writer.trial(trial, session.start)
        stored_midway.append(count(db, TuningTrialRecord))

    drive(session, send=server.send, meter=Meter(server, clock), clock=clock, wait=clock.wait,
          done=done)
    result = finish(session, server.send, apply=False, now=clock(), model="mlp")
    writer.end(result, state=store.state_of(result), now=2100.0)
    return writer, result, stored_midway


def register(db, instance_id: str = "rt-1", *, url: str = URL, device: str = "cuda:0",
             memory_bytes: int = 15 * GIB, host: str = "node-a") -> None:
    control.register_instance(db, instance_id=instance_id, host=host, pid=1, models=["mlp"],
                              url=url, device=device, version="t", now=1000.0, cpu_count=16)
    rec = Recorder(db)
    rec.put(DeviceRow(instance_id=instance_id, at=1001.0, device=device,
                      kind="gpu" if device.startswith("cuda") else "cpu",
                      memory_total_bytes=memory_bytes))
    assert rec.flush() == 1


@pytest.mark.both_backends
def test_a_session_and_each_trial_are_stored_as_they_end_and_read_back(db):
    register(db)
    assert store.instance_for_url(db, URL + "/", "mlp") == "rt-1"
    assert store.instance_for_url(db, URL, "other") is None
    writer, result, midway = tuned_session(db)
    # one row per trial, each written when it ended (refused ones too), not at the end
    assert midway == list(range(1, len(result.trials) + 1)) and writer.problem is None
    [s] = store.sessions(db)
    assert (s.id, s.state, s.model, s.instance_id, s.trials) == (writer.session_id, "finished",
                                                                 "mlp", "rt-1", 8)
    assert s.hardware == "GPU cuda:0, 15 GiB on node-a" and s.device_kind == "gpu"
    assert s.device_memory_bytes == 15 * GIB and s.load_description == "closed loop, 8 connections"
    assert s.start_settings == result.start and s.best_trial == result.best.number
    assert s.best_settings["max_batch_size"] == 16 and s.recommended == {"max_batch_size": 16}
    assert s.sentence == result.sentence() and s.outcome == "restored the starting settings"
    assert (s.started_at, s.finished_at) == (2000.0, 2100.0)
    # what the live view showed is what is read back
    back = store.trials_of(db, [s.id])[s.id]
    live = [t.row(result.start) for t in result.trials]
    assert [t.row() for t in back] == [{**r, "duration_s": round(r["duration_s"], 2)} for r in live]
    refused = next(t for t in back if t.status == "refused")
    assert refused.reason.startswith("refused by the server") and refused.p99_ms is None
    first = back[0]
    assert first.started_at == result.trials[0].started_s + 1500.0  # the session clock, as wall time
    assert store.best_trials(db, [s])[s.id].number == result.best.number


@pytest.mark.both_backends
def test_sessions_are_listed_newest_first_and_filtered(db):
    register(db)
    register(db, "rt-2", url="http://node-b:8000", device="cpu", memory_bytes=64 * GIB,
             host="node-b")
    ids = []
    for instance, started in (("rt-1", 10.0), ("rt-2", 30.0), (None, 20.0)):
        ids.append(store.SessionWriter.begin(db, store.SessionStart(
            model="mlp" if instance else "other", url=URL, instance_id=instance,
            objective="goodput", slo_p99_ms=SLO_MS, budget_s=60.0, load_kind="live",
            start_settings=START, requested_by="dashboard", started_at=started,
            hardware=store.hardware_of(db, instance) if instance else None)).session_id)
    assert [s.id for s in store.sessions(db)] == [ids[1], ids[2], ids[0]]
    assert [s.id for s in store.sessions(db, model="mlp")] == [ids[1], ids[0]]
    assert [s.id for s in store.sessions(db, instance_id="rt-1")] == [ids[0]]
    assert [s.id for s in store.sessions(db, since=15.0, until=30.0)] == [ids[2]]
    assert [s.id for s in store.sessions(db, limit=1)] == [ids[1]]
    cpu = store.sessions(db, instance_id="rt-2")[0]
    assert cpu.hardware == "CPU, 16 cores, 64 GiB on node-b" and cpu.state == "running"
    assert store.trials_of(db, [ids[0]]) == {ids[0]: []} and store.trials_of(db, []) == {}


def test_a_failed_write_stops_storing_but_not_the_session(db):
    register(db)
    writer = store.SessionWriter.begin(db, store.SessionStart(
        model="mlp", url=URL, objective="goodput", slo_p99_ms=SLO_MS, budget_s=60.0,
        load_kind="synthetic", start_settings=START, requested_by="cli", started_at=1.0))
    with db.begin() as conn:
        conn.execute(text(f"DROP TABLE {TuningTrialRecord.__tablename__}"))
    space = SearchSpace.for_model(DOC, FIXED, options=SPACE)
    clock, server = Clock(), Server()
    session = TuningSession(space, GridSearch(space), Objective(SLO_MS), now=clock(),
                            stopping=Stopping(budget_s=1000.0, patience=None))
    drive(session, send=server.send, meter=Meter(server, clock), clock=clock, wait=clock.wait,
          done=lambda trial: writer.trial(trial, session.start))
    result = finish(session, server.send, apply=False, now=clock(), model="mlp")
    writer.end(result, state=store.state_of(result), now=9.0)
    assert result.measured == 8 and result.best is not None      # the session ran through
    assert "writing trial 0" in writer.problem and "stored in part" in writer.note
    with db.connect() as conn:           # nothing after the failure was written
        assert conn.execute(text("SELECT state FROM tuning_sessions")).scalars().all() == ["running"]


def test_open_database_refuses_what_it_cannot_use_and_creates_nothing(tmp_path):
    missing = tmp_path / "nope" / "x.db"
    with pytest.raises(store.StoreUnavailable, match="no SQLite database file"):
        store.open_database(f"sqlite:///{missing}")
    assert not missing.parent.exists()
    with pytest.raises(store.StoreUnavailable, match="cannot be reached") as refused:
        store.open_database("postgresql+psycopg://nobody:s3cret@127.0.0.1:1/none?connect_timeout=2")
    assert "\n" not in str(refused.value) and "s3cret" not in str(refused.value)
    with pytest.raises(store.StoreUnavailable, match="cannot open"):
        store.open_database("nosuchdialect://x")
    assert (shown_url("postgresql+psycopg://nobody:s3cret@db:5432/bs")
            == "postgresql+psycopg://nobody:***@db:5432/bs")


# -- the golden-parameter table ------------------------------------------------------------
@pytest.mark.parametrize("hardware, kind, memory_gib, gpu, matched", [
    ("GPU NVIDIA A10G, 22 GiB on h", "gpu", 22.0, "A10G", "named"),
    ("GPU Tesla T4 on h", "gpu", None, "T4", "named"),
    ("GPU NVIDIA A100-SXM4-80GB on h", "gpu", 79.2, "A100", "named"),
    ("GPU cuda:0, 15 GiB on h", "gpu", 15.0, "T4", "guessed from 15 GiB of GPU memory"),
    ("GPU cuda:0, 79 GiB on h", "gpu", 79.3, "A100", "guessed from 79 GiB of GPU memory"),
    ("GPU cuda:0, 140 GiB on h", "gpu", 139.8, None, "no published GPU has 140 GiB"),
    ("CPU, 16 cores on h", "cpu", 64.0, None, "the published rows are for GPUs"),
    (None, None, None, None, "the GPU's model is unknown"),
])
def test_a_sessions_published_row_is_named_or_guessed_from_its_memory(hardware, kind, memory_gib,
                                                                      gpu, matched):
    row, how = golden.article_row(hardware, kind, None if memory_gib is None else int(memory_gib * GIB))
    assert (row.gpu if row else None, how) == (gpu, matched)


@pytest.mark.both_backends
def test_the_golden_table_compares_and_exports(db):
    register(db)
    writer, result, _ = tuned_session(db)
    tuned_session(db, instance_id=None)           # no hardware known
    found = store.sessions(db)
    rows = golden.golden_rows(found, store.best_trials(db, found))
    assert [r.session_id for r in rows] == [s.id for s in found]
    mine = next(r for r in rows if r.session_id == writer.session_id)
    best = result.best.figures
    assert (mine.model, mine.policy, mine.max_batch_size, mine.timeout_ms) == ("mlp", "dynamic", 16, 0.0)
    assert mine.throughput_rps == pytest.approx(best.throughput_rps)
    assert mine.p99_ms == pytest.approx(best.p99_ms) and mine.article.gpu == "T4"
    assert mine.comparison == ("T4 (guessed from 15 GiB of GPU memory): batch 16 within 16–32; "
                               "timeout 0 ms below 10–30 ms")
    other = next(r for r in rows if r.session_id != writer.session_id)
    assert other.hardware == "unknown" and other.comparison.startswith("no published row")
    parsed = list(csv.reader(io.StringIO(golden.to_csv(rows))))
    assert parsed[0] == list(golden.COLUMNS) and len(parsed) == 1 + len(rows)
    line = dict(zip(parsed[0], next(p for p in parsed[1:] if p[0] == str(writer.session_id))))
    assert (line["hardware"], line["best batch size"], line["timeout ms"], line["published GPU"]) == \
        ("GPU cuda:0, 15 GiB on node-a", "16", "0", "T4")
    md = golden.to_markdown(rows)
    assert "\n| T4 | 16–32 | 10–30 |\n" in md and f"\n| {writer.session_id} | " in md
    assert "No stored tuning session" in golden.to_markdown([])


def test_the_tuning_page_lists_stored_sessions_and_offers_the_table_for_download(tmp_path,
                                                                                 monkeypatch):
    url = f"sqlite:///{tmp_path / 'page.db'}"
    monkeypatch.setenv("BATCHSCOPE_DB_URL", url)
    monkeypatch.setenv("BATCHSCOPE_NO_DEMO", "1")
    db = make_engine(url)
    register(db)
    first, _, _ = tuned_session(db)
    second, result, _ = tuned_session(db)
    with db.begin() as conn:  # the second one started later
        conn.execute(text("UPDATE tuning_sessions SET started_at = 3000 WHERE id = :i"),
                     {"i": second.session_id})
    db.dispose()
    at = AppTest.from_file(str(Path(__file__).resolve().parent.parent / "app.py"),
                           default_timeout=60).run()
    at.switch_page("batchscope/dashboard/pages/tuning.py").run()
    assert not at.exception, [e.value for e in at.exception]
    assert any(s.value == "Tuning sessions" for s in at.subheader)
    box = next(b for b in at.selectbox if b.label == "Session")
    assert box.options[0].startswith(f"#{second.session_id} · mlp") and len(box.options) == 2
    assert any("Tuning trials" in c.proto.spec for c in at.get("plotly_chart"))
    frames = [f.value for f in at.dataframe]
    golden_frame = next(f for f in frames if "published GPU" in f.columns)
    assert list(golden_frame["best batch size"]) == ["16", "16"]
    assert any(list(f.columns) == list(golden.ARTICLE_COLUMNS) for f in frames)
    labels = [d.proto.label for d in at.get("download_button")]
    assert "Download CSV" in labels and "Download Markdown" in labels


# -- what replay reads besides the length ---------------------------------------------------
class PairModel(ModelAPI):
    """Two inputs of one variable length (token ids and their mask); answers their sum."""

    name = "pair"
    inputs = (TensorSpec("IDS", "INT64", (-1,)), TensorSpec("MASK", "INT64", (-1,)))
    outputs = (TensorSpec("SUM", "INT64", (1,)),)
    variable_length = True
    max_length = 64

    def decode(self, inputs):
        return np.asarray(inputs["IDS"], dtype=np.int64) + np.asarray(inputs["MASK"], dtype=np.int64)

    def length(self, item) -> int:
        return int(item.shape[0])

    def collate(self, items, pad_to):
        width = pad_to or max(len(x) for x in items)
        out = np.zeros((len(items), width), dtype=np.int64)
        for i, x in enumerate(items):
            out[i, :len(x)] = x
        return torch.from_numpy(out)

    def predict(self, batch):
        return batch.sum(dim=1)

    def split(self, output, n):
        return [{"SUM": output[i:i + 1].numpy()} for i in range(n)]


def test_the_engine_records_each_requests_input_shapes_and_timeout():
    recorder = ListRecorder()

    async def main() -> None:
        engine = Engine({"pair": PairModel(), "double": DoubleModel()},
                        {"pair": BatchingConfig(max_batch_size=4, default_timeout_ms=5000.0),
                         "double": BatchingConfig(max_batch_size=4, max_queue_size=1)},
                        recorder=recorder)
        await engine.start()
        try:
            ids = np.arange(7, dtype=np.int64)
            await engine.infer("pair", {"IDS": ids, "MASK": ids}, timeout_ms=250.0)
            await engine.infer("pair", {"IDS": ids[:3], "MASK": ids[:3]})  # the default
            await engine.infer("double", {"INPUT0": np.ones(4, dtype=np.float32)})
        finally:
            await engine.stop()

    asyncio.run(main())
    rows = {(r.model, r.length): r for r in recorder.of(RequestRow)}
    assert rows[("pair", 7)].input_shape_json == '{"IDS":[7],"MASK":[7]}'
    assert rows[("pair", 7)].timeout_ms == pytest.approx(250.0)
    assert rows[("pair", 3)].input_shape_json == '{"IDS":[3],"MASK":[3]}'
    assert rows[("pair", 3)].timeout_ms == pytest.approx(5000.0)
    assert rows[("double", None)].input_shape_json == '{"INPUT0":[4]}'
    assert rows[("double", None)].timeout_ms is None


def test_a_refused_requests_row_carries_them_too():
    recorder = ListRecorder()

    async def main() -> None:
        engine = Engine({"pair": PairModel()},
                        {"pair": BatchingConfig(max_batch_size=64, max_queue_size=1,
                                                max_queue_delay_ms=500.0)}, recorder=recorder)
        await engine.start()
        try:
            ids = np.arange(5, dtype=np.int64)
            first = asyncio.ensure_future(engine.infer("pair", {"IDS": ids, "MASK": ids},
                                                       timeout_ms=900.0))
            await asyncio.sleep(0.05)
            with pytest.raises(Exception, match="queue"):
                await engine.infer("pair", {"IDS": ids[:2], "MASK": ids[:2]}, timeout_ms=800.0)
            await first
        finally:
            await engine.stop()

    asyncio.run(main())
    refused = next(r for r in recorder.of(RequestRow) if r.outcome == "rejected")
    assert refused.input_shape_json == '{"IDS":[2],"MASK":[2]}'
    assert refused.timeout_ms == pytest.approx(800.0)


@pytest.mark.parametrize("writer_process", [False, True])
def test_a_batch_of_requests_keeps_its_shapes_and_timeouts_on_the_way_to_the_database(
        db, writer_process):
    block = RequestBatch("rt", "pair", 4, "ok", 10.5, 10.6, 1000.0, [0, 1, 0], [10.0, 10.1, 10.2],
                         [False, True, False], [7, 3, 7], [10.25, None, 11.2],
                         declared_shapes(PairModel.inputs))
    rows = block.rows()
    assert [(r.input_shape_json, r.timeout_ms) for r in rows] == [
        ('{"IDS":[7],"MASK":[7]}', pytest.approx(250.0)), ('{"IDS":[3],"MASK":[3]}', None),
        ('{"IDS":[7],"MASK":[7]}', pytest.approx(1000.0))]
    rec = Recorder(db, writer_process=writer_process)
    try:
        rec.put(block)
        assert rec.flush() == 3 and rec.dropped == 0
    finally:
        rec.close()
    assert stored(db, RequestRecord, RequestRow) == rows


PAIR_META = {"name": "pair", "inputs": [{"name": "IDS", "datatype": "INT64", "shape": [-1]},
                                        {"name": "MASK", "datatype": "INT64", "shape": [-1]}]}


@pytest.mark.parametrize("recorded, fits", [
    ('{"IDS":[5],"MASK":[5]}', True),
    ('{"IDS":[5]}', False),                         # an input missing
    ('{"IDS":[5,2],"MASK":[5,2]}', False),          # another rank
    ('{"IDS":[0],"MASK":[5]}', False),              # a dimension below 1
    ('{"IDS":["5"],"MASK":[5]}', False),
    ('not json', False), (None, False),
])
def test_a_recorded_shape_is_used_only_when_it_fits_the_metadata(recorded, fits):
    shaped = shaped_metadata(PAIR_META, recorded)
    assert (shaped is not None) == fits
    if fits:
        assert [i["shape"] for i in shaped["inputs"]] == [[5], [5]]
    fixed = {"name": "f", "inputs": [{"name": "X", "datatype": "FP32", "shape": [4]}]}
    assert shaped_metadata(fixed, '{"X":[5]}') is None and shaped_metadata(fixed, '{"X":[4]}')


@pytest.mark.both_backends
def test_replay_sends_the_recorded_shapes_and_timeouts(db):
    rec = Recorder(db)
    for i, (n, timeout) in enumerate([(3, 100.0), (6, None), (2, 40.0)]):
        rec.put(RequestRow("rt", "pair", i, 0, 10.0 + i, 10.1 + i, 0.0, 0.1, "ok", length=n,
                           input_shape_json=f'{{"IDS":[{n}],"MASK":[{n}]}}',
                           timeout_ms=None if timeout is None else timeout + 3e-9))
    rec.put(RequestRow("rt", "pair", 9, 0, 13.0, 13.1, 0.0, 0.1, "ok", length=4))  # an older row
    assert rec.flush() == 4
    traffic = read_traffic(db, "pair")
    assert traffic.timeouts_ms == (100.0, None, 40.0, None)
    assert "3 with their input shapes, 2 with their timeouts" in traffic.describe()
    docs = [orjson.loads(body) for body, _ in itertools.islice(replay_arrivals(traffic, PAIR_META), 4)]
    assert [[t["shape"] for t in d["inputs"]] for d in docs] == [[[3], [3]], [[6], [6]], [[2], [2]],
                                                                 [[4], [4]]]
    assert [d.get("parameters", {}).get("timeout") for d in docs] == [100_000, None, 40_000, None]


# -- end to end ---------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_real_session_is_stored_in_the_servers_database_with_its_instance(tmp_path):
    url = f"sqlite:///{tmp_path / 'served.db'}"
    service = Service({"double": DoubleModel()}, {"double": BatchingConfig(max_batch_size=8)},
                      ServerConfig(database_url=url, record=True, heartbeat_interval_s=0.5,
                                   device_sample_interval_s=0.2, recorder_process=False),
                      instance_id="tune-store")
    with ServiceThread(service) as runner:
        engine = make_engine(url)
        try:
            assert wait_until(lambda: control.live_instances(engine, now=time.time())
                              and store.hardware_of(engine, "tune-store") is not None
                              and store.hardware_of(engine, "tune-store").kind, 1000, 0.01)
            lines: list[str] = []
            result = run_tuning(TuneOptions(
                url=runner.url, model="double", slo_p99_ms=10_000.0, budget_s=4.0, concurrency=4,
                window_s=0.25, settle_s=0.05, warmup_s=0.2, min_requests=0, db_url=url,
                stability=Stability(windows=2, tolerance=0.95, max_windows=3),
                space=SpaceOptions(policies=("dynamic",), max_batch_sizes=(4, 16),
                                   queue_delays_ms=(None,), preferred=("none",))), say=lines.append)
            [s] = store.sessions(engine)
            assert result.stored_as == s.id and f"stored as tuning session #{s.id}" in result.storage
            assert any(line.startswith("session: stored as tuning session") for line in lines)
            assert (s.instance_id, s.state, s.requested_by) == ("tune-store", "finished", "cli")
            assert s.hardware.startswith(f"CPU, {os.cpu_count()} cores, ")
            assert s.trials == len([t for t in result.trials if t.status != "running"])
            assert s.sentence == result.sentence()
            # a database that is not there: refused before anything is sent, nothing created
            lines.clear()
            absent = f"sqlite:///{tmp_path / 'absent.db'}"
            with pytest.raises(TuningError, match=f"--db {absent} cannot be used, so nothing "
                                                  "was tuned: there is no SQLite database file"):
                run_tuning(TuneOptions(
                    url=runner.url, model="double", slo_p99_ms=10_000.0, budget_s=1.0,
                    concurrency=2, window_s=0.25, settle_s=0.05, warmup_s=0.1, min_requests=0,
                    db_url=absent, stability=Stability(windows=1, tolerance=0.95, max_windows=1)),
                    say=lines.append)
            assert lines == [] and not (tmp_path / "absent.db").exists()
            assert count(engine, TuningSessionRecord) == 1
        finally:
            engine.dispose()
