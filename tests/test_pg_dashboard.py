"""The Streamlit app against PostgreSQL: every page a visitor opens renders its charts,
diagnosis and controls without an error (the same app test as on SQLite)."""

from __future__ import annotations

import pytest
from streamlit.testing.v1 import AppTest

from batchscope.storage import control
from tests.factories import APP, PAGES

@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_every_page_renders_on_postgresql(app_db, backend):
    at = AppTest.from_file(APP, default_timeout=60).run()
    assert not at.exception, [e.value for e in at.exception]
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["mean batch / max"].endswith("/ 16") and metrics["latency p99"].endswith("ms")
    assert any("Out of memory 2 time(s)" in e.label for e in at.expander)
    assert len(at.get("plotly_chart")) >= 10
    for page in ("timeline", "tuning", "snapshots", "fleet"):
        at.switch_page(f"{PAGES}/{page}.py").run()
        assert not at.exception, (page, [e.value for e in at.exception])
    at.switch_page(f"{PAGES}/tuning.py").run()
    box = next(n for n in at.number_input if n.label == "Max batch size")
    box.set_value(24)
    next(b for b in at.button if b.label == "Apply").click()
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    assert [c.changes for c in control.recent_commands(app_db, model="mlp")] == [{"max_batch_size": 24}]
