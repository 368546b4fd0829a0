"""The dashboard's Database URL box, driven through Streamlit's AppTest: what a visitor
types opens existing BatchScope databases only, creates nothing unless asked (and then
only a database file in a folder that exists), and never starts more than one demo
runtime per server process."""

from __future__ import annotations

import sqlite3
import stat
import sys
import time
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from batchscope.dashboard import demo
from batchscope.storage import control
from batchscope.storage.db import make_engine, schema_version
from batchscope.testing import synthetic

APP = str(Path(__file__).resolve().parent.parent / "app.py")


@pytest.fixture()
def configured(tmp_path, monkeypatch):
    """The configured database holds a synthetic runtime that reported until now."""
    url = f"sqlite:///{tmp_path / 'configured.db'}"
    engine = make_engine(url)
    synthetic.generate(engine, synthetic.SCENARIOS["healthy"].with_(duration_s=120,
                                                                    batches_per_s=2),
                       end_s=time.time())
    monkeypatch.setenv("BATCHSCOPE_DB_URL", url)
    monkeypatch.setenv("BATCHSCOPE_NO_DEMO", "1")
    yield url
    engine.dispose()


def start(url_typed: str | None = None, *, create: bool = False) -> AppTest:
    at = AppTest.from_file(APP, default_timeout=60).run()
    assert not at.exception, [e.value for e in at.exception]
    if url_typed is not None:
        at.text_input(key="db_url").set_value(url_typed).run()
        assert not at.exception, [e.value for e in at.exception]
        if create:
            at.checkbox(key="db_create").check().run()
            assert not at.exception, [e.value for e in at.exception]
    return at


def refusals(at: AppTest) -> list[str]:
    return [e.value for e in at.sidebar.error if e.value.startswith("Not opened")]


def shown_instances(at: AppTest) -> list[str]:
    return [o.removesuffix(" (live)") for o in at.selectbox(key="instance").options]


