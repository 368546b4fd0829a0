"""The recorder's database writes in a child process.

A serving process is usually bound by one thread (its event loop). The recorder's
writer thread keeps the buffer off that thread, but the SQLite work itself (binding
parameters, B-tree and index inserts, WAL writes) still costs the serving process
CPU and interpreter-lock hand-offs: on the 2-core benchmark box about 4-5 us per
recorded request, 5-7 % of the mlp server's throughput. ``WriterProcess`` moves that
work into a child with its own interpreter (``batchscope.spawn.spawn_child``), started
lazily and run at the lowest CPU priority (``SCHED_IDLE`` on Linux, else ``nice``); it
runs the same inserts as the recorder's thread would (``batchscope.storage.inserts``).
It writes in the CPU time that serving leaves over, and if serving leaves none for
long, the recorder's buffer fills and rows are dropped and counted, as with a slow
disk, instead of requests slowing down. (Measured on the 2-core box at 15-16k requests/s with 30 % of the CPU idle: no
row dropped; throughput with recording within 1 % of without, against 4-5 % with a
normal-priority or niced writer.) The parent turns each table's rows into plain tuples
(C-level ``attrgetter``), pickles them (about 0.5 us per row) and waits for the
child's answer on a pipe, with the interpreter lock released. ``RequestBatch`` records
(one per batch, the requests as column lists) and ``TraceBatch`` records (traced
requests as tuples) travel as they are and become rows in the child, so a recorded
request costs the serving process a few list appends.

While the recorder's buffer fills up (``URGENT_BACKLOG``) the child leaves
``SCHED_IDLE`` for a normal policy at ``nice`` 10 and returns once it has caught up, so
a machine whose CPUs are never idle still gets its rows written.

One message per record type and flush: ``(type name, tuples, backlog)`` -> ``b"ok"`` +
the child's priority, or a pickled ``(exception name, message)``. A failure raises ``RemoteWriteError`` in the parent,
which the recorder treats like any database failure (rows dropped and counted, back
off). A child that dies or does not answer within ``reply_timeout_s`` is stopped and
its rows counted as dropped; the next write starts a new one.

The child opens the database without creating anything (``make_engine(create=False)``):
when the SQLite file is deleted under it, the recorder (in the parent) notices, creates
the database anew and stops the child, whose connection still points at the deleted
file; the next write starts a child on the new one.
"""

from __future__ import annotations

import logging
import os
import pickle
from itertools import chain
from operator import attrgetter
from typing import Any

from batchscope import gctune
from batchscope.spawn import BacklogPriority, child_priority, spawn_child, stop_child
from batchscope.storage.records import BATCHED

log = logging.getLogger(__name__)

#: how long the parent waits for one write's answer (SQLite's busy timeout is 5 s)
REPLY_TIMEOUT_S = 60.0
#: recorder buffer fill (0..1) at which an idle-scheduled child asks for a fair CPU share,
#: and at which it goes back to idle
URGENT_BACKLOG = 0.25
CALM_BACKLOG = 0.05
#: how long a new child may take to import and connect
START_TIMEOUT_S = 60.0
#: an idle-scheduled child that has not answered (or started) within this long is given a
#: fair CPU share by the parent: on a machine whose CPUs are never idle it would otherwise
#: not run at all, and could not ask for more itself
STARVED_AFTER_S = 0.5
_STOP = b"stop"
_OK = b"ok"
_READY = b"ready"


class RemoteWriteError(Exception):
    """A write the child could not do; the message names the child's exception."""


def _child_main(conn: Any, url: str, nice: int, busy_timeout_ms: int | None = None) -> None:
    """Receive ``(type name, rows, backlog)``, insert, answer; until told to stop or
    orphaned. Started by ``spawn_child``, which has set the CPU priority already."""
    prio = BacklogPriority(child_priority(), nice, URGENT_BACKLOG, CALM_BACKLOG)
    from batchscope.storage.db import make_engine
    from batchscope.storage.inserts import ROW_TABLES, BulkInserts

    classes = {cls.__name__: cls for cls in ROW_TABLES}
    batched = {cls.__name__: row for cls, row in BATCHED.items()}
    engine = make_engine(url, create=False)
    inserts = BulkInserts(engine)
    if inserts.sqlite and busy_timeout_ms is not None:
        from sqlalchemy import event

        @event.listens_for(engine, "connect")
        def _busy(dbapi_conn: Any, _record: Any) -> None:
            dbapi_conn.execute(f"PRAGMA busy_timeout={int(busy_timeout_ms)}")
    raw = None
    gctune.settle()  # the engine and its modules stay for the process's life
    conn.send_bytes(_READY + prio.state.encode())
    while True:
        try:
            msg = conn.recv_bytes()
        except (EOFError, OSError):  # the parent is gone
            break
        if msg == _STOP:
            break
        try:
            name, rows, backlog = pickle.loads(msg)
            prio.follow(backlog)
            if name in batched:  # one record per many rows: its rows, built here
                cls = batched[name]
                rows = list(chain.from_iterable(b.tuples() for b in rows))
            else:
                cls = classes[name]
            if inserts.sqlite:
                if raw is None:
                    raw = engine.raw_connection()
                inserts.insert_sqlite(raw, cls, rows, tuples=True)
            else:
                inserts.insert_core(cls, rows, tuples=True)
            prio.observe()  # a starved write may have been given a fair share meanwhile
            conn.send_bytes(_OK + prio.state.encode())
        except Exception as exc:  # database failure: tell the parent, start clean
            if raw is not None:
                try:
                    if raw.is_valid:
                        raw.invalidate()
                except Exception:
                    pass
                raw = None
            try:
                conn.send_bytes(pickle.dumps((type(exc).__name__, str(exc)[:500])))
            except (OSError, ValueError):
                break
    if raw is not None:
        raw.close()
    engine.dispose()


