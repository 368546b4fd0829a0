"""Loading a snapshot's tables: each ``tables/<table>.json`` member streamed in chunks,
parsed many rows at a time, checked column by column and inserted in batches into the
temporary database, so memory stays at a chunk, not the file."""

from __future__ import annotations

import codecs
import re
import zipfile
from typing import BinaryIO

from sqlalchemy import Engine
from sqlalchemy.schema import CreateIndex, CreateTable

from batchscope.presentation.snapshot.checks import (_DECODER, _READ_ERRORS, _column_checker,
                                                   _corrupt, _value_checker)
from batchscope.presentation.snapshot.layout import READ_CHUNK, TABLES, Limits, SnapshotError
from batchscope.storage.db import stamp_schema
from batchscope.storage.schema import Base

#: rows inserted into the temporary database per ``executemany``
INSERT_BATCH = 5000
_WS = re.compile(r"[ \t\n\r]*")


class _MemberStream:
    """A table member read ``READ_CHUNK`` bytes at a time, decoded as strict UTF-8, with
    the JSON values in it taken one by one: memory stays at a chunk plus one row."""

    def __init__(self, fh: BinaryIO, info: zipfile.ZipInfo, limits: Limits) -> None:
        self.fh, self.name = fh, info.filename
        self.cap = min(info.file_size, limits.max_member_bytes)
        #: the longest one value (a row, the column list) may be
        self.max_value_chars = limits.max_text_chars * 64 + READ_CHUNK
        self.read = 0
        self.buf, self.pos, self.eof = "", 0, False
        self._utf8 = codecs.getincrementaldecoder("utf-8")("strict")

    def fail(self, what: str) -> SnapshotError:
        return SnapshotError(f"{self.name} is not a valid table: {what}")

    def fill(self) -> None:
        if self.eof:
            return
        try:
            chunk = self.fh.read(READ_CHUNK)
        except _READ_ERRORS as exc:
            raise _corrupt(self.name, exc) from None
        self.read += len(chunk)
        if self.read > self.cap:
            raise SnapshotError(f"{self.name} expands beyond its declared or allowed size; "
                                "the file is corrupt or hostile")
        self.eof = not chunk
        try:
            text = self._utf8.decode(chunk, final=self.eof)
        except UnicodeDecodeError as exc:
            raise SnapshotError(f"{self.name} is not UTF-8 text: {exc}") from None
        self.buf = self.buf[self.pos:] + text
        self.pos = 0

    def peek(self) -> str:
        """The next character that is not white space ('' at the end)."""
        while True:
            self.pos = _WS.match(self.buf, self.pos).end()
            if self.pos < len(self.buf) or self.eof:
                return self.buf[self.pos:self.pos + 1]
            self.fill()

    def expect(self, char: str, where: str) -> None:
        found = self.peek()
        if found != char:
            raise self.fail(f"expected {char!r} {where}, found {found or 'the end'!r}")
        self.pos += 1

    def values(self) -> list:
        """The rows from here to the last complete one in the buffer, parsed in one go:
        ``[`` + the text up to a ``]`` + ``]`` parses only when the cut falls between
        two values (a cut inside a string or a row leaves it unbalanced). When it
        does not parse (nor with the ``]`` before, in case the last one closes the list of
        rows), one value is taken, the slow way that names what is wrong."""
        buf, pos = self.buf, self.pos
        cut = len(buf)
        for _ in range(2):  # the last ']' may close the list of rows: then the one before
            cut = buf.rfind("]", pos, cut)
            if cut <= pos:
                break
            try:
                rows = _DECODER.decode("[" + buf[pos:cut + 1] + "]")
            except SnapshotError:
                raise
            except (ValueError, RecursionError):
                continue
            self.pos = cut + 1
            return rows
        return [self.value()]

    def value(self):
        """The next JSON value, read on while it is cut off by the end of the buffer."""
        self.peek()  # raw_decode does not skip white space
        while True:
            try:
                value, end = _DECODER.raw_decode(self.buf, self.pos)
            except SnapshotError:
                raise
            except RecursionError:
                raise self.fail("values nest too deeply; a table is a list of flat rows") from None
            except ValueError as exc:
                if self.eof:
                    raise self.fail(f"bad JSON: {exc}") from None
                if len(self.buf) - self.pos > self.max_value_chars:
                    raise self.fail(f"a value longer than {self.max_value_chars} characters")
                self.fill()
                continue
            if end == len(self.buf) and not self.eof:  # a number may go on in the next chunk
                self.fill()
                continue
            self.pos = end
            return value


