"""The short benchmark a user runs first, as the common peer benchmarks run it.

For ``mlp`` and ``encoder`` (lengths 8..128), the BatchScope server with its defaults and
the plain one-forward-per-request server, each measured the same way in the same run:
2 s of warm-up, then a 10-s window, at 1, 8 and 64 closed-loop clients; then the p99
latency at an open-loop rate of 20 % of the plain server's 64-client throughput (so both
keep up). ``bench_serving --only short`` runs it and prints each figure as BatchScope /
the plain server.

This machine's speed drifts by more than the differences measured, so each figure is
taken on every server back to back (the order turning each round), and the run is
repeated ``rounds`` times, every server started afresh each round (a short benchmark
meets a server that has learned nothing yet). Each round also measures the model alone
(``offline``: the encoder in length-sorted batches of 32) right after its 64-client
windows. ``ratios`` gives the median over the rounds of each round's ratio.
"""

from __future__ import annotations

import contextlib
import statistics
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
               models: Sequence[str] = ("mlp", "encoder"), rounds: int = 3,
               offline: Callable[[str], float | None] | None = None) -> dict[str, Any]:
    """``servers``: (label, a context manager factory yielding the URL), the plain server
    last (its throughput sets the open-loop rate); ``offline(model)``: the model's own
    throughput to compare the 64-client figure with (None: none). Figures per round,
    label, model and load: ``{"rounds": [{"LABEL/MODEL/c64": {...}, ...}, ...]}``."""
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    out: dict[str, Any] = {"rounds": []}
    plain = servers[-1][0]
    for r in range(rounds):
        order = list(servers) if r % 2 == 0 else list(reversed(servers))
        got: dict[str, Any] = {}
        print(f"  round {r + 1} of {rounds}", flush=True)
        with contextlib.ExitStack() as stack:
            urls = {label: stack.enter_context(serve()) for label, serve in servers}
            for model in models:
                for c in CLIENTS:
                    for label, _ in order:
                        res = measure(urls[label], model, concurrency=c)
                        got[f"{label}/{model}/c{c}"] = res
                        print(f"  {label:10s} {model:8s} c={c:<3d} {res['throughput_rps']:9.1f} req/s  "
                              f"p50 {res['latency_p50_ms'] or 0:7.2f} ms  p99 "
                              f"{res['latency_p99_ms'] or 0:7.2f} ms", flush=True)
                        if "cpu" in res:
                            print("    " + cpu_line(res["cpu"]), flush=True)
                ceiling = offline(model) if offline is not None else None
                if ceiling:
                    got[f"offline/{model}"] = ceiling
                    print(f"  {'offline':10s} {model:8s} {ceiling:9.1f} items/s (the model alone)",
                          flush=True)
            for model in models:
                rate = OPEN_SHARE * got[f"{plain}/{model}/c{CLIENTS[-1]}"]["throughput_rps"]
                for label, _ in order:
                    res = measure(urls[label], model, rate=rate)
                    got[f"{label}/{model}/open"] = res
                    print(f"  {label:10s} {model:8s} open {rate:7.1f}/s  "
                          f"p99 {res['latency_p99_ms'] or 0:7.2f} ms", flush=True)
        out["rounds"].append(got)
    return out


def cpu_line(cpu: dict[str, Any]) -> str:
    parts = ", ".join(f"{k} {v:.0f}" for k, v in cpu["cpu_us_per_request"].items())
    return (f"CPU per request {cpu['total_cpu_us_per_request']:.0f} us ({parts}): bound "
            f"{cpu['cpu_bound_rps']:.0f} req/s on {cpu['cores']} cores, reached "
            f"{cpu['share_of_cpu_bound']:.0%}")


def ratios(out: dict[str, Any], ours: str, plain: str,
           models: Sequence[str] = ("mlp", "encoder")) -> dict[str, float]:
    """The median over the rounds of each round's ratios (``round_ratios``)."""
    per_round = [round_ratios(got, ours, plain, models) for got in out["rounds"]]
    keys = dict.fromkeys(key for r in per_round for key in r)  # in order, each once
    return {key: statistics.median(r[key] for r in per_round if key in r) for key in keys}


def round_ratios(got: dict[str, Any], ours: str, plain: str,
                 models: Sequence[str] = ("mlp", "encoder")) -> dict[str, float]:
    """One round's figures as ours / the plain server (and / the model alone)."""
    ratio: dict[str, float] = {}
    for model in models:
        for c in CLIENTS:
            a, b = got[f"{ours}/{model}/c{c}"], got[f"{plain}/{model}/c{c}"]
            ratio[f"short_{model}_c{c}_throughput_vs_plain"] = a["throughput_rps"] / b["throughput_rps"]
            if c == 1:
                ratio[f"short_{model}_c1_p50_minus_plain_ms"] = (a["latency_p50_ms"] or 0) - (b["latency_p50_ms"] or 0)
        top = got[f"{ours}/{model}/c{CLIENTS[-1]}"]
        cpu = top.get("cpu")
        if cpu:
            ratio[f"short_{model}_c{CLIENTS[-1]}_share_of_cpu_bound"] = cpu["share_of_cpu_bound"]
        ceiling = got.get(f"offline/{model}")
        if ceiling:
            ratio[f"short_{model}_c{CLIENTS[-1]}_vs_offline"] = top["throughput_rps"] / ceiling
        a, b = got[f"{ours}/{model}/open"], got[f"{plain}/{model}/open"]
        ratio[f"short_{model}_open20_p99_vs_plain"] = (a["latency_p99_ms"] or 0) / (b["latency_p99_ms"] or 1)
    return ratio
