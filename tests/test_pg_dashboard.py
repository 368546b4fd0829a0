"""The Streamlit app against PostgreSQL: every page a visitor opens renders its charts,
diagnosis and controls without an error (the same app test as on SQLite)."""

from __future__ import annotations

import pytest
from sqlalchemy import inspect
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


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_a_table_locked_by_another_program_is_said_on_the_page_not_waited_for(app_db,
                                                                            backend):
    """A migration's ALTER TABLE holds an exclusive lock on its table; a page behind it
    waited for ever. Its reads now give up after ``lock_timeout`` (``db.bounded_url``)
    and the page says why in one line, no stack trace: the whole page when the sidebar's
    own reads are locked out, the Live region alone when only its tables are; once the
    lock is released the page draws again."""
    with app_db.connect() as holder:
        holder.exec_driver_sql("BEGIN")
        holder.exec_driver_sql("LOCK TABLE batches, requests IN ACCESS EXCLUSIVE MODE")
        at = AppTest.from_file(APP, default_timeout=60).run()
        assert not at.exception, [e.value for e in at.exception]
        said = [e.value for e in at.error]
        assert any(s.startswith("The database is busy: another program held a lock on it "
                                "for longer than the 5 s") and "lock timeout" in s
                   for s in said), said
        assert at.sidebar.selectbox and at.title[0].value == "BatchScope"  # the rest drew
        names = ", ".join(sorted(inspect(holder).get_table_names()))
        holder.exec_driver_sql(f"LOCK TABLE {names} IN ACCESS EXCLUSIVE MODE")
        at = AppTest.from_file(APP, default_timeout=60).run()
        assert not at.exception, [e.value for e in at.exception]
        assert [e.value for e in at.error if e.value.startswith("The database is busy")]
        holder.exec_driver_sql("ROLLBACK")
    at.run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    assert len(at.get("plotly_chart")) >= 10
