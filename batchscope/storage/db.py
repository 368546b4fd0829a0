"""Engine creation: any SQLAlchemy URL; SQLite files get WAL mode and sane pragmas.

A SQLite database file that BatchScope creates is readable and writable by its owner
only (mode 0600; SQLite gives the ``-wal`` and ``-shm`` files the database's mode), and
a folder it creates for one is 0700: recorded traffic names models, clients and
timings that other users of the machine have no business reading. Files that already
exist keep their mode. Run the runtime and the dashboard as the same user, or widen
the mode yourself (``chmod 640``) to let a group read.

The schema is versioned by Alembic revisions (``batchscope/storage/migrations``, run
from here, no ``alembic.ini``); ``init_schema`` creates, upgrades or refuses a database
under a lock, so a fleet's instances can all start at once against a new PostgreSQL
database. ``schema_meta.schema_version`` is kept too: releases from before migrations
read it to refuse a database newer than themselves.
"""

from __future__ import annotations

import functools
import math
import os
import re
import sqlite3
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator
from urllib.parse import quote

from sqlalchemy import Connection, Engine, create_engine, delete, event, insert, inspect, select, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError

from batchscope.storage import migrations, summaries
from batchscope.storage.schema import SCHEMA_VERSION, SchemaMeta

DEFAULT_DB_PATH = Path("data") / "batchscope.db"
ENV_URL = "BATCHSCOPE_DB_URL"
#: the mode of a database file (and so of its -wal and -shm) that BatchScope creates
FILE_MODE = 0o600
#: the mode of a folder BatchScope creates for a database file
DIR_MODE = 0o700
#: SQLite's busy timeout, seconds (also the pragma below, in milliseconds)
BUSY_TIMEOUT_S = 5.0
#: the size a SQLite file's write-ahead log is cut back to once a checkpoint has emptied
#: it. A reader that holds one transaction open keeps checkpoints from emptying the log,
#: which then grows with every write; without this limit it would stay that large for
#: the life of the process that writes.
WAL_SIZE_LIMIT_BYTES = 64 * 1024 * 1024


#: how long a reader's PostgreSQL connection may take to open (``connect_timeout``,
#: unless the URL sets one): a host that accepts and never answers fails the read
#: instead of hanging
CONNECT_TIMEOUT_S = 5
#: how long a reader's PostgreSQL statement may wait for a lock (``lock_timeout``, unless
#: the URL passes its own ``options``): a table another program locked (a migration's
#: ALTER TABLE holds an exclusive lock) fails the read instead of hanging; SQLite waits
#: its busy timeout
LOCK_TIMEOUT_S = 5


def bounded_url(url: str) -> str:
    """``url`` with ``CONNECT_TIMEOUT_S`` and ``LOCK_TIMEOUT_S`` for the PostgreSQL drivers
    built on libpq (what the dashboard and ``batchscope trace`` read through); any other
    URL as it is. A runtime's own writes are not bounded so: its recorder waits behind a
    lock rather than drop the rows."""
    parsed = make_url(url)
    if (parsed.get_backend_name() != "postgresql"
            or parsed.get_driver_name() not in ("psycopg", "psycopg2", "psycopg2cffi")):
        return url
    query = {}
    if "connect_timeout" not in parsed.query:
        query["connect_timeout"] = str(CONNECT_TIMEOUT_S)
    if "options" not in parsed.query:
        query["options"] = f"-c lock_timeout={LOCK_TIMEOUT_S * 1000}"
    return parsed.update_query_dict(query).render_as_string(hide_password=False)


def lock_waited_s(message: str) -> float | None:
    """How long a read waited for a lock before it gave up, when ``message`` (the first
    line of the driver's error) says it did: PostgreSQL's ``lock_timeout``
    (``bounded_url``) or SQLite's busy timeout; None for any other error."""
    low = message.lower()
    if "lock timeout" in low:
        return LOCK_TIMEOUT_S
    if "database is locked" in low or "database is busy" in low:
        return BUSY_TIMEOUT_S
    return None


class DatabaseNotFound(FileNotFoundError):
    """``make_engine(..., create=False)`` was asked for a SQLite file that is not there."""


