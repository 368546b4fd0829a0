"""Tuning sessions against a real server on 127.0.0.1 (in-process, toy models): the
settings change through the control API while the session runs and are put back at the
end (or the best kept with ``apply``), for synthetic load, replayed recorded traffic and
live traffic. Budgets are seconds; outcomes asserted are counts and settings, not speed."""

from __future__ import annotations

import threading
import time

import pytest
from sqlalchemy.orm import Session

from batchscope.load.background import BackgroundLoad
from batchscope.storage.schema import RequestRecord
from batchscope.tuning.client import ControlClient, TuningError
from batchscope.tuning.figures import Stability
from batchscope.tuning.runner import TuneOptions, drain_backlog, run_tuning
from batchscope.tuning.space import SpaceOptions
from runtime.api.config import BatchingConfig, ServerConfig
from runtime.models.toys import DoubleModel, VarLenModel
from runtime.server.auth import AuthConfig
from runtime.server.service import Service, ServiceThread

pytestmark = pytest.mark.slow

TUNED = ("policy", "max_batch_size", "max_queue_delay_ms", "preferred_batch_sizes")
#: lenient enough that every trial counts on a busy machine: the tests are about the API
EASY = Stability(windows=2, tolerance=0.95, max_windows=3)
SMALL = SpaceOptions(policies=("dynamic",), max_batch_sizes=(4, 16), queue_delays_ms=(None, 1.0),
                     preferred=("none",), batch_tokens=())
TOKEN = "tuning-test-token-0123456789"


@pytest.fixture(scope="module")
def served():
    service = Service({"double": DoubleModel(), "varlen": VarLenModel()},
                      {"double": BatchingConfig(max_batch_size=8),
                       "varlen": BatchingConfig(max_batch_size=8, bucket_edges=(32, 64))},
                      ServerConfig(record=False))
    changes: list[tuple[str, int, dict]] = []
    service.engine.on_settings_change.append(
        lambda model, version, config: changes.append((model, version, config.to_dict())))
    with ServiceThread(service) as runner:
        yield runner.url, changes


def options(url: str, model: str = "double", **extra) -> TuneOptions:
    base = dict(url=url, model=model, slo_p99_ms=10_000.0, budget_s=4.0, concurrency=4,
                window_s=0.25, settle_s=0.05, warmup_s=0.2, stability=EASY, min_requests=0, space=SMALL)
    return TuneOptions(**{**base, **extra})


def settings(url: str, model: str) -> tuple[int, dict]:
    doc = ControlClient(url, model).batching()
    return doc["version"], doc["settings"]


def test_a_session_changes_settings_through_the_api_and_puts_them_back(served):
    url, changes = served
    version, before = settings(url, "double")
    seen = len(changes)
    result = run_tuning(options(url))
    after_version, after = settings(url, "double")
    mine = [c for c in changes[seen:] if c[0] == "double"]
    assert result.measured >= 2 and len(mine) >= 2          # a trial's change, then back
    assert {c[2]["max_batch_size"] for c in mine} > {8}      # other sizes were served
    assert after_version == version + len(mine)
    assert {k: after[k] for k in TUNED} == {k: before[k] for k in TUNED}
    assert result.outcome == "restored the starting settings"
    assert result.trials[0].changes == {} and result.trials[0].figures.ok > 0
    assert "trials" in result.sentence()


def test_apply_leaves_the_best_point_running(served):
    url, _ = served
    result = run_tuning(options(url, grid=True, apply=True, budget_s=30.0))
    assert result.best is not None and result.measured == 6  # max batch 4, 8, 16 x null, 1 ms
    _, now = settings(url, "double")
    assert {k: now[k] for k in TUNED} == result.best.point
    ControlClient(url, "double").change({k: v for k, v in result.start.items()})


def test_variable_length_models_get_bucket_edges_to_the_longest_length(served):
    url, changes = served
    seen = len(changes)
    space = SpaceOptions(policies=("dynamic",), max_batch_sizes=(8,), queue_delays_ms=(None,),
                         preferred=("none",), edge_steps=(16,), batch_tokens=())
    result = run_tuning(options(url, "varlen", lengths="uniform:4:60", space=space, grid=True,
                                budget_s=20.0))
    points = [t.point["bucket_edges"] for t in result.trials]
    assert points[0] == [32, 64] and [16, 32, 48, 64] in points
    assert any(c[2]["bucket_edges"] == [16, 32, 48, 64] for c in changes[seen:])
    assert settings(url, "varlen")[1]["bucket_edges"] == [32, 64]


