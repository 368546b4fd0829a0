"""The ``tracing`` section of ``benchmarks.gpu_full``: what tracing costs where the
database writer and the span process have cores of their own.

``benchmarks.bench_tracing`` measures it on a 2-vCPU machine, where those processes
compete with serving for the same two cores. This section runs its measuring loop
(``bench_tracing.measure``) on the GPU machine: ``batchscope serve --model mlp --device
<device>`` recording to ``DIR/tracing.db`` and exporting spans to the OTLP receiver of
``bench_tracing`` (a child process that needs ``grpcio`` alone), 64 closed-loop clients,
the modes ``off``, ``timestamps``, ``otel``, ``otel_1_in_100`` and, when the time allows
four rounds with it, ``off_again`` (the A/A check), in alternating rounds of 3-s slices
for as many rounds as fit the section's time (at most ``MAX_ROUNDS``). The CPU dry run
makes one round of 1-s slices.

Its claims are the targets of the spec, each met when the whole paired 95 % interval is
(the p99 target on the paired ratio itself, its interval beside): Triton timestamps at
every request cost at most 3 % of the throughput and 5 % of the p99; OpenTelemetry at
every request at most 5 % of the throughput, at 1 in 100 at most 1 %; no span dropped,
and at least ``SPANS_PER_REQUEST`` spans received for each request traced in a span mode.
Each claim's detail carries the figures (ratios, intervals, req/s, p99, rounds, cores).

Where the OpenTelemetry SDK or its OTLP exporter does not import (the carried wheels
missing, or the image's protobuf too old for them), the server runs without the
exporter, the Triton modes alone are measured and the span claims are UNVERIFIED with
the import error.
"""

from __future__ import annotations

import subprocess
import sys
import time
from typing import Any

from benchmarks import bench_tracing as bt
from benchmarks.bench_serving import ROOT
from benchmarks.gpu.harness import Context
from benchmarks.gpu.served import Server

MODEL = "mlp"
CLIENTS = 64
#: the modes always run, and the A/A check run when ``MIN_ROUNDS`` rounds fit with it
MODES = ("off", "timestamps", "otel", "otel_1_in_100")
AA = "off_again"
#: on CUDA: each slice's length, the rounds wanted at least and at most
SLICE_S = 3.0
MIN_ROUNDS = 4
MAX_ROUNDS = 8
#: on CUDA: the load before the first slice (the batcher and the device warmed up)
WARM_S = 5.0
#: the wait after a slice (``bench_tracing.settle``) and the settings change, about
SETTLE_S = 1.6
#: kept for after the rounds: the server's stop (its spans flushed), the last spans
RESERVE_S = 25.0
#: the targets: paired throughput ratio's low end, p99 ratio's bound
TARGETS = {"timestamps": 0.97, "otel": 0.95, "otel_1_in_100": 0.99}
P99_TARGET = 1.05
#: what the server's span export needs, as ``SpanProcess`` imports it
_PROBE = ("from runtime.engine.otel import exporter_for; exporter_for('http://127.0.0.1:9'); "
          "import opentelemetry.sdk.trace.export")