def default_url() -> str:
    return os.environ.get(ENV_URL) or f"sqlite:///{DEFAULT_DB_PATH}"


def sqlite_path(url: str) -> str | None:
    """The file a plain SQLite URL names (``sqlite:///data/x.db`` -> ``data/x.db``); None
    for other databases, in-memory SQLite, ``uri=true`` URLs and URLs that do not parse."""
    try:
        parsed = make_url(url)
    except Exception:
        return None
    if parsed.get_backend_name() != "sqlite" or parsed.query.get("uri"):
        return None
    path = parsed.database or ""
    return None if path in ("", ":memory:") or path.startswith("file:") else path


def with_driver(url: str) -> str:
    """``url`` with a driver SQLAlchemy can load: a PostgreSQL URL without one
    (``postgresql://``, or ``postgres://`` as some hosts write it) gets psycopg 3 (the
    ``postgres`` extra) unless psycopg2 is installed, which SQLAlchemy takes by default."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in ("postgresql", "postgres"):
        return url
    try:
        import psycopg2  # noqa: F401
    except ImportError:
        return f"postgresql+psycopg://{rest}"
    return f"postgresql://{rest}"


def create_file(path: str | Path) -> bool:
    """Create an empty SQLite database file at ``path`` (mode ``FILE_MODE``; an empty file
    is a valid empty database) and its folder (``DIR_MODE``) when missing. Returns
    whether this call created the file; an existing file is left as it is."""
    path = Path(path)
    path.parent.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
    except FileExistsError:
        return False
    os.close(fd)
    return True


def make_engine(url: str | None = None, *, create: bool = True) -> Engine:
    """An engine for ``url`` (default: ``$BATCHSCOPE_DB_URL`` or data/batchscope.db).

    ``create=True`` (what a runtime needs): a missing SQLite file and its folder are
    created (owner-only modes, see the module docstring) and missing tables are added.
    ``create=False``: only what exists is opened; nothing is created, no folder, no
    file, no table; a missing SQLite file raises ``DatabaseNotFound``. Either way the
    connections to a plain SQLite file URL open it read-write without SQLite's create
    flag, so a file deleted later is not recreated behind the caller's back.

    SQLite: WAL journal mode (set by the creating side, ``create=True``; it stays in the
    file, and a reader opening someone else's database changes nothing in it) lets the
    dashboard read while the runtime writes, and a busy timeout absorbs short lock waits.
    """
    url = with_driver(url or default_url())
    is_sqlite = url.startswith("sqlite")
    kwargs: dict = {}
    if is_sqlite:
        kwargs["connect_args"] = {"check_same_thread": False, "timeout": BUSY_TIMEOUT_S}
        path = sqlite_path(url)
        if path is not None and not make_url(url).query:
            if create:
                create_file(path)
            elif not os.path.isfile(path):
                raise DatabaseNotFound(f"there is no SQLite database file at {path}; check the "
                                       "path, or create the database first")
            # every connection opens the file without SQLite's create flag: one deleted
            # under a running process is not silently made anew, empty and world-readable
            # (the recorder notices and recreates it, see batchscope.storage.recorder)
            target = f"file:{quote(os.path.abspath(path))}?mode=rw"
            kwargs["creator"] = lambda: sqlite3.connect(target, uri=True, check_same_thread=False,
                                                        timeout=BUSY_TIMEOUT_S)
        elif path is not None and create:  # URL options: SQLite opens (and creates) it itself
            Path(path).parent.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    engine = create_engine(url, **kwargs)
    if is_sqlite:
        @event.listens_for(engine, "connect")
        def _pragmas(dbapi_conn, _record):  # pragma: no cover - exercised by every test
            cur = dbapi_conn.cursor()
            if create:  # kept in the file; a reader leaves a file's journal mode alone
                cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.execute(f"PRAGMA busy_timeout={int(BUSY_TIMEOUT_S * 1000)}")
            cur.execute(f"PRAGMA journal_size_limit={WAL_SIZE_LIMIT_BYTES}")
            cur.close()
            add_math_functions(dbapi_conn)
    if create:
        init_schema(engine)
    return engine


def add_math_functions(dbapi_conn) -> None:
    """``ln``, ``floor`` and ``ceil`` on a ``sqlite3`` connection whose SQLite was built
    without its math functions (the summaries and the queries use them, as on PostgreSQL)."""
    try:
        dbapi_conn.execute("SELECT ln(2.0), floor(2.5), ceil(2.5)").fetchone()
    except sqlite3.OperationalError:
        dbapi_conn.create_function("ln", 1, _ln, deterministic=True)
        dbapi_conn.create_function("floor", 1, _rounded(math.floor), deterministic=True)
        dbapi_conn.create_function("ceil", 1, _rounded(math.ceil), deterministic=True)


def _ln(x):
    """SQLite's own ``ln``: NULL for NULL, zero and negative numbers."""
    return math.log(x) if x is not None and x > 0 else None


def _rounded(to_int):
    def rounded(x):
        return None if x is None else float(to_int(x))
    return rounded


class DatabaseUnavailable(RuntimeError):
    """The database could not be opened or brought to this schema (the reason is in the
    message): a URL that names no reachable database, or a file that is not one."""


class SchemaTooNew(RuntimeError):
    """The database was written by a newer BatchScope than this one; nothing was changed."""


#: how long a process waits for another one that is creating or upgrading the schema
SCHEMA_LOCK_WAIT_S = 600.0
#: the PostgreSQL advisory lock held while the schema is created or upgraded (any
#: 64-bit number that other applications sharing the database are unlikely to use)
SCHEMA_LOCK_KEY = 0x6261_7463_6873_636F  # "batchsco"


def init_schema(engine: Engine) -> None:
    """Bring the database to the schema this BatchScope writes (idempotent).

    An empty database is created; one of an older schema version, including a
    database written before migrations existed (``schema_meta`` only), is upgraded in
    place by the migrations in ``batchscope/storage/migrations``; one newer than this
    BatchScope raises ``SchemaTooNew`` and is left as it is. The check is one read when
    the database is current. Creating and upgrading run under a lock (a PostgreSQL
    advisory lock; SQLite's write lock, ``BEGIN IMMEDIATE``), so instances started at
    the same moment against a fresh database wait for each other instead of racing.
    On SQLite a wait longer than the busy timeout (the first connection to a fresh file
    switching it to WAL while another holds the write lock for a migration on a busy
    machine) is tried again, for up to ``SCHEMA_LOCK_WAIT_S`` in all."""
    deadline = time.monotonic() + SCHEMA_LOCK_WAIT_S
    while True:
        try:
            _init_schema_once(engine)
            return
        except OperationalError as exc:
            if ("locked" not in str(exc) or engine.dialect.name != "sqlite"
                    or time.monotonic() > deadline):
                raise
            time.sleep(0.05)


def _init_schema_once(engine: Engine) -> None:
    with engine.connect() as conn:
        if engine.dialect.name == "sqlite":  # a writer's file (one made anew included) is WAL
            conn.exec_driver_sql("PRAGMA journal_mode=WAL")
        if _revision(conn) == _head():
            return
    with _schema_lock(engine) as conn:
        current = _revision(conn)  # again: another process may have done it meanwhile
        _refuse_newer(engine, conn, current)
        if current != _head():
            _upgrade(conn)


def stamp_schema(engine: Engine) -> None:
    """Mark a database whose tables were just made from ``batchscope.storage.schema``
    itself (``CREATE TABLE`` from the metadata, as a snapshot's temporary database is) as
    current: the newest revision and schema version, without running the migrations;
    its raw rows are summarised for the live queries (``batchscope.storage.summaries``)."""
    from alembic.runtime.migration import MigrationContext

    with engine.begin() as conn:
        context = MigrationContext.configure(conn, opts={"version_table": migrations.VERSION_TABLE})
        context.stamp(_scripts(), _head())
        conn.execute(delete(SchemaMeta).where(SchemaMeta.key == "schema_version"))
        conn.execute(insert(SchemaMeta).values(key="schema_version", value=str(SCHEMA_VERSION)))
        summaries.rebuild(conn)


def schema_version(engine: Engine) -> int | None:
    """The ``schema_meta`` version of the database (None when it has none)."""
    with engine.connect() as conn:
        return _meta_version(conn)


def schema_revision(engine: Engine) -> str | None:
    """The migration the database is at (None before any)."""
    with engine.connect() as conn:
        return _revision(conn)


@functools.cache
def _scripts():
    from alembic.script import ScriptDirectory

    return ScriptDirectory(migrations.SCRIPT_LOCATION)


def _head() -> str:
    return _scripts().get_current_head()


def _revision(conn: Connection) -> str | None:
    if not inspect(conn).has_table(migrations.VERSION_TABLE):
        return None
    return conn.execute(text(f"SELECT version_num FROM {migrations.VERSION_TABLE}")).scalar()


def _meta_version(conn: Connection) -> int | None:
    if not inspect(conn).has_table(SchemaMeta.__tablename__):
        return None
    value = conn.execute(select(SchemaMeta.value).where(SchemaMeta.key == "schema_version")).scalar()
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def shown_url(url: str) -> str:
    """``url`` as it may be printed: its password hidden (``***``)."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # not a URL SQLAlchemy parses: hide what stands between : and @
        return re.sub(r"(://[^:/@]*):[^@/]*@", r"\1:***@", url)


def _refuse_newer(engine: Engine, conn: Connection, revision: str | None) -> None:
    """Raise ``SchemaTooNew`` for a revision this BatchScope does not know, or a
    ``schema_meta`` version above its own."""
    where = engine.url.render_as_string(hide_password=True)
    known = revision is None or _known(revision)
    version = _meta_version(conn)
    if known and (version is None or version <= SCHEMA_VERSION):
        return
    what = (f"schema revision {revision!r}, which this BatchScope does not know" if not known
            else f"schema version {version}")
    raise SchemaTooNew(
        f"the database at {where} has {what}: it was written by a newer BatchScope than this "
        f"one (schema version {SCHEMA_VERSION}, revision {_head()}). Nothing was changed; "
        "upgrade BatchScope on this machine, or point it at another database")


def _known(revision: str) -> bool:
    from alembic.util import CommandError

    try:
        return _scripts().get_revision(revision) is not None
    except CommandError:
        return False


def _upgrade(conn: Connection) -> None:
    """Run the migrations from where ``conn``'s database is to the newest, inside the
    transaction ``conn`` is in (the caller commits); then, when the database comes from
    before the summary tables were last changed, summarise its raw rows into them."""
    from alembic import command
    from alembic.config import Config

    start = _revision(conn)
    config = Config()
    config.set_main_option("script_location", migrations.SCRIPT_LOCATION)
    config.attributes["connection"] = conn
    command.upgrade(config, "head")
    before = {r.revision for r in _scripts().walk_revisions("base", summaries.SINCE_REVISION)}
    if start is None or (start in before and start != summaries.SINCE_REVISION):
        summaries.rebuild(conn)


@contextmanager
def locked_transaction(engine: Engine, *, advisory_key: int | None = None,
                       wait_s: float = 0.0) -> Iterator[Connection]:
    """A connection in a transaction, committed at the end and rolled back on error,
    that holds a lock from its first statement: on SQLite the write lock (``BEGIN
    IMMEDIATE``, tried again for up to ``wait_s`` beyond the busy timeout), on PostgreSQL
    the transaction-level advisory lock ``advisory_key`` when one is given."""
    with engine.connect() as conn:
        dialect = conn.dialect.name
        if dialect == "postgresql" and advisory_key is not None:
            conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _signed64(advisory_key)})
        elif dialect == "sqlite":
            _begin_immediate(conn, wait_s)
        try:
            yield conn
            conn.commit()
        except BaseException:
            conn.rollback()
            raise


def _schema_lock(engine: Engine):
    return locked_transaction(engine, advisory_key=SCHEMA_LOCK_KEY, wait_s=SCHEMA_LOCK_WAIT_S)


def _signed64(n: int) -> int:
    return n - (1 << 64) if n >= 1 << 63 else n


def _begin_immediate(conn: Connection, wait_s: float) -> None:
    """``BEGIN IMMEDIATE``: SQLite's write lock, asked for again while another process
    holds it for up to ``wait_s`` (a migration may take longer than the busy timeout)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            conn.exec_driver_sql("BEGIN IMMEDIATE")
            return
        except OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            conn.rollback()
            time.sleep(0.05)
