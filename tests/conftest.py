"""Fixtures shared by the whole suite.

Plain helpers (row factories, read-back helpers, bounded waits, toy model sources)
live in ``tests/factories.py``; test modules import from there, never from each other.

Databases
---------
``db_url`` / ``db`` give each test a fresh database: a SQLite file in the test's own
folder, or, for a test marked ``both_backends``, also a new database on a throw-away
PostgreSQL server (pytest-postgresql's ``postgresql_proc`` with the server binaries of
Debian's ``postgresql`` package, started once per session, only when a test asks for
it). A module that fills one database for all its tests uses ``backend`` with
``new_database_url`` in a module-scoped fixture of its own.

Without PostgreSQL binaries the PostgreSQL tests fail, naming what to install
(``tests/run.sh`` installs them); they are never skipped quietly. To run SQLite only on
purpose: ``BATCHSCOPE_TEST_BACKENDS=sqlite``.

PostgreSQL refuses to run as root. Run as root (a CI container), ``pg_ctl`` is
started through a small wrapper that runs it as the ``postgres`` user (``runuser``),
gives that user its data folder and log file, and lets it through the folders above
them (``o+x`` on the session's temporary folders).
"""

from __future__ import annotations

import atexit
import glob
import os
import shutil
import stat
import time
import tempfile
import uuid
from pathlib import Path

import pytest
from pytest_postgresql import factories
from pytest_postgresql.janitor import DatabaseJanitor

from batchscope.storage.db import make_engine

#: no test may start the real demo runtime by opening the app (it would keep running and
#: recording into data/batchscope.db); the test of the demo's start removes this itself
os.environ.setdefault("BATCHSCOPE_NO_DEMO", "1")

BACKENDS_ENV = "BATCHSCOPE_TEST_BACKENDS"
BACKENDS = tuple(b for b in os.environ.get(BACKENDS_ENV, "sqlite,postgresql").split(",") if b)
PG_CTL_ENV = "BATCHSCOPE_TEST_PG_CTL"


def find_pg_ctl() -> str | None:
    """The PostgreSQL server's ``pg_ctl``: $BATCHSCOPE_TEST_PG_CTL, then the newest of
    Debian's /usr/lib/postgresql/<version>/bin, then PATH."""
    given = os.environ.get(PG_CTL_ENV)
    if given:
        return given if os.access(given, os.X_OK) else None
    debian = glob.glob("/usr/lib/postgresql/*/bin/pg_ctl")
    if debian:
        return max(debian, key=_major_version)
    found = shutil.which("pg_ctl")
    return os.path.realpath(found) if found else None


def _major_version(pg_ctl: str) -> int:
    name = Path(pg_ctl).parent.parent.name  # /usr/lib/postgresql/<version>/bin/pg_ctl
    return int(name) if name.isdigit() else 0


#: run as root, pg_ctl goes through this (in a folder only root can write)
_AS_POSTGRES = """#!/bin/sh
# pg_ctl as the postgres user, which owns the data folder and log file it is given
set -e
prev=
for arg in "$@"; do
  case $prev in
    -D|--pgdata)
      mkdir -p "$arg" && chown postgres "$arg" && chmod 700 "$arg"
      dir=$(dirname "$arg")
      while [ "$dir" != / ]; do chmod o+x "$dir"; dir=$(dirname "$dir"); done ;;
    -l|--log) touch "$arg" && chown postgres "$arg" ;;
  esac
  prev=$arg
done
exec runuser -u postgres -- "{pg_ctl}" "$@"
"""


def _pg_ctl_for_tests() -> str:
    real = find_pg_ctl()
    if real is None or os.geteuid() != 0:
        return real or "pg_ctl"
    folder = tempfile.mkdtemp(prefix="batchscope-pg-")
    atexit.register(shutil.rmtree, folder, True)
    wrapper = Path(folder) / "pg_ctl"
    wrapper.write_text(_AS_POSTGRES.format(pg_ctl=real))
    wrapper.chmod(stat.S_IRWXU)
    return str(wrapper)


postgresql_proc = factories.postgresql_proc(executable=_pg_ctl_for_tests())


def pytest_configure(config) -> None:
    config.addinivalue_line(
        "markers", "both_backends: runs on SQLite and on PostgreSQL (db_url, db, backend)")


