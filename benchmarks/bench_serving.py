"""End-to-end serving benchmark: the BatchScope server against the models' own offline
throughput and against a plain one-forward-per-request server, all in one run.

Every figure is measured in the same run on the same machine, and every target is
printed as a ratio of two of them:

* encoder, 64 clients, random lengths 8..128: server req/s / offline items/s of
  length-sorted batches of 32 (target >= 0.85), with bucket edges every 16 tokens; with
  the default settings (edges derived from the traffic: >= 0.9 of offline and >= 1.2 x the
  plain server); with bucketing off and with no batching (max batch size 1) to show what
  bucketing buys.
* mlp, 64 clients: server req/s / the plain no-batching server's req/s (target >= 6).
* 1 client, default settings: p50 latency - the model's batch-1 time (target <= 1 ms).
* recording on vs off: throughput loss (target <= 3 %), both servers up, alternating short
  load slices; the median of the on/off ratios of adjacent slices.
* the batching core alone: microseconds per request with a no-op model.

Server and load generator share this machine; torch runs on one thread in the server.
The server runs with its defaults (on the CPU: models in the device process); the mlp
figures are also taken with the model on a thread of the serving process
(``--no-device-process``) for comparison.

    python -m benchmarks.bench_serving                 # everything, ~4 minutes
    python -m benchmarks.bench_serving --duration-s 5 --only mlp --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Sequence

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_offline import run_offline  # noqa: E402
from batchscope.load.loadgen import run_load  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
#: on/off slices of the recording comparison (each side gets this many)
RECORDING_SLICES = 12
#: length buckets every 16 tokens: batches of near-equal lengths, little padding
FINE_EDGES = "16,32,48,64,80,96,112,128"
URL_RE = re.compile(r"(http://127\.0\.0\.1:\d+)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServedUrl(str):
    """A started server's URL; ``pid``: its process (``benchmarks.cpu_share`` reads its CPU
    time and its children's)."""

    pid: int


