"""Does the demo's autopilot hold mlp's p99 SLO through the demo's traffic phases?

``python -m benchmarks.bench_demo_autopilot`` runs the bundled demo runtime (the one
``streamlit run app.py`` starts: mlp, encoder and decoder in one server, traffic cycling
through quiet, busy, burst, recovery, tight deadlines, urgent priorities and long inputs)
for one pass of its phases, twice: as shipped (mlp's autopilot keeps p99 <= 50 ms) and with
the autopilot off, everything else equal. Each run records into its own SQLite file; the
figures come from the requests the server recorded for mlp:

* seconds in violation: one-second windows (by arrival) whose p99 is over the SLO, a
  request that did not succeed counting as infinitely late, so a burst's expiries count;
  and the same without the requests that expired at their own deadline (answered 503 in
  time, as the client asked), which the deadline phase's 15 ms timeouts produce next to
  encoder batches of up to 60 ms whatever mlp's settings are: seconds where the served
  requests' p99 is over the SLO, or a rejection or error makes it so;
* served within the SLO, per second of the pass; expired, rejected and failed requests;
* the autopilot's decisions: its events (each with its reason) as the timeline shows them.

The demo's burst (1,500 req/s for 6 s against a queue of 256) and its deadline phase
(15 ms timeouts) are built to refuse and expire requests whatever the settings; the ones
the server records (queue-full rejections, expiries) count against both scenarios alike.
``--runs 2`` interleaves the two scenarios twice (on, off, on, off).
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import format_table  # noqa: E402
from runtime.tools.demo import PHASES  # noqa: E402

SLO_MS = 50.0  # the demo's mlp autopilot target (runtime/tools/demo.py)
MIN_REQUESTS = 20  # a second with fewer requests is not judged


def run_demo(db_path: Path, autopilot: bool, timeout_s: float) -> float:
    """One pass of the demo's phases recorded into ``db_path``; returns its wall seconds."""
    cmd = [sys.executable, "-m", "runtime.tools.demo", "--db", f"sqlite:///{db_path}",
           "--port", "0", "--cycles", "1"] + ([] if autopilot else ["--no-autopilot"])
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    began = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"the demo exited with {done.returncode}:\n{done.stdout[-3000:]}")
    return time.perf_counter() - began


def p99(values: list[float]) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, math.ceil(0.99 * len(values)) - 1)]


def summarize(db_path: Path, slo_ms: float = SLO_MS, model: str = "mlp") -> dict[str, Any]:
    """The figures of one recorded pass (see the module docstring)."""
    from sqlalchemy import create_engine, text

    engine = create_engine(f"sqlite:///{db_path}")
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT arrived_at, latency_s, outcome FROM requests "
                                 "WHERE model = :m ORDER BY arrived_at"), {"m": model}).all()
        events = conn.execute(text("SELECT at, message FROM events WHERE kind = 'autopilot' "
                                   "AND model = :m ORDER BY at"), {"m": model}).all()
    engine.dispose()
    if not rows:
        raise RuntimeError(f"no {model} requests were recorded in {db_path}")
    start = rows[0][0]
    slo_s = slo_ms / 1000.0
    per_second: dict[int, list[float]] = {}
    served: dict[int, list[float]] = {}  # without the requests that expired in time
    counts: dict[str, int] = {}
    good = 0
    for arrived, latency, outcome in rows:
        counts[outcome] = counts.get(outcome, 0) + 1
        late = latency if outcome == "ok" else math.inf
        good += outcome == "ok" and latency <= slo_s
        per_second.setdefault(int(arrived - start), []).append(late)
        if outcome != "expired":
            served.setdefault(int(arrived - start), []).append(late)
    phases = []
    edge = 0.0
    for phase in PHASES:
        lo, edge = edge, edge + phase.duration_s
        lat = [x for s, v in per_second.items() if lo <= s < edge for x in v]
        ok_lat = [x for x in lat if not math.isinf(x)]
        phases.append({"phase": phase.name, "requests": len(lat),
                       "not ok": len(lat) - len(ok_lat),
                       "p99 of ok (ms)": round(p99(ok_lat) * 1000.0, 1) if ok_lat else None,
                       "over SLO s": sum(1 for s, v in per_second.items() if lo <= s < edge
                                         and len(v) >= MIN_REQUESTS and p99(v) > slo_s),
                       "served over SLO s": sum(1 for s, v in served.items() if lo <= s < edge
                                                and len(v) >= MIN_REQUESTS and p99(v) > slo_s)})
    judged = {s: v for s, v in per_second.items() if len(v) >= MIN_REQUESTS}
    violation = sorted(s for s, v in judged.items() if p99(v) > slo_s)
    served_violation = sorted(s for s, v in served.items()
                              if len(v) >= MIN_REQUESTS and p99(v) > slo_s)
    span = max(per_second) + 1
    ok = [x for v in per_second.values() for x in v if not math.isinf(x)]
    return {"requests": len(rows), "ok": counts.get("ok", 0),
            "expired": counts.get("expired", 0), "rejected": counts.get("rejected", 0),
            "failed": len(rows) - sum(counts.get(k, 0) for k in ("ok", "expired", "rejected")),
            "goodput_rps": good / span, "seconds": span, "judged_s": len(judged),
            "violation_s": len(violation), "violation_at": violation,
            "served_violation_s": len(served_violation), "served_violation_at": served_violation,
            "p99_ok_ms": p99(ok) * 1000.0 if ok else None,
            "phases": phases, "decisions": [(round(at - start, 1), msg) for at, msg in events]}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_demo_autopilot",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=1, help="passes per scenario (interleaved)")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="limit per pass")
    parser.add_argument("--keep", type=Path, default=None,
                        help="keep the recorded databases in this folder (to open in the app)")
    args = parser.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-demo-") as scratch:
        tmp = args.keep or Path(scratch)
        tmp.mkdir(parents=True, exist_ok=True)
        for run in range(1, args.runs + 1):
            for autopilot in (True, False):
                name = "autopilot (as shipped)" if autopilot else "autopilot off"
                db = tmp / f"run{run}-{'on' if autopilot else 'off'}.db"
                wall = run_demo(db, autopilot, args.timeout_s)
                row = {"scenario": name, "run": run, "wall_s": round(wall, 1), **summarize(db)}
                results.append(row)
                print(f"{name}, run {run}: {row['violation_s']} of {row['judged_s']} judged "
                      f"seconds over {SLO_MS:g} ms (at {row['violation_at']}); without the "
                      f"expired: {row['served_violation_s']} (at {row['served_violation_at']}); "
                      f"{row['goodput_rps']:.1f} req/s within the SLO", flush=True)
    table = [{"scenario": r["scenario"], "run": r["run"], "mlp requests": r["requests"],
              "ok": r["ok"], "expired": r["expired"], "rejected": r["rejected"],
              "failed": r["failed"], "within SLO (req/s)": round(r["goodput_rps"], 1),
              "p99 of ok (ms)": None if r["p99_ok_ms"] is None else round(r["p99_ok_ms"], 1),
              "violation s / judged": f"{r['violation_s']} / {r['judged_s']}",
              "without the expired": r["served_violation_s"],
              "autopilot decisions": len(r["decisions"])} for r in results]
    print(format_table(table, table[0].keys()))
    for r in results:
        print(f"{r['scenario']}, run {r['run']}, mlp by phase:")
        print(format_table(r["phases"], r["phases"][0].keys()))
    for r in results:
        if r["decisions"]:
            print(f"autopilot decisions, run {r['run']} (s into the pass: reason):")
            for at, msg in r["decisions"]:
                print(f"  {at:6.1f}  {msg}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
