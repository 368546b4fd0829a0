"""Changing traffic: the autopilot against the defaults and against the best fixed
setting a tuning session finds, on this machine, in one run.

First, on one server at the default settings (``batchscope serve``, torch on one thread,
nothing recorded), the run measures the model's capacity: requests per second answered
to a closed loop of four times ``max_batch_size`` clients. The phases are the model's
shares of that capacity, ``--phase-s`` seconds each (``encoder``: 0.2, 0.6, 0.8, 0.2 --
quiet, busy, a burst near saturation, quiet; ``wide``: 0.16, 0.66, 1.15, 0.16 -- a burst
the defaults' batches cannot keep up with), so the scenario means the same on a slow or
a fast machine or an accelerator. On the same server a tuning session (``run_tuning``,
open loop at the burst's rate, the SLO, ``--tune-budget-s``) then finds the fixed setting.
Three servers follow, one after another, each driven by the same seeded Poisson load
whose rate moves through the phases (latency counts from each request's scheduled
arrival):

* ``defaults``: the server's default settings;
* ``fixed``: the defaults plus what the session recommended (or ``--fixed
  key=value;...``; ``--fixed example`` takes the model's example from ``DEFAULTS``);
* ``autopilot``: the defaults plus ``autopilot_slo_p99_ms`` = the SLO.

``--phases rate:seconds,...`` gives the phases explicitly instead. ``--repeat N`` runs
the three N times, interleaved (defaults, fixed, autopilot, defaults, ...), so that a
slow moment of a shared machine does not fall on one scenario only, and totals each
scenario's figures over its runs.

For each: goodput at the SLO (requests answered 200 within the SLO, per second of the
run), throughput, and the seconds in SLO violation: seconds whose arrivals' p99 latency
(a request that failed counts as infinitely late) is over the SLO. The autopilot run
also lists the settings it moved to, polled every half second.

    python -m benchmarks.bench_autopilot                     # encoder, about 13 minutes
    python -m benchmarks.bench_autopilot --model wide        # about 13 minutes
    python -m benchmarks.bench_autopilot --model mlp --fixed max_batch_size=64
    python -m benchmarks.bench_autopilot --phases 20:20,60:20,90:20,20:20 --fixed example
    python -m benchmarks.bench_autopilot --only autopilot --json out.json
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Iterator, Sequence

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # allow `python benchmarks/bench_autopilot.py` as well as `-m`
    sys.path.insert(0, str(ROOT))

from benchmarks.bench_serving import process, serve_cmd  # noqa: E402
from benchmarks.common import format_table  # noqa: E402
from batchscope.tuning.runner import TuneOptions, run_tuning  # noqa: E402

try:  # the load generator's home
    from batchscope.load import loadgen  # noqa: E402
except ImportError:  # pragma: no cover - older trees kept it with the runtime's tools
    from runtime.tools import loadgen  # type: ignore[no-redef]  # noqa: E402

#: per model: the SLO, the phases as shares of the capacity measured at the defaults
#: (``--phases auto``), the lengths, and an explicit fixed setting for ``--fixed example``
#: (what a 2-minute session chose on the 2-vCPU machine of docs/performance.md)
DEFAULTS = {
    "encoder": {"slo_ms": 80.0, "profile": (0.2, 0.6, 0.8, 0.2), "lengths": "uniform:8:128",
                "example": "max_batch_size=8;max_queue_delay_ms=10;preferred_batch_sizes=2,4,8;"
                           "bucket_edges=32,64,96,128"},
    "wide": {"slo_ms": 300.0, "profile": (0.16, 0.66, 1.15, 0.16), "lengths": None,
             "example": "policy=static;max_batch_size=64;preferred_batch_sizes=2,4,8,16,32,64"},
    "mlp": {"slo_ms": 20.0, "profile": (0.1, 0.5, 1.0, 0.1), "lengths": None,
            "example": "max_batch_size=64"},
}
SCENARIOS = ("defaults", "fixed", "autopilot")
WARMUP_S = 5.0
CAPACITY_WARMUP_S = 3.0
CAPACITY_S = 8.0
POLL_S = 0.5


def parse_phases(spec: str) -> list[tuple[float, float]]:
    """``rate:seconds,...`` -> [(rate, seconds)]."""
    try:
        phases = [(float(r), float(s)) for r, s in (p.split(":") for p in spec.split(","))]
    except ValueError:
        phases = []
    if not phases or any(r <= 0 or s <= 0 for r, s in phases):
        raise SystemExit(f"--phases {spec!r}: write rate:seconds pairs, e.g. 10:20,50:20")
    return phases


def phased_arrivals(requests: Sequence[bytes], phases: Sequence[tuple[float, float]],
                    seed: int) -> Iterator[tuple[bytes, float]]:
    """``(request, seconds to the next arrival)``: Poisson arrivals at each phase's rate."""
    rng = random.Random(seed)
    t = end = 0.0
    i = 0
    for rate, seconds in phases:
        end += seconds
        while t < end:
            gap = rng.expovariate(rate)
            yield requests[i % len(requests)], gap
            t += gap
            i += 1
    while True:  # past the last phase: the loop's deadline stops it
        yield requests[i % len(requests)], 3600.0


