"""One live dashboard refresh over a fleet's day of traffic, on SQLite and PostgreSQL.

Generates ``--replicas`` instances (default 10) serving one model for ``--hours``
(default 24) with ``--batches`` batches in all (default 10 million; mean batch size 4,
so about 40 million requests), written hour by hour per instance with
``batchscope.testing.synthetic`` (vectorised; its inserts also fill the live summaries,
as the recorder's do). Then times one refresh of each live page for windows ending at
the newest data, the way the page runs it (what the Streamlit server spends per refresh):

* Live: ``queries.live_bundle`` (every query of the page, from the summaries), the
  diagnosis rules, the charts and their JSON (``bench_dashboard.refresh_once``);
* Fleet: ``fleet.bundle`` (per-instance figures from the summaries, exact per-instance
  and fleet-wide percentiles), the fleet rules, the busiest model's per-instance
  throughput timeline, its two charts and their JSON (``fleet_refresh_once``).

Each is the median of ``--repeat`` refreshes after a first one (reported apart, as
``first_total_s``: the cache is cold then). ``--raw`` also times the Live page's frames
aggregated from the raw rows (``queries.raw_bundle``, what a refresh cost before the
summaries).

PostgreSQL: a throw-away server started from the Debian binaries (as the ``postgres``
user when run as root), unless ``--pg-url`` names one. Its settings are printed.

    python benchmarks/bench_fleet_queries.py                          # both, full size
    python benchmarks/bench_fleet_queries.py --backends sqlite --batches 1000000
    python benchmarks/bench_fleet_queries.py --write-overhead         # insert cost of the summaries
    python benchmarks/bench_fleet_queries.py --folder /data/fleet     # keep (and reuse) both databases
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Iterator

if __package__ in (None, ""):
    import common  # noqa: F401  (puts the repository root on sys.path)
    from bench_dashboard import PARTS, refresh_once, to_json
else:
    from benchmarks.bench_dashboard import PARTS, refresh_once, to_json
from sqlalchemy import text

from batchscope.analysis import fleet, fleet_rules, queries
from batchscope.presentation import fleet_charts
from batchscope.storage import inserts as inserts_module
from batchscope.storage.db import make_engine
from batchscope.storage.inserts import BulkInserts
from batchscope.storage.records import RequestRow
from batchscope.testing import synthetic

#: settings of the throw-away PostgreSQL server (a benchmark's database: fast loading,
#: no durability)
PG_SETTINGS = {"shared_buffers": "2GB", "work_mem": "64MB", "maintenance_work_mem": "512MB",
               "max_wal_size": "8GB", "fsync": "off", "synchronous_commit": "off",
               "full_page_writes": "off"}


def pg_bin(name: str) -> str:
    found = shutil.which(name)
    if found:
        return found
    debian = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    if not debian:
        raise SystemExit(f"PostgreSQL's {name} was not found: apt-get install postgresql, or pass --pg-url")
    return debian[-1]


@contextlib.contextmanager
def pg_server(folder: Path) -> Iterator[str]:
    """A PostgreSQL server on a free port with its data in ``folder``; yields a URL.
    A ``folder`` that holds a server's data from an earlier run is started again as it
    is (so a filled database is measured again without generating it anew)."""
    as_postgres = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    data = folder / "pgdata"
    fresh = not (data / "PG_VERSION").exists()
    if fresh:
        data.mkdir(parents=True)
        if as_postgres:
            shutil.chown(folder, "postgres")
            shutil.chown(data, "postgres")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if fresh:
        subprocess.run([*as_postgres, pg_bin("initdb"), "-D", str(data), "-U", "postgres", "--auth=trust"],
                       check=True, capture_output=True)
    options = " ".join(f"-c {k}={v}" for k, v in PG_SETTINGS.items())
    subprocess.run([*as_postgres, pg_bin("pg_ctl"), "start", "-w", "-D", str(data), "-l", str(folder / "log"),
                    "-o", f"-p {port} -k {folder} -c listen_addresses=127.0.0.1 {options}"],
                   check=True, capture_output=True)
    try:
        if fresh:
            subprocess.run([*as_postgres, pg_bin("createdb"), "-h", "127.0.0.1", "-p", str(port), "-U",
                            "postgres", "bench"], check=True, capture_output=True)
        yield f"postgresql+psycopg://postgres@127.0.0.1:{port}/bench"
    finally:
        subprocess.run([*as_postgres, pg_bin("pg_ctl"), "stop", "-m", "fast", "-D", str(data)],
                       capture_output=True)


def build(url: str, *, replicas: int, hours: float, batches: int, mean_batch: float) -> dict:
    """Write the fleet's traffic, hour by hour per replica; returns counts and timings."""
    engine = make_engine(url)
    per_replica_s = batches / (replicas * hours * 3600.0)
    end = float(int(time.time()))
    t0 = time.perf_counter()
    out = {"batches": 0, "requests": 0}
    chunks = int(hours)
    for hour in range(chunks):
        for r in range(replicas):
            sc = synthetic.HEALTHY.with_(
                instance_id=f"replica-{r:02d}", duration_s=3600.0, batches_per_s=per_replica_s,
                batch_size_mean=mean_batch, batch_size_sd=mean_batch / 3,
                settings_changes=((0.5, {"max_batch_size": 24}),) if hour == chunks - 1 else ())
            got = synthetic.generate(engine, sc, end_s=end - (chunks - 1 - hour) * 3600.0,
                                     seed=hour * 1000 + r)
            out["batches"] += got.batches
            out["requests"] += got.requests
        elapsed = time.perf_counter() - t0
        print(f"  hour {hour + 1}/{chunks}: {out['batches']} batches, {out['requests']} requests, "
              f"{elapsed:.0f} s", flush=True)
    out["generate_s"] = round(time.perf_counter() - t0, 1)
    if engine.dialect.name == "postgresql":
        t1 = time.perf_counter()
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.exec_driver_sql("VACUUM ANALYZE")
        out["vacuum_analyze_s"] = round(time.perf_counter() - t1, 1)
    else:
        with engine.begin() as conn:
            conn.exec_driver_sql("ANALYZE")
    engine.dispose()
    return out


