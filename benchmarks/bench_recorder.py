"""What recording costs the serving hot path.

The server's throughput is bound by its event-loop thread, which holds the GIL while
it runs Python; the recorder's writer thread competes for that same lock. So the
figure that matters is not how fast the writer is but how much it slows a busy Python
thread down. Three measurements into a fresh SQLite file:

* ``put``: nanoseconds per ``Recorder.put`` (buffer filling) and per refused ``put``
  (buffer full), plus the ``TeeRecorder`` fan-out used by the server.
* writer: rows per second and process CPU microseconds per row while the writer
  drains a filled buffer (mixed rows, 32 requests per batch).
* GIL cost: the main thread runs a fixed amount of Python work standing in for the
  event loop (a fixed chunk per request, about 8k requests/s on a 2-core CI box; a
  zero-timeout ``select`` every few requests the way an event loop polls its
  sockets) and hands one request row per request and one batch row per 32 requests
  to the recorder; the same loop with a
  no-op recorder is the reference. Runs alternate on/off; the slowdown of the loop
  is reported per pair, as the median and as fastest-on vs fastest-off, along with
  the writer thread's CPU time per row.

    python -m benchmarks.bench_recorder          # ~1 min; on a busy machine the loop figures are noisy
    python -m benchmarks.bench_recorder --units 500 --requests 12000 --pairs 10 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import select
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from batchscope.storage.db import make_engine  # noqa: E402
from batchscope.storage.records import BatchRow, RequestRow  # noqa: E402
from batchscope.storage.recorder import Recorder, TeeRecorder  # noqa: E402

REQUESTS_PER_BATCH = 32
#: requests handled between two zero-timeout polls of the stand-in event loop
REQUESTS_PER_POLL = 8


def request_row(i: int) -> RequestRow:
    return RequestRow("bench", "mlp", i // REQUESTS_PER_BATCH, 0, 1_700_000_000.0 + i * 1e-4,
                      1_700_000_000.002 + i * 1e-4, 0.0011, 0.0023, "ok")


def batch_row(seq: int) -> BatchRow:
    return BatchRow("bench", "mlp", seq, "dynamic", 1, 64, None, REQUESTS_PER_BATCH, REQUESTS_PER_BATCH,
                    REQUESTS_PER_BATCH, 0.0001, 0.0006, 0.0012, 0.0009, 1_700_000_000.0 + seq * 4e-3,
                    1_700_000_000.001 + seq * 4e-3, queue_depth=12)


def fresh_db(folder: str, name: str) -> Any:
    return make_engine(f"sqlite:///{folder}/{name}.db")


# ---------------------------------------------------------------------------- put
def measure_put(folder: str, n: int = 200_000) -> dict[str, float]:
    engine = fresh_db(folder, "put")
    rec = Recorder(engine, buffer_size=n)
    rows = [request_row(i) for i in range(1000)]
    put = rec.put
    started = time.perf_counter()
    for i in range(n):
        put(rows[i % 1000])
    put_ns = (time.perf_counter() - started) / n * 1e9
    started = time.perf_counter()
    for i in range(n):
        put(rows[i % 1000])  # the buffer is full: every one is refused and counted
    full_ns = (time.perf_counter() - started) / n * 1e9
    rec.close(timeout_s=0.0)  # nothing is written: the writer never ran

    class Null:
        def put(self, record: Any) -> None:
            pass

    tee_rec = Recorder(engine, buffer_size=n)
    tee = TeeRecorder(tee_rec, Null())
    started = time.perf_counter()
    for i in range(n):
        tee.put(rows[i % 1000])
    tee_ns = (time.perf_counter() - started) / n * 1e9
    tee_rec.close(timeout_s=0.0)
    engine.dispose()
    return {"put_ns": put_ns, "put_when_full_ns": full_ns, "tee_put_ns": tee_ns}


# ---------------------------------------------------------------------------- writer
def measure_writer(folder: str, n: int = 200_000) -> dict[str, float]:
    engine = fresh_db(folder, "writer")
    rec = Recorder(engine, buffer_size=n + n // REQUESTS_PER_BATCH + 1)
    for i in range(n):
        rec.put(request_row(i))
        if i % REQUESTS_PER_BATCH == 0:
            rec.put(batch_row(i // REQUESTS_PER_BATCH))
    total = rec.buffered
    wall, cpu = time.perf_counter(), time.process_time()
    rec.start()
    rec.close(timeout_s=600.0)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    engine.dispose()
    if rec.written != total:
        raise RuntimeError(f"the writer wrote {rec.written} of {total} rows ({rec.dropped} dropped)")
    return {"writer_rows_per_s": total / wall, "writer_cpu_us_per_row": cpu / total * 1e6}


# ---------------------------------------------------------------------------- GIL cost
def _work(units: int) -> int:
    """Plain Python work: dict/list/str operations like request handling does."""
    acc = 0
    for j in range(units):
        d = {"id": j, "model": "mlp", "n": j & 7}
        acc += len(str(d["n"])) + d["id"] % 3
    return acc


def run_loop(put: Callable[[Any], None], requests: int, units: int, lead: int = 0) -> float:
    """Seconds the stand-in event loop needs for ``requests`` requests.

    ``lead`` untimed requests come before and after the timed ones, so a recorder is
    in its steady state (flushing the rows of earlier requests) throughout."""
    started = 0.0
    for i in range(requests + 2 * lead):
        if i == lead:
            started = time.perf_counter()
        elif i == lead + requests:
            return time.perf_counter() - started
        _work(units)
        put(request_row(i))
        if i % REQUESTS_PER_BATCH == 0:
            put(batch_row(i // REQUESTS_PER_BATCH))
        if i % REQUESTS_PER_POLL == 0:
            select.select([], [], [], 0)  # the event loop polls its sockets: the GIL is let go
    return time.perf_counter() - started


def measure_gil(folder: str, units: int, requests: int, pairs: int) -> dict[str, Any]:
    """Loop time with and without a recorder; alternating order cancels slow drifts.

    Other processes only ever add time, so besides the median of the pairwise
    slowdowns the ratio of the fastest runs is given. The writer's CPU time is the
    process CPU time of the recorded runs (drain included) less the main thread's."""
    lead = requests // 2
    engine = fresh_db(folder, "gil")
    off_s, on_s, slowdowns, written, dropped, writer_cpu_s = [], [], [], 0, 0, 0.0

    def off() -> float:
        return run_loop(lambda r: None, requests, units, lead)

    def on() -> float:
        nonlocal written, dropped, writer_cpu_s
        rec = Recorder(engine)
        cpu, main_cpu = time.process_time(), time.thread_time()
        rec.start()
        elapsed = run_loop(rec.put, requests, units, lead)
        main_cpu = time.thread_time() - main_cpu
        rec.close(timeout_s=60.0)
        writer_cpu_s += time.process_time() - cpu - main_cpu
        written += rec.written
        dropped += rec.dropped
        return elapsed

    off()  # warm up
    for i in range(pairs):
        if i % 2:
            b, a = on(), off()
        else:
            a, b = off(), on()
        off_s.append(a)
        on_s.append(b)
        slowdowns.append((b - a) / a * 100.0)
    engine.dispose()
    return {"work_units_per_request": units, "requests_per_run": requests,
            "loop_off_rps": [requests / s for s in off_s], "loop_on_rps": [requests / s for s in on_s],
            "slowdown_pct": slowdowns, "slowdown_pct_median": statistics.median(slowdowns),
            "slowdown_pct_fastest": (min(on_s) / min(off_s) - 1.0) * 100.0,
            "writer_cpu_us_per_row": writer_cpu_s / max(1, written) * 1e6,
            "rows_written": written, "rows_dropped": dropped}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--units", type=int, default=500,
                    help="work units per request (fixed, so runs compare across machines and load; "
                         "500 is about 8k requests/s here, like the mlp server under load)")
    ap.add_argument("--requests", type=int, default=12_000, help="timed requests per run")
    ap.add_argument("--pairs", type=int, default=10, help="on/off run pairs")
    ap.add_argument("--json", default=None, help="also write the figures to this file")
    args = ap.parse_args(argv)
    results: dict[str, Any] = {"cpus": os.cpu_count(), "python": sys.version.split()[0]}
    with tempfile.TemporaryDirectory() as folder:
        results["put"] = measure_put(folder)
        p = results["put"]
        print(f"put: {p['put_ns']:.0f} ns, when full: {p['put_when_full_ns']:.0f} ns, "
              f"through TeeRecorder(recorder, no-op): {p['tee_put_ns']:.0f} ns", flush=True)
        results["writer"] = measure_writer(folder)
        w = results["writer"]
        print(f"writer: {w['writer_rows_per_s']:,.0f} rows/s, {w['writer_cpu_us_per_row']:.2f} us CPU per row",
              flush=True)
        g = results["gil"] = measure_gil(folder, args.units, args.requests, args.pairs)
        print(f"busy loop: {args.units} work units per request, a batch row per {REQUESTS_PER_BATCH} "
              f"requests, {args.requests} timed requests per run")
        for off, on, s in zip(g["loop_off_rps"], g["loop_on_rps"], g["slowdown_pct"]):
            print(f"  off {off:8.0f} req/s   on {on:8.0f} req/s   slowdown {s:+.2f} %")
        print(f"loop slowdown with the recorder: median of pairs {g['slowdown_pct_median']:+.2f} %, "
              f"fastest on vs fastest off {g['slowdown_pct_fastest']:+.2f} %", flush=True)
        print(f"writer CPU while the loop ran: {g['writer_cpu_us_per_row']:.2f} us per row; "
              f"rows written {g['rows_written']:,}, dropped {g['rows_dropped']:,}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
