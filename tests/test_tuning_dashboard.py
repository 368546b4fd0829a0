"""The Tuning page's "Find best settings" panel (AppTest) against a real server that
records into the dashboard's database: the form starts a session on the URL the
instance registered and Cancel puts the starting settings back; a finished session
shows its trials, its sentence and an Apply button that queues the recommendation as a
control command requested by the tuner."""

from __future__ import annotations

from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from batchscope.storage import control
from batchscope.storage.db import make_engine
from batchscope.tuning.figures import Stability
from batchscope.tuning.runner import TuneOptions, TuningJob
from batchscope.tuning.space import SpaceOptions, format_point
from runtime.api.config import BatchingConfig, ServerConfig
from runtime.models.toys import DoubleModel
from runtime.server.service import Service, ServiceThread
from tests.factories import wait_until

pytestmark = pytest.mark.slow

APP = str(Path(__file__).resolve().parent.parent / "app.py")
PAGE = "batchscope/dashboard/pages/tuning.py"
INSTANCE = "tune-dash"
#: a start that breaks a 150 ms SLO (static waits 200 ms for 64 requests that never come)
SLOW_START = BatchingConfig(policy="static", max_batch_size=64, static_max_wait_ms=200.0)


@pytest.fixture()
def recorded_server(tmp_path, monkeypatch):
    url = f"sqlite:///{tmp_path / 'dash.db'}"
    monkeypatch.setenv("BATCHSCOPE_DB_URL", url)
    monkeypatch.setenv("BATCHSCOPE_NO_DEMO", "1")
    service = Service({"double": DoubleModel()}, {"double": SLOW_START},
                      ServerConfig(database_url=url, record=True, heartbeat_interval_s=0.5,
                                   recorder_process=False),
                      instance_id=INSTANCE)
    with ServiceThread(service) as runner:
        engine = make_engine(url)
        assert wait_until(lambda: control.current_settings(engine, INSTANCE, "double"), 1000,
                          0.01)
        yield runner.url, service, engine
        engine.dispose()


def tuning_page() -> AppTest:
    at = AppTest.from_file(APP, default_timeout=60).run()
    at.switch_page(PAGE).run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def test_the_form_starts_a_session_on_the_instance_url_and_cancel_restores(recorded_server):
    url, service, _ = recorded_server
    at = tuning_page()
    assert any(s.value == "Find best settings" for s in at.subheader)
    next(n for n in at.number_input if n.label.startswith("SLO")).set_value(150.0)
    next(n for n in at.number_input if n.label == "Connections (closed loop)").set_value(4)
    next(b for b in at.button if b.label == "Find best settings").click().run()
    job = at.session_state["tuning_jobs"][f"{INSTANCE}/double"]
    assert job.options.url == url and job.options.slo_p99_ms == 150.0
    assert job.options.concurrency == 4 and job.options.load == "synthetic"
    # once trial 1 (the first after the starting settings) was measured, cancel from the page
    assert wait_until(lambda: job.progress is not None and len(job.progress.rows) >= 2,
                      3000, 0.02), job.lines
    at.run()
    next(b for b in at.button if b.label == "Cancel the session").click().run()
    assert job.join(30)
    assert job.result is not None and job.result.stop_reason == "cancelled"
    now = service.engine.get_settings("double")[1]
    assert (now.policy, now.max_batch_size, now.static_max_wait_ms) == ("static", 64, 200.0)


def test_a_finished_session_shows_its_trials_and_applies_through_the_control_table(
        recorded_server):
    url, _, engine = recorded_server
    job = TuningJob(TuneOptions(
        url=url, model="double", slo_p99_ms=150.0, budget_s=30.0, concurrency=4, grid=True,
        window_s=0.25, settle_s=0.05, warmup_s=0.2, min_requests=0,
        stability=Stability(windows=2, tolerance=0.95, max_windows=3),
        space=SpaceOptions(policies=("dynamic",), max_batch_sizes=(4,), queue_delays_ms=(None,),
                           preferred=("none",), batch_tokens=()))).start()
    assert job.join(60) and job.result is not None, job.error
    recommended = job.result.recommended
    assert recommended and job.result.baseline.problem.startswith("p99")
    at = AppTest.from_file(APP, default_timeout=60)
    at.session_state["tuning_jobs"] = {f"{INSTANCE}/double": job}
    at.run()
    at.switch_page(PAGE).run()
    assert not at.exception, [e.value for e in at.exception]
    assert any("meets p99 <= 150 ms" in s.value for s in at.success)
    charts = [c for c in at.get("plotly_chart") if "Tuning trials" in c.proto.spec]
    assert charts
    apply = next(b for b in at.button if b.label == f"Apply {format_point(recommended)}")
    apply.click().run()
    cmd = control.recent_commands(engine, model="double", limit=1)[0]
    assert cmd.requested_by == "tuner" and cmd.instance_id == INSTANCE
    assert cmd.changes == recommended
    assert wait_until(lambda: control.command_status(engine, cmd.id).status == "applied",
                      1000, 0.02)
