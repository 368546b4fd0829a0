"""``batchscope trace``: its flags, and a window's recorded batches and requests
exported as a Perfetto or Chrome trace file."""

from __future__ import annotations

import argparse
import errno
import os
import sys
from typing import Any

from batchscope.trace.exits import EXIT_NO_ROOM, EXIT_TOO_MANY_ROWS
from runtime.tools.cli.common import EXIT_USAGE, UsageError, _fail, check_database_url


def _add_trace(sub: Any) -> None:
    p = sub.add_parser("trace", help="export a window's batches and requests as a trace for "
                                     "ui.perfetto.dev or chrome://tracing",
                       description="Write the batches, requests, generation steps and events "
                                   "a database recorded in a window of time (by default the "
                                   "last 10 seconds) to a trace file: Perfetto's (.pftrace) "
                                   "or Chrome's Trace Event JSON (.json), to open in "
                                   "ui.perfetto.dev or chrome://tracing. Exit status: 0 "
                                   "written, 3 the window holds more than --max-rows, 4 no "
                                   "room on the output's disk, 2 any other failure.")
    p.add_argument("--db", default=None, help="database URL (default: $BATCHSCOPE_DB_URL or "
                                              "sqlite:///data/batchscope.db)")
    p.add_argument("--start", default=None, help="window start: epoch seconds, ISO date and "
                                                 "time, now, or back from now (-30s, -5m)")
    p.add_argument("--end", default=None, help="window end, written the same way (default: 1 s "
                                               "ago, when the runtime's rows are surely "
                                               "written)")
    p.add_argument("--last", type=_seconds, default=None, metavar="SECONDS",
                   help="window length back from its end, instead of --start (default 10)")
    p.add_argument("--model", default=None, help="only this model (default: all)")
    p.add_argument("--instance", default=None, help="only this runtime instance")
    p.add_argument("--format", choices=("perfetto", "json"), default=None,
                   help="perfetto (.pftrace) or json (Chrome Trace Event); default: from the "
                        "-o name, which it must not contradict")
    p.add_argument("--max-rows", type=_max_rows, default=None,
                   help="refuse a window holding more batches and requests (default "
                        "1,000,000; at most 1,000,000,000: the rows are read into memory)")
    p.add_argument("-o", "--out", required=True, help="output file, e.g. run.pftrace or run.json; - for standard output "
                        "(with --format)")


#: the most rows ``--max-rows`` may allow (some 1 KB of memory each while read)
MOST_ROWS = 1_000_000_000


