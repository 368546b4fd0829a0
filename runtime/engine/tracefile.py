"""Triton's JSON trace file, appended off the event loop, bounded in memory.

``tritonserver --trace-file`` writes one JSON array of traces, each an object with
``id``, ``model_name``, ``model_version`` and ``timestamps``, a list of ``{"name",
"ns"}`` in the order they happen (Triton's steady-clock nanoseconds; here wall-clock
nanoseconds since the epoch, so traces line up with the database rows and with other
processes). ``TraceFileWriter`` writes the same, with ``request_id`` when the client
sent an ``id`` (left out when empty, as Triton does) and the W3C ids of a request that
carried a ``traceparent``. A gRPC handler is given its request already read, so a gRPC
trace has no time of its own for ``GRPC_WAITREAD_START``: the file writes it equal to
``GRPC_WAITREAD_END`` (the database row leaves it empty), since Triton's
``trace_summary.py`` counts only the gRPC traces that carry it:

* ``put(path, log_frequency, row)`` only appends to a bounded buffer (at most
  ``max_pending`` traces; one more is dropped and counted), and a daemon thread writes
  what waits every ``flush_interval_s``: nothing is written or serialized on the event
  loop;
* ``log_frequency`` 0: every trace goes to ``path``; N: to ``path.0`` until it holds N
  traces, then ``path.1``, ... (``reset(path)`` starts again from ``path.0``, as Triton
  does when ``trace_file`` changes);
* a file is appended to in place, so it is a whole JSON array after every write: the
  closing ``]`` is overwritten by the new traces and a new ``]``. A file that is not a
  JSON array is never written over: its traces are dropped and counted;
* a write that fails (a full disk, a folder made read-only) drops its traces, counts
  them (``dropped``) and logs once per kind of failure; the server goes on serving.
"""

from __future__ import annotations

import logging
import os
import stat
import tempfile
import threading
from collections import deque
from typing import Any

import orjson

from batchscope.threadnames import name_native

log = logging.getLogger("batchscope.trace")

#: traces waiting to be written at most; more are dropped and counted
MAX_PENDING = 10_000
#: how often the writer thread wakes to write what waits
FLUSH_INTERVAL_S = 0.5
#: bytes read back from the end of a file to find its closing bracket
_TAIL_BYTES = 4096


class NotATraceFile(OSError):
    """The file at a trace path exists and is not a JSON array."""


def trace_entry(row: Any, names: list[tuple[str, str]]) -> dict[str, Any]:
    """The Triton trace object of a ``TraceRow``: ``names`` maps its columns to Triton's
    timestamp names, in order."""
    doc: dict[str, Any] = {"id": row.trace_id, "model_name": row.model, "model_version": 1}
    if row.request_id:  # Triton leaves an empty id out
        doc["request_id"] = row.request_id
    if row.w3c_trace_id is not None:
        doc["w3c_trace_id"] = row.w3c_trace_id
        doc["w3c_parent_span_id"] = row.w3c_parent_span_id
    stamps = [{"name": name, "ns": int(round(at * 1e9))} for name, column in names
              if (at := getattr(row, column)) is not None]
    if stamps and stamps[0]["name"] == "GRPC_WAITREAD_END":  # no start seen (module doc)
        stamps.insert(0, {"name": "GRPC_WAITREAD_START", "ns": stamps[0]["ns"]})
    doc["timestamps"] = stamps
    return doc


def append_to_array(path: str, items: list[bytes]) -> None:
    """Append ``items`` (JSON texts) to the JSON array in the file at ``path``, made
    when missing; ``NotATraceFile`` when the file holds something else."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        body = b",".join(items)
        if size == 0:
            os.write(fd, b"[" + body + b"]\n")
            return
        os.lseek(fd, 0, os.SEEK_SET)
        first = os.read(fd, 1)
        start = max(0, size - _TAIL_BYTES)
        os.lseek(fd, start, os.SEEK_SET)
        tail = os.read(fd, size - start)
        end = tail.rstrip()
        if first != b"[" or not end.endswith(b"]"):
            raise NotATraceFile(f"{path} is not a JSON array; its traces are not written "
                                "there (set trace_file to a new file)")
        at = start + len(end) - 1  # the closing bracket
        empty = end[:-1].rstrip().endswith(b"[")  # "[]": no trace yet
        data = (b"" if empty else b",") + body + b"]\n"
        os.lseek(fd, at, os.SEEK_SET)
        os.write(fd, data)
        os.ftruncate(fd, at + len(data))
    finally:
        os.close(fd)


def check_writable(path: str) -> str | None:
    """Why traces could not be appended to ``path`` (its folder must exist), or None
    (a setting that names a file the server cannot write is refused, rather than every
    trace being dropped later). Nothing is created or removed: an existing file must be
    a regular one this process may read and write (as ``append_to_array`` opens it;
    opened without blocking, so a pipe cannot hold the caller); for a new one, the
    folder must take a file of this process and a name this long."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        st = None
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    if st is not None:
        if not stat.S_ISREG(st.st_mode):
            return "it is not a regular file"
        try:
            os.close(os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_NOFOLLOW))
        except OSError as exc:
            return exc.strerror or type(exc).__name__
        return None
    folder = os.path.dirname(os.path.abspath(path))
    try:
        most = os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError):
        most = 255
    if len(os.fsencode(os.path.basename(path))) > most:
        return f"the file name is longer than the {most} bytes the folder takes"
    if not os.access(folder, os.W_OK | os.X_OK):
        return "the folder is not writable"
    try:  # what the folder really takes (a read-only mount, a pseudo file system)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".batchscope-probe-"):
            pass
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    return None


