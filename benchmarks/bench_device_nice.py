"""What the device process's CPU priority is worth: the same server with ``--device-nice 0``
and with the default (``--device-nice 10`` on the CPU), side by side.

Starts two ``batchscope serve`` processes that differ only in ``--device-nice``, warms
both, then drives one and then the other with ``--clients`` closed-loop clients for
``--slice-s`` seconds, the order turning each round, ``--rounds`` times (the idle one
costs nothing meanwhile: nothing is sent to it). Prints each round's throughput, the
median of the rounds' ratios (default / nice 0) for throughput and p99, and each
server's CPU per request and share of the two cores' bound (``benchmarks.cpu_share``).

    python -m benchmarks.bench_device_nice                       # mlp, 64 clients
    python -m benchmarks.bench_device_nice --model encoder --lengths uniform:8:128
    python -m benchmarks.bench_device_nice --clients 8 --nice 4
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from batchscope.load.loadgen import run_load
from benchmarks.cpu_share import CpuShare
from benchmarks.reliability.server import Server


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="mlp")
    ap.add_argument("--lengths", default=None, help="as run_load's (variable-length models)")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--slice-s", type=float, default=3.0)
    ap.add_argument("--nice", type=int, default=10, help="the niceness set against 0")
    args = ap.parse_args()
    levels = (0, args.nice)
    servers = {}
    try:
        for level in levels:
            db = Path(tempfile.mkdtemp()) / "nice.db"
            servers[level] = Server([sys.executable, "-m", "runtime", "serve", "--model",
                                     args.model, "--port", "0", "--db", f"sqlite:///{db}",
                                     "--device-nice", str(level)])
        load = {"concurrency": args.clients, "lengths": args.lengths}
        for srv in servers.values():
            run_load(srv.url, args.model, duration_s=2.0, **load)  # warm
        rps: dict[int, list[float]] = {level: [] for level in levels}
        p99: dict[int, list[float]] = {level: [] for level in levels}
        cpu: dict[int, list[dict]] = {level: [] for level in levels}
        for r in range(args.rounds):
            for level in (levels if r % 2 == 0 else levels[::-1]):
                srv = servers[level]
                with CpuShare(srv.proc.pid) as share:
                    rep = run_load(srv.url, args.model, duration_s=args.slice_s, **load)
                rps[level].append(rep.throughput_rps)
                p99[level].append(rep.latency_p99_ms or float("nan"))
                cpu[level].append(share.summary(rep.ok))
            print(f"round {r + 1}: nice 0 {rps[0][-1]:8.1f}   nice {args.nice} "
                  f"{rps[args.nice][-1]:8.1f} req/s", flush=True)
    finally:
        for srv in servers.values():
            srv.stop()
    ratio = statistics.median(b / a for a, b in zip(rps[0], rps[args.nice]))
    p99_ratio = statistics.median(b / a for a, b in zip(p99[0], p99[args.nice]))
    wins = sum(b > a for a, b in zip(rps[0], rps[args.nice]))
    print(f"\n{args.model}, {args.clients} clients, {args.rounds} rounds of {args.slice_s:g} s "
          f"each: device nice {args.nice} / nice 0 throughput {ratio:.3f} (higher in {wins} of "
          f"{args.rounds} rounds), p99 {p99_ratio:.3f}")
    for level in levels:
        c = cpu[level]
        per = statistics.median(x["total_cpu_us_per_request"] for x in c)
        share = statistics.median(x["share_of_cpu_bound"] for x in c)
        print(f"  nice {level:2d}: {statistics.median(rps[level]):8.1f} req/s, CPU per request "
              f"{per:.0f} us, {100 * share:.0f} % of the CPU bound")


if __name__ == "__main__":
    main()