class WriterProcess:
    """Inserts rows through a child process; ``insert`` blocks until the child answers.

    Called from one thread at a time (the recorder's writer, under its lock)."""

    def __init__(self, url: str, *, idle: bool = True, nice: int = 10,
                 reply_timeout_s: float = REPLY_TIMEOUT_S, start_timeout_s: float = START_TIMEOUT_S,
                 busy_timeout_ms: int | None = None) -> None:
        self.url = url
        self.idle = idle
        #: the CPU priority the running child got ("idle", "nice" or "normal")
        self.priority: str | None = None
        #: the recorder's buffer fill (0..1), sent along with each write
        self.backlog = 0.0
        self.busy_timeout_ms = busy_timeout_ms
        self.nice = nice
        self.reply_timeout_s = reply_timeout_s
        self.start_timeout_s = start_timeout_s
        self.starts = 0
        #: times the parent gave a starved idle child a fair CPU share (``boost``)
        self.boosts = 0
        self._proc: Any = None
        self._conn: Any = None
        self._getters: dict[type, Any] = {}

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def _start(self) -> None:
        child = spawn_child(_child_main, (self.url, self.nice, self.busy_timeout_ms),
                            name="batchscope-db-writer", idle=self.idle, nice=self.nice)
        self._proc, self._conn = child.process, child.conn
        parent = child.conn
        self.starts += 1
        if not self._answered(parent, self.start_timeout_s):
            self.stop()
            raise RemoteWriteError(f"the database writer process did not start within "
                                   f"{self.start_timeout_s:.0f} s")
        try:
            self.priority = parent.recv_bytes()[len(_READY):].decode() or "normal"
        except (EOFError, OSError):
            self.stop()
            raise RemoteWriteError("the database writer process exited while starting "
                                   "(is the database URL reachable?)") from None

    def insert(self, cls: type, rows: list) -> None:
        """Write ``rows`` (records of type ``cls``) in one transaction in the child,
        starting it if needed; ``RemoteWriteError`` when that did not happen."""
        if self._proc is None or not self._proc.is_alive():
            if self._proc is not None:
                self.stop()
            self._start()
        if cls in BATCHED:  # column lists and tuples pickle cheaply; the rows are built there
            items: list = rows
        else:
            getter = self._getters.get(cls)
            if getter is None:
                getter = self._getters[cls] = attrgetter(*cls.__slots__)
            items = list(map(getter, rows))
        payload = pickle.dumps((cls.__name__, items, self.backlog), protocol=5)
        conn = self._conn
        try:
            conn.send_bytes(payload)
            if not self._answered(conn, self.reply_timeout_s):
                self.stop(timeout_s=1.0)  # it does not answer: do not wait long for it
                raise RemoteWriteError(f"the database writer process did not answer within "
                                       f"{self.reply_timeout_s:.0f} s; it was stopped")
            reply = conn.recv_bytes()
        except (EOFError, OSError, BrokenPipeError):
            self.stop()
            raise RemoteWriteError("the database writer process exited; a new one starts "
                                   "with the next write") from None
        if not reply.startswith(_OK):
            name, message = pickle.loads(reply)
            raise RemoteWriteError(f"{name}: {message}")
        self.priority = reply[len(_OK):].decode() or self.priority

    def _answered(self, conn: Any, timeout_s: float) -> bool:
        """Whether the child answers within ``timeout_s``; past ``STARVED_AFTER_S`` an
        idle-scheduled child gets a fair CPU share (``nice``) from here."""
        if conn.poll(min(timeout_s, STARVED_AFTER_S)):
            return True
        if timeout_s <= STARVED_AFTER_S:
            return False
        self.boost()
        return conn.poll(timeout_s - STARVED_AFTER_S)

    def boost(self) -> None:
        """Give the child a fair CPU share (``SCHED_OTHER`` at ``nice``) when it was
        started idle; its backlog rule may take it back to idle later."""
        pid = self.pid
        if pid is None or self.priority not in (None, "idle") or not self.idle \
                or not hasattr(os, "SCHED_IDLE"):
            return
        try:
            if os.sched_getscheduler(pid) != os.SCHED_IDLE:
                return
            os.sched_setscheduler(pid, os.SCHED_OTHER, os.sched_param(0))
            os.setpriority(os.PRIO_PROCESS, pid, max(os.getpriority(os.PRIO_PROCESS, pid),
                                                     self.nice))
            self.boosts += 1
        except OSError:  # gone, or not allowed here: the timeouts still bound the wait
            pass

    def stop(self, timeout_s: float = 5.0) -> None:
        proc, conn = self._proc, self._conn
        self._proc = self._conn = None
        if proc is None:
            return
        stop_child(proc, conn, _STOP, timeout_s)
