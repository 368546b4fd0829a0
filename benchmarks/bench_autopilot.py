"""Changing traffic: the autopilot against the defaults and against a fixed good setting.

Three servers run one after another (``batchscope serve``, torch on one thread, nothing
recorded), each driven by the same seeded open-loop load whose rate moves through
phases (default for ``encoder``: quiet 20/s, busy 60/s, burst 90/s, quiet 20/s, 20 s
each, random lengths 8..128, p99 SLO 80 ms; latency counts from each request's
scheduled arrival):

* ``defaults``: the server's default settings;
* ``fixed``: the defaults plus ``--fixed`` (``key=value;...``; for ``encoder`` what a
  2-minute ``batchscope tune --rate 90 --slo-p99-ms 80`` session chose: ``max_batch_size=8``,
  ``max_queue_delay_ms=10``, preferred sizes 2, 4, 8, bucket edges 32, 64, 96, 128);
* ``autopilot``: the defaults plus ``autopilot_slo_p99_ms`` = the SLO.

``--model wide`` (most of a batch's time is fixed, as for large models on accelerators):
100 -> 400 -> 700 -> 100 req/s, 20 s each, p99 SLO 300 ms, where the defaults' batches of
32 cannot keep up with the burst (on the 2-vCPU machine of the README's figures a batch of 32
serves about 610 req/s, 64 about 735, 128 about 830); fixed is what a 2-minute ``batchscope
tune --rate 700 --slo-p99-ms 300`` session chose there (``policy=static``,
``max_batch_size=64``, preferred sizes 2 .. 64). On a faster or slower machine, scale the
phases (``--phases``) to its capacity and tune again for ``--fixed``.

``--repeat N`` runs the three N times, interleaved (defaults, fixed, autopilot, defaults,
...), so that a slow moment of a shared machine does not fall on one scenario only, and
totals each scenario's figures over its runs.

For each: goodput at the SLO (requests answered 200 within the SLO, per second of the
run), throughput, and the seconds in SLO violation: seconds whose arrivals' p99 latency
(a request that failed counts as infinitely late) is over the SLO. The autopilot run
also lists the settings it moved to, polled every half second.

    python -m benchmarks.bench_autopilot                     # encoder, about 5 minutes
    python -m benchmarks.bench_autopilot --model wide --repeat 2   # about 11 minutes
    python -m benchmarks.bench_autopilot --model mlp --slo-ms 20 \\
        --phases 300:20,1500:20,3000:20,300:20 --fixed max_batch_size=64
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

try:  # the load generator's home
    from batchscope.load import loadgen  # noqa: E402
except ImportError:  # pragma: no cover - older trees kept it with the runtime's tools
    from runtime.tools import loadgen  # type: ignore[no-redef]  # noqa: E402

DEFAULTS = {
    "encoder": {"slo_ms": 80.0, "phases": "20:20,60:20,90:20,20:20",
                "lengths": "uniform:8:128",
                "fixed": "max_batch_size=8;max_queue_delay_ms=10;preferred_batch_sizes=2,4,8;"
                         "bucket_edges=32,64,96,128"},
    "wide": {"slo_ms": 300.0, "phases": "100:20,400:20,700:20,100:20", "lengths": None,
             "fixed": "policy=static;max_batch_size=64;preferred_batch_sizes=2,4,8,16,32,64"},
    "mlp": {"slo_ms": 20.0, "phases": "300:20,1500:20,3000:20,300:20",
            "lengths": None, "fixed": "max_batch_size=64"},
}
SCENARIOS = ("defaults", "fixed", "autopilot")
WARMUP_S = 5.0
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
    p99_by_phase = []
    edges = [0.0]
    for _, seconds in phases:
        edges.append(edges[-1] + seconds)
    for second, lat in per_second.items():
        lat.sort()
        p99 = lat[min(len(lat) - 1, math.ceil(0.99 * len(lat)) - 1)]
        violation += p99 > slo_s
    for lo, hi in zip(edges, edges[1:]):
        lat = sorted(x for s, v in per_second.items() if lo <= s < hi for x in v)
        p99_by_phase.append(None if not lat else
                            lat[min(len(lat) - 1, math.ceil(0.99 * len(lat)) - 1)] * 1000.0)
    return {"goodput_rps": good / total, "throughput_rps": ok / total, "failed": failed,
            "violation_s": violation, "seconds": len(per_second),
            "p99_ms_by_phase": [None if p is None or math.isinf(p) else round(p, 1)
                                for p in p99_by_phase]}


def run_scenario(name: str, model: str, phases, slo_ms: float, lengths: str | None,
                 fixed: str, seed: int) -> dict[str, Any]:
    extra: list[str] = []
    if name == "fixed":
        for pair in fixed.split(";"):
            extra += ["--set", f"{model}.{pair.strip()}"]
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
    ap.add_argument("--phases", default=None, help="rate:seconds,... (default per model)")
    ap.add_argument("--fixed", default=None, help="the fixed setting, key=value;...")
    ap.add_argument("--only", default=",".join(SCENARIOS), help="scenarios to run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=1, help="runs of each scenario, interleaved")
    ap.add_argument("--json", default=None, help="write the rows here too")
    args = ap.parse_args(argv)
    base = DEFAULTS[args.model]
    slo_ms = args.slo_ms or base["slo_ms"]
    phases = parse_phases(args.phases or base["phases"])
    fixed = args.fixed or base["fixed"]
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = sorted(set(names) - set(SCENARIOS))
    if unknown:
        raise SystemExit(f"--only {unknown}: choose from {', '.join(SCENARIOS)}")
    rows = []
    for run in range(1, max(1, args.repeat) + 1):
        for name in names:
            print(f"running {name} ({run}/{args.repeat}) ...", file=sys.stderr, flush=True)
            row = run_scenario(name, args.model, phases, slo_ms, base["lengths"], fixed,
                               args.seed)
            rows.append({"run": run, **row})
    print(f"{args.model}, p99 SLO {slo_ms:g} ms, phases (req/s x s) "
          f"{', '.join(f'{r:g}x{s:g}' for r, s in phases)}; fixed: {fixed}")
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
                                               "phases": phases, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
