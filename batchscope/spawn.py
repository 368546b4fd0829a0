"""Child processes and their channel: one way to start a helper process.

``spawn_child(target, args, name=...)`` starts ``target(conn, *args)`` in a fresh
interpreter (the ``multiprocessing`` ``spawn`` context: no inherited threads or locks,
safe with torch's thread pools and SQLite connections) and returns a ``Child``: the
process and the parent's end of a duplex channel (a Unix socket pair, wrapped as a
``multiprocessing.connection.Connection``). Both the device process
(``runtime.device.process``) and the database writer process
(``batchscope.storage.writer_process``) start this way.

Three things every such child needs, done here once:

- The parent's ``__main__`` is hidden while the child starts. A spawn child normally
  re-imports the parent's main script (as ``__mp_main__``) before running ``target``;
  for a script without an ``if __name__ == "__main__"`` guard, or a Streamlit page, that
  would run the script a second time in the child (render a page, start a server).
  The child needs only ``target`` and plain arguments, so ``target`` must live in an
  importable module, never in the main script.
- The child may lower its own CPU priority before ``target`` runs: ``idle=True`` asks
  for ``SCHED_IDLE`` (Linux: run only when a CPU has nothing else to do), ``nice`` is
  the increment used otherwise (or where ``SCHED_IDLE`` is refused). ``child_priority()``
  in the child says what was applied.
- The channel's frames: each message is a 4-byte big-endian length (or ``-1`` and an
  8-byte length above 2 GiB) and the bytes, the format of ``Connection.send_bytes``. A
  side that blocks uses the ``Connection``; a side on an event loop takes
  ``Child.socket()`` (non-blocking) and reads with ``FrameReader`` (partial reads are
  normal: bytes are kept until a frame is whole) and writes with ``FrameWriter`` (what
  the socket does not take now stays queued, in order, for the next ``flush``).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import socket
import struct
import sys
import threading
import types
from collections import deque
from dataclasses import dataclass
from itertools import islice
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any, Callable, Iterator, Sequence

from batchscope.threadnames import name_native

_HEADER = struct.Struct("!i")
_LONG = struct.Struct("!Q")
#: a frame longer than this has the ``-1`` marker and an 8-byte length
_LONG_FRAME = 0x7FFFFFFF
#: bytes read at once when no large frame body is being filled
READ_CHUNK = 256 * 1024
#: most buffers handed to one ``sendmsg`` call
_SEND_BUFFERS = 64

#: serialises the moments in which ``sys.modules["__main__"]`` is swapped out
_main_lock = threading.Lock()
#: in a child: the CPU priority it started with ("idle", "nice" or "normal")
_priority = "normal"


# -- starting a child -------------------------------------------------------------------
@dataclass(slots=True)
class Child:
    """A started child process and the parent's end of its channel."""

    process: BaseProcess
    conn: Connection

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def socket(self) -> socket.socket:
        """The parent's end as a non-blocking socket, for an event loop's ``add_reader``
        and ``add_writer``; the socket takes over the channel and ``conn`` is closed."""
        sock = socket.socket(fileno=os.dup(self.conn.fileno()))
        self.conn.close()
        sock.setblocking(False)
        return sock


def spawn_child(target: Callable[..., Any], args: Sequence[Any] = (), *, name: str,
                idle: bool = False, nice: int = 0, daemon: bool = True) -> Child:
    """Start ``target(conn, *args)`` in a spawned child named ``name``; ``conn`` is the
    child's end of the channel. ``target`` and ``args`` are pickled, so ``target`` must be
    a module-level function of an importable module. ``idle``/``nice``: the CPU priority
    the child gives itself before calling ``target`` (see ``lower_priority``)."""
    if getattr(target, "__module__", None) in ("__main__", "__mp_main__"):
        raise ValueError(f"{target!r} is defined in the main script, which a child does not "
                         "import; move it into an importable module")
    ctx = multiprocessing.get_context("spawn")
    parent_end, child_end = ctx.Pipe(duplex=True)
    proc = ctx.Process(target=_child_entry, name=name, daemon=daemon,
                       args=(target, child_end, tuple(args), bool(idle), int(nice)))
    try:
        with _main_module_hidden():
            proc.start()
    except BaseException:
        parent_end.close()
        raise
    finally:
        child_end.close()  # the child has its own copy now
    return Child(proc, parent_end)


def stop_child(proc: BaseProcess, conn: Connection, stop_message: bytes,
               timeout_s: float = 5.0) -> None:
    """Ask a child to exit with ``stop_message``, kill it after ``timeout_s``, close the
    channel (the shared end of ``WriterProcess`` and ``DatabaseCalls``)."""
    try:
        conn.send_bytes(stop_message)
    except (OSError, ValueError):
        pass
    proc.join(timeout_s)
    if proc.is_alive():
        proc.kill()
        proc.join(timeout_s)
    try:
        conn.close()
    except OSError:
        pass


