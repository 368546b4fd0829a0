"""What tracing costs: the same server, trace settings changed between slices.

Starts ``batchscope serve --model mlp --otlp-traces-endpoint ...`` with an OTLP gRPC
receiver in a child process of its own (it counts the spans it gets), then drives
``mlp`` with ``--clients`` closed-loop clients in slices of ``--slice-s`` seconds,
changing the trace settings through ``POST /v2/trace/setting`` between slices, the
modes in turn, ``--rounds`` times:

* ``off``: ``trace_level`` OFF (the default; the tracing code is there, idle);
* ``timestamps``: every request traced (``trace_rate`` 1), its Triton timestamps a
  ``request_traces`` row (``trace_mode`` triton, no file);
* ``otel``: every request traced and sent as spans (``trace_mode`` opentelemetry);
* ``otel_1_in_100``: 1 request in 100 sent as spans;
* ``timestamps_1_in_100``: 1 request in 100 traced, rows only (not run unless named in
  ``--modes``: it tells the span process's share of ``otel_1_in_100`` from the rest);
* ``sampling_only``: tracing on at a rate no request reaches after the first, so every
  request is counted by the sampler and none traced (named in ``--modes`` only);
* ``off_again``: tracing off under other settings, an A/A check: how far a mode that
  costs nothing reads from ``off`` in this run (named in ``--modes`` only).

After each slice it waits until the receiver has had no span and the database no new row
for a second, so a slice does not pay for the spans and rows the one before it left. Prints each mode's median
throughput and p99 and their ratios to ``off`` measured in the same run, the spans received against those the server says it traced, and the
spans it reported dropped (``trace_export_drops`` events), and each mode's CPU time per
request in the serving process, its child processes (device process, database writer,
span process) and the load generator (``benchmarks.cpu_share``), so a cost can be told
from noise and placed. Each mode's ratio is also given paired round by round with its
bootstrap 95 % interval (``benchmarks.intervals``): a target is met when the whole
interval is.

    python -m benchmarks.bench_tracing                      # 4 rounds of 10-s slices
    python -m benchmarks.bench_tracing --rounds 2 --slice-s 5
    python -m benchmarks.bench_tracing --modes otel_1_in_100 --rounds 10   # one mode against off
    python -m benchmarks.bench_tracing --encode     # building and encoding spans alone
    python -m benchmarks.bench_tracing --side-by-side otel_1_in_100 --rounds 10 --slice-s 4
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx
from sqlalchemy import create_engine, text

from batchscope.load.loadgen import run_load
from benchmarks.cpu_share import CpuShare
from benchmarks.intervals import paired_ratio
from benchmarks.reliability.server import Server

MODES = {
    "off": {"trace_level": ["OFF"]},
    "timestamps": {"trace_level": ["TIMESTAMPS"], "trace_rate": "1", "trace_mode": "triton"},
    "otel": {"trace_level": ["TIMESTAMPS"], "trace_rate": "1", "trace_mode": "opentelemetry"},
    "timestamps_1_in_100": {"trace_level": ["TIMESTAMPS"], "trace_rate": "100",
                            "trace_mode": "triton"},
    "otel_1_in_100": {"trace_level": ["TIMESTAMPS"], "trace_rate": "100",
                      "trace_mode": "opentelemetry"},
    "sampling_only": {"trace_level": ["TIMESTAMPS"], "trace_rate": "100000000",
                      "trace_mode": "triton"},
    "off_again": {"trace_level": ["OFF"], "trace_rate": "999"},
}
#: the modes run when ``--modes`` is not given
DEFAULT_MODES = ("off", "timestamps", "otel", "otel_1_in_100")


def _receiver(conn, count) -> None:
    """An OTLP gRPC trace receiver that counts spans (child process)."""
    from concurrent import futures

    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    class Counting(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):  # noqa: N802
            n = sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
            with count.get_lock():
                count.value += n
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Counting(), server)
    conn.send(server.add_insecure_port("127.0.0.1:0"))
    server.start()
    server.wait_for_termination()


def _cpu_s(pid: int) -> float:
    """CPU seconds (user and system) a process has used so far."""
    import psutil

    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def mean_batch_size(db: Path, began: float, ended: float) -> float:
    """The mean size of the batches that started between two wall-clock times."""
    eng = create_engine(f"sqlite:///{db}")
    try:
        with eng.connect() as conn:
            got = conn.execute(text("SELECT AVG(batch_size) FROM batches WHERE started_at "
                                    "BETWEEN :a AND :b"), {"a": began, "b": ended}).scalar()
    finally:
        eng.dispose()
    return float(got or 0.0)


def settle(count, db: Path, quiet_s: float = 1.0, limit_s: float = 60.0) -> None:
    """Wait until neither the receiver has had a span nor the database a row for
    ``quiet_s``: the exporter and the database writer have done what the slice left them,
    so the next slice does not pay for this one's spans and rows."""
    eng = create_engine(f"sqlite:///{db}")

    def rows() -> int:
        with eng.connect() as conn:
            return conn.execute(text("SELECT (SELECT COUNT(*) FROM requests) + "
                                     "(SELECT COUNT(*) FROM request_traces)")).scalar()

    deadline = time.monotonic() + limit_s
    last, since = (count.value, rows()), time.monotonic()
    try:
        while time.monotonic() < deadline:
            time.sleep(0.2)
            now = (count.value, rows())
            if now != last:
                last, since = now, time.monotonic()
            elif time.monotonic() - since >= quiet_s:
                return
    finally:
        eng.dispose()


