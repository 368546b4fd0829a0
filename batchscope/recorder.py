"""Bounded in-memory buffer + background bulk writer.

``put`` runs on the request path: it is a length check and a ``deque.append`` (both
atomic under the GIL), never touches the database and never raises. When the buffer
is full the record is dropped and counted. A daemon thread drains the buffer every
``flush_interval_s`` (sooner when a full flush is waiting) and inserts each table's
rows with one Core ``insert`` per flush, in its own transaction.

When the database fails (locked, disk full, unreachable) the rows in hand are dropped
and counted, the failure is logged once per kind, and the writer backs off
exponentially while ``put`` keeps filling (and, once full, dropping from) the buffer.
When writing works again a ``recorder_drops`` event says how many rows were lost.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from operator import attrgetter
from typing import Any, Callable

from sqlalchemy import Engine, Table, insert

from batchscope.records import BatchRow, DeviceRow, EventRow, GenStepRow, RequestRow
from batchscope.schema import BatchRecord, DeviceSample, EventRecord, GenerationStep, RequestRecord

log = logging.getLogger(__name__)

_ROW_TABLES: dict[type, Table] = {
    BatchRow: BatchRecord.__table__,
    RequestRow: RequestRecord.__table__,
    EventRow: EventRecord.__table__,
    DeviceRow: DeviceSample.__table__,
    GenStepRow: GenerationStep.__table__,
}

#: Table name used as the key of ``dropped_by_kind`` for a record type.
KIND_OF: dict[type, str] = {cls: table.name for cls, table in _ROW_TABLES.items()}

BACKOFF_START_S = 0.05
BACKOFF_MAX_S = 5.0
#: least time between two ``recorder_drops`` events
DROP_REPORT_INTERVAL_S = 10.0


def _to_dicts(cls: type) -> Callable[[list], list[dict]]:
    """A fast converter from slotted dataclass instances to insert parameter dicts."""
    names = tuple(cls.__slots__)
    getter = attrgetter(*names)

    def convert(records: list) -> list[dict]:
        return [dict(zip(names, getter(r))) for r in records]

    return convert


_CONVERTERS: dict[type, Callable[[list], list[dict]]] = {cls: _to_dicts(cls) for cls in _ROW_TABLES}


class Recorder:
    """Implements ``RecorderLike``: non-blocking ``put``, bulk writes in the background."""

    def __init__(self, engine: Engine, *, buffer_size: int = 100_000, flush_interval_s: float = 0.25,
                 max_rows_per_flush: int = 20_000, instance_id: str = "local",
                 clock: Callable[[], float] = time.time) -> None:
        if buffer_size < 1 or max_rows_per_flush < 1 or flush_interval_s <= 0:
            raise ValueError("buffer_size and max_rows_per_flush must be >= 1 and flush_interval_s > 0")
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
        self._unknown_types: set[type] = set()
        self._reported_dropped = 0
        self._last_report_at = float("-inf")
        self._backoff_s = 0.0
        self._retry_at = 0.0

    # ------------------------------------------------------------------ hot path
    def put(self, record: Any) -> None:
        """Queue ``record`` for writing; drop and count it when the buffer is full."""
        buffer = self._buffer
        if len(buffer) < self._limit:
            buffer.append(record)
            return
        self._dropped_full += 1
        kind = KIND_OF.get(type(record)) or type(record).__name__
        counts = self._dropped_full_by_kind
        counts[kind] = counts.get(kind, 0) + 1

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
            return self._flush_locked()

    def _run(self) -> None:
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
            if self._stopping and self._failing:
                self._discard_rest()
                return

    def _take(self) -> list:
        buffer = self._buffer
        n = min(len(buffer), self.max_rows_per_flush)
        popleft = buffer.popleft
        return [popleft() for _ in range(n)]

    def _flush_locked(self) -> int:
        records = self._take()
        if not records:
            return 0
        groups: dict[type, list] = {}
        for record in records:
            groups.setdefault(type(record), []).append(record)
        written = 0
        for cls, group in groups.items():
            table = _ROW_TABLES.get(cls)
            if table is None:
                if cls not in self._unknown_types:
                    self._unknown_types.add(cls)
                    log.warning("recorder: records of type %s have no table; they are dropped and counted",
                                cls.__name__)
                self._count_write_drops(cls, len(group))
                continue
            written += self._write(cls, table, group)
        self.flushes += 1
        if written and not self._failing:
            self._maybe_report_drops()
        return written

    def _write(self, cls: type, table: Table, group: list) -> int:
        kind = table.name
        try:
            rows = _CONVERTERS[cls](group)
            with self.engine.begin() as conn:
                conn.execute(insert(table), rows)
        except Exception as exc:  # the database is down, locked, full...: drop, count, back off
            self._count_write_drops(cls, len(group))
            self._note_failure(type(exc).__name__, f"writing {len(group)} {kind} rows failed: {exc}")
            return 0
        self.written += len(group)
        self.written_by_kind[kind] = self.written_by_kind.get(kind, 0) + len(group)
        if self._failing:
            log.info("recorder writes work again; %d rows dropped so far", self.dropped)
            self._failing.clear()
            self._backoff_s = 0.0
        return len(group)

    def _count_write_drops(self, cls: type, n: int) -> None:
        kind = KIND_OF.get(cls) or cls.__name__
        self._dropped_write += n
        self._dropped_write_by_kind[kind] = self._dropped_write_by_kind.get(kind, 0) + n

    def _note_failure(self, key: str, message: str) -> None:
        self.failures += 1
        if key not in self._failing:
            log.warning("recorder: %s (further failures of this kind are counted, not logged)", message)
            self._failing.add(key)
        self._backoff_s = min(BACKOFF_MAX_S, max(BACKOFF_START_S, self._backoff_s * 2))
        self._retry_at = time.monotonic() + self._backoff_s

    def _discard_rest(self) -> None:
        with self._write_lock:
            while self._buffer:
                for record in self._take():
                    self._count_write_drops(type(record), 1)

    def _maybe_report_drops(self) -> None:
        dropped = self.dropped
        new = dropped - self._reported_dropped
        now = time.monotonic()
        if new <= 0 or now - self._last_report_at < DROP_REPORT_INTERVAL_S:
            return
        event = EventRow(instance_id=self.instance_id, model=None, at=self._clock(), kind="recorder_drops",
                         severity="warning",
                         message=f"the recorder dropped {new} rows (buffer full or database unavailable); "
                                 f"{dropped} since start",
                         details_json=json.dumps({"dropped": new, "dropped_total": dropped,
                                                  "by_kind": self.dropped_by_kind}))
        try:
            with self.engine.begin() as conn:
                conn.execute(insert(EventRecord.__table__), _CONVERTERS[EventRow]([event]))
        except Exception as exc:
            self._note_failure(type(exc).__name__, f"writing the recorder_drops event failed: {exc}")
            return
        self._reported_dropped = dropped
        self._last_report_at = now


class TeeRecorder:
    """Hands each record to several recorders (e.g. the database and a live view)."""

    def __init__(self, *targets: Any) -> None:
        self.targets = tuple(targets)

    def put(self, record: Any) -> None:
        for target in self.targets:
            try:
                target.put(record)
            except Exception:  # one broken target must not break the request path
                log.exception("recorder target %r failed", target)

    @property
    def dropped(self) -> int:
        return sum(getattr(t, "dropped", 0) for t in self.targets)

    def start(self) -> None:
        for target in self.targets:
            if hasattr(target, "start"):
                target.start()

    def close(self, timeout_s: float = 5.0) -> None:
        for target in self.targets:
            if hasattr(target, "close"):
                target.close(timeout_s)


def _measure(path: str, rows: int = 300_000) -> dict[str, float]:
    """Cost of ``put`` and the sustained write rate into a SQLite file at ``path``."""
    from batchscope.db import make_engine
    from batchscope.records import RequestRow

    engine = make_engine(f"sqlite:///{path}")
    row = RequestRow(instance_id="bench", model="m", batch_seq=1, priority=0, arrived_at=1.0, finished_at=2.0,
                     queue_wait_s=0.001, latency_s=0.01, outcome="ok")
    recorder = Recorder(engine, buffer_size=rows)
    started = time.perf_counter()
    for _ in range(rows):
        recorder.put(row)
    put_ns = (time.perf_counter() - started) / rows * 1e9
    started = time.perf_counter()
    for _ in range(rows):
        recorder.put(row)  # buffer full: every one of these is dropped
    drop_ns = (time.perf_counter() - started) / rows * 1e9
    started = time.perf_counter()
    recorder.start()
    recorder.close(timeout_s=600.0)
    rate = recorder.written / (time.perf_counter() - started)
    engine.dispose()
    return {"put_ns": put_ns, "put_when_full_ns": drop_ns, "write_rows_per_s": rate}


if __name__ == "__main__":  # python -m batchscope.recorder [db path]
    import sys
    import tempfile

    target = sys.argv[1] if len(sys.argv) > 1 else f"{tempfile.mkdtemp()}/recorder-bench.db"
    for name, value in _measure(target).items():
        print(f"{name}: {value:,.0f}")
