"""Bulk inserts of recorded rows: one transaction per record type and call.

The recorder's writer thread and the writer child process
(``batchscope.storage.writer_process``) both write through ``BulkInserts``; which of
them runs it only decides where the CPU time is spent.

Rows come as the slotted record dataclasses of ``batchscope.storage.records`` or, from
the writer process, as plain tuples in field order (``tuples=True``). On SQLite
(``pysqlite``) they go straight to the ``sqlite3`` connection as multi-row
``INSERT ... VALUES (...), (...)`` statements of up to a few hundred rows each, their
parameters flattened by C-level iterators (``chain``, ``attrgetter``, extended slices):
a flush of thousands of rows binds its parameters in C and lets go of the interpreter
lock only a few times, while SQLite does the work. Other databases get one SQLAlchemy
Core ``insert`` per table and call.

``requests`` and ``batches`` rows are also added to the summaries the live dashboard
reads (``batchscope.storage.summaries``) in the same transaction, by SQL over the rows
just inserted: on SQLite the range of rowids they got (consecutive: the transaction
holds the write lock from its first insert), on PostgreSQL the ids drawn for them from
the table's sequence before the insert (instances writing at once interleave it).

Errors are not handled here: a failed insert is rolled back and its exception goes to
the caller, which decides what a failure costs (the recorder drops and counts the
rows, the writer process reports it to its parent).
"""

from __future__ import annotations

import sqlite3
from itertools import chain, repeat
from operator import attrgetter
from typing import Any

from sqlalchemy import Boolean, Engine, Table, insert, text

from batchscope.storage import summaries
from batchscope.storage.records import (BatchRow, DeviceRow, EventRow, GenStepRow, RequestRow,
                                        TraceRow)
from batchscope.storage.schema import (BatchRecord, DeviceSample, EventRecord, GenerationStep,
                                       RequestRecord, RequestTraceRecord)

#: the table each row type is written to
ROW_TABLES: dict[type, Table] = {
    BatchRow: BatchRecord.__table__,
    RequestRow: RequestRecord.__table__,
    EventRow: EventRecord.__table__,
    DeviceRow: DeviceSample.__table__,
    GenStepRow: GenerationStep.__table__,
    TraceRow: RequestTraceRecord.__table__,
}

#: the tables whose rows are summarised as they are written
SUMMARISED = frozenset(summaries.STATEMENTS)

#: most rows in one multi-row SQLite INSERT (a power of two); fewer when the
#: connection's limit on bound parameters calls for it
SQLITE_ROWS_PER_STATEMENT = 256
#: SQLite's limit on bound parameters before 3.32, used when the limit cannot be read
SQLITE_SAFE_PARAMS = 999


def is_pysqlite(engine: Engine) -> bool:
    """Whether ``engine`` talks to SQLite through the standard ``sqlite3`` module (the
    fast path); anything else goes through SQLAlchemy Core."""
    return engine.dialect.name == "sqlite" and engine.dialect.driver == "pysqlite"


def max_params(raw: Any) -> int:
    """The most parameters one statement on this ``sqlite3`` connection may bind."""
    try:
        return int(raw.driver_connection.getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER))
    except Exception:  # Python < 3.11 or an unexpected wrapper: the oldest limit is safe
        return SQLITE_SAFE_PARAMS


class SqliteInserts:
    """Multi-row INSERT statements for one record type, run on a ``sqlite3`` connection.

    ``n`` rows are written as ``n // chunk`` full statements (one ``executemany``) plus
    at most one statement per set bit of the remainder, so every statement text is
    one of a handful, each prepared once and kept in the connection's cache.

    ``sqlite3`` binds ``None`` and ``bool`` through its slow adaptation path (several
    times the cost of a number), so before binding, boolean columns become ints and
    nullable columns that are ``None`` in every row of the flush are left out of the
    statement (they are NULL either way). All of it runs on whole columns at once
    (extended slices of the flat list), never row by row in Python."""

    def __init__(self, cls: type, table: Table, max_params: int) -> None:
        self.table = table.name
        self.names = tuple(cls.__slots__)
        self.max_params = max_params
        self._flatten = attrgetter(*self.names)
        columns = [table.c[name] for name in self.names]
        self._booleans = tuple(i for i, col in enumerate(columns) if isinstance(col.type, Boolean))
        self._nullable = tuple(i for i, col in enumerate(columns)
                               if col.nullable and col.server_default is None)
        self._sql: dict[tuple[tuple[str, ...], int], str] = {}

    def rows_per_statement(self, width: int) -> int:
        rows = SQLITE_ROWS_PER_STATEMENT
        while rows > 1 and rows * width > self.max_params:
            rows //= 2
        return rows

    def sql(self, names: tuple[str, ...], rows: int) -> str:
        key = (names, rows)
        text = self._sql.get(key)
        if text is None:
            one = "(" + ", ".join(repeat("?", len(names))) + ")"
            text = self._sql[key] = (f'INSERT INTO "{self.table}" ({", ".join(names)}) VALUES '
                                     + ", ".join(repeat(one, rows)))
        return text

    def params(self, records: list, tuples: bool = False) -> tuple[tuple[str, ...], list]:
        """The columns to write and all rows' values for them in one flat list
        (``tuples``: the rows are already tuples in field order)."""
        flat = list(chain.from_iterable(records if tuples else map(self._flatten, records)))
        n, width = len(records), len(self.names)
        for c in self._booleans:
            try:
                flat[c::width] = list(map(int, flat[c::width]))
            except TypeError:  # a None among them: leave the column as it is
                pass
        omitted = [c for c in self._nullable if flat[c] is None and flat[c::width].count(None) == n]
        if not omitted:
            return self.names, flat
        for c in reversed(omitted):  # highest first, so lower columns keep their offsets
            del flat[c::width]
            width -= 1
        return tuple(name for i, name in enumerate(self.names) if i not in omitted), flat

    def run(self, cursor: Any, records: list, *, tuples: bool = False) -> None:
        names, flat = self.params(records, tuples)
        width = len(names)
        chunk = self.rows_per_statement(width)
        full, rest = divmod(len(records), chunk)
        step = chunk * width
        if full:
            cursor.executemany(self.sql(names, chunk), [flat[i:i + step] for i in range(0, full * step, step)])
        done = full * step
        size = chunk // 2
        while rest:
            if rest >= size:
                cursor.execute(self.sql(names, size), flat[done:done + size * width])
                done += size * width
                rest -= size
            size //= 2