def otel_missing() -> str | None:
    """Why the server cannot export spans here (the import error), None when it can."""
    done = subprocess.run([sys.executable, "-c", _PROBE], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    if done.returncode == 0:
        return None
    lines = done.stderr.strip().splitlines()
    return lines[-1] if lines else f"exit code {done.returncode}"


def plan(ctx: Context, span_modes: bool) -> tuple[list[str], int, float]:
    """The modes, the most rounds and the slice length for the time left."""
    modes = list(MODES) if span_modes else [m for m in MODES if m not in bt.SPAN_MODES]
    if ctx.small:
        return modes + [AA], 1, 1.0
    room = ctx.left() - RESERVE_S - WARM_S - SETTLE_S
    if room >= MIN_ROUNDS * (len(modes) + 1) * (SLICE_S + SETTLE_S):
        modes.append(AA)
    rounds = int(room // (len(modes) * (SLICE_S + SETTLE_S)))
    return modes, max(1, min(MAX_ROUNDS, rounds)), SLICE_S


def _interval(iv: Any) -> dict[str, float] | None:
    return None if iv is None else {k: round(v, 4) for k, v in iv._asdict().items()}


def _text(iv: dict[str, float] | None) -> str:
    return "-" if iv is None else f"{iv['ratio']:.3f} ({iv['low']:.3f}-{iv['high']:.3f})"


def figures(result: dict[str, Any]) -> dict[str, Any]:
    """``bench_tracing.measure``'s result, as the section's JSON keeps it."""
    modes = {}
    for mode, m in result["modes"].items():
        modes[mode] = {
            "rps": m["rps"], "p99_ms": m["p99_ms"], "rps_ratio": m["rps_ratio"],
            "p99_ratio": m["p99_ratio"], "paired_rps": _interval(m["paired_rps"]),
            "paired_p99": _interval(m["paired_p99"]), "rounds_rps": m["rounds_rps"],
            "rounds_p99_ms": m["rounds_p99_ms"], "mean_batch": m["mean_batch"],
            "cpu_us_per_request": m["cpu_us"], "cpu_us_total": m["cpu_us_total"],
            "serving_threads_us": m["threads_us"], "children_us": m.get("children_us", {}),
            "cores_used": m["cores_used"],
            "receiver_us_per_request": m["receiver_us"],
            "after_slice_us_per_request": m.get("after_us"),
            "requests": m["requests"], "errors": m["errors"], "traced": m["traced"],
            "spans": m["spans"]}
    keep = ("model", "clients", "slice_s", "rounds", "cores", "traced", "trace_rows",
            "spans_received", "spans_expected", "spans_dropped")
    return {**{k: result[k] for k in keep}, "modes": modes}


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _mode_text(got: dict[str, Any], mode: str) -> str:
    m, off = got["modes"][mode], got["modes"]["off"]
    return (f"{mode} / off: req/s {_text(m['paired_rps'])}, p99 {_text(m['paired_p99'])} "
            f"(paired, 95 %); {_fmt(m['rps'], ',.0f')} against {_fmt(off['rps'], ',.0f')} "
            f"req/s, p99 {_fmt(m['p99_ms'], '.2f')} against {_fmt(off['p99_ms'], '.2f')} ms; "
            f"errors {m['errors']}")


def claims(ctx: Context, got: dict[str, Any], missing: str | None) -> None:
    """The section's four claims from its figures (``figures``)."""
    rounds = f"{got['rounds']} round" + ("s" if got["rounds"] != 1 else "")
    run = (f"{rounds} of {got['slice_s']:g}-s slices, {got['clients']} clients on "
           f"{got['model']}, device {ctx.device}, {got['cores']} cores")
    if AA in got["modes"]:
        run += f"; A/A {AA} / off: req/s {_text(got['modes'][AA]['paired_rps'])}"

    def cost(claim_id: str, mode: str, p99: bool = False) -> None:
        if mode not in got["modes"]:
            ctx.claim(claim_id, None, f"not measured: the server cannot export spans here "
                                      f"({missing})")
            return
        m = got["modes"][mode]
        ok = m["paired_rps"] is not None and m["paired_rps"]["low"] >= TARGETS[mode]
        target = f"target: the req/s interval's low end >= {TARGETS[mode]}"
        if p99:
            ok = ok and m["paired_p99"] is not None and m["paired_p99"]["ratio"] <= P99_TARGET
            target += f", the p99 ratio <= {P99_TARGET}"
        ctx.claim(claim_id, ok, f"{_mode_text(got, mode)} ({target}); {run}")

    cost("tracing.timestamps_cost", "timestamps", p99=True)
    cost("tracing.otel_cost", "otel")
    cost("tracing.sampled_cost", "otel_1_in_100")
    if missing is not None:
        ctx.claim("tracing.no_drops", None, f"no spans exported: the server cannot export "
                                            f"them here ({missing})")
        return
    received, expected, dropped = got["spans_received"], got["spans_expected"], got["spans_dropped"]
    ctx.claim("tracing.no_drops", dropped == 0 and received > 0 and received >= expected,
              f"{dropped:,} spans dropped (the server's counter and its trace_export_drops "
              f"events); {received:,} received against at least {expected:,} "
              f"({bt.SPANS_PER_REQUEST} for each of the "
              f"{expected // bt.SPANS_PER_REQUEST:,} requests traced in the span modes); "
              f"{got['traced']:,} requests traced in all, {got['trace_rows']:,} request_traces "
              f"rows; {run}")


def tracing(ctx: Context) -> dict[str, Any]:
    """What tracing costs on this machine (module doc)."""
    db = ctx.out_dir / "tracing.db"
    for old in (db, db.with_name(db.name + "-wal"), db.with_name(db.name + "-shm")):
        old.unlink(missing_ok=True)  # a run before in the same folder: its rows and events
    missing = otel_missing()
    began = time.monotonic()
    with bt.Receiver() as receiver:
        args = ["--device", ctx.device, "--model", MODEL, "--db", f"sqlite:///{db}"]
        if missing is None:
            args += ["--otlp-traces-endpoint", receiver.endpoint]
        with Server(ctx, *args) as srv:
            started_s = time.monotonic() - began
            modes, rounds, slice_s = plan(ctx, missing is None)
            result = bt.measure(srv.url, db, MODEL, modes, rounds, slice_s, CLIENTS, receiver,
                                srv.proc.pid, until=ctx.deadline - RESERVE_S,
                                warm_s=1.0 if ctx.small else WARM_S,
                                say=lambda line: print(f"tracing: {line}", flush=True))
        bt.after_stop(result, receiver, db)
    got = figures(result)
    got.update(device=ctx.device, start_s=round(started_s, 1), otel_missing=missing)
    claims(ctx, got, missing)
    return got
