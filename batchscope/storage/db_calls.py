"""Database calls run in a child process, so that the caller never opens the database.

A process that serves requests must not hold anything whose failure kills it. A SQLite
database in WAL mode is not such a thing: every process with a connection maps the
``-shm`` file (SQLite's WAL index) into its memory, and when a write to that mapping
cannot be backed (a full disk or tmpfs, a file made immutable, a filesystem remounted
read-only) the kernel ends the process with ``SIGBUS``, with no Python exception to
catch. ``DatabaseCalls`` keeps those connections in a child (``batchscope.spawn``), so
only the child can die that way; the parent sees an error, counts what it lost and
starts a new child on its next call.

``DatabaseCalls(url).call(fn, *args, **kwargs)`` runs ``fn(engine, *args, **kwargs)`` in
the child and returns its result. ``fn`` must be a module-level function (it is sent by
reference, as ``pickle`` sends functions), its arguments and result plain picklable
values. The child opens the database with ``make_engine(url, create=create)`` (the
first child creates the file and the schema when ``create`` is true). It runs at the
normal CPU priority: heartbeats and control commands must not wait for idle CPU time.
A call that fails in the child raises ``RemoteCallError`` naming the child's exception
(``.name``, ``.message``); a child that dies or does not answer within
``reply_timeout_s`` is stopped, and the next call starts a new one.

Called from one thread at a time (calls are serialised by a lock).
"""

from __future__ import annotations

import pickle
import threading
from typing import Any, Callable

from batchscope.spawn import spawn_child, stop_child

#: how long the parent waits for one call's answer (SQLite's busy timeout is 5 s)
REPLY_TIMEOUT_S = 30.0
#: how long a new child may take to import, connect and bring the schema up to date
START_TIMEOUT_S = 120.0
_STOP = b"stop"


class RemoteCallError(Exception):
    """A call the child could not complete: its exception's class name and message."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(f"{name}: {message}")
        self.name = name
        self.message = message


def _child_main(conn: Any, url: str, create: bool) -> None:
    """Open the database, say so, then answer ``(fn, args, kwargs)`` until told to stop
    or orphaned. A failed call disposes of the engine's connections (start clean)."""
    from batchscope.storage.db import make_engine

    try:
        engine = make_engine(url, create=create)
    except Exception as exc:
        conn.send_bytes(pickle.dumps(("error", type(exc).__name__, str(exc)[:1000])))
        return
    conn.send_bytes(pickle.dumps(("ok", None)))
    while True:
        try:
            msg = conn.recv_bytes()
        except (EOFError, OSError):  # the parent is gone
            break
        if msg == _STOP:
            break
        try:
            fn, args, kwargs = pickle.loads(msg)
            reply = pickle.dumps(("ok", fn(engine, *args, **kwargs)), protocol=5)
        except Exception as exc:
            engine.dispose()
            reply = pickle.dumps(("error", type(exc).__name__, str(exc)[:1000]))
        try:
            conn.send_bytes(reply)
        except (OSError, ValueError):
            break
    engine.dispose()


class DatabaseCalls:
    """Runs database functions in a child process (see the module docstring)."""

    def __init__(self, url: str, *, create: bool = True,
                 reply_timeout_s: float = REPLY_TIMEOUT_S,
                 start_timeout_s: float = START_TIMEOUT_S) -> None:
        self.url = url
        self.create = create
        self.reply_timeout_s = reply_timeout_s
        self.start_timeout_s = start_timeout_s
        #: children started so far (a restart after a failure counts)
        self.starts = 0
        self._proc: Any = None
        self._conn: Any = None
        self._lock = threading.Lock()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start(self) -> None:
        """Start the child now (it opens the database, creating it and its schema when
        ``create``); raises ``RemoteCallError`` when it cannot."""
        with self._lock:
            self._ensure()

    def _ensure(self) -> None:
        if self._proc is not None and self._proc.is_alive():
            return
        self._stop()
        child = spawn_child(_child_main, (self.url, self.create), name="batchscope-db-calls")
        self._proc, self._conn = child.process, child.conn
        self.starts += 1
        reply = self._reply(self.start_timeout_s, "start")
        if reply[0] != "ok":
            self._stop()
            raise RemoteCallError(reply[1], reply[2])

    def _reply(self, timeout_s: float, what: str) -> tuple:
        conn = self._conn
        try:
            if not conn.poll(timeout_s):
                self._stop(timeout_s=1.0)  # it does not answer: do not wait long for it
                raise RemoteCallError("TimeoutError", f"the database process did not {what} "
                                                      f"within {timeout_s:.0f} s; it was stopped")
            return pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            code = self._proc.exitcode if self._proc is not None else None
            self._stop()
            raise RemoteCallError("ChildExited", f"the database process exited (code {code}) "
                                                 f"during {what}; a new one starts with the "
                                                 "next call") from None

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(engine, *args, **kwargs)`` in the child; its result, or ``RemoteCallError``."""
        payload = pickle.dumps((fn, args, kwargs), protocol=5)
        with self._lock:
            self._ensure()
            try:
                self._conn.send_bytes(payload)
            except (OSError, ValueError):
                self._stop()
                raise RemoteCallError("ChildExited", "the database process exited; a new one "
                                                     "starts with the next call") from None
            reply = self._reply(self.reply_timeout_s, f"answer {getattr(fn, '__name__', fn)}")
        if reply[0] != "ok":
            raise RemoteCallError(reply[1], reply[2])
        return reply[1]

    def _stop(self, timeout_s: float = 5.0) -> None:
        proc, conn = self._proc, self._conn
        self._proc = self._conn = None
        if proc is None:
            return
        stop_child(proc, conn, _STOP, timeout_s)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the child (the next call starts a new one)."""
        with self._lock:
            self._stop(timeout_s)