class SettingsPoll:
    """Polls a model's settings in a thread: [(seconds since start, settings, the
    autopilot's note)] on change (the note: the reason of its last move, if it made it)."""

    def __init__(self, url: str, model: str) -> None:
        self.url = f"{url}/v2/models/{model}/batching"
        self.changes: list[tuple[float, dict]] = []
        self._stop = threading.Event()
        self.start = time.perf_counter()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        last = None
        while not self._stop.wait(POLL_S):
            try:
                with urllib.request.urlopen(self.url, timeout=5) as resp:
                    doc = json.load(resp)
            except OSError:
                continue
            s = doc["settings"]
            knobs = {"max_batch_size": s["max_batch_size"],
                     "max_queue_delay_ms": s["max_queue_delay_ms"]}
            if knobs != last:
                note = self._note()
                self.changes.append((round(time.perf_counter() - self.start, 1), knobs, note))
                last = knobs

    def _note(self) -> str:
        try:
            with urllib.request.urlopen(f"{self.url}/stats", timeout=5) as resp:
                return (json.load(resp).get("autopilot") or {}).get("note", "")
        except OSError:
            return ""

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


async def drive(url: str, model: str, phases, lengths: str | None, seed: int):
    """Warm up, then run the phases; the tally and the time the phases began."""
    host, port = loadgen.split_url(url)
    meta = await loadgen.fetch_metadata(url, model)
    bodies = loadgen.build_payloads(meta, lengths=lengths, seed=seed)
    requests = [loadgen.request_bytes("POST", host, port, f"/v2/models/{model}/infer", b)
                for b in bodies]
    warm = loadgen.Tally()
    start = time.perf_counter()
    await loadgen.open_loop(host, port, loadgen.poisson_arrivals(requests, phases[0][0], seed),
                            loadgen.Until(start + WARMUP_S), 10**9, 512, warm)
    tally = loadgen.Tally()
    began = time.perf_counter()
    total = sum(s for _, s in phases)
    await loadgen.open_loop(host, port, phased_arrivals(requests, phases, seed + 1),
                            loadgen.Until(began + total), 10**9, 512, tally)
    return tally, began


def summarize(tally, began: float, phases, slo_ms: float) -> dict[str, Any]:
    """Goodput, throughput and violation seconds of one run (see the module docstring)."""
    total = sum(s for _, s in phases)
    slo_s = slo_ms / 1000.0
    per_second: dict[int, list[float]] = {}
    ok = good = failed = 0
    for done, latency, status in zip(tally.done_at, tally.latency_s, tally.status):
        arrived = done - latency - began
        late = latency if status == 200 else math.inf
        per_second.setdefault(int(arrived), []).append(late)
        if status == 200:
            ok += 1
            good += latency <= slo_s
        else:
            failed += 1
    violation = 0
    by_second: dict[int, float | None] = {}
    p99_by_phase = []
    edges = [0.0]
    for _, seconds in phases:
        edges.append(edges[-1] + seconds)
    for second, lat in per_second.items():
        lat.sort()
        p99 = lat[min(len(lat) - 1, math.ceil(0.99 * len(lat)) - 1)]
        violation += p99 > slo_s
        by_second[second] = None if math.isinf(p99) else round(p99 * 1000.0, 1)
    for lo, hi in zip(edges, edges[1:]):
        lat = sorted(x for s, v in per_second.items() if lo <= s < hi for x in v)
        p99_by_phase.append(None if not lat else
                            lat[min(len(lat) - 1, math.ceil(0.99 * len(lat)) - 1)] * 1000.0)
    return {"goodput_rps": good / total, "throughput_rps": ok / total, "failed": failed,
            "violation_s": violation, "seconds": len(per_second),
            "p99_ms_by_phase": [None if p is None or math.isinf(p) else round(p, 1)
                                for p in p99_by_phase],
            "p99_ms_by_second": [by_second.get(i) for i in range(int(total))]}