def pytest_generate_tests(metafunc) -> None:
    if "backend" not in metafunc.fixturenames or not metafunc.definition.get_closest_marker("both_backends"):
        return
    for mark in metafunc.definition.iter_markers("parametrize"):  # a test that names its own
        names = mark.args[0]
        if "backend" in (names.replace(" ", "").split(",") if isinstance(names, str) else names):
            return
    metafunc.parametrize("backend", BACKENDS, indirect=True, scope="module")


@pytest.fixture(scope="module")
def backend(request) -> str:
    """``sqlite``, or for a test marked ``both_backends`` each of ``BACKENDS`` in turn."""
    return getattr(request, "param", "sqlite")


def _require_postgresql() -> None:
    if find_pg_ctl() is None:
        pytest.fail("PostgreSQL server binaries (pg_ctl) were not found: install Debian's "
                    "'postgresql' package (bash tests/run.sh does), point "
                    f"{PG_CTL_ENV} at pg_ctl, or set {BACKENDS_ENV}=sqlite to leave "
                    "PostgreSQL out on purpose", pytrace=False)
    if os.geteuid() == 0 and shutil.which("runuser") is None:
        pytest.fail("running as root, PostgreSQL needs runuser (util-linux) to start as the "
                    "postgres user", pytrace=False)


class PgDatabases:
    """New databases on the session's PostgreSQL server, all dropped at its end."""

    def __init__(self, server) -> None:
        self.server = server
        self.janitors: dict[str, DatabaseJanitor] = {}

    def create(self) -> str:
        """A new database's URL."""
        pg = self.server
        name = f"bs_{uuid.uuid4().hex[:12]}"
        janitor = DatabaseJanitor(user=pg.user, host=pg.host, port=pg.port, dbname=name,
                                  password=pg.password)
        janitor.init()
        url = f"postgresql+psycopg://{pg.user}@{pg.host}:{pg.port}/{name}"
        self.janitors[url] = janitor
        return url

    def drop(self, url: str) -> None:
        """Drop the database (closing what is still connected to it)."""
        janitor = self.janitors.pop(url, None)
        if janitor is not None:
            janitor.drop()

    def drop_all(self) -> None:
        for url in list(self.janitors):
            self.drop(url)


@pytest.fixture(scope="session")
def pg_databases(postgresql_proc):
    """The session's PostgreSQL server (started on first use) as a maker of databases."""
    databases = PgDatabases(postgresql_proc)
    yield databases
    databases.drop_all()


def _pg(request) -> PgDatabases:
    _require_postgresql()
    return request.getfixturevalue("pg_databases")


@pytest.fixture(scope="session")
def new_database_url(request, tmp_path_factory):
    """``new_database_url(backend)``: the URL of a new, empty database for the session
    (a SQLite file, or a database on the PostgreSQL server)."""

    def make(backend: str) -> str:
        if backend == "sqlite":
            return f"sqlite:///{tmp_path_factory.mktemp('db') / 'bs.db'}"
        if backend != "postgresql":
            raise ValueError(f"unknown backend {backend!r}; use sqlite or postgresql")
        return _pg(request).create()

    return make


@pytest.fixture
def db_url(backend, tmp_path, request) -> str:
    """A SQLAlchemy URL of a fresh database: a SQLite file in the test's own temporary
    folder, or a new PostgreSQL database (dropped after the test)."""
    if backend == "sqlite":
        return f"sqlite:///{tmp_path / 'bs.db'}"
    databases = _pg(request)
    url = databases.create()
    request.addfinalizer(lambda: databases.drop(url))
    return url


@pytest.fixture
def db(db_url):
    """A SQLAlchemy engine on ``db_url`` with the BatchScope schema, disposed afterwards."""
    eng = make_engine(db_url)
    yield eng
    eng.dispose()


@pytest.fixture()
def app_db(db_url, monkeypatch):
    """A database (SQLite; PostgreSQL under ``backend``) of five minutes of synthetic traffic
    (two OOMs, a settings change) that the app reads (``BATCHSCOPE_DB_URL``; no demo
    runtime): for ``factories.run_app``."""
    from batchscope.testing import synthetic
    engine = make_engine(db_url)
    synthetic.generate(engine, synthetic.SCENARIOS["oom"].with_(
        duration_s=300, batches_per_s=4, settings_changes=((0.5, {"max_batch_size": 16}),)),
        end_s=time.time())
    monkeypatch.setenv("BATCHSCOPE_DB_URL", db_url)
    monkeypatch.setenv("BATCHSCOPE_NO_DEMO", "1")
    yield engine
    engine.dispose()