def has_rows(url: str, table: str) -> bool:
    engine = make_engine(url)
    with engine.connect() as conn:
        found = conn.execute(text(f"SELECT 1 FROM {table} LIMIT 1")).first() is not None
    engine.dispose()
    return found


def has_batches(url: str) -> bool:
    return has_rows(url, "batches")


def fleet_refresh_once(engine, w: queries.Window, now: float) -> dict:
    """One refresh of the Fleet page's live region (``dashboard.fleet.fleet_region``)."""
    t0 = time.perf_counter()
    fb = fleet.bundle(engine, queries.Window(w.start_s, w.end_s), now=now)
    model = fb["busiest"][1] if fb["busiest"] else w.model
    timeline = fleet.throughput_timeline(engine, queries.Window(w.start_s, w.end_s, model))
    t1 = time.perf_counter()
    flags = fleet_rules.diagnose(fb)
    t2 = time.perf_counter()
    rows = fb["table"][fb["table"]["model"] == model]
    per_model = fb["fleet"][fb["fleet"]["model"] == model]
    figs = {"fleet_throughput": fleet_charts.throughput_by_instance(timeline),
            "fleet_latency": fleet_charts.latency_by_instance(
                rows, per_model.iloc[0].to_dict() if len(per_model) else None)}
    t3 = time.perf_counter()
    to_json(figs)
    t4 = time.perf_counter()
    return {"queries_s": t1 - t0, "diagnosis_s": t2 - t1, "charts_s": t3 - t2, "to_json_s": t4 - t3,
            "total_s": t4 - t0, "flags": len(flags), "instances": len(rows),
            "requests_in_window": int(rows["requests"].sum()), "latencies_read": fb["latencies_read"]}


def timed(refresh, repeat: int) -> dict:
    """The median of ``repeat`` refreshes per part, after a first one (``first_total_s``)."""
    first = refresh()
    runs = [refresh() for _ in range(repeat)]
    out = {k: round(statistics.median(r[k] for r in runs), 4) for k in PARTS}
    out["first_total_s"] = round(first["total_s"], 4)
    out.update({k: v for k, v in runs[-1].items() if k not in PARTS})
    return out


def measure(url: str, windows: list[float], repeat: int, raw: bool, pages: tuple[str, ...]) -> dict:
    engine = make_engine(url)
    with engine.connect() as conn:
        end = conn.execute(text("SELECT MAX(ended_at) FROM batches")).scalar()
        rows = {t: conn.execute(text(f"SELECT COUNT(*) FROM {t}")).scalar()
                for t in ("batches", "requests", "device_samples", "summary_stats", "summary_latency",
                          "summary_shapes")}
    print(f"  rows: {rows}", flush=True)
    out: dict = {"rows": rows, "refresh": {}, "fleet_refresh": {}}
    for minutes in windows:
        w = queries.Window.last(minutes, now=end + 1, model="mlp")
        label = f"{minutes:g}min"
        if "live" in pages:
            summary = timed(lambda: refresh_once(engine, w), repeat)
            if raw:
                summary["raw_queries_s"] = round(refresh_once(engine, w, raw=True)["queries_s"], 4)
            out["refresh"][label] = summary
            print(f"  Live page, {minutes:g} min: {json.dumps(summary)}", flush=True)
        if "fleet" in pages:
            summary = timed(lambda: fleet_refresh_once(engine, w, end + 1), repeat)
            out["fleet_refresh"][label] = summary
            print(f"  Fleet page, {minutes:g} min: {json.dumps(summary)}", flush=True)
    engine.dispose()
    return out


