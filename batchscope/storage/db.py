"""Engine creation: any SQLAlchemy URL; SQLite files get WAL mode and sane pragmas.

A SQLite database file that BatchScope creates is readable and writable by its owner
only (mode 0600; SQLite gives the ``-wal`` and ``-shm`` files the database's mode), and
a folder it creates for one is 0700: recorded traffic names models, clients and
timings that other users of the machine have no business reading. Files that already
exist keep their mode. Run the runtime and the dashboard as the same user, or widen
the mode yourself (``chmod 640``) to let a group read.
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path
from urllib.parse import quote

from sqlalchemy import Engine, create_engine, event, select
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session

from batchscope.storage.schema import SCHEMA_VERSION, Base, SchemaMeta

DEFAULT_DB_PATH = Path("data") / "batchscope.db"
ENV_URL = "BATCHSCOPE_DB_URL"
#: the mode of a database file (and so of its -wal and -shm) that BatchScope creates
FILE_MODE = 0o600
#: the mode of a folder BatchScope creates for a database file
DIR_MODE = 0o700
#: SQLite's busy timeout, seconds (also the pragma below, in milliseconds)
BUSY_TIMEOUT_S = 5.0


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

    SQLite: WAL journal mode lets the dashboard read while the runtime writes, and a
    busy timeout absorbs short lock waits.
    """
    url = url or default_url()
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
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.execute(f"PRAGMA busy_timeout={int(BUSY_TIMEOUT_S * 1000)}")
            cur.close()
    if create:
        init_schema(engine)
    return engine


def init_schema(engine: Engine) -> None:
    """Create missing tables and record the schema version (idempotent)."""
    Base.metadata.create_all(engine)
    with Session(engine) as session:
        row = session.get(SchemaMeta, "schema_version")
        if row is None:
            session.add(SchemaMeta(key="schema_version", value=str(SCHEMA_VERSION)))
            session.commit()
        elif int(row.value) > SCHEMA_VERSION:
            raise RuntimeError(
                f"the database at {engine.url} has schema version {row.value}, newer than this "
                f"BatchScope ({SCHEMA_VERSION}); upgrade BatchScope or point it at another database")


def schema_version(engine: Engine) -> int | None:
    with Session(engine) as session:
        row = session.execute(select(SchemaMeta).where(SchemaMeta.key == "schema_version")).scalar_one_or_none()
        return int(row.value) if row else None
