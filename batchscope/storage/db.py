"""Engine creation: any SQLAlchemy URL; SQLite files get WAL mode and sane pragmas."""

from __future__ import annotations

import os
from pathlib import Path

from sqlalchemy import Engine, create_engine, event, select
from sqlalchemy.orm import Session

from batchscope.storage.schema import SCHEMA_VERSION, Base, SchemaMeta

DEFAULT_DB_PATH = Path("data") / "batchscope.db"
ENV_URL = "BATCHSCOPE_DB_URL"


def default_url() -> str:
    return os.environ.get(ENV_URL) or f"sqlite:///{DEFAULT_DB_PATH}"


def make_engine(url: str | None = None, *, create: bool = True) -> Engine:
    """An engine for ``url`` (default: ``$BATCHSCOPE_DB_URL`` or data/batchscope.db).

    SQLite: the parent folder is created, WAL journal mode lets the dashboard read
    while the runtime writes, and a busy timeout absorbs short lock waits.
    """
    url = url or default_url()
    is_sqlite = url.startswith("sqlite")
    kwargs: dict = {}
    if is_sqlite:
        path = url.split("///", 1)[1] if "///" in url else ""
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        kwargs["connect_args"] = {"check_same_thread": False, "timeout": 5.0}
    engine = create_engine(url, **kwargs)
    if is_sqlite:
        @event.listens_for(engine, "connect")
        def _pragmas(dbapi_conn, _record):  # pragma: no cover - exercised by every test
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.execute("PRAGMA busy_timeout=5000")
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