@contextmanager
def process(cmd: Sequence[str], *, ready: str, timeout_s: float = 120.0, url: str | None = None,
            health: str = "/v2/health/ready", env: dict | None = None) -> Iterator[str]:
    """Start ``cmd``, wait for a line containing ``ready`` and a URL (or, given ``url``,
    for ``health`` there to answer 200); yield the URL."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **(env or {}))
    proc = subprocess.Popen(list(cmd), cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    given, url = url, None
    deadline = time.monotonic() + timeout_s
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:  # read in a thread so a silent, hung process cannot block us
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    seen: list[str] = []
    try:
        while url is None and time.monotonic() < deadline:
            try:
                line = lines.get(timeout=max(0.05, deadline - time.monotonic()))
            except queue.Empty:
                break
            if line is None:
                break
            seen.append(line)
            match = URL_RE.search(line)
            if ready in line and (match or given):
                url = given or match.group(1)
        if url is None:
            raise RuntimeError(f"{cmd[2:5]} did not start within {timeout_s:.0f} s:\n"
                               f"{''.join(seen[-20:])}")
        wait_ready(url, deadline, health)
        served = ServedUrl(url)
        served.pid = proc.pid
        yield served
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wait_ready(url: str, deadline: float, health: str = "/v2/health/ready") -> None:
    """Poll the readiness route until it answers 200 (bounded by ``deadline``)."""
    import urllib.request

    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}{health}", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} never became ready")


#: flags every BatchScope server of this run gets (e.g. --no-device-process)
SERVE_EXTRA: list[str] = []


def serve_cmd(*extra: str, db: str | None = None, models: Sequence[str] = ("mlp", "encoder")) -> list[str]:
    cmd = [sys.executable, "-m", "runtime.tools.cli", "serve", "--port", "0", "--torch-threads", "1",
           *SERVE_EXTRA]
    for m in models:
        cmd += ["--model", m]
    cmd += ["--db", db] if db else ["--no-record"]
    return cmd + list(extra)


def baseline_cmd() -> list[str]:
    return [sys.executable, "-m", "benchmarks.baseline_server", "--port", str(free_port()),
            "--model", "mlp", "--model", "encoder"]


def load(url: str, model: str, *, concurrency: int, duration_s: float,
         lengths: str | None = None, warmup_s: float = 1.0) -> dict[str, Any]:
    if warmup_s > 0:
        run_load(url, model, concurrency=concurrency, duration_s=warmup_s, lengths=lengths)
    report = run_load(url, model, concurrency=concurrency, duration_s=duration_s, lengths=lengths)
    out = report.to_dict()
    errors = sum(report.errors_by_status.values())
    print(f"  {model:8s} c={concurrency:<3d} {report.throughput_rps:9.1f} req/s  "
          f"p50 {report.latency_p50_ms or 0:7.2f} ms  p99 {report.latency_p99_ms or 0:7.2f} ms"
          f"  errors {errors}", flush=True)
    return out


def core_overhead_us() -> dict[str, float]:
    from runtime.api.config import BatchingConfig
    from benchmarks.bench_core import measure

    return {
        "fixed_size_us": measure(BatchingConfig(), n=200_000),
        "bucketed_us": measure(BatchingConfig(), n=200_000, variable_length=True,
                               lengths=(8, 40, 70, 100, 128)),
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration-s", type=float, default=8.0, help="length of each load run")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--only", default="mlp,encoder,latency,recording,core,short",
                    help="comma list of parts: mlp, encoder, latency, recording, core, short")
    ap.add_argument("--short-rounds", type=int, default=3,
                    help="rounds of the short runs (each figure's median over them)")
    ap.add_argument("--json", default=None, help="write all figures to this file")
    ap.add_argument("--no-device-process", action="store_true",
                    help="serve with batchscope serve --no-device-process (models on a thread of "
                         "the serving process) for every part")
    args = ap.parse_args(argv)
    if args.no_device_process:
        SERVE_EXTRA.append("--no-device-process")
    parts = set(args.only.split(","))
    d, c = args.duration_s, args.concurrency
    results: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version()},
        "settings": {"duration_s": d, "concurrency": c, "torch_threads": 1,
                     "device_process": not args.no_device_process},
    }
    ratios: dict[str, float] = {}

    print("offline ceilings (torch 1 thread)", flush=True)
    offline = run_offline(("mlp", "encoder"), (1, 32), duration_s=2.0, threads=1)
    results["offline"] = offline

    def off(model: str, order: str, bs: int) -> dict[str, Any]:
        return next(r for r in offline if r["model"] == model and r["order"] == order
                    and r["batch_size"] == bs)

    for r in offline:
        print(f"  {r['model']:8s} {r['order']:7s} batch {r['batch_size']:3d}: "
              f"{r['items_per_s']:9.1f} items/s  {r['ms_per_batch']:.3f} ms/batch", flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        db = f"sqlite:///{tmp}/bench.db"
        if parts & {"mlp", "encoder", "latency"}:
            print(f"batchscope server (recording on, bucket edges {FINE_EDGES}, other settings "
                  "default)", flush=True)
            with process(serve_cmd("--bucket-edges", FINE_EDGES, db=db), ready="serving") as url:
                if "mlp" in parts:
                    results["mlp_server"] = load(url, "mlp", concurrency=c, duration_s=d)
                if "encoder" in parts:
                    results["encoder_server"] = load(url, "encoder", concurrency=c, duration_s=d,
                                                     lengths="uniform:8:128")
                if "latency" in parts:
                    results["mlp_1client"] = load(url, "mlp", concurrency=1, duration_s=d)
                    results["encoder_1client"] = load(url, "encoder", concurrency=1, duration_s=d,
                                                      lengths="fixed:64")
        if "encoder" in parts:
            print("encoder with the default settings (bucket edges derived from the traffic)",
                  flush=True)
            with process(serve_cmd(models=("encoder",)), ready="serving") as url:
                results["encoder_default_settings"] = load(url, "encoder", concurrency=c,
                                                           duration_s=d, lengths="uniform:8:128")
            print("encoder with bucketing off", flush=True)
            with process(serve_cmd("--no-bucketing", models=("encoder",)), ready="serving") as url:
                results["encoder_no_bucketing"] = load(url, "encoder", concurrency=c, duration_s=d,
                                                       lengths="uniform:8:128")
            print("encoder with no batching (max batch size 1)", flush=True)
            with process(serve_cmd("--max-batch-size", "1", models=("encoder",)), ready="serving") as url:
                results["encoder_batch1"] = load(url, "encoder", concurrency=c, duration_s=d,
                                                 lengths="uniform:8:128")
        if "mlp" in parts and "--no-device-process" not in SERVE_EXTRA:
            print("batchscope server with the model on a thread of the serving process "
                  "(--no-device-process)", flush=True)
            with process(serve_cmd("--no-device-process", db=db, models=("mlp",)),
                         ready="serving") as url:
                results["mlp_in_thread"] = load(url, "mlp", concurrency=c, duration_s=d)
                if "latency" in parts:
                    results["mlp_in_thread_1client"] = load(url, "mlp", concurrency=1,
                                                            duration_s=d)
        if parts & {"mlp", "encoder"}:
            print("plain server, one forward per request (FastAPI/uvicorn)", flush=True)
            with process(baseline_cmd(), ready="baseline server") as url:
                if "mlp" in parts:
                    results["mlp_baseline"] = load(url, "mlp", concurrency=c, duration_s=d)
                if "encoder" in parts:
                    results["encoder_baseline"] = load(url, "encoder", concurrency=c,
                                                       duration_s=d, lengths="uniform:8:128")
        if "recording" in parts:
            print(f"recording on vs off (mlp; both servers up, {RECORDING_SLICES} alternating "
                  f"slices of {d / 2:.0f} s each)", flush=True)
            on_runs, off_runs = [], []
            with process(serve_cmd(db=db, models=("mlp",)), ready="serving") as url_on, \
                    process(serve_cmd(models=("mlp",)), ready="serving") as url_off:
                # short alternating slices, each side first in turn: the slow drift of a
                # shared machine hits both sides alike instead of whichever ran later
                for i in range(RECORDING_SLICES):
                    for record in ((True, False) if i % 2 == 0 else (False, True)):
                        r = load(url_on if record else url_off, "mlp", concurrency=c,
                                 duration_s=d / 2, warmup_s=0.5)
                        (on_runs if record else off_runs).append(r["throughput_rps"])
            results["recording"] = {"on_rps": on_runs, "off_rps": off_runs}

    if "short" in parts:
        from benchmarks.short_runs import ratios as short_ratios, short_runs

        print("short runs (2-s warm-up, 10-s window): batchscope defaults vs the plain server",
              flush=True)
        def sorted32(model: str) -> float | None:  # the encoder alone, length-sorted 32s
            if model != "encoder":
                return None
            rows = run_offline(("encoder",), (32,), duration_s=2.0, threads=1)
            return next(r["items_per_s"] for r in rows if r["order"] == "sorted")

        results["short"] = short_runs([
            ("batchscope", lambda: process(serve_cmd(), ready="serving")),
            ("plain", lambda: process(baseline_cmd(), ready="baseline server"))],
            rounds=args.short_rounds, offline=sorted32)
        ratios.update(short_ratios(results["short"], "batchscope", "plain"))

    if "core" in parts:
        results["core"] = core_overhead_us()
        print(f"batching core alone: {results['core']['fixed_size_us']:.2f} us/request fixed-size, "
              f"{results['core']['bucketed_us']:.2f} us/request bucketed", flush=True)

    if "encoder_server" in results:
        sorted32 = off("encoder", "sorted", 32)["items_per_s"]
        ratios["encoder_server_vs_offline_sorted32"] = results["encoder_server"]["throughput_rps"] / sorted32
        for key in ("encoder_default_settings", "encoder_no_bucketing", "encoder_batch1"):
            if key in results:
                ratios[f"{key}_vs_offline_sorted32"] = results[key]["throughput_rps"] / sorted32
    if "encoder_default_settings" in results and "encoder_baseline" in results:
        ratios["encoder_default_settings_vs_plain_server"] = (
            results["encoder_default_settings"]["throughput_rps"]
            / results["encoder_baseline"]["throughput_rps"])
    if "mlp_server" in results and "mlp_baseline" in results:
        ratios["mlp_server_vs_plain_server"] = (results["mlp_server"]["throughput_rps"]
                                                / results["mlp_baseline"]["throughput_rps"])
    if "mlp_in_thread" in results and "mlp_baseline" in results:
        ratios["mlp_in_thread_vs_plain_server"] = (
            results["mlp_in_thread"]["throughput_rps"] / results["mlp_baseline"]["throughput_rps"])
    if "mlp_in_thread_1client" in results:
        ratios["mlp_in_thread_1client_p50_minus_batch1_ms"] = (
            results["mlp_in_thread_1client"]["latency_p50_ms"] - off("mlp", "fixed", 1)["ms_per_batch"])
    if "mlp_1client" in results:
        b1 = off("mlp", "fixed", 1)["ms_per_batch"]
        ratios["mlp_1client_p50_minus_batch1_ms"] = results["mlp_1client"]["latency_p50_ms"] - b1
    if "encoder_1client" in results:
        results["encoder_1client_note"] = "length 64; offline batch-1 figure is over lengths 8..128"
    if "recording" in results:
        on_rps, off_rps = results["recording"]["on_rps"], results["recording"]["off_rps"]
        # each on slice against the off slice next to it in time: the machine's drift
        # cancels within a pair; the median pair is the figure, the medians a cross-check
        pairs = sorted(a / b for a, b in zip(on_rps, off_rps))
        ratios["recording_throughput_loss_pct"] = (1 - statistics.median(pairs)) * 100
        ratios["recording_loss_pct_of_medians"] = (
            1 - statistics.median(on_rps) / statistics.median(off_rps)) * 100
        results["recording"]["pair_ratios"] = pairs
    results["ratios"] = ratios

    print("\nratios measured in this run", flush=True)
    targets = {"encoder_server_vs_offline_sorted32": ">= 0.85",
               "encoder_default_settings_vs_offline_sorted32": ">= 0.9",
               "encoder_default_settings_vs_plain_server": ">= 1.2", "mlp_server_vs_plain_server": ">= 6",
               "mlp_in_thread_1client_p50_minus_batch1_ms": "<= 1.0",
               "mlp_1client_p50_minus_batch1_ms": "<= 1.0", "recording_throughput_loss_pct": "<= 3",
               "short_mlp_c1_throughput_vs_plain": ">= 0.95", "short_mlp_c1_p50_minus_plain_ms": "<= 0.1",
               "short_mlp_open20_p99_vs_plain": "<= 1", "short_encoder_open20_p99_vs_plain": "<= 1",
               "short_encoder_c64_vs_offline": ">= 0.9", "short_encoder_c64_throughput_vs_plain": ">= 1.2",
               "short_mlp_c64_share_of_cpu_bound": ">= 0.9"}
    for key, value in ratios.items():
        print(f"  {key:45s} {value:8.3f}   {targets.get(key, '')}", flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