def test_a_variable_length_model_gets_its_token_limit_tried_and_put_back(served):
    url, changes = served
    seen = len(changes)
    space = SpaceOptions(policies=("dynamic",), max_batch_sizes=(8,), queue_delays_ms=(None,),
                         preferred=("none",), edge_steps=(32,), batch_tokens=(64,))
    result = run_tuning(options(url, "varlen", lengths="uniform:4:60", space=space, grid=True,
                                budget_s=20.0))
    tried = {t.point["max_batch_tokens"] for t in result.trials}
    assert tried == {None, 64}
    assert any(c[2].get("max_batch_tokens") == 64 for c in changes[seen:])
    assert settings(url, "varlen")[1]["max_batch_tokens"] is None  # the start, put back


def test_replay_sends_the_recorded_lengths_on_the_recorded_schedule(served, db, db_url):
    url, _ = served
    now = time.time() - 60
    with Session(db) as s:
        s.add_all(RequestRecord(instance_id="rec", model="varlen", priority=1, length=8 + k % 40,
                                arrived_at=now + 0.005 * k, finished_at=now + 0.005 * k + 0.01,
                                queue_wait_s=0.0, latency_s=0.01, outcome="ok")
                  for k in range(400))
        s.commit()
    result = run_tuning(options(url, "varlen", load="replay", db_url=db_url, budget_s=3.0,
                                space=SpaceOptions(policies=("dynamic",), max_batch_sizes=(8,),
                                                   queue_delays_ms=(None,), preferred=("none",),
                                                   edge_steps=(16,), batch_tokens=())))
    # the edges reach the longest recorded length (47), the load ran at the recorded 200/s
    assert [16, 32, 48] in [t.point["bucket_edges"] for t in result.trials]
    base = result.trials[0].figures
    assert base is not None and 100 <= base.throughput_rps <= 300
    assert result.outcome == "restored the starting settings"


def test_live_measures_the_servers_own_figures(served):
    url, _ = served
    with BackgroundLoad(url, "double", rate=300.0, seed=5):
        time.sleep(0.5)
        result = run_tuning(options(url, load="live", window_s=0.5, budget_s=4.0))
    base = result.trials[0].figures
    assert base is not None and 150 <= base.throughput_rps <= 450 and base.p99_ms is not None
    assert {k: settings(url, "double")[1][k] for k in TUNED} == result.start


def test_a_token_server_needs_the_token():
    service = Service({"double": DoubleModel()}, None, ServerConfig(record=False),
                      auth=AuthConfig(token=TOKEN))
    with ServiceThread(service) as runner:
        with pytest.raises(TuningError, match="control token"):
            run_tuning(options(runner.url, budget_s=2.0))
        result = run_tuning(options(runner.url, budget_s=2.0, token=TOKEN))
        assert result.outcome == "restored the starting settings" and result.measured >= 1


def test_a_paused_open_loop_lets_the_server_work_off_a_backlog():
    """A held model builds a real queue under an open loop; ``drain_backlog`` stops the
    arrivals, the queue empties once the model runs again, and the load goes on."""
    hold = threading.Event()
    model = DoubleModel(hold=hold)
    service = Service({"double": model}, {"double": BatchingConfig(max_batch_size=4)},
                      ServerConfig(record=False))
    with ServiceThread(service) as runner, BackgroundLoad(runner.url, "double", rate=400.0,
                                                          seed=2) as load:
        assert model.entered.wait(10)
        for _ in range(200):          # at most 10 s for 40 requests to queue up
            if load.in_flight >= 40:
                break
            time.sleep(0.05)
        assert load.in_flight >= 40
        sent_during_pause: list[int] = []

        def wait(seconds: float) -> bool:
            hold.set()                # the model runs again once the load is paused
            sent_during_pause.append(load.tally.sent)
            time.sleep(seconds)
            return False

        said = drain_backlog(load, slo_p99_ms=10.0, limit_s=10.0, clock=time.perf_counter,
                             wait=wait)
        assert said is not None and "worked off the" in said and "still open" not in said
        assert load.in_flight == 0 and len(set(sent_during_pause)) == 1
        sent = load.tally.sent
        for _ in range(200):          # resumed: the arrivals are sent again
            if load.tally.sent > sent:
                break
            time.sleep(0.05)
        assert load.tally.sent > sent
        # nothing to work off now: no pause
        assert drain_backlog(load, slo_p99_ms=10_000.0, limit_s=10.0, clock=time.perf_counter,
                             wait=wait) is None
