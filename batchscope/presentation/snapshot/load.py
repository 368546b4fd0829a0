"""Opening a snapshot: ``load_snapshot`` checks a file and loads it into a temporary
SQLite database (a ``Snapshot``); ``report_html`` and ``trace_bytes`` give back its stored
report and trace after the same member checks.

The temporary database is named after the process that opened it
(``batchscope-snapshot-<pid>-*.db``): it goes with its ``Snapshot`` or at exit, and the
next ``load_snapshot`` removes those of processes that are gone (killed before they could),
so a dashboard killed with SIGKILL does not leave copies of its snapshots behind."""

from __future__ import annotations

import io
import os
import re
import sqlite3
import tempfile
import weakref
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from sqlalchemy import Engine

from batchscope.analysis.queries import Window
from batchscope.presentation.snapshot.checks import (_check_manifest, _check_members, _read_member,
                                                   written_by)
from batchscope.presentation.snapshot.layout import MANIFEST, REPORT, TRACE, Limits, SnapshotError
from batchscope.presentation.snapshot.tables import _load_tables
from batchscope.storage.db import make_engine


@dataclass


class Snapshot:
    """A snapshot opened into a temporary SQLite database."""

    engine: Engine
    manifest: dict
    path: Path
    window: Window = field(init=False)

    def __post_init__(self) -> None:
        w = self.manifest["window"]
        self.window = Window(float(w["start_s"]), float(w["end_s"]), w.get("model"),
                             w.get("instance_id"))
        # the temporary database goes away with the object (or at exit), even when
        # nobody calls close(): a dashboard session that ends just drops its snapshots
        self._finalizer = weakref.finalize(self, _discard, self.engine, str(self.path))

    @property
    def written_by(self) -> str | None:
        """The BatchScope version that wrote the file (``0.1.0``); None when it does not say."""
        return written_by(self.manifest)

    def close(self) -> None:
        self._finalizer()


PREFIX = "batchscope-snapshot-"
_LEFT = re.compile(re.escape(PREFIX) + r"(\d+)-[^/]*\.db(-wal|-shm)?")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def sweep(folder: str | Path) -> list[str]:
    """Remove the temporary databases in ``folder`` left by processes of this user that
    are gone; the names removed."""
    removed = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    uid = os.getuid()
    for entry in entries:
        found = _LEFT.fullmatch(entry.name)
        if found is None or int(found.group(1)) == os.getpid():
            continue
        try:
            if entry.stat(follow_symlinks=False).st_uid != uid or not entry.is_file(
                    follow_symlinks=False) or _alive(int(found.group(1))):
                continue
            os.remove(entry.path)
            removed.append(entry.name)
        except OSError:
            continue
    return removed


def _discard(engine: Engine | None, path: str) -> None:
    if engine is not None:
        engine.dispose()
    for suffix in ("", "-wal", "-shm"):
        try:
            os.remove(path + suffix)
        except OSError:
            pass


def _open_zip(source: str | Path | bytes | BinaryIO, limits: Limits) -> zipfile.ZipFile:
    """The archive, after the file size check; a path is read from disk as needed."""
    if isinstance(source, (str, Path)):
        size = os.path.getsize(source)
        if size > limits.max_file_bytes:
            raise SnapshotError(f"the file is {size} bytes, more than the limit of "
                                f"{limits.max_file_bytes}")
        target: str | Path | BinaryIO = source
    else:
        data = bytes(source) if isinstance(source, (bytes, bytearray, memoryview)) \
            else source.read(limits.max_file_bytes + 1)
        if len(data) > limits.max_file_bytes:
            raise SnapshotError(f"the file is larger than the limit of {limits.max_file_bytes} bytes")
        target = io.BytesIO(data)
    try:
        return zipfile.ZipFile(target)
    except (zipfile.BadZipFile, EOFError, ValueError, NotImplementedError) as exc:
        raise SnapshotError(f"the file is not a zip archive ({exc}); a BatchScope snapshot is a "
                            ".zip written by 'batchscope snapshot export' or the dashboard") from None


def load_snapshot(source: str | Path | bytes | BinaryIO, *, limits: Limits | None = None,
                  workdir: str | Path | None = None) -> Snapshot:
    """Check ``source`` and load it into a temporary SQLite database (see ``Snapshot``).

    Tables are streamed: each member is read in chunks, its rows checked and inserted a
    batch at a time, so memory stays bounded whatever the size of the file. Every
    problem with the file (damaged, cut off, hostile, or simply not a snapshot) raises
    ``SnapshotError`` saying what was wrong, and leaves no temporary file behind."""
    limits = limits or Limits()
    with _open_zip(source, limits) as zf:
        members = _check_members(zf, limits)
        manifest = _check_manifest(_read_member(zf, members[MANIFEST], limits,
                                                min(limits.max_manifest_bytes,
                                                    limits.max_member_bytes)), limits)
        folder = workdir if workdir is not None else tempfile.gettempdir()
        sweep(folder)
        fd, path = tempfile.mkstemp(prefix=f"{PREFIX}{os.getpid()}-", suffix=".db", dir=folder)
        os.close(fd)
        try:
            engine = make_engine(f"sqlite:///{path}", create=False)
        except Exception:
            _discard(None, path)
            raise
        try:
            _load_tables(zf, members, limits, engine)
        except BaseException as exc:
            _discard(engine, path)
            if isinstance(exc, SnapshotError) or not isinstance(exc, Exception):
                raise
            if isinstance(exc, sqlite3.IntegrityError):  # e.g. duplicate primary keys
                raise SnapshotError(f"the snapshot's rows do not fit the schema: {exc}") from None
            if isinstance(exc, sqlite3.Error):  # the temporary database, not the file
                raise SnapshotError(f"the snapshot could not be loaded into a temporary database "
                                    f"in {Path(path).parent} ({exc}); free some disk space there "
                                    "and open it again") from None
            raise SnapshotError(f"the snapshot could not be read ({type(exc).__name__}: {exc}); "
                                "it is damaged or was not written by BatchScope") from None
    return Snapshot(engine=engine, manifest=manifest, path=Path(path))


def report_html(source: bytes) -> str:
    """The stored offline report of a snapshot (after the same member checks)."""
    limits = Limits()
    with _open_zip(source, limits) as zf:
        members = _check_members(zf, limits)
        if REPORT not in members:
            raise SnapshotError(f"the snapshot has no {REPORT}")
        try:
            return _read_member(zf, members[REPORT], limits).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise SnapshotError(f"{REPORT} is not UTF-8 text: {exc}") from None


def trace_bytes(source: str | Path | bytes | BinaryIO, *,
                limits: Limits | None = None) -> bytes | None:
    """The stored Perfetto trace of a snapshot (after the same member checks), or None
    when it has none (written before traces, or its window was too large for one; the
    manifest's ``trace`` entry says which)."""
    limits = limits or Limits()
    with _open_zip(source, limits) as zf:
        members = _check_members(zf, limits)
        if TRACE not in members:
            return None
        return _read_member(zf, members[TRACE], limits, limits.max_trace_bytes)