def _max_rows(text: str) -> int:
    """``--max-rows``: a whole number from 1 to ``MOST_ROWS``."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text[:40]!r} is not a whole number") from None
    if not 1 <= value <= MOST_ROWS:
        raise argparse.ArgumentTypeError(f"{text[:40]} is not between 1 and {MOST_ROWS:,}")
    return value


def _seconds(text: str) -> float:
    """``--last``: argparse reports the mistake as ``argument --last: '1e400' is not ...``."""
    from batchscope.trace.timespec import parse_seconds

    try:
        return parse_seconds(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _glued(argv: list[str]) -> list[str]:
    """``--start -10s`` as ``--start=-10s`` (argparse takes a value that starts with a
    dash for an option of its own)."""
    out: list[str] = []
    for arg in argv:
        if out and out[-1] in ("--start", "--end") and arg.startswith("-"):
            out[-1] = f"{out[-1]}={arg}"
        else:
            out.append(arg)
    return out


def _trace(args: argparse.Namespace) -> int:
    import time

    try:
        from batchscope.storage.db import (ENV_URL, DatabaseNotFound, bounded_url, default_url,
                                           make_engine)
        from batchscope.trace import (UnknownName, WindowTooLarge, check_names, export_trace,
                                      format_for)
        from batchscope.trace.timespec import window_from
    except ImportError as exc:
        raise UsageError(f"trace export needs the dashboard packages ({exc.name} is not "
                         "installed); install them with: pip install 'batchscope[dashboard]'"
                         ) from None
    from sqlalchemy.exc import SQLAlchemyError

    # -o -: standard output, as most tools take it, written as a stream (a file it is
    # redirected to is appended to or written, never replaced as -o FILE is)
    to_stdout = args.out == "-"
    if to_stdout and args.format is None:
        raise UsageError("batchscope trace: -o - writes the trace to standard output; "
                         "name its format too: --format perfetto or --format json")
    try:
        fmt = args.format if to_stdout else format_for(_checked_out(args.out), args.format)
        now = time.time()
        w = window_from(args.start, args.end, args.last, now=now, model=args.model,
                        instance_id=args.instance)
    except ValueError as exc:
        raise UsageError(f"batchscope trace: {exc}") from None
    url = args.db if args.db is not None else default_url()
    try:
        check_database_url(url, "--db" if args.db is not None else f"${ENV_URL}")
    except UsageError as exc:
        raise UsageError(f"batchscope trace: {exc}") from None
    kwargs = {} if args.max_rows is None else {"max_rows": args.max_rows}
    engine = None
    try:
        engine = make_engine(bounded_url(url), create=False)
        check_names(engine, w)
        summary = export_trace(engine, w, sys.stdout.buffer if to_stdout else args.out, fmt,
                               now=now, **kwargs)
        if to_stdout:
            sys.stdout.buffer.flush()
    except WindowTooLarge as exc:
        _fail(f"batchscope trace: {exc}; or raise --max-rows (the rows are read into memory)")
        return EXIT_TOO_MANY_ROWS
    except (DatabaseNotFound, UnknownName) as exc:
        return _fail(f"batchscope trace: {exc}")
    except SQLAlchemyError as exc:
        if "database or disk is full" in str(exc).lower():
            _fail(f"batchscope trace: {_temp_full(exc)}")
            return EXIT_NO_ROOM
        return _fail(f"batchscope trace: {_database_problem(exc, url, engine)}")
    except OSError as exc:
        where = "standard output" if to_stdout else args.out
        _fail(f"batchscope trace: cannot write {where}: {_write_problem(exc, args.out)}")
        return EXIT_NO_ROOM if exc.errno in (errno.ENOSPC, errno.EDQUOT) else EXIT_USAGE
    except ImportError as exc:  # the perfetto package, imported when a trace is written
        raise UsageError(f"batchscope trace: {exc.name} is not installed; install it with: "
                         f"pip install {exc.name}") from None
    except Exception as exc:  # a row no BatchScope wrote (text where a time belongs ...)
        return _fail(f"batchscope trace: cannot make a trace of this window: "
                     f"{type(exc).__name__}: {_first_line(exc)[:300]}; a row in it holds a "
                     "value BatchScope does not write (the database was changed by another "
                     "program?): export a window without it (--start, --end, --model)")
    finally:
        if engine is not None:
            engine.dispose()
    # the trace went to stdout (-o /dev/stdout): the summary must not follow it there
    told = sys.stderr if to_stdout or _is_stdout(args.out) else sys.stdout
    if to_stdout:
        args.out = "standard output"
    written = summary.bytes_written
    size = f"{written / 1e6:.1f} MB" if written >= 100_000 else f"{written:,} bytes"
    where = "ui.perfetto.dev" if fmt == "perfetto" else "ui.perfetto.dev or chrome://tracing"
    if summary.empty:
        held = f"{summary.events:,} event(s) and a note" if summary.events else "only a note"
        print(f"wrote {args.out} ({fmt}, {size}): no batch, request or step was recorded in "
              f"this window; the trace holds {held} saying so", file=told)
        return 0
    print(f"wrote {args.out} ({fmt}, {size}): {summary.batch_slices:,} batches, "
          f"{summary.request_slices:,} requests, {summary.flows:,} flows, "
          f"{summary.step_slices:,} steps, {summary.events:,} events; open it in {where}",
          file=told)
    for note in summary.notes:  # e.g. traced requests drawn without their timestamps
        print(f"note: {note}", file=told)
    return 0


def _checked_out(out: str) -> str:
    """``out`` if a trace file can be written there; ``ValueError`` saying what to give
    for a folder, or for a name in a folder that is not there."""
    if os.path.isdir(out):
        raise ValueError(f"-o {out!r} is a directory; give a file name, e.g. "
                         f"{os.path.join(out, 'run.pftrace')}")
    folder = os.path.dirname(out)
    if folder and not os.path.isdir(folder):
        raise ValueError(f"-o {out!r}: there is no directory {folder!r} to write it in")
    if os.path.islink(out) and not os.path.exists(out):  # written through: to its target
        target = os.path.realpath(out)
        if not os.path.isdir(os.path.dirname(target)):
            raise ValueError(f"-o {out!r} is a link to {os.readlink(out)!r}, in a directory "
                             "that is not there; give -o a file in a directory that exists, "
                             "or mend the link")
    return out


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _database_problem(exc: BaseException, url: str, engine) -> str:
    """What went wrong reading the database, and what to do, in one line."""
    from batchscope.storage.db import lock_waited_s, shown_url, sqlite_path

    first = _first_line(exc)[:300]
    low = first.lower()
    path = sqlite_path(url)
    where = path if path is not None else shown_url(url)
    missing = ("no such column" in low or "no such table" in low
               or ("does not exist" in low and ("column" in low or "relation" in low)))
    if missing:
        version = _schema_version(engine)
        from batchscope.storage.schema import SCHEMA_VERSION

        if version is not None and version < SCHEMA_VERSION:
            return (f"the database was written by an older BatchScope (schema version "
                    f"{version}; this one reads {SCHEMA_VERSION}) and lacks what a trace "
                    f"reads ({first}); upgrade it by opening it once with this BatchScope "
                    f"(batchscope serve --db URL, or the dashboard), then export again")
        if "no such table" in low or "relation" in low:
            return (f"the database holds no BatchScope tables ({first}); give the URL a "
                    "runtime records to (batchscope serve --db)")
    if "file is not a database" in low:
        return (f"{where} is not a SQLite database ({first}); give --db the database file "
                "a runtime records to")
    if "malformed" in low or "database corrupt" in low:
        return (f"the database file {where} is damaged ({first}); export from a backup, or "
                f"save what is left with: sqlite3 {path or 'FILE'} .recover")
    waited = lock_waited_s(first)
    if waited is not None:
        return (f"another program held a lock on the database for longer than the "
                f"{waited:g} s this waits ({first}); export again once it is done")
    if ("unable to open database file" in low or "readonly database" in low) and _wal(path):
        return (f"cannot open {where} to read ({first}): SQLite reads a database in WAL "
                "mode through a -shm file it writes beside it, so its folder must be "
                "writable; copy the file (with its -wal) to a writable folder and export "
                "from the copy")
    if "unable to open database file" in low:
        return (f"cannot open {where} ({first}); check that you may read it and its "
                "folder")
    if "disk i/o error" in low:
        return (f"the disk that holds {where} gave an I/O error ({first}): it may be full "
                "(a reader writes the database's -shm file beside it) or failing; free some "
                "space there and export again")
    if path is None and ("connection" in low or "timeout" in low or "could not" in low):
        return (f"cannot connect to the database at {where} ({first}); check that its "
                "server is running and that the URL names its host and port")
    return f"cannot read the database: {first}"


def _temp_full(exc: BaseException) -> str:
    """SQLite ran out of room while reading (its sorts spill to temporary files)."""
    where = os.environ.get("SQLITE_TMPDIR") or os.environ.get("TMPDIR") or "/var/tmp or /tmp"
    return (f"SQLite found no room for its temporary files while reading this window "
            f"({_first_line(exc)[:200]}); they go to {where}: free some space there, set "
            "SQLITE_TMPDIR to a folder on a disk with room, or export a shorter window")


def _wal(path: str | None) -> bool:
    """Whether the SQLite file at ``path`` is in WAL mode (its header's read version 2)."""
    if path is None:
        return False
    try:
        with open(path, "rb") as fh:
            head = fh.read(20)
    except OSError:
        return False
    return len(head) == 20 and head.startswith(b"SQLite format 3\0") and head[18] == 2


def _schema_version(engine) -> int | None:
    """The database's schema version, or None when it has none or cannot be read."""
    if engine is None:
        return None
    try:
        from batchscope.storage.db import schema_version

        return schema_version(engine)
    except Exception:
        return None


def _write_problem(exc: OSError, out: str) -> str:
    """Why the trace file could not be written, and what to do, in one line."""
    code = exc.errno
    if code in (errno.ENOSPC, errno.EDQUOT):
        return f"{exc.strerror}: free some space there, or give -o a file on another disk"
    if code == errno.EROFS:
        return f"{exc.strerror}: give -o a file on a writable disk"
    if code in (errno.EACCES, errno.EPERM):
        return f"{exc.strerror}: give -o a file in a folder you may write to"
    if code == errno.ENXIO and _is_fifo(out):
        return ("it is a named pipe that no program is reading; start the program that "
                "reads it first, or give -o a file")
    return exc.strerror or str(exc)


def _is_fifo(path: str) -> bool:
    import stat

    try:
        return stat.S_ISFIFO(os.stat(path).st_mode)
    except OSError:
        return False


def _is_stdout(path: str) -> bool:
    """Whether ``path`` is this process's standard output (``-o /dev/stdout``)."""
    try:
        return os.path.samestat(os.stat(path), os.fstat(sys.stdout.fileno()))
    except (OSError, ValueError, AttributeError):
        return False