def measure_capacity(url: str, model: str, lengths: str | None) -> tuple[float, int]:
    """Requests per second the server answers at its current settings, closed loop with
    four times ``max_batch_size`` clients (batches run full), and that client count."""
    with urllib.request.urlopen(f"{url}/v2/models/{model}/batching", timeout=10) as resp:
        clients = 4 * int(json.load(resp)["settings"]["max_batch_size"])
    loadgen.run_load(url, model, concurrency=clients, duration_s=CAPACITY_WARMUP_S,
                     lengths=lengths)
    report = loadgen.run_load(url, model, concurrency=clients, duration_s=CAPACITY_S,
                              lengths=lengths)
    return report.throughput_rps, clients


def fixed_from_session(url: str, model: str, rate: float, slo_ms: float,
                       lengths: str | None, budget_s: float, seed: int) -> tuple[str, str]:
    """A tuning session at the burst's rate: its best point as ``key=value;...`` (empty
    when it kept the defaults) and its sentence."""
    result = run_tuning(TuneOptions(url=url, model=model, slo_p99_ms=slo_ms, budget_s=budget_s,
                                    concurrency=None, rate=rate, lengths=lengths, seed=seed))
    return fixed_text(result.recommended or {}), result.sentence()


def fixed_text(changes: dict[str, Any]) -> str:
    """Settings changes as ``key=value;...``, each value as ``--set`` reads it back (JSON,
    so that a one-item list stays a list; a word as it is)."""
    return ";".join(f"{key}={value if isinstance(value, str) else json.dumps(value)}"
                    for key, value in changes.items())


def calibrate(model: str, profile: Sequence[float], phase_s: float, slo_ms: float,
              lengths: str | None, fixed: str | None, budget_s: float, seed: int,
              phases: Sequence[tuple[float, float]] | None = None) -> dict[str, Any]:
    """On one server at the defaults: its capacity, the phases scaled to it (unless
    ``phases`` are given), and (when ``fixed`` is None) the fixed setting a session finds
    for the burst."""
    with process(serve_cmd(models=(model,)), ready="serving") as url:
        capacity, clients = measure_capacity(url, model, lengths)
        if phases is None:
            phases = [(max(1.0, round(share * capacity)), phase_s) for share in profile]
        out: dict[str, Any] = {"capacity_rps": round(capacity, 1), "clients": clients,
                               "phases": phases, "fixed": fixed, "session": None}
        print(f"capacity at the defaults: {capacity:.1f} req/s (closed loop, {clients} "
              f"clients, {CAPACITY_S:g} s)", file=sys.stderr, flush=True)
        if fixed is None:
            burst = max(rate for rate, _ in phases)
            print(f"tuning session at {burst:g} req/s, budget {budget_s:g} s ...",
                  file=sys.stderr, flush=True)
            out["fixed"], out["session"] = fixed_from_session(url, model, burst, slo_ms,
                                                              lengths, budget_s, seed)
    return out


