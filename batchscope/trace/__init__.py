"""Traces of recorded windows, for Perfetto (ui.perfetto.dev) and chrome://tracing.

``export_trace(engine, window, out, fmt)`` reads the window's batches, requests,
generation steps and events (``analysis.queries.timeline.timeline_rows``, which refuses
a window holding more than ``max_rows`` batches and requests with ``WindowTooLarge``),
lays them out as tracks and slices (``layout``) and writes them in one of two formats:

* ``perfetto`` (``.pftrace``): Perfetto's native protobuf trace (``perfetto``), the
  compact one, with every time exact to the nanosecond;
* ``json`` (``.json``): Chrome's Trace Event JSON (``chrome``), which chrome://tracing
  and most trace tools open too.

Both hold the same picture: a process per instance; per model a batch track (more
lanes while batches overlap), a step track for generation models and a pool of request
tracks; each request a slice with ``queue`` and ``compute`` parts and an arrow to its
batch. An empty window still gives a valid trace, holding a note that says so.

``format_for(path)`` picks the format from a file name (``FORMATS``); ``check_names``
refuses a model or instance the database has never seen (``UnknownName``).
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from sqlalchemy import Engine

if TYPE_CHECKING:
    from batchscope.analysis.queries.timeline import WindowTooLarge
    from batchscope.analysis.queries.window import Window

#: file name suffix -> format
FORMATS = {".pftrace": "perfetto", ".perfetto-trace": "perfetto", ".pb": "perfetto",
           ".json": "json"}

__all__ = ["ExportSummary", "FORMATS", "UnknownName", "WindowTooLarge", "check_names",
           "export_trace", "format_for"]


@dataclass
class ExportSummary:
    """What one export wrote."""

    format: str
    batch_slices: int = 0
    #: requests drawn (a batched one is a slice with a queue and a compute slice in it)
    request_slices: int = 0
    flows: int = 0
    step_slices: int = 0
    events: int = 0
    processes: int = 0
    tracks: int = 0
    bytes_written: int = 0
    #: batches and requests read from the database
    rows: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (self.batch_slices or self.request_slices or self.step_slices)

    def to_dict(self) -> dict:
        return asdict(self)


def format_for(path: str | os.PathLike, asked: str | None = None) -> str:
    """The format a file name asks for (``FORMATS``), or ``asked`` (a format named
    outright); ``ValueError`` for a name of no known format when none is asked, and for
    an ``asked`` format another than the name's (a .pftrace file of JSON opens nowhere)."""
    name = str(path).lower()
    named = next((fmt for suffix, fmt in FORMATS.items() if name.endswith(suffix)), None)
    if asked is None and named is None:
        raise ValueError(f"cannot tell the trace format from the name {os.fspath(path)!r}: "
                         f"end it with {', '.join(FORMATS)}, or name the format (perfetto "
                         "or json)")
    if asked is not None and named is not None and asked != named:
        ends = " or ".join(suffix for suffix, fmt in FORMATS.items() if fmt == asked)
        raise ValueError(f"the format {asked} contradicts the name {os.fspath(path)!r} (a "
                         f"{named} file name): end the name in {ends}, or leave the format "
                         "to the name")
    return asked or named


class UnknownName(LookupError):
    """A window's model or instance that the database holds nothing of."""


#: at most this many known names are listed in an ``UnknownName`` message
_LISTED = 20


def check_names(engine: Engine, window: Window) -> None:
    """``UnknownName`` when the window's model or instance is one the database has never
    seen: neither registered (``runtime_instances``, ``model_settings``) nor in a batch,
    request or step row. The message names the unknown ones and lists the registered
    ones. Past the small registration tables, one indexed look-up per table of rows."""
    from sqlalchemy import select

    from batchscope.analysis.queries import catalog
    from batchscope.storage.schema import (BatchRecord, GenerationStep, RequestRecord,
                                           RuntimeInstance)

    problems = []
    if window.model is not None:
        known = catalog.models(engine)
        if window.model not in known and not _recorded(
                engine, "model", window.model, (BatchRecord, RequestRecord, GenerationStep)):
            problems.append(f"unknown model {window.model!r} ({_listed('model', known)})")
    if window.instance_id is not None:
        with engine.connect() as conn:
            known = sorted(conn.scalars(select(RuntimeInstance.id)))
        if window.instance_id not in known and not _recorded(
                engine, "instance_id", window.instance_id, (BatchRecord, RequestRecord)):
            problems.append(f"unknown instance {window.instance_id!r} "
                            f"({_listed('instance', known)})")
    if problems:
        raise UnknownName("; ".join(problems))


def _recorded(engine: Engine, column: str, value: str, tables: tuple) -> bool:
    """Whether a row of one of ``tables`` has ``value`` in ``column``."""
    from sqlalchemy import literal, select

    with engine.connect() as conn:
        return any(conn.execute(select(literal(1)).where(getattr(table, column) == value)
                                .limit(1)).first() is not None for table in tables)


