"""What tracing costs the serving process, counted in instructions, not timed.

``bench_tracing`` times throughput, and on a 2-vCPU machine its A/A check spans about 6 %:
a cost of 1-3 % is below what it resolves. This benchmark counts instead. It runs
``batchscope serve --model mlp`` under Valgrind's callgrind (the serving process only:
its device process, database writer and span process are spawned interpreters and run
natively) and, per trace mode, counts the instructions the serving process executes
for exactly ``--requests`` requests of 64 closed-loop clients: counters zeroed while the
server is idle, the requests sent, the writer and span hand-overs let finish, counters
dumped (``callgrind_control``). The batches are static, 32 requests each, so every mode
forms the same batches. Instruction counts repeat to a fraction of a percent (each mode
is counted ``--repeats`` times, in alternating order, and both counts printed), so each
mode's ratio to ``off`` is exact for that build.

Instructions are a proxy for time: they leave out cache misses and the other processes'
work. But the serving process's event loop is what bounds a server with cores to spare
(the GPU machine's 16), and there each instruction it does not execute is throughput.

    python -m benchmarks.bench_tracing_instructions
    python -m benchmarks.bench_tracing_instructions --modes off,otel_1_in_100 --requests 8000

Needs ``valgrind`` (Debian's package). The server starts uninstrumented and is
instrumented from its first counted mode on; under callgrind it serves about 2 % of its
native rate, so a mode of 4,000 requests (and its warm-up) takes about 20 s.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

ROOT = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))

import httpx

from batchscope.load.loadgen import run_load
from benchmarks.bench_tracing import MODES, Receiver, settle
from benchmarks.reliability.server import Server

DEFAULT_MODES = ("off", "timestamps", "otel", "timestamps_1_in_100", "otel_1_in_100",
                 "sampling_only")
CLIENTS = 64
BATCH = 32
#: requests sent after each change of mode before counting (first allocations, caches)
WARM_REQUESTS = 320


def _control(pid: int, *flags: str) -> None:
    """``callgrind_control`` on the server: it acts once the process runs (the server's
    heartbeat wakes an idle loop), so this waits for it."""
    subprocess.run(["callgrind_control", *flags, str(pid)], check=True, timeout=120,
                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _total(path: str) -> int:
    """The instruction total of a callgrind dump (its ``summary:`` or ``totals:`` line)."""
    with open(path) as fh:
        for line in fh:
            if line.startswith(("summary:", "totals:")):
                return int(line.split()[1])
    raise ValueError(f"{path} holds no instruction total")


def _dumps(out: Path, pid: int) -> set[str]:
    return set(glob.glob(str(out / f"cg.{pid}.*")))


def count_mode(url: str, pid: int, out: Path, db: Path, receiver: Receiver, mode: str,
               requests: int) -> tuple[int, int]:
    """(instructions, requests answered) of the serving process for ``requests`` requests
    of ``mode``."""
    with httpx.Client(base_url=url, timeout=120.0) as http:
        assert http.post("/v2/trace/setting", json=MODES[mode]).status_code == 200
    run_load(url, "mlp", concurrency=CLIENTS, duration_s=600, max_requests=WARM_REQUESTS)
    settle(receiver, db, quiet_s=1.5, limit_s=120.0)
    before = _dumps(out, pid)
    _control(pid, "--zero")
    report = run_load(url, "mlp", concurrency=CLIENTS, duration_s=600, max_requests=requests)
    settle(receiver, db, quiet_s=1.5, limit_s=120.0)
    _control(pid, "--dump")
    new = sorted(_dumps(out, pid) - before)
    if len(new) != 1:
        raise RuntimeError(f"expected one new callgrind dump, found {new}")
    return _total(new[0]), int(report.ok)


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", default=",".join(DEFAULT_MODES))
    ap.add_argument("--requests", type=int, default=4000, help="counted per mode (a "
                    f"multiple of {BATCH} keeps every batch full)")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args(argv)
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        ap.error(f"unknown mode(s) {unknown}; the modes: {', '.join(MODES)}")
    if "off" not in modes:
        modes.insert(0, "off")
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        sys.exit("valgrind is not installed (apt-get install valgrind)")
    # one string hashing for every run: the dictionaries' collisions, and so their
    # instructions, are the same from one server process to the next
    os.environ.setdefault("PYTHONHASHSEED", "0")
    out = Path(tempfile.mkdtemp(prefix="callgrind-"))
    db = out / "tracing.db"
    counts: dict[str, list[float]] = {m: [] for m in modes}
    with Receiver() as receiver:
        server = Server(["valgrind", "--tool=callgrind", "--instr-atstart=no",
                         f"--callgrind-out-file={out}/cg.%p", sys.executable, "-m", "runtime",
                         "serve", "--model", "mlp", "--port", "0", "--db", f"sqlite:///{db}",
                         "--otlp-traces-endpoint", receiver.endpoint, "--policy", "static",
                         "--max-batch-size", str(BATCH), "--max-queue-delay-ms", "2000"],
                        timeout_s=900.0)
        try:
            pid = server.proc.pid
            _control(pid, "--instr=on")
            for repeat in range(args.repeats):
                order = modes if repeat % 2 == 0 else modes[::-1]
                for mode in order:
                    began = time.monotonic()
                    total, answered = count_mode(server.url, pid, out, db, receiver, mode,
                                                 args.requests)
                    per = total / max(answered, 1)
                    counts[mode].append(per)
                    print(f"repeat {repeat + 1} {mode:20s} {per:12,.0f} instructions a request "
                          f"({answered:,} answered, {time.monotonic() - began:.0f} s)",
                          flush=True)
        finally:
            server.stop()
    base = sum(counts["off"]) / len(counts["off"])
    print(f"\nmlp, {CLIENTS} clients, static batches of {BATCH}, {args.requests:,} requests "
          "per count: instructions of the serving process a request, and the ratio of each "
          "mode's mean to off's (throughput, where this process bounds it, goes as its "
          "inverse)")
    print(f"{'mode':22s}{'counts':>32s}{'mean':>12s}{'x off':>8s}{'more':>10s}")
    for mode in modes:
        values = counts[mode]
        mean = sum(values) / len(values)
        shown = " ".join(f"{v:,.0f}" for v in values)
        print(f"{mode:22s}{shown:>32s}{mean:12,.0f}{mean / base:8.3f}{mean - base:+10,.0f}")
    spread = max(abs(v - base) / base for v in counts["off"])
    print(f"(off's counts lie within {100 * spread:.2f} % of their mean: the resolution)")


if __name__ == "__main__":
    main()
