"""How long the batch timeline takes to read, build and draw a busy window.

Fills a SQLite file with ``--seconds`` of synthetic traffic at ``--rps`` requests a
second (batches of mean ``--mean-batch``; ``batchscope.testing.synthetic``), then, for
the newest ``--window`` seconds, times what one run of the Batch timeline page does:
reading the rows (``queries.timeline.timeline_rows``: what the page reads, and every
request as an export does), building the figure
(``presentation.timeline_chart.timeline``), turning it into the JSON that
``st.plotly_chart`` sends, and drawing it in a real browser (Debian's chromium through
Playwright: ``Plotly.newPlot`` on that JSON with the plotly.js the ``plotly`` package
ships, until its promise resolves, median of ``--draws``). Skips the browser when
chromium is absent.

    python benchmarks/bench_timeline.py                     # 10 s at 10,000 req/s
    python benchmarks/bench_timeline.py --rps 1000 --window 60
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    import common  # noqa: F401  (puts the repository root on sys.path)

from batchscope.analysis.queries import Window
from batchscope.analysis.queries.timeline import timeline_rows
from batchscope.presentation import timeline_chart
from batchscope.storage.db import make_engine
from batchscope.testing import synthetic

CHROMIUM = "/usr/bin/chromium"


def fill(path: Path, seconds: float, rps: float, mean_batch: float) -> float:
    engine = make_engine(f"sqlite:///{path}")
    end = time.time()
    synthetic.generate(engine, synthetic.HEALTHY.with_(
        duration_s=seconds, batches_per_s=rps / mean_batch, batch_size_mean=mean_batch,
        batch_size_sd=mean_batch / 4, max_batch_size=int(2 * mean_batch),
        rejected_per_s=rps / 500, expired_per_s=rps / 1000,
        settings_changes=((0.95, {"max_batch_size": int(mean_batch)}),)), end_s=end)
    engine.dispose()
    return end


def browser_draw_s(fig_json: str, draws: int) -> list[float]:
    """Seconds ``Plotly.newPlot`` takes on ``fig_json`` in chromium, ``draws`` times."""
    from playwright.sync_api import sync_playwright
    from plotly.offline import get_plotlyjs

    page_html = f"<html><body><div id='g' style='width:1400px;height:700px'></div>" \
                f"<script>{get_plotlyjs()}</script></body></html>"
    out = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1500, "height": 800})
        page.set_content(page_html)
        for _ in range(draws):
            out.append(page.evaluate("""async (spec) => {
                const fig = JSON.parse(spec);
                Plotly.purge('g');
                const t0 = performance.now();
                await Plotly.newPlot('g', fig.data, fig.layout);
                await new Promise(r => requestAnimationFrame(() => r()));
                return (performance.now() - t0) / 1000;
            }""", fig_json))
        browser.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--rps", type=float, default=10_000.0)
    ap.add_argument("--mean-batch", type=float, default=32.0)
    ap.add_argument("--window", type=float, default=10.0)
    ap.add_argument("--draws", type=int, default=5)
    ap.add_argument("--db", type=Path, default=None)
    args = ap.parse_args()
    path = args.db or Path(tempfile.mkdtemp()) / "timeline.db"
    t = time.perf_counter()
    end = fill(path, args.seconds, args.rps, args.mean_batch)
    print(f"filled {args.seconds:g} s at {args.rps:,.0f} req/s in {time.perf_counter() - t:.1f} s")
    engine = make_engine(f"sqlite:///{path}")
    w = Window(end - args.window, end)
    reads, reads_all, builds, jsons = [], [], [], []
    for _ in range(3):
        t = time.perf_counter()
        everything = timeline_rows(engine, w)
        reads_all.append(time.perf_counter() - t)
        t = time.perf_counter()
        rows = timeline_rows(engine, w, requests="marks")
        reads.append(time.perf_counter() - t)
        t = time.perf_counter()
        fig = timeline_chart.timeline(rows)
        builds.append(time.perf_counter() - t)
        t = time.perf_counter()
        spec = fig.to_json()
        jsons.append(time.perf_counter() - t)
    print(f"window {args.window:g} s: {len(rows.batches):,} batches, {len(everything.requests):,} "
          f"requests ({len(rows.requests):,} marked or listed), {len(fig.data)} traces, "
          f"{len(spec) / 1e6:.1f} MB of figure JSON")
    print(f"read rows      {1000 * statistics.median(reads):7.0f} ms (median of 3; what the page "
          "reads: batches, marked and slowest requests)")
    print(f"read all rows  {1000 * statistics.median(reads_all):7.0f} ms (every request too, as "
          "a trace export does)")
    print(f"build figure   {1000 * statistics.median(builds):7.0f} ms")
    print(f"figure to JSON {1000 * statistics.median(jsons):7.0f} ms")
    if Path(CHROMIUM).exists():
        draws = browser_draw_s(spec, args.draws)
        print(f"browser draw   {1000 * statistics.median(draws):7.0f} ms (chromium, median of "
              f"{len(draws)}; software rendering, no GPU)")
    else:
        print(f"browser draw   skipped: {CHROMIUM} is absent")
    total = statistics.median(builds) + statistics.median(jsons)
    print(f"build + JSON   {1000 * total:7.0f} ms")


if __name__ == "__main__":
    main()