def _listed(kind: str, known: list[str]) -> str:
    if not known:
        return f"the database has no {kind} registered"
    shown = ", ".join(known[:_LISTED])
    more = f" and {len(known) - _LISTED:,} more" if len(known) > _LISTED else ""
    return f"known: {shown}{more}"


class _Counting:
    """A binary file that counts what goes through it."""

    def __init__(self, fh: BinaryIO) -> None:
        self.fh = fh
        self.written = 0

    def write(self, data: bytes) -> int:
        self.fh.write(data)
        self.written += len(data)
        return len(data)


def _write_whole(path: Path, write) -> _Counting:
    """``write`` into a new file beside ``path``, which then replaces ``path``: a failed
    export leaves no half-written file, and an older file of that name as it was (its
    mode kept; a link is written through). What is not a regular file (a device, a
    pipe), and a file in a folder that takes no new one, is written in place."""
    try:
        st = os.stat(path)  # through links: what a write would reach
    except FileNotFoundError:
        st = None
    if st is not None and not stat.S_ISREG(st.st_mode):
        # as named: /dev/stdout leads (through /proc) to a pipe no path names
        return _write_in_place(path, write)
    path = Path(os.path.realpath(path))
    tmp = path.with_name(f".{path.name[:64]}.{os.getpid()}.{secrets.token_hex(4)}.part")
    try:
        # a new file gets the mode the umask leaves, as open() gives; one replacing a
        # file gets that file's mode, the part file owner-only until then
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666 if st is None else 0o600)
    except OSError as exc:
        if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENAMETOOLONG):
            return _write_in_place(path, write)
        raise
    try:
        with os.fdopen(fd, "wb") as fh:
            counting = _Counting(fh)
            write(counting)
            if st is not None:
                os.fchmod(fh.fileno(), stat.S_IMODE(st.st_mode))
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return counting


def _write_in_place(path: Path, write) -> _Counting:
    # opened without waiting: a named pipe that no program reads is ENXIO at once, not
    # a wait for ever; then writes wait as usual
    nonblock = getattr(os, "O_NONBLOCK", 0)  # POSIX; Windows has no named pipe files
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | nonblock
                 | getattr(os, "O_BINARY", 0), 0o666)
    try:
        if nonblock:
            os.set_blocking(fd, True)
        fh = os.fdopen(fd, "wb")
    except BaseException:
        os.close(fd)
        raise
    with fh:
        counting = _Counting(fh)
        write(counting)
    return counting


def __getattr__(name: str) -> Any:
    # the reading side (pandas) is imported when it is used: the server checks a window
    # with ``timespec`` without the dashboard packages
    if name == "WindowTooLarge":
        from batchscope.analysis.queries.timeline import WindowTooLarge
        return WindowTooLarge
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def export_trace(engine: Engine, window: Window, out: str | os.PathLike | BinaryIO,
                 fmt: str = "perfetto", *, max_rows: int | None = None,
                 now: float | None = None) -> ExportSummary:
    """Write the trace of ``window`` to ``out`` (a path, or a binary file left open) in
    ``fmt`` (``perfetto`` or ``json``); see the module doc. A path is written whole or
    not at all (``_write_whole``). Raises ``WindowTooLarge`` (nothing written) past
    ``max_rows`` batches and requests (default ``MAX_ROWS`` of the timeline queries), ``ValueError`` for an unknown format.
    ``now``: when the window is read (epoch seconds); a window that ends less than
    ``timespec.WRITTEN_LAG_S`` before it gets a note that its last rows may be missing."""
    if fmt not in ("perfetto", "json"):
        raise ValueError(f"unknown trace format {fmt!r}; use perfetto or json")
    from batchscope.analysis.queries.timeline import MAX_ROWS, timeline_rows
    from batchscope.trace import layout as layout_module

    rows = timeline_rows(engine, window, max_rows=MAX_ROWS if max_rows is None else max_rows)
    if now is not None:
        from batchscope.trace.timespec import recent_note

        note = recent_note(window.end_s, now)
        if note is not None:
            rows.notes.append(note)
    laid = layout_module.build(rows)
    if fmt == "perfetto":
        from batchscope.trace import perfetto as writer
    else:
        from batchscope.trace import chrome as writer
    if isinstance(out, (str, os.PathLike)):
        counting = _write_whole(Path(out), lambda fh: writer.write(laid, fh))
    else:
        counting = _Counting(out)
        writer.write(laid, counting)
    c = laid.counts
    return ExportSummary(format=fmt, batch_slices=c.batch_slices, request_slices=c.request_slices,
                         flows=c.flows, step_slices=c.step_slices, events=c.events,
                         processes=c.processes, tracks=c.tracks, bytes_written=counting.written,
                         rows=len(rows.batches) + len(rows.requests), notes=list(laid.notes))
