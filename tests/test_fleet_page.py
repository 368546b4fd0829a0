"""The Fleet page rendered with AppTest on a recorded fleet (no demo runtime)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import yaml
from streamlit.testing.v1 import AppTest

from batchscope.storage import control
from batchscope.storage.db import make_engine
from batchscope.storage.records import DeviceRow
from batchscope.storage.recorder import Recorder
from batchscope.testing import synthetic


def fleet_app() -> None:
    """The entry script's part the page needs: the sidebar's scope, then the page."""
    from batchscope.dashboard import fleet, scope

    scope.remember(scope.from_sidebar())
    fleet.render(scope.current())


@pytest.fixture()
def fleet_db(tmp_path, monkeypatch):
    """mlp on a saturated replica ``busy`` and a nearly idle ``calm`` (with a smaller
    max_batch_size); ``spare`` serves
    encoder without any traffic and started first, so the sidebar opens on it; all live."""
    url = f"sqlite:///{tmp_path / 'fleet.db'}"
    engine = make_engine(url)
    now = time.time()
    busy = synthetic.generate(engine, synthetic.SCENARIOS["saturation"].with_(
        instance_id="busy", duration_s=240, batches_per_s=3), end_s=now)
    calm = synthetic.generate(engine, synthetic.HEALTHY.with_(
        instance_id="calm", duration_s=240, batches_per_s=1, batch_size_mean=2.0, max_batch_size=16,
        queue_depth_start=0, queue_depth_end=0), end_s=now, seed=1)
    control.register_instance(engine, instance_id="spare", host="h", pid=1, models=["encoder"],
                              url=None, device="cpu", version="test", now=now - 300)
    control.heartbeat(engine, "spare", now)
    rec = Recorder(engine, flush_interval_s=0.01)
    # a minute old at the latest: inside the page's history however it rounds its end
    rec.put_many([DeviceRow(instance_id="spare", at=now - 260 + i, device="cpu", kind="cpu",
                            utilization_pct=20.0, process_rss_bytes=2 ** 30) for i in range(200)])
    rec.flush()
    rec.close()
    monkeypatch.setenv("BATCHSCOPE_DB_URL", url)
    monkeypatch.setenv("BATCHSCOPE_NO_DEMO", "1")
    yield engine, np.concatenate([busy.latencies_ok_s, calm.latencies_ok_s]), now
    engine.dispose()


def run_page() -> AppTest:
    at = AppTest.from_function(fleet_app, default_timeout=60).run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def test_opens_on_the_model_and_instance_with_traffic(fleet_db):
    at = run_page()
    assert at.sidebar.selectbox(key="model").value == "encoder"  # no traffic there
    assert at.selectbox(key="fleet_model").value == "mlp"
    assert at.selectbox(key="fleet_instance").value == "busy"
    table = at.dataframe[0].value
    assert list(table["instance"]) == ["busy", "calm"]
    assert set(table["state"]) == {"🟢 live"}


def test_fleet_percentiles_are_exact_over_every_replica(fleet_db):
    _, latencies, _ = fleet_db
    at = run_page()
    metrics = {m.label: m.value for m in at.metric}
    p99 = np.percentile(latencies, 99, method="inverted_cdf")
    assert metrics["fleet p99"] == f"{p99 * 1000:.1f} ms"
    assert metrics["replicas live / all"] == "2 / 2"


def test_fleet_flags_and_recommendations_render(fleet_db):
    _, _, now = fleet_db
    at = run_page()
    assert any("is saturated while 1 other replica(s) idle" in e.label for e in at.expander)
    assert any("run different settings (max_batch_size)" in e.label for e in at.expander)
    labels = [b.label for b in at.get("download_button")]
    assert labels == ["VerticalPodAutoscaler (YAML)", "resources: block (YAML)",
                      "recommendation with evidence (JSON)"]
    block = yaml.safe_load(at.code[0].value)
    assert block["resources"]["limits"]["nvidia.com/gpu"] == 1  # the synthetic replicas sample a GPU
    # pick the CPU instance: its CPU comes from the utilization, its memory from the RSS
    at.selectbox(key="rec_pick").set_value("instance spare").run()
    assert not at.exception
    block = yaml.safe_load(at.code[0].value)
    assert set(block["resources"]["requests"]) == {"cpu", "memory"}
    evidence = at.dataframe[-1].value
    assert list(evidence["resource"]) == ["cpu", "memory"]
    minutes = {int((now - 260 + i) // 60) for i in range(200)}  # its samples, one a minute
    assert int(evidence.set_index("resource").loc["memory", "samples"]) == len(minutes)


def test_an_empty_database_says_so(tmp_path, monkeypatch):
    url = f"sqlite:///{tmp_path / 'empty.db'}"
    make_engine(url).dispose()
    monkeypatch.setenv("BATCHSCOPE_DB_URL", url)
    monkeypatch.setenv("BATCHSCOPE_NO_DEMO", "1")
    at = run_page()
    assert any("No instance has registered" in i.value for i in at.info)