class _TableLoader:
    """Checks one table member row batch by row batch and inserts each batch."""

    def __init__(self, name: str, limits: Limits, cursor) -> None:
        self.name, self.limits, self.cursor = name, limits, cursor
        self.member = f"tables/{name}.json"
        self.table = Base.metadata.tables[name]
        self.rows = 0

    def columns(self, columns: object) -> None:
        table = self.table
        if not isinstance(columns, list):
            raise SnapshotError(f"{self.member} must be an object with 'columns' and 'rows' lists")
        unknown = [c for c in columns if not isinstance(c, str) or c not in table.columns]
        if unknown or len(set(columns)) != len(columns):
            raise SnapshotError(f"{self.member} has unknown or repeated columns {unknown!r:.200}; "
                                f"known columns are {[c.name for c in table.columns]}")
        required = [c.name for c in table.columns
                    if not c.nullable and not c.primary_key and c.default is None
                    and c.name not in columns]
        if required:
            raise SnapshotError(f"{self.member} lacks required columns {required}")
        self.names = columns
        self.width = len(columns)
        self.value_checks = [_value_checker(table.columns[c], self.limits) for c in columns]
        self.column_checks = [_column_checker(table.columns[c], self.limits) for c in columns]
        marks = ", ".join("?" for _ in columns)
        self.sql = f"INSERT INTO {self.name} ({', '.join(columns)}) VALUES ({marks})"

    def add(self, batch: list) -> None:
        """Check ``batch`` (the rows after ``self.rows``) and insert it."""
        first = self.rows
        self.rows += len(batch)
        if self.rows > self.limits.max_rows_per_table:
            raise SnapshotError(f"{self.member} has {self.limits.max_rows_per_table + 1} or more "
                                f"rows, more than the limit of {self.limits.max_rows_per_table}")
        if set(map(type, batch)) != {list} or set(map(len, batch)) != {self.width}:
            self._blame(batch, first)
        if self.width and not all(check(values) for check, values
                                  in zip(self.column_checks, zip(*batch))):
            self._blame(batch, first)
        self.cursor.executemany(self.sql, batch)

    def _blame(self, batch: list, first: int) -> None:
        """Raise the error that names the first bad row of ``batch``."""
        width = self.width
        for i, row in enumerate(batch, first):
            if not isinstance(row, list) or len(row) != width:
                raise SnapshotError(f"{self.member} row {i} is not a list of {width} values")
            for col, check, value in zip(self.names, self.value_checks, row):
                if not check(value):
                    raise SnapshotError(f"{self.member} row {i}: {col}={value!r:.60} has the "
                                        f"wrong type for a {self.table.columns[col].type} column")
        raise AssertionError("a batch failed its check but no row in it did")  # pragma: no cover


def _load_table(zf: zipfile.ZipFile, info: zipfile.ZipInfo, name: str, limits: Limits,
                cursor) -> int:
    """Stream ``tables/<name>.json`` (``{"columns": [...], "rows": [[...], ...]}``, columns
    first, as BatchScope writes it) into the table; returns the row count."""
    loader = _TableLoader(name, limits, cursor)
    try:
        fh = zf.open(info)
    except _READ_ERRORS as exc:
        raise _corrupt(info.filename, exc) from None
    with fh:
        s = _MemberStream(fh, info, limits)
        s.fill()
        shape = SnapshotError(f"{loader.member} must be an object with 'columns' and 'rows' lists")
        if s.peek() != "{":
            raise shape
        s.pos += 1
        seen: set[str] = set()
        while s.peek() != "}":
            if seen:
                s.expect(",", "between the entries of the object")
            key = s.value()
            if not isinstance(key, str) or key in seen:
                raise s.fail(f"the key {key!r:.40} is not a string or appears twice")
            seen.add(key)
            s.expect(":", f"after {key!r:.40}")
            if key != "rows":
                value = s.value()
                if key == "columns":
                    loader.columns(value)
                continue
            if "columns" not in seen:
                raise s.fail("'rows' comes before 'columns'")
            if s.peek() != "[":
                raise shape
            s.pos += 1
            batch: list = []
            first = True
            while s.peek() != "]":
                if not first:
                    s.expect(",", "between rows")
                first = False
                batch.extend(s.values())
                if len(batch) >= INSERT_BATCH:
                    loader.add(batch)
                    batch = []
            s.pos += 1
            if batch:
                loader.add(batch)
        s.pos += 1
        if "columns" not in seen or "rows" not in seen:
            raise shape
        if s.peek() != "":
            raise s.fail("more data after the end of the object")
    return loader.rows


def _load_tables(zf: zipfile.ZipFile, members: dict[str, zipfile.ZipInfo], limits: Limits,
                 engine: Engine) -> None:
    """The live schema's tables, filled from the members, then its indexes (building an
    index once over loaded rows is faster than keeping it up to date row by row)."""
    raw = engine.raw_connection()
    dialect = engine.dialect
    try:
        cur = raw.cursor()
        cur.execute("PRAGMA synchronous=OFF")  # a throwaway database: nothing to keep safe
        for table in Base.metadata.sorted_tables:
            cur.execute(str(CreateTable(table).compile(dialect=dialect)))
        for name in TABLES:
            info = members.get(f"tables/{name}.json")
            if info is not None:
                _load_table(zf, info, name, limits, cur)
        for table in Base.metadata.sorted_tables:
            for index in table.indexes:
                cur.execute(str(CreateIndex(index).compile(dialect=dialect)))
        raw.commit()
    finally:
        raw.close()
    stamp_schema(engine)
