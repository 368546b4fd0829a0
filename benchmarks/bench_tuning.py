"""Tuning sessions against an exhaustive grid: does a 2-minute session find a setting
as good as the best of every point of the same space?

For ``mlp`` and ``encoder`` (one ``batchscope serve``, torch on one thread, no
recording) it runs, on the same load and the same search space:

* a session (Optuna TPE, seeded, early stopping) with a 2-minute budget,
* the exhaustive grid over that space (every point, the same stability rule),

then measures the two winners again side by side (alternating, ``--confirm`` rounds of
``--confirm-s`` each), since figures taken minutes apart on a shared machine move. It
prints each one's best goodput, the ratio session/grid (as found, and re-measured), how
many trials each ran and at which trial the session found its best.

    python -m benchmarks.bench_tuning                       # both models, ~12 minutes
    python -m benchmarks.bench_tuning --only mlp --budget-s 60 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from batchscope.load.background import BackgroundLoad  # noqa: E402
from batchscope.tuning.client import ControlClient  # noqa: E402
from batchscope.tuning.figures import Window  # noqa: E402
from batchscope.tuning.runner import TuneOptions, run_tuning  # noqa: E402
from batchscope.tuning.space import SpaceOptions, changes_between, format_point  # noqa: E402
from benchmarks.bench_serving import serve_cmd  # noqa: E402
from benchmarks.reliability.server import Server  # noqa: E402

#: per model: the load, the SLO and the search space both the session and the grid get
CASES: dict[str, dict[str, Any]] = {
    "mlp": dict(concurrency=64, lengths=None, slo_p99_ms=50.0, space=SpaceOptions(
        policies=("dynamic", "adaptive"), max_batch_sizes=(8, 16, 32, 64, 128),
        queue_delays_ms=(None, 1.0, 5.0), preferred=("none", "powers_of_two"))),
    "encoder": dict(concurrency=16, lengths="uniform:8:128", slo_p99_ms=300.0, space=SpaceOptions(
        policies=("dynamic",), max_batch_sizes=(8, 16, 32, 64), queue_delays_ms=(None, 2.0),
        preferred=("none",), edge_steps=(16, 32), batch_tokens=())),
}


def measure(url: str, model: str, case: dict, point: dict, seconds: float) -> Window:
    """Goodput and p99 of ``point`` under the case's load, after a short settle."""
    client = ControlClient(url, model)
    current = client.batching()["settings"]
    changes = changes_between(current, point)
    if changes:
        client.change(changes)
    with BackgroundLoad(url, model, concurrency=case["concurrency"], lengths=case["lengths"],
                        seed=7) as load:
        time.sleep(1.0)
        start = load.now()
        time.sleep(seconds)
        done = load.window(start, load.now())
    return Window.from_latencies(done.latencies_ms, done.failed, seconds, case["slo_p99_ms"])


def found_at(result: Any) -> int | None:
    """The trial number at which the session first reached its best point."""
    return None if result.best is None else result.best.number


def run_case(url: str, model: str, case: dict, args: argparse.Namespace) -> dict[str, Any]:
    common = dict(url=url, model=model, slo_p99_ms=case["slo_p99_ms"],
                  concurrency=case["concurrency"], lengths=case["lengths"], space=case["space"],
                  seed=args.seed)
    say = (lambda text: print(f"  [{model}] {text}", flush=True)) if args.verbose else None
    print(f"{model}: session, budget {args.budget_s:g} s ...", flush=True)
    t0 = time.monotonic()
    session = run_tuning(TuneOptions(budget_s=args.budget_s, **common), say=say)
    session_s = time.monotonic() - t0
    print(f"  {session.sentence()}", flush=True)
    print(f"{model}: exhaustive grid ...", flush=True)
    t0 = time.monotonic()
    grid = run_tuning(TuneOptions(budget_s=args.grid_budget_s, grid=True, **common), say=say)
    grid_s = time.monotonic() - t0
    print(f"  {grid.sentence()}", flush=True)
    row: dict[str, Any] = {
        "model": model, "slo_p99_ms": case["slo_p99_ms"], "concurrency": case["concurrency"],
        "lengths": case["lengths"],
        "session_trials": session.measured, "session_found_at_trial": found_at(session),
        "session_s": round(session_s, 1), "session_stop": session.stop_reason,
        "grid_trials": grid.measured, "grid_s": round(grid_s, 1), "grid_stop": grid.stop_reason,
        "session_best": None, "grid_best": None, "session_goodput_rps": None,
        "grid_goodput_rps": None, "ratio_found": None, "ratio_confirmed": None}
    if session.best is None or grid.best is None:
        return row
    start = session.start
    row.update(session_best=format_point(changes_between(start, session.best.point)) or "(start)",
               grid_best=format_point(changes_between(start, grid.best.point)) or "(start)",
               session_goodput_rps=round(session.best.figures.goodput_rps, 1),
               grid_goodput_rps=round(grid.best.figures.goodput_rps, 1))
    row["ratio_found"] = round(row["session_goodput_rps"] / row["grid_goodput_rps"], 3)
    ours, theirs = [], []
    for _ in range(args.confirm):
        ours.append(measure(url, model, case, session.best.point, args.confirm_s).goodput_rps)
        theirs.append(measure(url, model, case, grid.best.point, args.confirm_s).goodput_rps)
    back = changes_between(grid.best.point, start)
    if back:
        ControlClient(url, model).change(back)
    row.update(session_confirmed_rps=round(statistics.median(ours), 1),
               grid_confirmed_rps=round(statistics.median(theirs), 1),
               ratio_confirmed=round(statistics.median(ours) / statistics.median(theirs), 3))
    return row


def print_table(rows: list[dict[str, Any]]) -> None:
    head = ("model", "session best goodput", "grid best goodput", "session/grid found",
            "session/grid re-measured", "session trials (best at)", "grid trials")
    print("\n| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for r in rows:
        print(f"| {r['model']} | {r['session_goodput_rps']} req/s | {r['grid_goodput_rps']} "
              f"req/s | {r['ratio_found']} | {r['ratio_confirmed']} | "
              f"{r['session_trials']} ({r['session_found_at_trial']}) in {r['session_s']} s | "
              f"{r['grid_trials']} in {r['grid_s']} s |")
    for r in rows:
        print(f"{r['model']}: session chose {r['session_best']}; grid chose {r['grid_best']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_tuning",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=list(CASES), action="append", default=None)
    parser.add_argument("--budget-s", type=float, default=120.0, help="the session's budget")
    parser.add_argument("--grid-budget-s", type=float, default=3600.0)
    parser.add_argument("--confirm", type=int, default=3, help="side-by-side rounds")
    parser.add_argument("--confirm-s", type=float, default=4.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--verbose", action="store_true", help="print every trial")
    parser.add_argument("--json", default=None, metavar="PATH")
    args = parser.parse_args(argv)
    models = args.only or list(CASES)
    server = Server(serve_cmd(models=models))
    rows = []
    try:
        assert server.url is not None
        for model in models:
            rows.append(run_case(server.url, model, CASES[model], args))
    finally:
        server.stop()
    print_table(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
