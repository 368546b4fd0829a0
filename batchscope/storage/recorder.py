"""Bounded in-memory buffer + background bulk writer.

``put`` runs on the request path: it is a length check and a ``deque.append`` (both
atomic under the GIL), never touches the database and never raises. When the buffer
is full the record is dropped and counted. A daemon thread drains the buffer every
``flush_interval_s`` (at once again while a full flush is waiting) and writes each
table's rows in one transaction per flush.

The serving process is bound by its event-loop thread, and the writer competes with
it for the GIL, so the writer keeps its own Python work per row near zero: rows
leave the buffer and are grouped by type with C-level iterators (``starmap``,
``compress``), then written by ``batchscope.storage.inserts`` (multi-row SQLite
statements bound in C, or SQLAlchemy Core for other databases). With
``writer_process=True`` those inserts run in a child process instead
(``batchscope.storage.writer_process``); buffering, drop counting and back-off stay
here either way.

When the database fails (locked, disk full, unreachable) the rows in hand are dropped
and counted, the failure is logged once per kind, and the writer backs off
exponentially while ``put`` keeps filling (and, once full, dropping from) the buffer.
When writing works again a ``recorder_drops`` event says how many rows were lost.

A SQLite database file deleted (or replaced) under a running recorder would otherwise
swallow every later row: open connections keep writing into the unlinked file. So the
writer checks, at most every ``file_check_interval_s`` and never on the request path,
that the file at the database's path is still the one it opened (device and inode).
When it is not, the pooled connections are closed (and the writer process stopped),
a new database is created with the schema, the rows written since the last good check
are counted as dropped, a warning is logged and a ``recorder_drops`` event in the new
database says how many were lost (``details.reason`` = ``"database file deleted"`` or
``"database file replaced"``).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import deque
from itertools import compress, repeat, starmap
from operator import is_
from typing import Any, Callable

from sqlalchemy import Engine

from batchscope.storage.db import create_file, init_schema, sqlite_path
from batchscope.storage.inserts import ROW_TABLES, BulkInserts
from batchscope.storage.records import (BATCHED, EventRow, RequestBatch, TraceBatch, expand,
                                        put_many_of)
from batchscope.storage.schema import RequestRecord, RequestTraceRecord
from batchscope.storage.writer_process import WriterProcess
from batchscope.threadnames import name_native

log = logging.getLogger(__name__)

#: Table name used as the key of ``dropped_by_kind`` for a record type.
KIND_OF: dict[type, str] = {cls: table.name for cls, table in ROW_TABLES.items()}
KIND_OF[RequestBatch] = RequestRecord.__table__.name
KIND_OF[TraceBatch] = RequestTraceRecord.__table__.name


def rows_in(cls: type, group: list) -> int:
    """How many table rows ``group`` (records of type ``cls``) stands for."""
    return sum(map(len, group)) if cls in BATCHED else len(group)


BACKOFF_START_S = 0.05
BACKOFF_MAX_S = 1.0
#: least time between two ``recorder_drops`` events
DROP_REPORT_INTERVAL_S = 10.0
#: least time between two checks that the SQLite file is still the one opened
FILE_CHECK_INTERVAL_S = 1.0
#: how often a recorder writes what it holds, by default (seconds)
FLUSH_INTERVAL_S = 0.5


def file_identity(path: str) -> tuple[int, int] | None:
    """(device, inode) of the file at ``path``; None when there is none."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def group_by_type(records: list) -> dict[type, list]:
    """``records`` split by exact type, order kept within each type; C-level loops only."""
    types = list(map(type, records))
    kinds = dict.fromkeys(types)  # first-appearance order: deterministic
    if len(kinds) == 1:
        return {types[0]: records}
    return {cls: list(compress(records, map(is_, types, repeat(cls)))) for cls in kinds}


