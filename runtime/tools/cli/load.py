"""``batchscope load``: its flags, and a closed- or open-loop run against a server
(or ``--ceiling``, the load generator's own ceiling)."""

from __future__ import annotations

import argparse
import json
from typing import Any


def _add_load(sub: Any) -> None:
    p = sub.add_parser("load", help="drive a server with closed- or open-loop load")
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default="mlp")
    p.add_argument("--concurrency", type=int, default=16, help="closed loop: connections")
    p.add_argument("--rate", type=float, default=None,
                   help="open loop: Poisson arrivals per second (overrides --concurrency)")
    p.add_argument("--duration-s", type=float, default=10.0)
    p.add_argument("--max-requests", type=int, default=1_000_000)
    p.add_argument("--lengths", default=None, help="uniform:8:128, fixed:64 or choice:16,64")
    p.add_argument("--priority", default=None,
                   help="HTTP priority (1 = most urgent) or a mix like 1=0.1,2=0.9")
    p.add_argument("--timeout-ms", type=float, default=None)
    p.add_argument("--bypass", action="store_true", help="ask for the bypass lane")
    p.add_argument("--adapter", action="append", default=[], dest="adapters",
                   metavar="NAME",
                   help="the LoRA adapter each request names, drawn evenly from those given; "
                        "repeat for several, 'base' for requests without one")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--ceiling", action="store_true",
                   help="measure the generator's own ceiling against a trivial local server")


def _load(args: argparse.Namespace) -> int:
    import math
    import sys

    from batchscope.load.loadgen import measure_ceiling, run_load
    from runtime.tools.cli.common import UsageError

    if args.timeout_ms is not None and not (math.isfinite(args.timeout_ms)
                                            and args.timeout_ms > 0):
        raise UsageError(f"batchscope load: --timeout-ms {args.timeout_ms} must be a positive "
                         "number of milliseconds")
    if args.ceiling:
        report = measure_ceiling(duration_s=args.duration_s, concurrency=args.concurrency)
    else:
        report = run_load(args.url, args.model, concurrency=args.concurrency, rate=args.rate,
                          duration_s=args.duration_s, max_requests=args.max_requests,
                          lengths=args.lengths, priority=args.priority,
                          timeout_ms=args.timeout_ms, bypass=args.bypass, seed=args.seed,
                          adapters=[None if a == "base" else a for a in args.adapters])
    print(json.dumps(report.to_dict()) if args.json else report.summary(), flush=True)
    if report.sent and not report.ok:  # every request refused: the run measured nothing
        print("batchscope load: no request was answered ok; see the errors by status above",
              file=sys.stderr)
        return 1
    return 0
