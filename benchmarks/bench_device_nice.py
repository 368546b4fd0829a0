"""What the device process's CPU priority is worth: the same server with ``--device-nice 0``
and with its default (on the CPU: 10 levels nicer once the model costs less per request
than the event loop, ``runtime.device.priority``), side by side.

Starts two ``batchscope serve`` processes that differ only in ``--device-nice``, warms
both, then drives one and then the other with ``--clients`` closed-loop clients for
``--slice-s`` seconds, the order turning each round, ``--rounds`` times (the idle one
costs nothing meanwhile: nothing is sent to it). Prints each round's throughput, the
median of the rounds' ratios (default / nice 0) for throughput and p99, and each
server's CPU per request and share of the two cores' bound (``benchmarks.cpu_share``).

    python -m benchmarks.bench_device_nice                       # mlp, 64 clients
    python -m benchmarks.bench_device_nice --model encoder --lengths uniform:8:128
    python -m benchmarks.bench_device_nice --clients 8 --nice 4     # a fixed level against 0
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from batchscope.load.loadgen import run_load
from benchmarks.cpu_share import CpuShare, tree_cpu_s
from benchmarks.reliability.server import Server


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="mlp")
    ap.add_argument("--lengths", default=None, help="as run_load's (variable-length models)")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--slice-s", type=float, default=3.0)
    ap.add_argument("--nice", type=int, default=None,
                    help="a fixed --device-nice to set against 0 (default: the server's default)")
    args = ap.parse_args()
    other = "default" if args.nice is None else f"nice {args.nice}"
    levels = ("nice 0", other)
    servers = {}
    try:
        for level, flag in zip(levels, (["--device-nice", "0"], [] if args.nice is None
                                        else ["--device-nice", str(args.nice)])):
            db = Path(tempfile.mkdtemp()) / "nice.db"
            servers[level] = Server([sys.executable, "-m", "runtime", "serve", "--model",
                                     args.model, "--port", "0", "--db", f"sqlite:///{db}",
                                     *flag])
        load = {"concurrency": args.clients, "lengths": args.lengths}
        for srv in servers.values():
            run_load(srv.url, args.model, duration_s=2.0, **load)  # warm
        rps: dict[str, list[float]] = {level: [] for level in levels}
        p99: dict[str, list[float]] = {level: [] for level in levels}
        cpu: dict[str, list[dict]] = {level: [] for level in levels}
        for r in range(args.rounds):
            for level in (levels if r % 2 == 0 else levels[::-1]):
                srv = servers[level]
                with CpuShare(srv.proc.pid) as share:
                    rep = run_load(srv.url, args.model, duration_s=args.slice_s, **load)
                rps[level].append(rep.throughput_rps)
                p99[level].append(rep.latency_p99_ms or float("nan"))
                cpu[level].append(share.summary(rep.ok))
            print(f"round {r + 1}: nice 0 {rps[levels[0]][-1]:8.1f}   {other} "
                  f"{rps[other][-1]:8.1f} req/s", flush=True)
        srv = servers[other]
        used = tree_cpu_s(srv.proc.pid)  # the device process: the child that used most CPU
        device = max((pid for pid in used if pid != srv.proc.pid), key=used.__getitem__)
        nicer = (os.getpriority(os.PRIO_PROCESS, device)
                 - os.getpriority(os.PRIO_PROCESS, srv.proc.pid))
    finally:
        for srv in servers.values():
            srv.stop()
    base = levels[0]
    ratio = statistics.median(b / a for a, b in zip(rps[base], rps[other]))
    p99_ratio = statistics.median(b / a for a, b in zip(p99[base], p99[other]))
    wins = sum(b > a for a, b in zip(rps[base], rps[other]))
    print(f"\n{args.model}, {args.clients} clients, {args.rounds} rounds of {args.slice_s:g} s "
          f"each: {other} / nice 0 throughput {ratio:.3f} (higher in {wins} of "
          f"{args.rounds} rounds), p99 {p99_ratio:.3f}"
          + ("" if args.nice is not None else
             f"; the default server's device process ran {nicer} levels nicer than it "
             "at the end"))
    for level in levels:
        c = cpu[level]
        per = statistics.median(x["total_cpu_us_per_request"] for x in c)
        share = statistics.median(x["share_of_cpu_bound"] for x in c)
        print(f"  {level:>8}: {statistics.median(rps[level]):8.1f} req/s, CPU per request "
              f"{per:.0f} us, {100 * share:.0f} % of the CPU bound")


if __name__ == "__main__":
    main()