def encode_costs(requests: int = 3000, repeats: int = 5) -> dict[str, float]:
    """Microseconds of CPU per span to build the spans of ``requests`` traced requests
    (in batches of 30) and to encode them for OTLP, with the SDK's ``encode_spans`` and
    with ``runtime.engine.otlp_wire`` (best of ``repeats``); raises if the two differ."""
    import random

    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
    from opentelemetry.sdk.resources import Resource

    from runtime.engine.otel import BatchInfo, FinishedTrace, SpanBuilder
    from runtime.engine.otlp_wire import encode_request

    now = time.time()
    batches = [BatchInfo(seq, "mlp", now + 0.005, now + 0.009, 30, 32, 30, 30, None, "dynamic", 1,
                         "ok") for seq in range(requests // 30 + 1)]  # one per batch, as kept
    traces = [(FinishedTrace("mlp", "infer", random.getrandbits(128), random.getrandbits(64), None,
                             now, now + 0.01, now + 0.001, now + 0.005, now + 0.009, "ok", i // 30),
               batches[i // 30]) for i in range(requests)]
    best = {"build": float("inf"), "sdk": float("inf"), "wire": float("inf"),
            "at_once": float("inf")}
    resource = Resource.create({"service.name": "batchscope"})
    for _ in range(repeats):
        builder = SpanBuilder(resource, "bench")
        random.seed(1)
        t0 = time.perf_counter()
        spans = [s for t, b in traces for s in builder.spans(t, b)]
        t1 = time.perf_counter()
        sdk = encode_spans(spans).SerializeToString()
        t2 = time.perf_counter()
        wire = encode_request(spans)
        t3 = time.perf_counter()
        if ExportTraceServiceRequest.FromString(wire) != ExportTraceServiceRequest.FromString(sdk):
            raise AssertionError("otlp_wire and the SDK encoded the same spans differently")
        # what the span process does: each span written as its message as it is built
        at_once = SpanBuilder(resource, "bench", wire=True)
        random.seed(1)
        t4 = time.perf_counter()
        written = encode_request([s for t, b in traces for s in at_once.spans(t, b)])
        t5 = time.perf_counter()
        if written != wire:
            raise AssertionError("spans written at once differ from the SDK's spans encoded")
        n = len(spans)
        for key, seconds in (("build", t1 - t0), ("sdk", t2 - t1), ("wire", t3 - t2),
                             ("at_once", t5 - t4)):
            best[key] = min(best[key], seconds / n * 1e6)
    return {**best, "spans": float(n)}


def side_by_side(mode: str, rounds: int, slice_s: float, clients: int, model: str,
                 port: int, count: Any) -> dict[str, Any]:
    """Two servers at once, one with ``mode``, the other with tracing off, each load
    window on one then the other (the order turning each round): no settings change
    between windows, so no window pays for a switch. The median of the rounds' ratios,
    and each server's CPU per request over its windows."""
    servers = []
    try:
        for _ in range(2):
            db = Path(tempfile.mkdtemp()) / "side.db"
            servers.append(Server([sys.executable, "-m", "runtime", "serve", "--model", model,
                                   "--port", "0", "--db", f"sqlite:///{db}",
                                   "--otlp-traces-endpoint", f"http://127.0.0.1:{port}"]))
        off, on = servers
        for srv, settings in ((off, MODES["off"]), (on, MODES[mode])):
            assert httpx.post(f"{srv.url}/v2/trace/setting", json=settings,
                              timeout=30).status_code == 200
            run_load(srv.url, model, concurrency=clients, duration_s=2.0)  # warm
        got: dict[str, list] = {"off": [], mode: []}
        cpu: dict[str, list] = {"off": [], mode: []}
        for r in range(rounds):
            order = [("off", off), (mode, on)] if r % 2 == 0 else [(mode, on), ("off", off)]
            for name, srv in order:
                with CpuShare(srv.proc.pid) as share:
                    rep = run_load(srv.url, model, concurrency=clients, duration_s=slice_s)
                got[name].append(rep.throughput_rps)
                cpu[name].append(share.summary(rep.ok))
            print(f"round {r + 1}: off {got['off'][-1]:8.0f}  {mode} {got[mode][-1]:8.0f} req/s",
                  flush=True)
    finally:
        for srv in servers:
            srv.stop()
    ratio = statistics.median(b / a for a, b in zip(got["off"], got[mode]))
    paired = paired_ratio(got["off"], got[mode])
    per = {name: statistics.median(c["total_cpu_us_per_request"] for c in cpu[name])
           for name in cpu}
    print(f"\n{model}, {clients} clients, two servers side by side, {rounds} rounds of "
          f"{slice_s:g} s each: {mode} / off {ratio:.3f}, paired {paired.text()} (medians {statistics.median(got['off']):.0f}"
          f" and {statistics.median(got[mode]):.0f} req/s); CPU per request (server, its "
          f"children, load generator): off {per['off']:.1f} us, {mode} {per[mode]:.1f} us; "
          f"spans received {count.value:,}")
    return {"ratio": ratio, "paired": paired, "rps": got, "cpu": per}


def _paired(results: dict[str, list], mode: str, figure: str) -> str:
    """``mode`` against ``off`` round by round (``benchmarks.intervals.paired_ratio``)."""
    try:
        return paired_ratio([getattr(r, figure) or 0.0 for r in results["off"]],
                            [getattr(r, figure) or 0.0 for r in results[mode]]).text()
    except ValueError:  # no round with both figures (no request answered): nothing to say
        return "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--side-by-side", metavar="MODE", choices=[m for m in MODES if m != "off"],
                    help="two servers at once, MODE against off, instead of one server whose "
                         "settings change between windows")
    ap.add_argument("--encode", action="store_true",
                    help="only the cost per span of building and encoding spans (no server)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--slice-s", type=float, default=10.0)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--model", default="mlp")
    ap.add_argument("--modes", default=",".join(DEFAULT_MODES),
                    help="the modes to alternate, comma-separated (off always included)")
    args = ap.parse_args()
    if args.encode:
        got = encode_costs()
        print(f"{got['spans']:.0f} spans (3,000 traced requests, batches of 30), us per span: "
              f"build {got['build']:.2f}; encode: SDK encode_spans {got['sdk']:.2f}, "
              f"otlp_wire {got['wire']:.2f} ({got['sdk'] / got['wire']:.1f}x less), "
              "the same bytes' message; built and encoded in one (the span process's "
              f"WireSpans, the same bytes) {got['at_once']:.2f} against "
              f"{got['build'] + got['wire']:.2f} in two steps")
        return
    unknown = [m for m in args.modes.split(",") if m not in MODES]
    if unknown:
        ap.error(f"unknown mode(s) {unknown}; the modes: {', '.join(MODES)}")
    modes = ["off"] + [m for m in args.modes.split(",") if m != "off"]
    ctx = mp.get_context("spawn")
    count = ctx.Value("q", 0)
    parent, child = ctx.Pipe()
    receiver = ctx.Process(target=_receiver, args=(child, count), daemon=True)
    receiver.start()
    port = parent.recv()
    if args.side_by_side:
        side_by_side(args.side_by_side, args.rounds, args.slice_s, args.clients, args.model,
                     port, count)
        return
    db = Path(tempfile.mkdtemp()) / "tracing.db"
    server = Server([sys.executable, "-m", "runtime", "serve", "--model", args.model,
                     "--port", "0", "--db", f"sqlite:///{db}",
                     "--otlp-traces-endpoint", f"http://127.0.0.1:{port}"])
    results: dict[str, list] = {m: [] for m in modes}
    cpus: dict[str, list] = {m: [] for m in modes}
    sizes: dict[str, list] = {m: [] for m in modes}
    receiving: dict[str, list] = {m: [] for m in modes}
    try:
        with httpx.Client(base_url=server.url, timeout=30) as http:
            run_load(server.url, args.model, concurrency=args.clients, duration_s=2.0)  # warm
            for r in range(args.rounds):
                order = list(modes) if r % 2 == 0 else list(reversed(modes))
                for mode in order:
                    assert http.post("/v2/trace/setting", json=MODES[mode]).status_code == 200
                    began = time.time()
                    before = _cpu_s(receiver.pid)
                    with CpuShare(server.proc.pid) as cpu:
                        rep = run_load(server.url, args.model, concurrency=args.clients,
                                       duration_s=args.slice_s)
                    ended = time.time()
                    results[mode].append(rep)
                    cpus[mode].append(cpu.summary(rep.ok))
                    receiving[mode].append((_cpu_s(receiver.pid) - before) / max(rep.ok, 1) * 1e6)
                    settle(count, db)
                    sizes[mode].append(mean_batch_size(db, began, ended))
                    print(f"round {r + 1} {mode:14s} {rep.throughput_rps:8.0f} req/s  p99 "
                          f"{rep.latency_p99_ms:6.2f} ms", flush=True)
            http.post("/v2/trace/setting", json=MODES["off"])
            metrics = http.get("/metrics").text
    finally:
        server.stop()
    traced = sum(float(line.split()[-1]) for line in metrics.splitlines()
                 if line.startswith("batchscope_traced_requests_total{"))
    time.sleep(1.0)
    eng = create_engine(f"sqlite:///{db}")
    with eng.connect() as conn:
        drops = conn.execute(text("SELECT details_json FROM events WHERE kind = "
                                  "'trace_export_drops'")).scalars().all()
        rows = conn.execute(text("SELECT COUNT(*) FROM request_traces")).scalar()
    receiver.terminate()
    dropped = max([json.loads(d)["total"] for d in drops], default=0)
    base_rps = statistics.median(r.throughput_rps for r in results["off"])
    base_p99 = statistics.median(r.latency_p99_ms for r in results["off"])
    print(f"\n{args.model}, {args.clients} clients, {args.rounds} rounds of {args.slice_s:g} s "
          "per mode (medians; ratios to 'off' in this run)")
    print(f"{'mode':16s}{'req/s':>9s}{'ratio':>8s}{'p99 ms':>9s}{'ratio':>8s}{'mean batch':>12s}"
          f"{'paired req/s ratio (95 %)':>28s}{'paired p99 ratio (95 %)':>26s}")
    for mode, reps in results.items():
        rps = statistics.median(r.throughput_rps for r in reps)
        p99 = statistics.median(r.latency_p99_ms for r in reps)
        paired = ""
        if mode != "off":
            paired = (f"{_paired(results, mode, 'throughput_rps'):>28s}"
                      f"{_paired(results, mode, 'latency_p99_ms'):>26s}")
        print(f"{mode:16s}{rps:9.0f}{rps / base_rps:8.3f}{p99:9.2f}{p99 / base_p99:8.3f}"
              f"{statistics.median(sizes[mode]):12.1f}{paired}")
    print("(paired: the geometric mean over the rounds of each round's mode / off, and its "
          "bootstrap 95 % interval: a target is met when the whole interval is)")
    print("\nCPU per request (medians, microseconds): where each mode's cost goes")
    parts = list(cpus["off"][0]["cpu_us_per_request"])
    print(f"{'mode':16s}" + "".join(f"{p:>22s}" for p in parts) + f"{'in all':>9s}"
          f"{'share of bound':>16s}{'OTLP receiver':>15s}")
    for mode, got in cpus.items():
        per = [statistics.median(g["cpu_us_per_request"][p] for g in got) for p in parts]
        total = statistics.median(g["total_cpu_us_per_request"] for g in got)
        share = statistics.median(g["share_of_cpu_bound"] for g in got)
        print(f"{mode:16s}" + "".join(f"{v:22.1f}" for v in per) + f"{total:9.1f}{share:16.0%}"
              f"{statistics.median(receiving[mode]):15.1f}")
    print("(the OTLP receiver shares the machine's cores but is not in 'in all' nor in the "
          "bound: a collector runs elsewhere in a deployment)")
    print(f"traced requests {traced:,.0f} (request_traces rows {rows:,}), spans received "
          f"{count.value:,}, spans dropped (reported) {dropped:,}")


if __name__ == "__main__":
    main()
