"""``batchscope snapshot export``: its options and the command."""

from __future__ import annotations

import argparse
import math
import time
from typing import NoReturn

from batchscope.analysis.queries import Window
from batchscope.presentation.snapshot.export import export_snapshot
from batchscope.storage.db import make_engine


class _Parser(argparse.ArgumentParser):
    """A mistake in the options is one line on stderr and exit status 2, as every
    ``batchscope`` command answers one (not argparse's usage block)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def export_parser() -> argparse.ArgumentParser:
    """The options of ``batchscope snapshot export``."""
    parser = _Parser(prog="batchscope snapshot export",
                     description="Export a window of recorded data to one file.")
    parser.add_argument("--db", default=None, help="database URL (default: $BATCHSCOPE_DB_URL "
                                                   "or sqlite:///data/batchscope.db)")
    parser.add_argument("--model", default=None, help="only this model (default: all)")
    parser.add_argument("--instance", default=None, help="only this runtime instance")
    parser.add_argument("--minutes", type=float, default=15.0, help="window length (default 15)")
    parser.add_argument("--end", type=float, default=None,
                        help="window end, epoch seconds (default: now)")
    parser.add_argument("--slo-ms", type=float, default=None, help="latency SLO for the report")
    parser.add_argument("--out", required=True, help="output .zip path")
    return parser


def cli_export(argv: list[str] | None = None) -> int:
    """``batchscope snapshot export --db URL --model M --minutes 15 --out file.zip``."""
    parser = export_parser()
    args = parser.parse_args(argv)
    if not (args.minutes > 0 and math.isfinite(args.minutes)):
        parser.error(f"--minutes={args.minutes} must be a positive number")
    engine = make_engine(args.db, create=False)  # a snapshot reads; it creates nothing
    end = args.end if args.end is not None else time.time()
    w = Window.last(args.minutes, now=end, model=args.model, instance_id=args.instance)
    manifest = export_snapshot(engine, w, args.out, slo_ms=args.slo_ms)
    rows = ", ".join(f"{k} {v['rows']}" for k, v in manifest["tables"].items())
    print(f"wrote {args.out}: {rows}; {len(manifest['flags'])} flag(s)")
    return 0
