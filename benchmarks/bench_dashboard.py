"""How long one live refresh of the dashboard takes over a large recorded database.

Generates ``--batches`` batch rows (default one million) spread over ``--hours``
of history, with their requests (mean batch size ``--mean-batch``), device
samples and events, into a SQLite file with ``batchscope.testing.synthetic``; then
times one live refresh as the Live page runs it: every query of the live fragment
(``queries.live_bundle``, which reads the live summaries), the diagnosis rules, building
the charts and turning them into the JSON ``st.plotly_chart`` sends (what Streamlit does
with each figure), for several window lengths ending at the newest data. ``--raw``
times the same frames aggregated from the raw rows instead (``queries.raw_bundle``).
For ten replicas sharing a database, on SQLite and PostgreSQL, see
``bench_fleet_queries.py``.

    python benchmarks/bench_dashboard.py                 # 1M batches, ~4M requests
    python benchmarks/bench_dashboard.py --batches 100000 --db /tmp/small.db
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    import common  # noqa: F401  (puts the repository root on sys.path)
import plotly.io as pio
import plotly.tools

from batchscope.presentation import charts
from batchscope.analysis import diagnosis, queries
from batchscope.testing import synthetic
from batchscope.storage.db import make_engine


def build(db_path: Path, batches: int, hours: float, mean_batch: float) -> dict:
    engine = make_engine(f"sqlite:///{db_path}")
    duration_s = hours * 3600.0
    sc = synthetic.HEALTHY.with_(duration_s=duration_s, batches_per_s=batches / duration_s,
                                 batch_size_mean=mean_batch, batch_size_sd=mean_batch / 3,
                                 settings_changes=((0.99, {"max_batch_size": 24}),), oom_events=3)
    t0 = time.perf_counter()
    out = synthetic.generate(engine, sc, end_s=time.time())
    engine.dispose()
    return {"generate_s": round(time.perf_counter() - t0, 1), "batches": out.batches,
            "requests": out.requests, "device_samples": out.device_samples, "end_s": out.end_s}


#: the parts of one refresh, in the order they run
PARTS = ("queries_s", "diagnosis_s", "charts_s", "to_json_s", "total_s")


def to_json(figs: dict) -> None:
    """What ``st.plotly_chart`` does with each figure before it leaves the server."""
    for fig in figs.values():
        pio.to_json(plotly.tools.return_figure_from_figure_or_data(fig, validate_figure=True),
                    validate=False)


def refresh_once(engine, w: queries.Window, raw: bool = False) -> dict:
    """One refresh of the Live page: its queries, the diagnosis, the charts and their JSON."""
    t0 = time.perf_counter()
    bundle = queries.raw_bundle(engine, w) if raw else queries.live_bundle(engine, w)
    t1 = time.perf_counter()
    flags = diagnosis.diagnose(bundle)
    t2 = time.perf_counter()
    figs = charts.build_all(bundle, slo_ms=50)
    t3 = time.perf_counter()
    to_json(figs)
    t4 = time.perf_counter()
    head = bundle["headline"].iloc[0]
    return {"queries_s": t1 - t0, "diagnosis_s": t2 - t1, "charts_s": t3 - t2, "to_json_s": t4 - t3,
            "total_s": t4 - t0, "flags": len(flags), "requests_in_window": int(head["requests"]),
            "resolution": head.get("resolution")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batches", type=int, default=1_000_000)
    p.add_argument("--hours", type=float, default=24.0, help="history the batches span")
    p.add_argument("--mean-batch", type=float, default=4.0)
    p.add_argument("--db", type=Path, default=None, help="reuse or create this SQLite file")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--windows", default="1,5,15,60", help="window lengths in minutes")
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    p.add_argument("--raw", action="store_true", help="aggregate the raw rows, not the summaries")
    args = p.parse_args(argv)

    db_path = args.db or Path(tempfile.mkdtemp(prefix="bench-dash-")) / "bench.db"
    result: dict = {"db": str(db_path)}
    if not db_path.exists():
        result["build"] = build(db_path, args.batches, args.hours, args.mean_batch)
        print(f"built {db_path}: {json.dumps(result['build'])}", flush=True)
    engine = make_engine(f"sqlite:///{db_path}")
    with engine.connect() as conn:
        from sqlalchemy import text
        end = conn.execute(text("SELECT MAX(ended_at) FROM batches")).scalar()
        result["rows"] = {t: conn.execute(text(f"SELECT COUNT(*) FROM {t}")).scalar()
                          for t in ("batches", "requests", "events", "device_samples")}
    print(f"rows: {result['rows']}", flush=True)
    result["refresh"] = {}
    for minutes in [float(m) for m in args.windows.split(",")]:
        w = queries.Window.last(minutes, now=end + 1, model="mlp")
        runs = [refresh_once(engine, w, args.raw) for _ in range(args.repeat)]
        summary = {k: round(statistics.median(r[k] for r in runs), 4) for k in PARTS}
        summary["requests_in_window"] = runs[0]["requests_in_window"]
        result["refresh"][f"{minutes:g}min"] = summary
        print(f"window {minutes:g} min: {json.dumps(summary)}", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    engine.dispose()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