def child_priority() -> str:
    """In a child started by ``spawn_child``: the CPU priority it gave itself at start."""
    return _priority


class BacklogPriority:
    """A child's CPU priority that follows its backlog (0..1, how full the queue it
    serves is): idle while it keeps up, ``nice`` (a fair share of a CPU) from ``urgent``
    until the backlog is back to ``calm``, so that a machine whose CPUs are never idle
    still gets the work done instead of dropped. ``start`` is what the child got at start
    (``child_priority``); a child that did not start idle keeps its priority."""

    def __init__(self, start: str, nice: int, urgent: float, calm: float) -> None:
        self.nice = nice
        self.urgent = urgent
        self.calm = calm
        self.start = self.state = start

    def follow(self, backlog: float) -> None:
        """Move every thread of this process to ``nice`` or back to idle as ``backlog``
        (0..1) crosses ``urgent`` or ``calm``. Every thread: on Linux the policy and the
        nice value belong to a thread, not to its process, and the work may be done by
        threads other than the one that calls (the span process's span and export
        threads)."""
        if self.start != "idle":
            return
        self.observe()
        try:
            if self.state == "idle" and backlog >= self.urgent:
                _set_threads(os.SCHED_OTHER, self.nice)
                self.state = "nice"
            elif self.state == "nice" and backlog <= self.calm:
                _set_threads(os.SCHED_IDLE, None)
                self.state = "idle"
        except OSError:  # not allowed here (an unprivileged user's limits): stay as it is
            pass

    def observe(self) -> None:
        """Take in a fair share the parent gave this child while it was starved
        (``WriterProcess.boost``): it counts as ``nice`` until the backlog is calm, then
        the child goes back to idle."""
        try:
            if self.state == "idle" and os.sched_getscheduler(0) != os.SCHED_IDLE:
                self.state = "nice"
        except OSError:
            pass


def _own_threads() -> list[int]:
    """The ids of this process's threads (Linux's ``/proc/self/task``), the calling
    thread first; ``[0]`` (the calling thread) where there is no such folder."""
    try:
        others = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return [0]
    me = threading.get_native_id()
    return [me] + [t for t in others if t != me]


def _set_threads(policy: int, nice: int | None) -> None:
    """``policy`` (and a nice value of at least ``nice``) for every thread of this
    process, the calling thread first: raises ``OSError`` when that one may not take it,
    before any other is changed."""
    for tid in _own_threads():
        try:
            if nice is not None:
                os.setpriority(os.PRIO_PROCESS, tid, max(os.getpriority(os.PRIO_PROCESS, tid),
                                                         nice))
            os.sched_setscheduler(tid, policy, os.sched_param(0))
        except ProcessLookupError:  # the thread ended meanwhile
            continue


def lower_priority(idle: bool, nice: int) -> str:
    """Lower this process' CPU priority: ``SCHED_IDLE`` where the system has it (Linux:
    the process runs only when a CPU has nothing else to do), else ``nice``. Returns
    what was applied: ``"idle"``, ``"nice"`` or ``"normal"``."""
    if idle and hasattr(os, "SCHED_IDLE"):
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            return "idle"
        except OSError:
            pass
    if nice:
        try:
            os.nice(nice)
            return "nice"
        except OSError:
            pass
    return "normal"


def _child_entry(target: Callable[..., Any], conn: Connection, args: tuple, idle: bool,
                 nice: int) -> None:
    global _priority
    name_native(multiprocessing.current_process().name)  # ps, top and perf show the child
    _priority = lower_priority(idle, nice)
    target(conn, *args)


@contextlib.contextmanager
def _main_module_hidden() -> Iterator[None]:
    """While a child starts: an empty ``__main__`` in place of the parent's, so that the
    child is told of no main script to re-import. The script's own module object is left
    untouched (code running in it still sees its globals); only ``sys.modules`` changes,
    for the few milliseconds ``Process.start`` takes, under a lock."""
    with _main_lock:
        main = sys.modules.get("__main__")
        sys.modules["__main__"] = types.ModuleType("__main__")
        try:
            yield
        finally:
            if main is None:
                sys.modules.pop("__main__", None)
            else:
                sys.modules["__main__"] = main


# -- the channel's frames, without blocking ---------------------------------------------
def frame_header(size: int) -> bytes:
    """The length prefix of a frame of ``size`` bytes (as ``Connection.send_bytes`` writes)."""
    if size > _LONG_FRAME:
        return _HEADER.pack(-1) + _LONG.pack(size)
    return _HEADER.pack(size)


class FrameError(ValueError):
    """The byte stream is not a sequence of frames (a corrupt or foreign writer)."""