def write_overhead(url: str, rows: int = 200_000, flush_rows: int = 2000) -> dict:
    """Seconds to insert ``rows`` request rows in flushes of ``flush_rows``, with the
    summaries and without them (the same rows, a fresh table each time)."""
    if has_batches(url) or has_rows(url, "requests"):
        raise SystemExit(f"--write-overhead deletes what it writes: give it an empty database, not {url}")
    engine = make_engine(url)
    records = [RequestRow(instance_id="rt", model="mlp", batch_seq=i // 4, priority=i % 3,
                          arrived_at=1e9 + i * 0.001, finished_at=1e9 + i * 0.001 + 0.01,
                          queue_wait_s=0.002, latency_s=0.004 + (i % 97) * 1e-4, outcome="ok")
               for i in range(rows)]
    out = {}
    saved = inserts_module.SUMMARISED
    for label, summarised in (("with_summaries_s", saved), ("without_summaries_s", frozenset())):
        inserts_module.SUMMARISED = summarised
        with engine.begin() as conn:
            for table in ("requests", "summary_stats", "summary_latency"):  # empty before: see above
                conn.exec_driver_sql(f"DELETE FROM {table}")
        bulk = BulkInserts(engine)
        t0 = time.perf_counter()
        raw = engine.raw_connection() if bulk.sqlite else None
        try:
            for i in range(0, rows, flush_rows):
                chunk = records[i:i + flush_rows]
                if raw is not None:
                    bulk.insert_sqlite(raw, RequestRow, chunk)
                else:
                    bulk.insert_core(RequestRow, chunk)
        finally:
            if raw is not None:
                raw.close()
        out[label] = round(time.perf_counter() - t0, 3)
    inserts_module.SUMMARISED = saved
    out["us_per_row_with"] = round(out["with_summaries_s"] / rows * 1e6, 2)
    out["us_per_row_without"] = round(out["without_summaries_s"] / rows * 1e6, 2)
    engine.dispose()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--backends", default="sqlite,postgresql")
    p.add_argument("--replicas", type=int, default=10)
    p.add_argument("--hours", type=int, default=24)
    p.add_argument("--batches", type=int, default=10_000_000)
    p.add_argument("--mean-batch", type=float, default=4.0)
    p.add_argument("--windows", default="1,5,15,60", help="window lengths in minutes")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--raw", action="store_true", help="also time the frames from the raw rows")
    p.add_argument("--pages", default="live,fleet", help="the pages whose refresh is timed")
    p.add_argument("--sqlite-db", type=Path, default=None, help="a SQLite file to fill (when empty) and query")
    p.add_argument("--pg-url", default=None, help="a PostgreSQL database to fill (when empty) and query")
    p.add_argument("--write-overhead", action="store_true", help="only measure the summaries' insert cost")
    p.add_argument("--folder", type=Path, default=None,
                   help="where the databases go, and are read again from on the next run "
                        "(default: a temporary folder)")
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = p.parse_args(argv)

    folder = args.folder or Path(tempfile.mkdtemp(prefix="bench-fleet-"))
    folder.mkdir(parents=True, exist_ok=True)
    windows = [float(m) for m in args.windows.split(",")]
    result: dict = {"replicas": args.replicas, "hours": args.hours, "batches_asked": args.batches,
                    "cpus": os.cpu_count(), "pg_settings": PG_SETTINGS}
    for backend in args.backends.split(","):
        print(f"{backend}:", flush=True)
        with contextlib.ExitStack() as stack:
            if backend == "sqlite":
                url = f"sqlite:///{args.sqlite_db or folder / 'fleet.db'}"
            else:
                url = args.pg_url or stack.enter_context(pg_server(folder / "pg"))
            if args.write_overhead:
                result[backend] = {"write_overhead": write_overhead(url)}
                print(f"  {json.dumps(result[backend])}", flush=True)
                continue
            entry: dict = {}
            if not has_batches(url):  # a database filled before is measured again as it is
                entry["build"] = build(url, replicas=args.replicas, hours=args.hours, batches=args.batches,
                                       mean_batch=args.mean_batch)
                print(f"  built: {json.dumps(entry['build'])}", flush=True)
            entry.update(measure(url, windows, args.repeat, args.raw, tuple(args.pages.split(","))))
            result[backend] = entry
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