def tree(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def test_the_configured_database_opens_without_a_refusal(configured):
    at = start()
    assert refusals(at) == []
    assert "synthetic-1" in shown_instances(at)


def test_a_path_in_a_missing_folder_creates_nothing(configured, tmp_path):
    before = tree(tmp_path)
    at = start(f"sqlite:///{tmp_path / 'new' / 'deep' / 'x.db'}")
    [message] = refusals(at)
    assert "there is no database at" in message and "Showing the configured database" in message
    # even when asked to create, no folder is made
    at.checkbox(key="db_create").check().run()
    [message] = refusals(at)
    assert "does not exist; the dashboard does not create folders" in message
    assert tree(tmp_path) == before
    assert "synthetic-1" in shown_instances(at)   # the configured database is what shows


def test_a_missing_file_is_created_only_when_asked(configured, tmp_path):
    path = tmp_path / "fresh.db"
    at = start(f"sqlite:///{path}")
    assert refusals(at) and not path.exists()
    at.checkbox(key="db_create").check().run()
    assert not at.exception and refusals(at) == []
    assert path.exists() and stat.S_IMODE(path.stat().st_mode) & 0o077 == 0
    engine = make_engine(f"sqlite:///{path}", create=False)
    try:
        assert schema_version(engine) is not None
    finally:
        engine.dispose()
    assert shown_instances(at) == ["all"]   # the new, empty database is what shows


def test_only_database_file_names_are_created(configured, tmp_path):
    target = tmp_path / "notes.txt"
    at = start(f"sqlite:///{target}", create=True)
    [message] = refusals(at)
    assert "must be named" in message and not target.exists()


@pytest.mark.parametrize("label, url, reason", [
    ("network database", "postgresql://db.internal:5432/prod", "not a SQLite database file URL"),
    ("in memory", "sqlite://", "not a SQLite database file URL"),
    ("options", "sqlite:///file:x.db?mode=rwc&uri=true", "not a SQLite database file URL"),
    ("garbage", "::::", "not a SQLite database file URL"),
])
def test_urls_that_are_not_sqlite_files_are_refused(configured, label, url, reason):
    at = start(url)
    [message] = refusals(at)
    assert reason in message
    assert "synthetic-1" in shown_instances(at)


def test_files_that_are_not_batchscope_databases_are_left_alone(configured, tmp_path):
    text = tmp_path / "passwords.db"
    text.write_text("not a database")
    other = tmp_path / "someone.db"
    with sqlite3.connect(other) as conn:
        conn.execute("CREATE TABLE secrets (v TEXT)")
    other_bytes = other.read_bytes()
    at = start(f"sqlite:///{text}", create=True)
    [message] = refusals(at)
    assert "is not a SQLite database" in message and text.read_text() == "not a database"
    at.text_input(key="db_url").set_value(f"sqlite:///{other}").run()
    [message] = refusals(at)
    assert "not a BatchScope one" in message
    assert other.read_bytes() == other_bytes      # no table added to someone else's database
    at.text_input(key="db_url").set_value(f"sqlite:///{tmp_path}").run()
    [message] = refusals(at)
    assert "is not a file" in message


def test_another_batchscope_database_is_opened(configured, tmp_path):
    url = f"sqlite:///{tmp_path / 'other.db'}"
    engine = make_engine(url)
    control.register_instance(engine, instance_id="other-1", host="h", pid=1, models=["mlp"],
                              url=None, device="cpu", version="1", now=time.time() - 3600)
    engine.dispose()
    at = start(url)
    assert refusals(at) == []
    assert "other-1" in shown_instances(at) and "synthetic-1" not in shown_instances(at)


@pytest.fixture()
def fake_demo(monkeypatch):
    """The demo runtime replaced by a process that only sleeps; the server's slot empty."""
    monkeypatch.setattr(demo.DemoRuntime, "argv",
                        staticmethod(lambda url: [sys.executable, "-c", "import time; time.sleep(60)"]))
    demo.demo_slot.clear()
    yield
    slot = demo.demo_slot()
    if slot.runtime is not None:
        slot.runtime.stop()
    demo.demo_slot.clear()


def test_at_most_one_demo_runtime_whatever_is_typed(tmp_path, monkeypatch, fake_demo):
    url = f"sqlite:///{tmp_path / 'empty.db'}"    # nothing reports here: the demo starts
    make_engine(url).dispose()
    others = []
    for i in range(3):
        other = f"sqlite:///{tmp_path / f'other{i}.db'}"
        make_engine(other).dispose()
        others.append(other)
    monkeypatch.setenv("BATCHSCOPE_DB_URL", url)
    monkeypatch.delenv("BATCHSCOPE_NO_DEMO", raising=False)
    at = start()
    slot = demo.demo_slot()
    assert slot.starts == 1 and slot.runtime.url == url and slot.runtime.running()
    assert any("demo runtime was started" in i.value for i in at.info)
    for other in others:   # other databases, nobody reporting: no demo for them
        at.text_input(key="db_url").set_value(other).run()
        assert not at.exception
        assert any("the demo runtime only records into" in w.value for w in at.warning)
    at.text_input(key="db_url").set_value(url).run()
    assert any("demo runtime was started" in i.value for i in at.info)
    second = start()       # another session of the same server
    assert not second.exception
    assert slot.starts == 1 and demo.demo_slot() is slot


def test_the_demo_records_where_the_dashboard_reads_from_any_folder(tmp_path, monkeypatch):
    """The demo runs in the checkout's root; a relative SQLite path is the dashboard's
    working folder's, so the demo is handed it made absolute."""
    monkeypatch.chdir(tmp_path)
    assert demo.absolute_sqlite_url("sqlite:///data/batchscope.db") == \
        f"sqlite:///{tmp_path / 'data' / 'batchscope.db'}"
    for url in (f"sqlite:///{tmp_path / 'x.db'}", "postgresql+psycopg://u:p@db:5432/bs"):
        assert demo.absolute_sqlite_url(url) == url
    seen = []
    monkeypatch.setattr(demo.DemoRuntime, "argv", staticmethod(
        lambda url: seen.append(url) or [sys.executable, "-c", "pass"]))
    runtime = demo.DemoRuntime("sqlite:///data/batchscope.db")
    runtime.proc.wait(timeout=60)
    assert seen == [f"sqlite:///{tmp_path / 'data' / 'batchscope.db'}"]
    assert runtime.url == "sqlite:///data/batchscope.db"  # what the dashboard compares



def test_a_configured_database_that_cannot_be_reached_is_said_in_one_box(monkeypatch):
    # a PostgreSQL URL at a port nothing listens on (1): no traceback, the box stays usable
    monkeypatch.setenv("BATCHSCOPE_DB_URL", "postgresql+psycopg://u:secret@127.0.0.1:1/db")
    monkeypatch.setenv("BATCHSCOPE_NO_DEMO", "1")
    at = AppTest.from_file(APP, default_timeout=60).run()
    assert not at.exception, [e.value for e in at.exception]
    [box] = [e.value for e in at.error]
    assert box.startswith("The database at postgresql+psycopg://u:***@127.0.0.1:1/db cannot "
                          "be opened") and "secret" not in box
    assert at.text_input(key="db_url").value.endswith("127.0.0.1:1/db")
