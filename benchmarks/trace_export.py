"""Exporting a busy window as a trace: time, file size, memory, and whether it reads back right.

``python -m benchmarks.trace_export`` writes ``--seconds`` (default 60) of synthetic
traffic of one model at about ``--rps`` (default 1,000) requests per second (the
``healthy`` preset, mean batch size 16, with some refused and expired requests) into a
temporary SQLite database, then exports the whole window as a Perfetto trace and as
Chrome Trace Event JSON (``batchscope.trace.export_trace``), each in a fresh child
process so its time and peak memory (``VmHWM``) are its own; a third child only reads
the window's rows (``timeline_rows``), for reference: what an export holds beyond them
is the layout and the writer's buffers, not the trace.

Each file is then parsed back (``batchscope.trace.check``: the official protos for the
Perfetto file, ``json`` for the other) and checked: one batch slice per batch row, one
request slice per request row with a queue and a compute slice in each batched one, one
flow per batched request from its queue slice to its batch, every begin ended on its
track, no overlap on a track but nesting, and every batch's and request's times equal to
the rows' to the nanosecond (``round(t * 1e9)``). The target: a Perfetto file under
50 MB. A run takes about a minute on a 2-core box.

``--traced-every N`` also writes a ``request_traces`` row for one request in N (1: every
request, as ``trace_rate`` 1 would), with receive and send times around the request and
input and output copies inside its compute; then each traced request's slice must span
its receive to its send, with ``receive``, ``queue``, ``compute`` and ``send`` parts and
``input``, ``infer`` and ``output`` in its compute.

    python -m benchmarks.trace_export
    python -m benchmarks.trace_export --traced-every 1      # every request traced
    python -m benchmarks.trace_export --seconds 10 --rps 200 --json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
END = 2_000_000_000.0
#: the Perfetto file of the default run should stay under this
TARGET_PERFETTO_MB = 50.0
CHILD_TIMEOUT_S = 600.0

CHILD = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
url, fmt, path = sys.argv[2:5]
start, end = float(sys.argv[5]), float(sys.argv[6])
from batchscope.analysis.queries.timeline import timeline_rows
from batchscope.analysis.queries.window import Window
from batchscope.storage.db import make_engine
from batchscope.trace import export_trace

def peak_rss_mb():  # this process's high-water mark since exec
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

engine = make_engine(url, create=False)
w = Window(start, end)
t0 = time.perf_counter()
if fmt == "rows":
    rows = timeline_rows(engine, w)
    out = {"rows": len(rows.batches) + len(rows.requests)}
else:
    summary = export_trace(engine, w, path, fmt)
    out = summary.to_dict()
out.update(wall_s=time.perf_counter() - t0, peak_rss_mb=peak_rss_mb())
print(json.dumps(out))
"""


#: one trace row per request whose id is a multiple of :every: 50 us receiving before its
#: arrival, input and output copies of a fifth of its compute each, 30 us sending after
TRACES_SQL = """
INSERT INTO request_traces (instance_id, model, trace_id, protocol, outcome, batch_seq,
  recv_start_at, recv_end_at, request_start_at, queue_start_at, compute_start_at,
  compute_input_end_at, compute_output_start_at, compute_end_at, request_end_at,
  send_start_at, send_end_at)
SELECT instance_id, model, id, 'http', outcome, batch_seq,
  arrived_at - 0.00005, arrived_at - 0.00001, arrived_at - 0.000005, arrived_at,
  CASE WHEN served THEN arrived_at + queue_wait_s END,
  CASE WHEN served THEN arrived_at + queue_wait_s + 0.2 * (latency_s - queue_wait_s) END,
  CASE WHEN served THEN arrived_at + queue_wait_s + 0.8 * (latency_s - queue_wait_s) END,
  CASE WHEN served THEN finished_at END,
  finished_at, finished_at + 0.000005, finished_at + 0.00003
FROM (SELECT *, outcome NOT IN ('rejected', 'expired') AND batch_seq IS NOT NULL AS served
      FROM requests WHERE id % :every = 0) AS r
"""


def fill(url: str, seconds: float, rps: float, traced_every: int = 0) -> dict:
    from sqlalchemy import text

    from batchscope.storage.db import make_engine
    from batchscope.testing import synthetic

    engine = make_engine(url)
    sc = synthetic.SCENARIOS["healthy"]
    t0 = time.perf_counter()
    made = synthetic.generate(engine, sc.with_(
        duration_s=seconds, batches_per_s=rps / sc.batch_size_mean, rejected_per_s=rps / 200,
        expired_per_s=rps / 500), end_s=END)
    traced = 0
    if traced_every:
        with engine.begin() as conn:
            traced = conn.execute(text(TRACES_SQL), {"every": traced_every}).rowcount
    engine.dispose()
    return {"batches": made.batches, "requests": made.requests, "traced": traced,
            "generate_s": time.perf_counter() - t0}