class FrameReader:
    """Cuts the bytes read from a channel into whole frames.

    ``feed(data)`` takes any piece of the stream (a single byte, or several frames at
    once) and returns the frames it completed, in order; the rest is kept. A frame's
    body is filled into a buffer of its final size, so a large frame arriving in many
    pieces is copied once. ``receive(sock)`` reads once from a non-blocking socket, into
    that buffer directly when a large body is being filled; ``more`` then says whether
    the socket may hold more right away (the read took all it asked for), which spares a
    caller the extra read that would only fail with ``BlockingIOError``."""

    __slots__ = ("_head", "_body", "_filled", "_scratch", "more")

    def __init__(self) -> None:
        self._head = bytearray()
        self._body: bytearray | None = None
        self._filled = 0
        self._scratch: bytearray | None = None  # receive()'s read buffer, made on first use
        self.more = False

    def feed(self, data: bytes | bytearray | memoryview) -> list[bytearray]:
        frames: list[bytearray] = []
        view = memoryview(data)
        pos, end = 0, len(view)
        while pos < end:
            body = self._body
            if body is None:
                pos = self._read_header(view, pos, end)
                body = self._body
                if body is None:
                    break  # the header is not whole yet: everything was taken
                if not body:
                    frames.append(body)
                    self._body = None
                continue
            filled = self._filled
            take = min(len(body) - filled, end - pos)
            body[filled:filled + take] = view[pos:pos + take]
            pos += take
            self._filled = filled + take
            if self._filled == len(body):
                frames.append(body)
                self._body = None
        return frames

    def receive(self, sock: socket.socket) -> list[bytearray] | None:
        """Read once from ``sock``: the frames that completed (often none), or None at
        end of file. ``BlockingIOError`` (nothing to read now) and other ``OSError``
        come from the socket as they are."""
        body = self._body
        if body is not None and len(body) - self._filled >= READ_CHUNK:
            with memoryview(body) as view:
                n = sock.recv_into(view[self._filled:])
            if not n:
                return None
            self.more = n == len(body) - self._filled
            self._filled += n
            if self._filled < len(body):
                return []
            self._body = None
            return [body]
        scratch = self._scratch
        if scratch is None:
            scratch = self._scratch = bytearray(READ_CHUNK)
        with memoryview(scratch) as view:
            n = sock.recv_into(view)
            if not n:
                return None
            self.more = n == READ_CHUNK
            return self.feed(view[:n])

    def _read_header(self, view: memoryview, pos: int, end: int) -> int:
        head = self._head
        while pos < end:
            need = (4 if len(head) < 4 else 12) - len(head)
            take = min(need, end - pos)
            head += view[pos:pos + take]
            pos += take
            if len(head) < 4 or take < need:
                continue
            size = _HEADER.unpack_from(head)[0]
            if size == -1:
                if len(head) < 12:
                    continue
                size = _LONG.unpack_from(head, 4)[0]
            elif size < 0:
                raise FrameError(f"a frame header says {size} bytes; the channel is corrupt")
            head.clear()
            self._body = bytearray(size)
            self._filled = 0
            break
        return pos


class FrameWriter:
    """Frames written in order to a non-blocking socket, never blocking.

    ``send`` writes what the socket takes at once and queues the rest; while anything is
    queued, later frames queue behind it, so frames never interleave. The caller calls
    ``flush`` when the socket is writable again (``loop.add_writer``) until it returns
    True. ``OSError`` other than "would block" (the other end is gone) is raised."""

    __slots__ = ("_queue",)

    def __init__(self) -> None:
        self._queue: deque[memoryview | bytes] = deque()

    @property
    def pending(self) -> int:
        """Bytes queued, not yet taken by the socket."""
        return sum(map(len, self._queue))

    def send(self, sock: socket.socket, payload: bytes) -> bool:
        """Write ``payload`` as one frame; True when it went out whole, False when part of
        it (or all, behind earlier frames) waits for ``flush``."""
        header = frame_header(len(payload))
        if self._queue:
            self._queue.append(header)
            self._queue.append(payload)
            return False
        try:
            n = sock.sendmsg((header, payload))
        except (BlockingIOError, InterruptedError):
            n = 0
        if n == len(header) + len(payload):
            return True
        if n < len(header):
            self._queue.append(memoryview(header)[n:])
            self._queue.append(payload)
        else:
            self._queue.append(memoryview(payload)[n - len(header):])
        return False

    def flush(self, sock: socket.socket) -> bool:
        """Write queued bytes until the socket is full; True when nothing is left."""
        queue = self._queue
        while queue:
            try:
                n = sock.sendmsg(list(islice(queue, _SEND_BUFFERS)))
            except (BlockingIOError, InterruptedError):
                return False
            while n:
                first = queue[0]
                if n >= len(first):
                    n -= len(first)
                    queue.popleft()
                else:
                    queue[0] = memoryview(first)[n:]
                    n = 0
        return True

    def clear(self) -> None:
        self._queue.clear()
