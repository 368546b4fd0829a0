"""The short benchmark a user runs first, as the common peer benchmarks run it.

For ``mlp`` and ``encoder`` (lengths 8..128), the BatchScope server with its defaults and
the plain one-forward-per-request server, each measured the same way in the same run:
2 s of warm-up, then a 10-s window, at 1, 8 and 64 closed-loop clients; then the p99
latency at an open-loop rate of 20 % of the plain server's 64-client throughput (so both
keep up). ``bench_serving --only short`` runs it and prints each figure as BatchScope /
the plain server.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from batchscope.load.loadgen import run_load
from benchmarks.cpu_share import CpuShare

WARMUP_S = 2.0
WINDOW_S = 10.0
CLIENTS = (1, 8, 64)
OPEN_SHARE = 0.2
LENGTHS = {"mlp": None, "encoder": "uniform:8:128"}


def measure(url: str, model: str, **options: Any) -> dict[str, Any]:
    """One warm-up and one window; at the most clients, also where the CPU went
    (``benchmarks.cpu_share``: per request, the serving process, its children and the
    load generator, and the share of the machine's CPU bound the window reached)."""
    lengths = LENGTHS[model]
    run_load(url, model, duration_s=WARMUP_S, lengths=lengths,
             **({"rate": options["rate"]} if "rate" in options else
                {"concurrency": options["concurrency"]}))
    pid = getattr(url, "pid", None)
    if pid is None or options.get("concurrency") != CLIENTS[-1]:
        return run_load(url, model, duration_s=WINDOW_S, lengths=lengths, **options).to_dict()
    with CpuShare(pid) as cpu:
        report = run_load(url, model, duration_s=WINDOW_S, lengths=lengths, **options)
    return {**report.to_dict(), "cpu": cpu.summary(report.ok)}


def short_runs(servers: Sequence[tuple[str, Callable[[], Any]]],
               models: Sequence[str] = ("mlp", "encoder")) -> dict[str, Any]:
    """``servers``: (label, a context manager factory yielding the URL), the plain server
    last (its throughput sets the open-loop rate). Figures per label, model and load."""
    out: dict[str, Any] = {}
    closed = {}
    for label, serve in servers:
        with serve() as url:
            for model in models:
                for c in CLIENTS:
                    r = measure(url, model, concurrency=c)
                    out[f"{label}/{model}/c{c}"] = r
                    closed[(label, model, c)] = r["throughput_rps"]
                    print(f"  {label:10s} {model:8s} c={c:<3d} {r['throughput_rps']:9.1f} req/s  "
                          f"p50 {r['latency_p50_ms'] or 0:7.2f} ms  p99 {r['latency_p99_ms'] or 0:7.2f} ms",
                          flush=True)
                    if "cpu" in r:
                        print("    " + cpu_line(r["cpu"]), flush=True)
    plain = servers[-1][0]
    rates = {m: OPEN_SHARE * closed[(plain, m, CLIENTS[-1])] for m in models}
    for label, serve in servers:
        with serve() as url:
            for model in models:
                r = measure(url, model, rate=rates[model])
                out[f"{label}/{model}/open"] = r
                print(f"  {label:10s} {model:8s} open {rates[model]:7.1f}/s  "
                      f"p99 {r['latency_p99_ms'] or 0:7.2f} ms", flush=True)
    return out


def cpu_line(cpu: dict[str, Any]) -> str:
    parts = ", ".join(f"{k} {v:.0f}" for k, v in cpu["cpu_us_per_request"].items())
    return (f"CPU per request {cpu['total_cpu_us_per_request']:.0f} us ({parts}): bound "
            f"{cpu['cpu_bound_rps']:.0f} req/s on {cpu['cores']} cores, reached "
            f"{cpu['share_of_cpu_bound']:.0%}")


def ratios(out: dict[str, Any], ours: str, plain: str,
           models: Sequence[str] = ("mlp", "encoder")) -> dict[str, float]:
    got: dict[str, float] = {}
    for model in models:
        for c in CLIENTS:
            a, b = out[f"{ours}/{model}/c{c}"], out[f"{plain}/{model}/c{c}"]
            got[f"short_{model}_c{c}_throughput_vs_plain"] = a["throughput_rps"] / b["throughput_rps"]
            if c == 1:
                got[f"short_{model}_c1_p50_minus_plain_ms"] = (a["latency_p50_ms"] or 0) - (b["latency_p50_ms"] or 0)
        cpu = out[f"{ours}/{model}/c{CLIENTS[-1]}"].get("cpu")
        if cpu:
            got[f"short_{model}_c{CLIENTS[-1]}_share_of_cpu_bound"] = cpu["share_of_cpu_bound"]
        a, b = out[f"{ours}/{model}/open"], out[f"{plain}/{model}/open"]
        got[f"short_{model}_open20_p99_vs_plain"] = (a["latency_p99_ms"] or 0) / (b["latency_p99_ms"] or 1)
    return got