def child(url: str, fmt: str, path: str, start: float, end: float) -> dict:
    proc = subprocess.run([sys.executable, "-c", CHILD, str(ROOT), url, fmt, path, repr(start),
                           repr(end)], stdout=subprocess.PIPE, text=True, timeout=CHILD_TIMEOUT_S)
    if proc.returncode != 0:
        raise SystemExit(f"the {fmt} child failed (exit {proc.returncode})")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def verify(url: str, fmt: str, path: Path, start: float, end: float) -> dict:
    """Parse the file back and check it against the rows (see module doc)."""
    from batchscope.analysis.queries.timeline import timeline_rows
    from batchscope.analysis.queries.window import Window
    from batchscope.storage.db import make_engine
    from batchscope.trace.check import read_chrome, read_perfetto

    engine = make_engine(url, create=False)
    rows = timeline_rows(engine, Window(start, end))
    engine.dispose()
    t0 = time.perf_counter()
    data = path.read_bytes()
    got = read_perfetto(data) if fmt == "perfetto" else read_chrome(data)
    parse_s = time.perf_counter() - t0
    del data
    cats = got.by_category()
    ns = lambda t: round(t * 1e9)  # noqa: E731
    batches = {s.args["batch_id"]: (s.start_ns, s.end_ns) for s in got.slices
               if s.category == "batch"}
    requests = {s.args["request_id"]: (s.start_ns, s.end_ns) for s in got.slices
                if s.category == "request"}

    def span(r) -> tuple[int, int]:  # a traced request: its receive to its send
        lo, hi = ns(r.arrived_at), ns(r.finished_at)
        if r.recv_start_at == r.recv_start_at:  # not NaN
            lo, hi = min(lo, ns(r.recv_start_at)), max(hi, ns(r.send_end_at))
        return lo, hi

    times_ok = (batches == {r.id: (ns(r.started_at), ns(r.ended_at))
                            for r in rows.batches.itertuples()}
                and requests == {r.id: span(r) for r in rows.requests.itertuples()})
    unserved = rows.requests["outcome"].isin(("rejected", "expired"))
    batched = int((~unserved & rows.requests["batch_seq"].notna()).sum())
    traced = rows.requests["trace_id"].notna()
    traced_batched = int((traced & ~unserved & rows.requests["batch_seq"].notna()).sum())
    flows_ok = all(src.category == "queue" and dst.category == "batch"
                   for src, dst in got.flows.values())
    checks = {
        "well_formed": got.ok,  # begin/end pairs, nesting, flows, names (check.py)
        "one_batch_slice_per_row": cats["batch"] == len(rows.batches) == len(batches),
        "one_request_slice_per_row": cats["request"] == len(rows.requests) == len(requests),
        "queue_and_compute_per_batched_request": cats["queue"] == cats["compute"] == batched,
        "one_flow_per_batched_request": len(got.flows) == batched and flows_ok,
        "times_equal_rows_ns": times_ok,
        "receive_and_send_per_traced_request": cats["receive"] == cats["send"] == int(traced.sum()),
        "input_infer_output_per_traced_batched_request":
            cats["input"] == cats["infer"] == cats["output"] == traced_batched,
    }
    return {"parse_s": parse_s, "checks": checks, "problems": got.problems[:5]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="traffic to export (s)")
    parser.add_argument("--rps", type=float, default=1000.0, help="requests per second")
    parser.add_argument("--traced-every", type=int, default=0, metavar="N",
                        help="a trace row for one request in N (0: none)")
    parser.add_argument("--keep", type=Path, help="keep the database and traces in this folder")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    tmp = tempfile.TemporaryDirectory(prefix="bench-trace-")
    folder = args.keep or Path(tmp.name)
    folder.mkdir(parents=True, exist_ok=True)
    try:
        url = f"sqlite:///{folder / 'trace.db'}"
        made = fill(url, args.seconds, args.rps, args.traced_every)
        start, end = END - args.seconds - 1, END + 1
        base = child(url, "rows", "-", start, end)
        results = {"generated": made, "rows_only": base, "formats": {}}
        for fmt, name in (("perfetto", "run.pftrace"), ("json", "run.json")):
            path = folder / name
            r = child(url, fmt, str(path), start, end)
            r.update(verify(url, fmt, path, start, end))
            results["formats"][fmt] = r
        perfetto_mb = results["formats"]["perfetto"]["bytes_written"] / 1e6
        results["perfetto_under_target"] = perfetto_mb < TARGET_PERFETTO_MB
    finally:
        tmp.cleanup()
    if args.json:
        print(json.dumps(results, indent=1))
        return 0
    print(f"synthetic traffic: {args.seconds:.0f} s at ~{args.rps:,.0f} req/s: "
          f"{made['batches']:,} batches, {made['requests']:,} requests, "
          f"{made['traced']:,} of them traced (generated in {made['generate_s']:.1f} s)")
    print(f"rows read alone: {base['rows']:,} in {base['wall_s']:.1f} s, "
          f"peak RSS {base['peak_rss_mb']:.0f} MB")
    print(f"{'format':<9} {'rows':>8} {'export_s':>9} {'MB':>7} {'peak_RSS_MB':>12} "
          f"{'parse_s':>8}  checks")
    for fmt, r in results["formats"].items():
        failed = [k for k, ok in r["checks"].items() if not ok]
        print(f"{fmt:<9} {r['rows']:>8,} {r['wall_s']:>9.1f} {r['bytes_written'] / 1e6:>7.1f} "
              f"{r['peak_rss_mb']:>12.0f} {r['parse_s']:>8.1f}  "
              + ("all hold" if not failed else "FAILED: " + ", ".join(failed)))
        for k, ok in r["checks"].items():
            print(f"    {k}: {'yes' if ok else 'NO'}")
        if r["problems"]:
            print(f"    first problems: {r['problems']}")
    print(f"perfetto file under {TARGET_PERFETTO_MB:.0f} MB: "
          f"{'yes' if results['perfetto_under_target'] else 'NO'}")
    ok = results["perfetto_under_target"] and all(
        all(r["checks"].values()) for r in results["formats"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