def run_scenario(name: str, model: str, phases, slo_ms: float, lengths: str | None,
                 fixed: str, seed: int) -> dict[str, Any]:
    extra: list[str] = []
    if name == "fixed":
        for pair in filter(None, (p.strip() for p in fixed.split(";"))):
            extra += ["--set", f"{model}.{pair}"]
    elif name == "autopilot":
        extra += ["--set", f"{model}.autopilot_slo_p99_ms={slo_ms:g}"]
    with process(serve_cmd(*extra, models=(model,)), ready="serving") as url:
        poll = SettingsPoll(url, model)
        try:
            tally, began = loadgen.run_async(drive(url, model, phases, lengths, seed))
        finally:
            poll.stop()
    row = {"scenario": name, **summarize(tally, began, phases, slo_ms)}
    warm = began - poll.start
    row["settings"] = [(round(t - warm, 1), s, note) for t, s, note in poll.changes]
    return row


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="encoder", choices=sorted(DEFAULTS))
    ap.add_argument("--slo-ms", type=float, default=None, help="p99 SLO (ms)")
    ap.add_argument("--phases", default="auto",
                    help="rate:seconds,..., or auto: the model's shares of the capacity "
                         "measured at the defaults, --phase-s each (default)")
    ap.add_argument("--phase-s", type=float, default=45.0, help="seconds per phase (auto)")
    ap.add_argument("--fixed", default="auto",
                    help="the fixed setting, key=value;...; auto: what a tuning session at "
                         "the burst's rate finds (default); example: the model's example")
    ap.add_argument("--tune-budget-s", type=float, default=120.0,
                    help="the session's budget (--fixed auto)")
    ap.add_argument("--only", default=",".join(SCENARIOS), help="scenarios to run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=1, help="runs of each scenario, interleaved")
    ap.add_argument("--json", default=None, help="write the rows here too")
    args = ap.parse_args(argv)
    base = DEFAULTS[args.model]
    slo_ms = args.slo_ms or base["slo_ms"]
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = sorted(set(names) - set(SCENARIOS))
    if unknown:
        raise SystemExit(f"--only {unknown}: choose from {', '.join(SCENARIOS)}")
    if args.phase_s <= 0:
        raise SystemExit(f"--phase-s {args.phase_s}: give a positive number of seconds")
    fixed = {"auto": None, "example": base["example"]}.get(args.fixed, args.fixed)
    if "fixed" not in names and fixed is None:
        fixed = ""
    phases = None if args.phases == "auto" else parse_phases(args.phases)
    calibration: dict[str, Any] = {}
    if phases is None or fixed is None:
        calibration = calibrate(args.model, base["profile"], args.phase_s, slo_ms,
                                base["lengths"], fixed, args.tune_budget_s, args.seed, phases)
        fixed, phases = calibration["fixed"], calibration["phases"]
    rows = []
    for run in range(1, max(1, args.repeat) + 1):
        for name in names:
            print(f"running {name} ({run}/{args.repeat}) ...", file=sys.stderr, flush=True)
            row = run_scenario(name, args.model, phases, slo_ms, base["lengths"], fixed,
                               args.seed)
            rows.append({"run": run, **row})
    if calibration:
        print(f"capacity at the defaults: {calibration['capacity_rps']} req/s (closed loop, "
              f"{calibration['clients']} clients)" + (
                  f"; phases at {', '.join(f'{share:g}' for share in base['profile'])} of it"
                  if args.phases == "auto" else ""))
    if calibration.get("session"):
        print(f"session at the burst's rate: {calibration['session']}")
    print(f"{args.model}, p99 SLO {slo_ms:g} ms, phases (req/s x s) "
          f"{', '.join(f'{r:g}x{s:g}' for r, s in phases)}; fixed: {fixed or '(the defaults)'}")
    print(format_table(rows, ["run", "scenario", "goodput_rps", "throughput_rps",
                              "violation_s", "seconds", "failed", "p99_ms_by_phase"]))
    for row in rows:
        if row["scenario"] == "autopilot":
            print(f"autopilot settings, run {row['run']} (s into the phases: settings):")
            for t, s, note in row["settings"]:
                print(f"  {t:7.1f}  max_batch_size={s['max_batch_size']}  "
                      f"max_queue_delay_ms={s['max_queue_delay_ms']}  ({note})")
    by: dict[str, dict[str, float]] = {}
    for row in rows:
        total = by.setdefault(row["scenario"], {"goodput_rps": 0.0, "violation_s": 0, "runs": 0})
        total["goodput_rps"] += row["goodput_rps"]
        total["violation_s"] += row["violation_s"]
        total["runs"] += 1
    for total in by.values():
        total["goodput_rps"] /= total["runs"]
    if {"defaults", "autopilot"} <= by.keys():
        d, a = by["defaults"], by["autopilot"]
        print(f"violation seconds autopilot/defaults: {a['violation_s']}/{d['violation_s']}"
              f" (over {a['runs']} run(s) each)")
    if {"fixed", "autopilot"} <= by.keys():
        f, a = by["fixed"], by["autopilot"]
        ratio = a["goodput_rps"] / f["goodput_rps"] if f["goodput_rps"] else float("nan")
        print(f"goodput autopilot/fixed: {ratio:.2f} (mean over runs)")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "slo_ms": slo_ms,
                                               "phases": phases, "fixed": fixed,
                                               "calibration": calibration, "rows": rows},
                                              indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
