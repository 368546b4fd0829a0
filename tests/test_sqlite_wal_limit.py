"""A SQLite database's write-ahead log grows while a reader holds a transaction open
(no checkpoint can empty it); once the reader is gone, the next checkpoint empties it and
the log is cut back to ``WAL_SIZE_LIMIT_BYTES`` rather than staying at its largest."""

from __future__ import annotations

import os

from sqlalchemy import text

from batchscope.storage import db
from batchscope.storage.db import make_engine


def test_the_write_ahead_log_is_cut_back_once_a_long_reader_is_gone(tmp_path, monkeypatch):
    limit = 256 * 1024
    monkeypatch.setattr(db, "WAL_SIZE_LIMIT_BYTES", limit)
    path = tmp_path / "wal.db"
    engine = make_engine(f"sqlite:///{path}")
    wal = f"{path}-wal"
    blob = "x" * 4000  # about a page a row
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE filler (id INTEGER PRIMARY KEY, body TEXT)"))
    reader = engine.connect()
    reader.execute(text("BEGIN"))
    reader.execute(text("SELECT count(*) FROM filler")).scalar()  # holds its snapshot
    for i in range(30):  # 30 commits of 100 pages: the log cannot be emptied meanwhile
        with engine.begin() as conn:
            conn.execute(text("INSERT INTO filler (body) VALUES (:b)"),
                         [{"b": blob}] * 100)
    grown = os.path.getsize(wal)
    assert grown > 8 * limit
    reader.rollback()
    reader.close()
    with engine.begin() as conn:  # its commit checkpoints: the log is emptied
        conn.execute(text("INSERT INTO filler (body) VALUES (:b)"), [{"b": blob}])
    with engine.begin() as conn:  # the next write starts the log over, cut to the limit
        conn.execute(text("INSERT INTO filler (body) VALUES (:b)"), [{"b": blob}])
    assert os.path.getsize(wal) <= limit
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM filler")).scalar() == 30 * 100 + 2
        assert conn.execute(text("PRAGMA journal_size_limit")).scalar() == limit
    engine.dispose()