class BulkInserts:
    """Writes rows of the record types in ``ROW_TABLES`` to the database of ``engine``.

    ``sqlite`` says which path the caller should take: with it, ``insert_sqlite`` on a
    DBAPI connection the caller holds (``engine.raw_connection()``, kept for as many
    calls as it likes); without it, ``insert_core``, which takes its own connection.
    Each call is one transaction. Not thread-safe: one writer uses it at a time."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.sqlite = is_pysqlite(engine)
        self._sqlite: dict[type, SqliteInserts] = {}
        self._getters: dict[type, Any] = {}
        self._summaries: dict[tuple[str, str], list[str]] = {}
        self._sequences: dict[str, str] = {}

    def insert_sqlite(self, raw: Any, cls: type, rows: list, *, tuples: bool = False) -> None:
        """One transaction on the pooled DBAPI connection ``raw``; rolled back (or, if that
        fails too, the connection invalidated) and the error raised on failure."""
        inserts = self._sqlite.get(cls)
        if inserts is None:
            inserts = self._sqlite[cls] = SqliteInserts(cls, ROW_TABLES[cls], max_params(raw))
        cursor = raw.cursor()
        try:
            inserts.run(cursor, rows, tuples=tuples)
            if inserts.table in SUMMARISED and rows:
                hi = cursor.execute("SELECT last_insert_rowid()").fetchone()[0]
                for sql in self._summary_sql(inserts.table, summaries.ID_RANGE):
                    cursor.execute(sql, {"lo": hi - len(rows) + 1, "hi": hi})
            raw.commit()
        except BaseException:
            try:
                raw.rollback()
            except Exception:  # the connection is gone; the pool replaces it
                raw.invalidate()
            raise
        finally:
            cursor.close()

    def insert_core(self, cls: type, rows: list, *, tuples: bool = False) -> None:
        """One SQLAlchemy Core ``insert`` in its own transaction (any database)."""
        names = tuple(cls.__slots__)
        if not tuples:
            getter = self._getters.get(cls)
            if getter is None:
                getter = self._getters[cls] = attrgetter(*names)
            rows = map(getter, rows)
        table = ROW_TABLES[cls]
        params = [dict(zip(names, r)) for r in rows]
        with self.engine.begin() as conn:
            if table.name not in SUMMARISED or not params:
                conn.execute(insert(table), params)
                return
            if conn.dialect.name == "postgresql":
                # ids drawn from the table's sequence first: a plain bulk insert is several
                # times faster than one with RETURNING
                ids = conn.execute(text("SELECT nextval(:seq) FROM generate_series(1, :n)"),
                                   {"seq": self._sequence(conn, table.name), "n": len(params)}).scalars().all()
                for row, row_id in zip(params, ids):
                    row["id"] = row_id
                conn.execute(insert(table), params)
                summaries.add_rows(conn, table.name, summaries.ID_LIST,
                                   {"lo": min(ids), "hi": max(ids), "ids": ids})
                return
            ids = conn.execute(insert(table).returning(table.c.id), params).scalars().all()
            # one writer at a time: consecutive ids
            summaries.add_rows(conn, table.name, summaries.ID_RANGE, {"lo": min(ids), "hi": max(ids)})

    def _sequence(self, conn, table: str) -> str:
        name = self._sequences.get(table)
        if name is None:
            name = self._sequences[table] = conn.execute(
                text("SELECT pg_get_serial_sequence(:t, 'id')"), {"t": table}).scalar_one()
        return name

    def _summary_sql(self, table: str, where: str) -> list[str]:
        key = (table, where)
        sql = self._summaries.get(key)
        if sql is None:
            sql = self._summaries[key] = summaries.STATEMENTS[table](where)
        return sql