class TraceFileWriter:
    """Writes traces to Triton-format JSON files on a thread of its own (see module doc)."""

    def __init__(self, names: list[tuple[str, str]] | None = None, *,
                 grpc_names: list[tuple[str, str]] | None = None,
                 max_pending: int = MAX_PENDING,
                 flush_interval_s: float = FLUSH_INTERVAL_S) -> None:
        self.names = names or []
        self.grpc_names = grpc_names or self.names
        self.max_pending = max_pending
        self.flush_interval_s = flush_interval_s
        self._pending: deque = deque()
        #: traces dropped because the buffer was full (counted by ``put``'s thread) and
        #: because their write failed (counted by the writer): see ``dropped``
        self._dropped_full = 0
        self._dropped_write = 0
        self.written = 0
        #: path -> [file index, traces in that file] (log_frequency > 0)
        self._index: dict[str, list[int]] = {}
        self._failures: set[str] = set()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None

    def put(self, path: str, log_frequency: int, row: Any) -> None:
        """Queue one trace (a ``TraceRow``) for ``path``; never blocks, never raises."""
        if len(self._pending) >= self.max_pending or self._stop:
            self._dropped_full += 1
            return
        self._pending.append((path, log_frequency, row))
        if self._thread is None:
            self._start()

    @property
    def dropped(self) -> int:
        """Traces dropped so far: the buffer was full, or their write failed."""
        return self._dropped_full + self._dropped_write

    def reset(self, path: str) -> None:
        """The next traces for ``path`` (with a log frequency) start again at ``path.0``."""
        with self._lock:
            self._index.pop(path, None)

    def _start(self) -> None:
        thread = threading.Thread(target=self._run, name="batchscope-trace-file", daemon=True)
        self._thread = thread
        thread.start()

    def _run(self) -> None:
        name_native()
        while not self._stop:
            self._wake.wait(self.flush_interval_s)
            self._wake.clear()
            self.flush()
        self.flush()

    def flush(self) -> int:
        """Write every trace waiting now; how many were written."""
        with self._lock:
            taken = []
            pending = self._pending
            while pending:
                taken.append(pending.popleft())
            if not taken:
                return 0
            written = 0
            groups: dict[str, list[bytes]] = {}
            for path, frequency, row in taken:
                names = self.grpc_names if row.protocol == "grpc" else self.names
                text = orjson.dumps(trace_entry(row, names))
                if frequency <= 0:
                    groups.setdefault(path, []).append(text)
                    continue
                index = self._index.setdefault(path, [0, 0])
                if index[1] >= frequency:
                    index[0] += 1
                    index[1] = 0
                index[1] += 1
                groups.setdefault(f"{path}.{index[0]}", []).append(text)
            for target, items in groups.items():
                try:
                    append_to_array(target, items)
                    written += len(items)
                except OSError as exc:
                    self._dropped_write += len(items)
                    kind = f"{target}:{type(exc).__name__}:{getattr(exc, 'errno', None)}"
                    if kind not in self._failures:
                        self._failures.add(kind)
                        log.warning("writing %d trace(s) to %s failed (%s); they are dropped "
                                    "and counted, and the server goes on", len(items), target,
                                    exc)
            self.written += written
            return written

    def close(self, timeout_s: float = 5.0) -> None:
        """Write what waits and stop the thread (later traces are dropped and counted)."""
        self._stop = True
        self._wake.set()
        thread = self._thread
        if thread is not None:
            thread.join(timeout_s)
        else:
            self.flush()
