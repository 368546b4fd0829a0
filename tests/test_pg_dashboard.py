"""The Streamlit app against PostgreSQL: every page a visitor opens renders its charts,
diagnosis and controls without an error (the same app test as on SQLite)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from batchscope.storage import control
from batchscope.storage.db import make_engine
from batchscope.testing import synthetic

APP = str(Path(__file__).resolve().parent.parent / "app.py")
PAGES = "batchscope/dashboard/pages"


@pytest.fixture()
def pg_app(db_url, monkeypatch):
    engine = make_engine(db_url)
    synthetic.generate(engine, synthetic.SCENARIOS["oom"].with_(
        duration_s=300, batches_per_s=4, settings_changes=((0.5, {"max_batch_size": 16}),)),
        end_s=time.time())
    monkeypatch.setenv("BATCHSCOPE_DB_URL", db_url)
    monkeypatch.setenv("BATCHSCOPE_NO_DEMO", "1")
    yield engine
    engine.dispose()


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_every_page_renders_on_postgresql(pg_app, backend):
    at = AppTest.from_file(APP, default_timeout=60).run()
    assert not at.exception, [e.value for e in at.exception]
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["mean batch / max"].endswith("/ 16") and metrics["latency p99"].endswith("ms")
    assert any("Out of memory 2 time(s)" in e.label for e in at.expander)
    assert len(at.get("plotly_chart")) >= 10
    for page in ("tuning", "snapshots", "fleet"):
        at.switch_page(f"{PAGES}/{page}.py").run()
        assert not at.exception, (page, [e.value for e in at.exception])
    at.switch_page(f"{PAGES}/tuning.py").run()
    box = next(n for n in at.number_input if n.label == "Max batch size")
    box.set_value(24)
    next(b for b in at.button if b.label == "Apply").click()
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    assert [c.changes for c in control.recent_commands(pg_app, model="mlp")] == [{"max_batch_size": 24}]
