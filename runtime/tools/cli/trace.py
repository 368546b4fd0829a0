"""``batchscope trace``: its flags, and a window's recorded batches and requests
exported as a Perfetto or Chrome trace file."""

from __future__ import annotations

import argparse
import os
from typing import Any

from runtime.tools.cli.common import UsageError, _fail, check_database_url


def _add_trace(sub: Any) -> None:
    p = sub.add_parser("trace", help="export a window's batches and requests as a trace for "
                                     "ui.perfetto.dev or chrome://tracing",
                       description="Write the batches, requests, generation steps and events "
                                   "a database recorded in a window of time (by default the "
                                   "last 10 seconds) to a trace file: Perfetto's (.pftrace) "
                                   "or Chrome's Trace Event JSON (.json), to open in "
                                   "ui.perfetto.dev or chrome://tracing.")
    p.add_argument("--db", default=None, help="database URL (default: $BATCHSCOPE_DB_URL or "
                                              "sqlite:///data/batchscope.db)")
    p.add_argument("--start", default=None, help="window start: epoch seconds, ISO date and "
                                                 "time, now, or back from now (-30s, -5m)")
    p.add_argument("--end", default=None, help="window end, written the same way (default: now)")
    p.add_argument("--last", type=_seconds, default=None, metavar="SECONDS",
                   help="window length back from its end, instead of --start (default 10)")
    p.add_argument("--model", default=None, help="only this model (default: all)")
    p.add_argument("--instance", default=None, help="only this runtime instance")
    p.add_argument("--format", choices=("perfetto", "json"), default=None,
                   help="perfetto (.pftrace) or json (Chrome Trace Event); default: from the "
                        "-o name, which it must not contradict")
    p.add_argument("--max-rows", type=int, default=None,
                   help="refuse a window holding more batches and requests (default 1,000,000)")
    p.add_argument("-o", "--out", required=True, help="output file, e.g. run.pftrace or run.json")


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
        from batchscope.storage.db import ENV_URL, DatabaseNotFound, default_url, make_engine
        from batchscope.trace import (UnknownName, WindowTooLarge, check_names, export_trace,
                                      format_for)
        from batchscope.trace.timespec import window_from
    except ImportError as exc:
        raise UsageError(f"trace export needs the dashboard packages ({exc.name} is not "
                         "installed); install them with: pip install 'batchscope[dashboard]'"
                         ) from None
    from sqlalchemy.exc import SQLAlchemyError

    try:
        fmt = format_for(_checked_out(args.out), args.format)
        w = window_from(args.start, args.end, args.last, now=time.time(), model=args.model,
                        instance_id=args.instance)
    except ValueError as exc:
        raise UsageError(f"batchscope trace: {exc}") from None
    try:
        if args.db is not None:
            check_database_url(args.db, "--db")
        else:
            check_database_url(default_url(), f"${ENV_URL}")
    except UsageError as exc:
        raise UsageError(f"batchscope trace: {exc}") from None
    if args.max_rows is not None and args.max_rows < 1:
        raise UsageError(f"batchscope trace: --max-rows {args.max_rows} must be 1 or more")
    kwargs = {} if args.max_rows is None else {"max_rows": args.max_rows}
    try:
        engine = make_engine(args.db, create=False)
        try:
            check_names(engine, w)
            summary = export_trace(engine, w, args.out, fmt, **kwargs)
        finally:
            engine.dispose()
    except WindowTooLarge as exc:
        return _fail(f"batchscope trace: {exc}; or raise --max-rows (the rows are read into "
                     "memory)")
    except (DatabaseNotFound, UnknownName) as exc:
        return _fail(f"batchscope trace: {exc}")
    except SQLAlchemyError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if "no such table" in first or ("relation" in first and "does not exist" in first):
            return _fail(f"batchscope trace: the database holds no BatchScope tables ({first}); "
                         "give the URL a runtime records to (batchscope serve --db)")
        return _fail(f"batchscope trace: cannot read the database: {first}")
    except OSError as exc:
        return _fail(f"batchscope trace: cannot write {args.out}: {exc.strerror or exc}")
    except ImportError as exc:  # the perfetto package, imported when a trace is written
        raise UsageError(f"batchscope trace: {exc.name} is not installed; install it with: "
                         f"pip install {exc.name}") from None
    written = summary.bytes_written
    size = f"{written / 1e6:.1f} MB" if written >= 100_000 else f"{written:,} bytes"
    where = "ui.perfetto.dev" if fmt == "perfetto" else "ui.perfetto.dev or chrome://tracing"
    if summary.empty:
        held = f"{summary.events:,} event(s) and a note" if summary.events else "only a note"
        print(f"wrote {args.out} ({fmt}, {size}): no batch, request or step was recorded in "
              f"this window; the trace holds {held} saying so")
        return 0
    print(f"wrote {args.out} ({fmt}, {size}): {summary.batch_slices:,} batches, "
          f"{summary.request_slices:,} requests, {summary.flows:,} flows, "
          f"{summary.step_slices:,} steps, {summary.events:,} events; open it in {where}")
    for note in summary.notes:  # e.g. traced requests drawn without their timestamps
        print(f"note: {note}")
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
    return out