class Recorder:
    """Implements ``RecorderLike``: non-blocking ``put``, bulk writes in the background."""

    def __init__(self, engine: Engine, *, buffer_size: int = 100_000, flush_interval_s: float = FLUSH_INTERVAL_S,
                 max_rows_per_flush: int = 50_000, instance_id: str = "local",
                 clock: Callable[[], float] = time.time, writer_process: bool = False,
                 file_check_interval_s: float = FILE_CHECK_INTERVAL_S) -> None:
        if buffer_size < 1 or max_rows_per_flush < 1 or flush_interval_s <= 0:
            raise ValueError("buffer_size and max_rows_per_flush must be >= 1 and flush_interval_s > 0")
        if not file_check_interval_s >= 0:
            raise ValueError("file_check_interval_s must be >= 0")
        self.engine = engine
        self.buffer_size = buffer_size
        self.flush_interval_s = flush_interval_s
        self.max_rows_per_flush = max_rows_per_flush
        self.instance_id = instance_id
        self._clock = clock
        self._buffer: deque = deque()
        # put() compares against _limit; close() sets it to 0 so later puts are counted as drops
        self._limit = buffer_size
        # counters written only by put() callers ...
        self._dropped_full = 0
        self._dropped_full_by_kind: dict[str, int] = {}
        # ... and counters written only under _write_lock (writer side)
        self._dropped_write = 0
        self._dropped_write_by_kind: dict[str, int] = {}
        self.written = 0
        self.written_by_kind: dict[str, int] = {}
        self.flushes = 0
        self.failures = 0
        self._write_lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._failing: set[str] = set()
        #: the last write failure's message, named in the ``recorder_drops`` event
        self._last_failure: str | None = None
        self._unknown_types: set[type] = set()
        self._reported_dropped = 0
        self._last_report_at = float("-inf")
        self._backoff_s = 0.0
        self._retry_at = 0.0
        self._inserts = BulkInserts(engine)
        # the SQLite file written to (None for other databases) and what it was when
        # last seen in place, with the rows written up to then
        path = sqlite_path(engine.url.render_as_string(hide_password=False))
        self._db_file = os.path.abspath(path) if path is not None else None
        self._db_identity = file_identity(self._db_file) if self._db_file else None
        self.file_check_interval_s = file_check_interval_s
        self._file_checked_at = float("-inf")
        self._reopen_pending = False
        self._written_at_check: dict[str, int] = {}
        #: how many times the database file was found deleted or replaced
        self.database_replacements = 0
        #: with ``writer_process``, the inserts run in a child process (see
        #: ``batchscope.storage.writer_process``); buffering, drops and back-off stay here
        self.process: WriterProcess | None = None
        if writer_process:
            self.process = WriterProcess(engine.url.render_as_string(hide_password=False))

    # ------------------------------------------------------------------ hot path
    #: ``RequestBatch`` and ``TraceBatch`` records are welcome: expanded to rows by the
    #: writer, not by ``put``
    accepts_request_batches = True

    def put(self, record: Any) -> None:
        """Queue ``record`` for writing; drop and count it when the buffer is full."""
        buffer = self._buffer
        if len(buffer) < self._limit:
            buffer.append(record)
            return
        n = len(record) if type(record) in BATCHED else 1
        self._dropped_full += n
        kind = KIND_OF.get(type(record)) or type(record).__name__
        counts = self._dropped_full_by_kind
        counts[kind] = counts.get(kind, 0) + n

    def put_many(self, records: list) -> None:
        """``put`` of each record, in order, with one buffer operation when they fit."""
        buffer = self._buffer
        room = self._limit - len(buffer)
        if len(records) <= room:
            buffer.extend(records)
            return
        if room > 0:
            buffer.extend(records[:room])
        for record in records[max(room, 0):]:
            self.put(record)  # counted as dropped (or kept, if the writer made room)

    @property
    def dropped(self) -> int:
        return self._dropped_full + self._dropped_write

    @property
    def dropped_by_kind(self) -> dict[str, int]:
        merged = dict(self._dropped_full_by_kind)
        for kind, n in list(self._dropped_write_by_kind.items()):
            merged[kind] = merged.get(kind, 0) + n
        return merged

    @property
    def buffered(self) -> int:
        return len(self._buffer)

    @property
    def pickles_records(self) -> bool:
        """Whether the records go to another process (the database writer's), pickled."""
        return self.process is not None

    @property
    def healthy(self) -> bool:
        """False while the last write attempt failed."""
        return not self._failing

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="batchscope-recorder", daemon=True)
        self._thread.start()

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop accepting records, write what is buffered, stop the writer thread.

        Rows that cannot be written within ``timeout_s`` (database down) are dropped
        and counted."""
        self._limit = 0
        self._stopping = True
        self._wake.set()
        thread = self._thread
        if thread is not None:
            thread.join(timeout_s)
            if thread.is_alive():
                log.warning("recorder writer did not finish within %.1f s; %d rows left unwritten",
                            timeout_s, len(self._buffer))
                return
        else:
            deadline = time.monotonic() + timeout_s
            while self._buffer and time.monotonic() < deadline:
                self.flush()
        self._discard_rest()
        if self.process is not None:
            with self._write_lock:
                self.process.stop()

    def __enter__(self) -> "Recorder":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ writer
    def flush(self) -> int:
        """Write up to ``max_rows_per_flush`` buffered rows now; returns rows written.

        Rows are dropped (and counted) when the database refuses them."""
        with self._write_lock:
            self._watch_file()
            return self._flush_locked()

    def _run(self) -> None:
        name_native()
        try:
            self._loop()
        except Exception:  # a bug, not a database failure: say so once, then count what comes
            log.exception("recorder writer stopped unexpectedly; further records are dropped and counted")
            self._limit = 0
            self._discard_rest()

    def _loop(self) -> None:
        while True:
            if not self._stopping and len(self._buffer) < self.max_rows_per_flush:
                self._wake.wait(self.flush_interval_s)
                self._wake.clear()
            now = time.monotonic()
            if self._failing and now < self._retry_at:
                if self._stopping:
                    # one last attempt for the rest, then give up on it
                    self._retry_at = now
                else:
                    self._wake.wait(self._retry_at - now)
                    continue
            if self._buffer:
                self.flush()
            elif self._stopping:
                return
            else:
                with self._write_lock:
                    if self._db_file is not None:
                        self._watch_file()
                    if not self._failing and self.dropped > self._reported_dropped:
                        # drops that a report within DROP_REPORT_INTERVAL_S held back:
                        # reported once it has passed, with or without new rows
                        self._maybe_report_drops()
            if self._stopping and self._failing:
                self._discard_rest()
                return

    def _take(self) -> list:
        buffer = self._buffer
        n = min(len(buffer), self.max_rows_per_flush)
        return list(starmap(buffer.popleft, repeat((), n)))

    def _flush_locked(self) -> int:
        records = self._take()
        if not records:
            return 0
        if self.process is None:  # rows are built here; the child process builds its own
            records = expand(records)
        groups: dict[type, list] = {}
        for cls, group in group_by_type(records).items():
            if cls in ROW_TABLES or cls in BATCHED:
                groups[cls] = group
                continue
            if cls not in self._unknown_types:
                self._unknown_types.add(cls)
                log.warning("recorder: records of type %s have no table; they are dropped and counted",
                            cls.__name__)
            self._count_write_drops(cls, len(group))
        written = self._write_groups(groups) if groups else 0
        self.flushes += 1
        if written and not self._failing:
            self._maybe_report_drops()
        return written

    def _write_groups(self, groups: dict[type, list]) -> int:
        """Each group in its own transaction; a failed group is dropped and counted. The
        recorder counts as healthy again only after a flush in which every group was written."""
        failures_before = self.failures
        written = self._write_each(groups)
        if written and self._failing and self.failures == failures_before:
            log.info("recorder writes work again; %d rows dropped so far", self.dropped)
            self._failing.clear()
            self._backoff_s = 0.0
        return written

    def _write_each(self, groups: dict[type, list]) -> int:
        if self.process is not None:
            self.process.backlog = len(self._buffer) / self.buffer_size
            return sum(self._write(cls, group, self.process.insert) for cls, group in groups.items())
        inserts = self._inserts
        if not inserts.sqlite:
            return sum(self._write(cls, group, inserts.insert_core) for cls, group in groups.items())
        try:
            raw = self.engine.raw_connection()
        except Exception as exc:  # cannot even connect: everything in hand is lost
            for cls, group in groups.items():
                self._count_write_drops(cls, rows_in(cls, group))
            self._note_failure(type(exc).__name__, f"connecting to write {sum(map(len, groups.values()))} "
                                                   f"rows failed: {exc}")
            return 0
        written = 0
        try:
            for cls, group in groups.items():
                written += self._write(cls, group, lambda c, rows: inserts.insert_sqlite(raw, c, rows))
        finally:
            raw.close()  # back to the pool
        return written

    def _write(self, cls: type, group: list, insert_rows: Callable[[type, list], None]) -> int:
        kind = KIND_OF[cls]
        n = rows_in(cls, group)
        try:
            insert_rows(cls, group)
        except Exception as exc:  # the database is down, locked, full...: drop, count, back off
            self._count_write_drops(cls, n)
            self._note_failure(type(exc).__name__, f"writing {n} {kind} rows failed: {exc}")
            return 0
        self.written += n
        self.written_by_kind[kind] = self.written_by_kind.get(kind, 0) + n
        return n

    def _count_write_drops(self, cls: type, n: int) -> None:
        kind = KIND_OF.get(cls) or cls.__name__
        self._dropped_write += n
        self._dropped_write_by_kind[kind] = self._dropped_write_by_kind.get(kind, 0) + n

    def _note_failure(self, key: str, message: str) -> None:
        self.failures += 1
        self._last_failure = message[:300]
        if key not in self._failing:
            log.warning("recorder: %s (further failures of this kind are counted, not logged)", message)
            self._failing.add(key)
        self._backoff_s = min(BACKOFF_MAX_S, max(BACKOFF_START_S, self._backoff_s * 2))
        self._retry_at = time.monotonic() + self._backoff_s

    def _discard_rest(self) -> None:
        with self._write_lock:
            while self._buffer:
                for cls, group in group_by_type(self._take()).items():
                    self._count_write_drops(cls, rows_in(cls, group))

    # ------------------------------------------------------------------ database file
    def _watch_file(self) -> None:
        """Under the write lock: at most every ``file_check_interval_s``, check that the
        SQLite file is still the one opened; replace the database when it is not."""
        path = self._db_file
        if path is None:
            return
        now = time.monotonic()
        if now - self._file_checked_at < self.file_check_interval_s:
            return
        self._file_checked_at = now
        found = file_identity(path)
        if self._db_identity is None and not self._reopen_pending:
            self._db_identity = found  # not there when the recorder started: adopt it
        if found is not None and found == self._db_identity:
            self._written_at_check = dict(self.written_by_kind)
            return
        if found is None and self._db_identity is None:
            return  # never seen yet (SQLite creates it on first connection)
        self._reopen_database(path, deleted=found is None)

    def _reopen_database(self, path: str, *, deleted: bool) -> None:
        """Count the rows written since the last good check as lost, close every
        connection to the old file, create the database anew (schema included) and
        say what happened in it."""
        lost_by_kind = {kind: n - self._written_at_check.get(kind, 0)
                        for kind, n in self.written_by_kind.items()
                        if n > self._written_at_check.get(kind, 0)}
        self._written_at_check = dict(self.written_by_kind)
        lost = sum(lost_by_kind.values())
        for kind, n in lost_by_kind.items():
            self._dropped_write += n
            self._dropped_write_by_kind[kind] = self._dropped_write_by_kind.get(kind, 0) + n
        self.database_replacements += 1
        reason = "database file deleted" if deleted else "database file replaced"
        self.engine.dispose()  # pooled connections still point at the old file
        if self.process is not None:
            self.process.stop()  # its connection too; the next write starts a new child
        try:
            if deleted:
                # an empty file; SQLite itself discards a -wal left by the old one when it
                # opens an empty database (removing it here could pull it from under a
                # connection another process just opened)
                create_file(path)
            init_schema(self.engine)
            if self.process is not None:
                self.engine.dispose()  # this process keeps no connection (see WriterProcess)
        except Exception as exc:
            self._reopen_pending = True  # the next check tries again
            self._note_failure(type(exc).__name__, f"{reason} ({path}); {lost} rows written to it "
                                                   f"were lost and recreating it failed: {exc}")
            return
        self._db_identity = file_identity(path)
        self._reopen_pending = False
        log.warning("recorder: the %s (%s); a new database was created there and the %d rows "
                    "written since the last check were lost", reason, path, lost)
        event = EventRow(instance_id=self.instance_id, model=None, at=self._clock(), kind="recorder_drops",
                         severity="error",
                         message=f"the {reason} while the recorder wrote to it; a new database was "
                                 f"created and {lost} rows written since the last check were lost",
                         details_json=json.dumps({"reason": reason, "path": path, "dropped": lost,
                                                  "dropped_total": self.dropped,
                                                  "by_kind": lost_by_kind}))
        try:
            self._insert_event(event)
        except Exception as exc:
            self._note_failure(type(exc).__name__, f"writing the {reason} event failed: {exc}")
            return
        self._reported_dropped += lost

    def _insert_event(self, event: EventRow) -> None:
        """Write one event now: through the writer process when there is one (this
        process then never opens the database), else here."""
        if self.process is not None:
            self.process.insert(EventRow, [event])
        else:
            self._inserts.insert_core(EventRow, [event])

    def _maybe_report_drops(self) -> None:
        dropped = self.dropped
        new = dropped - self._reported_dropped
        now = time.monotonic()
        if new <= 0 or now - self._last_report_at < DROP_REPORT_INTERVAL_S:
            return
        causes = []
        if self._dropped_full:
            causes.append(f"{self._dropped_full} because the buffer was full")
        if self._dropped_write:
            causes.append(f"{self._dropped_write} because writing failed"
                          + (f" (last: {self._last_failure})" if self._last_failure else ""))
        event = EventRow(instance_id=self.instance_id, model=None, at=self._clock(), kind="recorder_drops",
                         severity="warning",
                         message=f"the recorder dropped {new} rows; {dropped} since start: "
                                 + "; ".join(causes),
                         details_json=json.dumps({"dropped": new, "dropped_total": dropped,
                                                  "dropped_buffer_full": self._dropped_full,
                                                  "dropped_write_failed": self._dropped_write,
                                                  "last_failure": self._last_failure,
                                                  "by_kind": self.dropped_by_kind}))
        try:
            self._insert_event(event)
        except Exception as exc:
            self._note_failure(type(exc).__name__, f"writing the recorder_drops event failed: {exc}")
            return
        self._reported_dropped = dropped
        self._last_report_at = now


class TeeRecorder:
    """Hands each record to several recorders (e.g. the database and a live view)."""

    def __init__(self, *targets: Any) -> None:
        self.targets = tuple(targets)
        #: ``RequestBatch`` records only when every target takes them
        self.accepts_request_batches = all(getattr(t, "accepts_request_batches", False)
                                           for t in self.targets)
        self._puts = tuple((target, target.put) for target in self.targets)
        self._put_manys = tuple((target, put_many_of(target)) for target in self.targets)

    def put(self, record: Any) -> None:
        for target, put in self._puts:
            try:
                put(record)
            except Exception:  # one broken target must not break the request path
                log.exception("recorder target %r failed", target)

    def put_many(self, records: list) -> None:
        for target, put_many in self._put_manys:
            try:
                put_many(records)
            except Exception:
                log.exception("recorder target %r failed", target)

    @property
    def dropped(self) -> int:
        return sum(getattr(t, "dropped", 0) for t in self.targets)

    @property
    def pickles_records(self) -> bool:
        return any(getattr(t, "pickles_records", False) for t in self.targets)

    def start(self) -> None:
        for target in self.targets:
            if hasattr(target, "start"):
                target.start()

    def close(self, timeout_s: float = 5.0) -> None:
        for target in self.targets:
            if hasattr(target, "close"):
                target.close(timeout_s)
