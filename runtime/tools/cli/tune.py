"""``batchscope tune``: its flags, the session's ``TuneOptions`` and search space from
them (``tune_options``), and the session run against a running server."""

from __future__ import annotations

import argparse
import json
from typing import Any

from runtime.api.errors import ConfigError
from runtime.tools.cli.common import UsageError, _add_token_flags, check_database_url


def _add_tune(sub: Any) -> None:
    p = sub.add_parser("tune", help="find the settings that serve a model best under an SLO, "
                                    "on a running server")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the running server")
    p.add_argument("--model", required=True, help="the served model to tune")
    p.add_argument("--slo-p99-ms", type=float, required=True, metavar="MS",
                   help="the latency SLO: p99 at most this many milliseconds")
    p.add_argument("--budget-s", type=float, default=120.0, metavar="S",
                   help="the session's time budget in seconds (default 120)")
    p.add_argument("--load", choices=("synthetic", "replay", "live"), default="synthetic",
                   help="synthetic: the session's own closed loop (--concurrency) or open "
                        "loop (--rate); replay: the model's recorded traffic from --db; "
                        "live: measure the traffic the server gets (default synthetic)")
    rate = p.add_mutually_exclusive_group()
    rate.add_argument("--concurrency", type=int, default=None,
                      help="closed loop: connections (default 64)")
    rate.add_argument("--rate", type=float, default=None,
                      help="open loop: Poisson arrivals per second; the target rate of "
                           "--objective latency")
    p.add_argument("--lengths", default=None,
                   help="synthetic input lengths: uniform:8:128, fixed:64 or choice:16,64 "
                        "(variable-length models)")
    p.add_argument("--db", default=None, metavar="URL",
                   help="the database (SQLAlchemy URL): replay reads the recorded traffic from "
                        "it, and the session and its trials are stored in it")
    p.add_argument("--replay-window-s", type=float, default=None, metavar="S",
                   help="replay: the last S seconds of recorded traffic (default: the newest "
                        "100000 requests)")
    p.add_argument("--replay-speed", type=float, default=1.0,
                   help="replay: this many times as fast as recorded (default 1)")
    p.add_argument("--objective", choices=("goodput", "latency"), default="goodput",
                   help="goodput: most requests per second within the SLO (default); "
                        "latency: the lowest p99 at --rate")
    p.add_argument("--apply", action="store_true",
                   help="keep the best settings at the end (default: put the starting ones "
                        "back)")
    p.add_argument("--grid", action="store_true",
                   help="measure every point of the space instead of searching it (slow)")
    space = p.add_argument_group("search space (the starting values are always included)")
    space.add_argument("--policies", default=None, metavar="P,P",
                       help="default dynamic,adaptive,static")
    space.add_argument("--max-batch-sizes", default=None, metavar="N,N",
                       help="default 4,8,16,32,64,128")
    space.add_argument("--queue-delays-ms", default=None, metavar="MS,MS",
                       help="none = work-conserving; default none,1,2,5,10")
    space.add_argument("--preferred", default=None, metavar="OPT,OPT",
                       help="preferred batch sizes: none, powers_of_two (default both)")
    space.add_argument("--edge-steps", default=None, metavar="N,N",
                       help="bucket edges every N tokens (variable-length models; default "
                            "8,16,32)")
    space.add_argument("--batch-tokens", default=None, metavar="N,N",
                       help="token limits per batch, none for no limit (variable-length "
                            "models; default none and 4, 8 and 16 times the longest length; "
                            "an empty list keeps the current limit)")
    trial = p.add_argument_group("trials")
    trial.add_argument("--window-s", type=float, default=1.0,
                       help="one measurement window (default 1 s)")
    trial.add_argument("--settle-s", type=float, default=0.5,
                       help="discarded after each change (default 0.5 s)")
    trial.add_argument("--warmup-s", type=float, default=2.0,
                       help="the session's load runs this long before the first trial "
                            "(default 2 s)")
    trial.add_argument("--drain-limit-s", type=float, default=20.0,
                       help="an open loop pauses before a trial while the server works off "
                            "a backlog an earlier trial left, at most this long (default 20 s;"
                            " 0: never)")
    trial.add_argument("--seed", type=int, default=0, help="the optimizer's seed")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    _add_token_flags(p, "settings changes")


def _space_options(args: argparse.Namespace) -> Any:
    from batchscope.tuning.space import SpaceError, SpaceOptions, parse_values

    given: dict[str, Any] = {}
    try:
        for flag, field_name, kind in (("--policies", "policies", "word"),
                                       ("--max-batch-sizes", "max_batch_sizes", "int"),
                                       ("--queue-delays-ms", "queue_delays_ms", "delay"),
                                       ("--preferred", "preferred", "word"),
                                       ("--edge-steps", "edge_steps", "int"),
                                       ("--batch-tokens", "batch_tokens", "int_or_none")):
            text = getattr(args, field_name)
            if text is not None and field_name == "batch_tokens" and not text.strip():
                given[field_name] = ()
            elif text is not None:
                given[field_name] = parse_values(text, kind, flag)
        return SpaceOptions(**given).check()
    except SpaceError as exc:
        raise UsageError(f"batchscope tune: {exc}") from None


def tune_options(args: argparse.Namespace, environ: Any = None) -> Any:
    """The session's ``TuneOptions`` from the command line; ``UsageError`` for a mistake."""
    from batchscope.tuning.client import TuningError
    from batchscope.tuning.runner import TuneOptions
    from runtime.server.auth import token_from

    try:
        token = token_from(args.control_token, args.control_token_file, environ)
    except ConfigError as exc:
        raise UsageError(f"batchscope tune: {exc.message}") from None
    if args.concurrency is not None and args.concurrency < 1:
        raise UsageError(f"batchscope tune: --concurrency {args.concurrency} must be at least 1")
    if args.load == "live" and (args.concurrency or args.rate) and args.objective != "latency":
        raise UsageError("batchscope tune: --load live sends no load of its own; leave out "
                         "--concurrency and --rate")
    if args.db is not None:
        check_database_url(args.db, "--db")
    options = TuneOptions(
        url=args.url, model=args.model, slo_p99_ms=args.slo_p99_ms, budget_s=args.budget_s,
        load=args.load, concurrency=args.concurrency or (None if args.rate else 64),
        rate=args.rate, lengths=args.lengths, db_url=args.db,
        replay_window_s=args.replay_window_s, replay_speed=args.replay_speed,
        objective=args.objective, apply=args.apply, grid=args.grid, seed=args.seed,
        token=token, window_s=args.window_s, settle_s=args.settle_s, warmup_s=args.warmup_s,
        drain_limit_s=args.drain_limit_s, space=_space_options(args))
    try:
        return options.check()
    except TuningError as exc:
        raise UsageError(f"batchscope tune: {exc.message}") from None


def _tune(args: argparse.Namespace) -> int:
    from batchscope.load.loadgen import parse_lengths
    from batchscope.tuning.runner import run_tuning

    options = tune_options(args)
    parse_lengths(options.lengths)  # a LoadError before anything is sent
    say = (lambda text: None) if args.json else (lambda text: print(text, flush=True))
    result = run_tuning(options, say=say)
    if args.json:
        print(json.dumps(result.to_dict()), flush=True)
    else:
        print(f"stopped: {result.stop_reason}", flush=True)
        print(result.sentence(), flush=True)
        print(f"settings: {result.outcome}", flush=True)
    return 130 if result.stop_reason == "cancelled" else 0
