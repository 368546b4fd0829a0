"""What tracing costs: the same server, trace settings changed between slices.

Starts ``batchscope serve --model mlp --otlp-traces-endpoint ...`` with an OTLP gRPC
receiver in a child process of its own (it counts the spans it gets; it runs in the idle
CPU class, taking only the CPU time the server leaves as a collector on another machine
would, unless ``--receiver-normal``), then drives ``mlp`` with ``--clients`` closed-loop
clients in slices of ``--slice-s`` seconds, changing the trace settings through ``POST
/v2/trace/setting`` between slices, the modes in turn, ``--rounds`` times:

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
for a second, so a slice does not pay for the spans and rows the one before it left.
Prints each mode's median throughput and p99 and their ratios to ``off`` measured in the
same run, the spans received against the requests the server says it traced, the spans it
reported dropped (its counter and its ``trace_export_drops`` events), and each mode's CPU
time per request in the serving process, its child processes (device process, database
writer, span process) and the load generator (``benchmarks.cpu_share``), and the serving
process's by thread, so a cost can be told from noise and placed. Each mode's ratio is
also given paired round by round with its bootstrap 95 % interval
(``benchmarks.intervals``): a target is met when the whole interval is.

``measure`` is the measuring loop, given a running server and a ``Receiver``; the GPU
script's ``tracing`` section (``benchmarks/gpu/tracing_cost.py``) calls it too. The
receiver is a gRPC generic handler that counts the spans of each request by walking its
protobuf bytes (``span_count``), so it needs ``grpcio`` alone, not ``opentelemetry-proto``.

    python -m benchmarks.bench_tracing                      # 4 rounds of 10-s slices
    python -m benchmarks.bench_tracing --rounds 2 --slice-s 5
    python -m benchmarks.bench_tracing --modes otel_1_in_100 --rounds 10   # one mode against off
    python -m benchmarks.bench_tracing --encode     # building and encoding spans alone
    python -m benchmarks.bench_tracing --side-by-side otel_1_in_100 --rounds 10 --slice-s 4
"""

from __future__ import annotations

import argparse
import json
import os
import select
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

#: the repository root (the receiver's process imports this module from it)
ROOT = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))

from sqlalchemy import create_engine, text

from batchscope.load.loadgen import run_load
from benchmarks.cpu_share import CpuShare
from benchmarks.intervals import Interval, paired_ratio
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
#: the serving process's threads shown in the CPU split: those with at least this many
#: microseconds a request in some mode
THREAD_SHOWN_US = 0.01
#: the modes run when ``--modes`` is not given
DEFAULT_MODES = ("off", "timestamps", "otel", "otel_1_in_100")


#: the gRPC service an OTLP trace exporter calls (its method ``Export``)
TRACE_SERVICE = "opentelemetry.proto.collector.trace.v1.TraceService"
#: the spans each traced ``mlp`` request makes at least: the request's, ``queue`` and
#: ``compute`` (a batch's own span comes on top, once per batch with a traced member)
SPANS_PER_REQUEST = 3
#: the modes whose traced requests are sent as spans
SPAN_MODES = frozenset(m for m, s in MODES.items() if s.get("trace_mode") == "opentelemetry")
#: the server's counters of traced requests and of spans it dropped
TRACED = "batchscope_traced_requests_total"
DROPPED = "batchscope_trace_spans_dropped_total"


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    """The varint at ``buf[i]`` and the index after it."""
    value = shift = 0
    while True:
        byte = buf[i]
        i += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, i
        shift += 7


def _fields(buf: bytes, start: int, end: int) -> Iterator[tuple[int, int, int]]:
    """(field number, start, end) of each length-delimited field of the protobuf message
    in ``buf[start:end]``; fields of the other wire types are stepped over."""
    i = start
    while i < end:
        key, i = _varint(buf, i)
        wire = key & 7
        if wire == 2:
            size, i = _varint(buf, i)
            yield key >> 3, i, i + size
            i += size
        elif wire == 0:
            _, i = _varint(buf, i)
        elif wire == 1:
            i += 8
        elif wire == 5:
            i += 4
        else:
            raise ValueError(f"protobuf wire type {wire} at byte {i}: not an OTLP request")
    if i != end:
        raise ValueError("a protobuf field runs past its message: the request is truncated")


def span_count(request: bytes) -> int:
    """The spans in an encoded ``ExportTraceServiceRequest``, counted without parsing it
    into messages (so without ``opentelemetry-proto``): its ``resource_spans`` (field 1),
    their ``scope_spans`` (field 2), their ``spans`` (field 2)."""
    n = 0
    for resource, a, z in _fields(request, 0, len(request)):
        if resource == 1:
            for scope, b, y in _fields(request, a, z):
                if scope == 2:
                    n += sum(1 for field, _, _ in _fields(request, b, y) if field == 2)
    return n


def _same(data: bytes) -> bytes:
    return data


def receive_main(idle: bool = False) -> None:
    """The receiver's process (``Receiver``): a gRPC server whose ``TraceService.Export``
    counts the request's spans and answers an empty ``ExportTraceServiceResponse``. It
    prints its port (or ``error ...``), then its span count for each line it reads, and
    stops when its input closes. ``idle``: first lower its CPU priority
    (``batchscope.spawn.lower_priority``: ``SCHED_IDLE`` where Linux has it)."""
    import threading
    from concurrent import futures

    import grpc

    if idle:
        from batchscope.spawn import lower_priority

        lower_priority(True, 19)

    lock = threading.Lock()
    count = [0]

    def export(request: bytes, context: Any) -> bytes:
        n = span_count(request)
        with lock:
            count[0] += n
        return b""

    try:
        handler = grpc.method_handlers_generic_handler(TRACE_SERVICE, {
            "Export": grpc.unary_unary_rpc_method_handler(
                export, request_deserializer=_same, response_serializer=_same)})
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), handlers=[handler])
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
    except Exception as exc:  # noqa: BLE001 - told to the parent, which raises it
        print(f"error {type(exc).__name__}: {exc}", flush=True)
        return
    print(port, flush=True)
    for _ in sys.stdin:
        with lock:
            n = count[0]
        print(n, flush=True)
    server.stop(0)


class Receiver:
    """An OTLP gRPC trace receiver in a process of its own (``receive_main``) that counts
    the spans it gets (``spans``); it needs ``grpcio`` alone. ``port`` on 127.0.0.1.

    ``idle`` (the default): the receiver runs in the idle CPU class (``SCHED_IDLE``, else
    ``nice`` 19), so it takes only CPU time the server leaves, as a collector on a machine
    of its own would; its CPU is still measured. False: at normal priority, competing with
    the server for the cores as a collector on the same machine does.

    A plain child interpreter, not a ``multiprocessing`` one: a spawned child re-runs the
    parent's ``__main__``, which in a test process may be a script that is gone."""

    def __init__(self, start_s: float = 60.0, idle: bool = True) -> None:
        self.idle = idle
        self._proc = subprocess.Popen(
            [sys.executable, "-c", "from benchmarks.bench_tracing import receive_main; "
                                   f"receive_main(idle={idle!r})"],
            cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        ready = select.select([self._proc.stdout], [], [], start_s)[0]
        got = self._proc.stdout.readline().strip() if ready else f"no answer in {start_s:g} s"
        if not got.isdigit():
            self.close()
            raise RuntimeError(f"the OTLP receiver did not start: {got or 'its process ended'}")
        self.port = int(got)
        self.endpoint = f"http://127.0.0.1:{got}"
        self.pid: int = self._proc.pid

    @property
    def spans(self) -> int:
        """The spans received so far (asked of the receiver's process)."""
        self._proc.stdin.write("\n")
        self._proc.stdin.flush()
        line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError("the OTLP receiver's process ended")
        return int(line)

    def close(self) -> None:
        if self._proc.stdin is not None and not self._proc.stdin.closed:
            try:
                self._proc.stdin.close()  # it stops when its input closes
            except OSError:
                pass
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(10)
        if self._proc.stdout is not None:
            self._proc.stdout.close()

    def __enter__(self) -> "Receiver":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


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


def settle(receiver: Receiver, db: Path, quiet_s: float = 1.0, limit_s: float = 60.0) -> None:
    """Wait until neither the receiver has had a span nor the database a row for
    ``quiet_s``: the exporter and the database writer have done what the slice left them,
    so the next slice does not pay for this one's spans and rows."""
    eng = create_engine(f"sqlite:///{db}")

    def rows() -> int:
        with eng.connect() as conn:
            return conn.execute(text("SELECT (SELECT COUNT(*) FROM requests) + "
                                     "(SELECT COUNT(*) FROM request_traces)")).scalar()

    deadline = time.monotonic() + limit_s
    last, since = (receiver.spans, rows()), time.monotonic()
    try:
        while time.monotonic() < deadline:
            time.sleep(0.2)
            now = (receiver.spans, rows())
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

    from runtime.engine.otel_spans import BatchInfo, FinishedTrace, SpanBuilder
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
        builder = SpanBuilder(resource, "bench", ids=random.Random(1))
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
        at_once = SpanBuilder(resource, "bench", wire=True, ids=random.Random(1))
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
                 receiver: Receiver) -> dict[str, Any]:
    """Two servers at once, one with ``mode``, the other with tracing off, each load
    window on one then the other (the order turning each round; ``bench_builds.drive``):
    no settings change between windows, so no window pays for a switch. The median of the
    rounds' ratios, and each server's CPU per request over its windows."""
    from benchmarks.bench_builds import drive, paired  # it imports this module

    windows = drive({"off": (ROOT, "off"), mode: (ROOT, mode)}, rounds, slice_s, clients,
                    model, say=lambda line: print(line, flush=True), receiver=receiver)
    got = {name: [w["rps"] for w in ws] for name, ws in windows.items()}
    ratio = statistics.median(b / a for a, b in zip(got["off"], got[mode]))
    interval = paired(windows)["rps"]
    per = {name: statistics.median(sum(w["cpu_us"].values()) for w in ws)
           for name, ws in windows.items()}
    print(f"\n{model}, {clients} clients, two servers side by side, {rounds} rounds of "
          f"{slice_s:g} s each: {mode} / off {ratio:.3f}, paired {interval.text()} (medians "
          f"{statistics.median(got['off']):.0f} and {statistics.median(got[mode]):.0f} "
          f"req/s); CPU per request (server, its children, load generator): off "
          f"{per['off']:.1f} us, {mode} {per[mode]:.1f} us; spans received {receiver.spans:,}")
    return {"ratio": ratio, "paired": interval, "rps": got, "cpu": per}


def _say(line: str) -> None:
    print(line, flush=True)


def _median(values: Iterable[float | None]) -> float | None:
    got = [v for v in values if v is not None]
    return statistics.median(got) if got else None


def _ratio(base: float | None, other: float | None) -> float | None:
    return other / base if base and other is not None else None


def _paired(base: list, other: list, figure: str) -> Interval | None:
    """``other`` against ``base`` round by round (``benchmarks.intervals.paired_ratio``);
    None when no round has both figures (no request answered)."""
    try:
        return paired_ratio([getattr(r, figure) or 0.0 for r in base],
                            [getattr(r, figure) or 0.0 for r in other])
    except ValueError:
        return None


def _metrics(http: Any, *names: str) -> list[float]:
    """Each named Prometheus series at ``/metrics``, summed over its labels."""
    sums = dict.fromkeys(names, 0.0)
    for line in http.get("/metrics").text.splitlines():
        name = line.partition("{")[0].partition(" ")[0]
        if name in sums:
            sums[name] += float(line.split()[-1])
    return [sums[name] for name in names]


def _traces_in(db: Path) -> tuple[int, int]:
    """``request_traces`` rows in the database, and the spans dropped so far as its last
    ``trace_export_drops`` event says."""
    eng = create_engine(f"sqlite:///{db}")
    try:
        with eng.connect() as conn:
            rows = conn.execute(text("SELECT COUNT(*) FROM request_traces")).scalar()
            drops = conn.execute(text("SELECT details_json FROM events WHERE kind = "
                                      "'trace_export_drops'")).scalars().all()
    finally:
        eng.dispose()
    return int(rows or 0), max([json.loads(d)["total"] for d in drops], default=0)


def measure(url: str, db: Path, model: str, modes: Sequence[str], rounds: int, slice_s: float,
            clients: int, receiver: Receiver, server_pid: int, *, until: float | None = None,
            warm_s: float = 2.0, say: Callable[[str], Any] = _say) -> dict[str, Any]:
    """What each trace mode costs a server already running at ``url`` (process
    ``server_pid``, started with ``--db sqlite:///DB`` and ``--otlp-traces-endpoint``
    ``receiver.endpoint``): ``clients`` closed-loop clients on ``model`` in slices of
    ``slice_s`` seconds, the ``modes`` in turn (``off`` first, added when missing; the
    order reversed every other round) ``rounds`` times, ``settle`` after each slice, a
    line a slice to ``say``. With ``until`` (a ``time.monotonic()`` time) no round begins
    that the round before says would end past it; the first always runs.

    Returns the ``rounds`` run, the machine's ``cores`` and by mode (``modes``): the
    median req/s and p99 and their ratios to ``off``'s; the ratios paired round by round
    with their 95 % intervals (``paired_rps``, ``paired_p99``: an ``Interval``, None for
    ``off`` or without figures); each round's figures; the mean batch size; CPU
    microseconds a request by part (``benchmarks.cpu_share``), in all and as a share of
    the machine's bound, and the cores each part kept busy; the OTLP receiver's CPU
    microseconds a request; requests answered, errors, requests traced, spans received.
    In all: requests traced, ``request_traces`` rows, spans received against
    ``spans_expected`` (``SPANS_PER_REQUEST`` for each request traced in a mode of
    ``SPAN_MODES``) and spans dropped (the server's counter, its events). The warm-up
    before the first slice runs with tracing off and counts in none of them. A mode's
    spans are those received during its slices and the waits after them; the span
    process's exporter sends a batch every few seconds when few spans come, so some
    arrive in the next slice. Once the server has stopped, ``after_stop`` adds the
    spans and rows it sent while stopping."""
    # imported here, not with the module: httpx loads the optional packages of its command
    # line (click, rich) where they are installed, and the GPU script imports this module
    import httpx

    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, not {rounds}")
    modes = ["off"] + [m for m in modes if m != "off"]
    slices: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    with httpx.Client(base_url=url, timeout=30) as http:
        assert http.post("/v2/trace/setting", json=MODES["off"]).status_code == 200
        run_load(url, model, concurrency=clients, duration_s=warm_s)  # warm, tracing off
        settle(receiver, db)
        spans_at_start, (rows_at_start, _) = receiver.spans, _traces_in(db)
        (traced,) = _metrics(http, TRACED)
        done, round_s = 0, 0.0
        for r in range(rounds):
            began_round = time.monotonic()
            if r and until is not None and began_round + round_s > until:
                break
            for mode in modes if r % 2 == 0 else modes[::-1]:
                assert http.post("/v2/trace/setting", json=MODES[mode]).status_code == 200
                spans, began, receiving = receiver.spans, time.time(), _cpu_s(receiver.pid)
                with CpuShare(server_pid) as cpu:
                    rep = run_load(url, model, concurrency=clients, duration_s=slice_s)
                ended, receiving = time.time(), _cpu_s(receiver.pid) - receiving
                with CpuShare(server_pid) as after:  # what the slice left to its processes
                    settle(receiver, db)
                (now,) = _metrics(http, TRACED)
                slices[mode].append({
                    "report": rep, "cpu": cpu.summary(rep.ok),
                    "after_us": (after.used["serving process"]
                                 + after.used["its child processes"]) / max(rep.ok, 1) * 1e6,
                    "cores": {part: used / cpu.wall_s for part, used in cpu.used.items()},
                    "receiver_us": receiving / max(rep.ok, 1) * 1e6,
                    "batch": mean_batch_size(db, began, ended),
                    "traced": now - traced, "spans": receiver.spans - spans})
                traced = now
                say(f"round {r + 1} {mode:14s} {rep.throughput_rps:8.0f} req/s  p99 "
                    f"{_num(rep.latency_p99_ms, 6, 2)} ms")
            done, round_s = r + 1, time.monotonic() - began_round
        http.post("/v2/trace/setting", json=MODES["off"])
        (dropped,) = _metrics(http, DROPPED)
    base = [s["report"] for s in slices["off"]]
    base_rps = _median(r.throughput_rps for r in base)
    base_p99 = _median(r.latency_p99_ms for r in base)
    figures = {}
    for mode, got in slices.items():
        reps = [s["report"] for s in got]
        rps, p99 = _median(r.throughput_rps for r in reps), _median(r.latency_p99_ms for r in reps)
        parts = list(got[0]["cpu"]["cpu_us_per_request"])
        figures[mode] = {
            "rps": rps, "p99_ms": p99,
            "rps_ratio": _ratio(base_rps, rps), "p99_ratio": _ratio(base_p99, p99),
            "paired_rps": None if mode == "off" else _paired(base, reps, "throughput_rps"),
            "paired_p99": None if mode == "off" else _paired(base, reps, "latency_p99_ms"),
            "rounds_rps": [r.throughput_rps for r in reps],
            "rounds_p99_ms": [r.latency_p99_ms for r in reps],
            "mean_batch": _median(s["batch"] for s in got),
            "cpu_us": {p: _median(s["cpu"]["cpu_us_per_request"][p] for s in got) for p in parts},
            "cpu_us_total": _median(s["cpu"]["total_cpu_us_per_request"] for s in got),
            "threads_us": {t: _median(s["cpu"]["serving_threads_us"].get(t, 0.0) for s in got)
                           for t in sorted({t for s in got
                                            for t in s["cpu"]["serving_threads_us"]})},
            "children_us": {c: _median(s["cpu"]["children_us"].get(c, 0.0) for s in got)
                            for c in sorted({c for s in got
                                             for c in s["cpu"]["children_us"]})},
            "share_of_bound": _median(s["cpu"]["share_of_cpu_bound"] for s in got),
            "cores_used": {p: _median(s["cores"][p] for s in got) for p in parts},
            "receiver_us": _median(s["receiver_us"] for s in got),
            "after_us": _median(s["after_us"] for s in got),
            "requests": sum(r.ok for r in reps),
            "errors": sum(sum(r.errors_by_status.values()) for r in reps),
            "traced": int(sum(s["traced"] for s in got)), "spans": sum(s["spans"] for s in got)}
    rows, drops = _traces_in(db)
    return {"model": model, "clients": clients, "slice_s": slice_s, "rounds": done,
            "cores": os.cpu_count(), "modes": figures,
            "receiver_idle": getattr(receiver, "idle", False),
            "traced": sum(m["traced"] for m in figures.values()),
            "trace_rows_at_start": rows_at_start, "trace_rows": rows - rows_at_start,
            "spans_at_start": spans_at_start, "spans_received": receiver.spans - spans_at_start,
            "spans_expected": SPANS_PER_REQUEST * sum(m["traced"] for k, m in figures.items()
                                                      if k in SPAN_MODES),
            "spans_dropped": max(int(dropped), drops)}


def after_stop(result: dict[str, Any], receiver: Receiver, db: Path) -> None:
    """Bring ``measure``'s span and row figures up to date once its server has stopped:
    its span process sends what it held, and drops are reported as it closes."""
    settle(receiver, db, limit_s=15.0)
    rows, drops = _traces_in(db)
    result["trace_rows"] = rows - result["trace_rows_at_start"]
    result["spans_received"] = receiver.spans - result["spans_at_start"]
    result["spans_dropped"] = max(result["spans_dropped"], drops)


def _num(value: float | None, width: int, digits: int) -> str:
    return "-".rjust(width) if value is None else f"{value:{width}.{digits}f}"


def resolution(aa: Interval | None) -> str | None:
    """What the A/A check (``off_again`` / ``off``, paired) says of a run's resolution:
    None without one."""
    if aa is None:
        return None
    if not aa.low <= 1.0 <= aa.high:
        return (f"resolution: the A/A check reads {aa.text()}, its interval missing 1: this "
                "run's noise is larger than its intervals say, so none of them is to be "
                "trusted (more rounds, or a quieter time)")
    return (f"resolution: the A/A check reads {aa.text()}; a cost smaller than about half "
            f"its interval's span ({aa.high - aa.low:.1%}) is not resolved by this run")


def _split(modes: dict[str, Any], key: str, title: str) -> None:
    """A table of each mode's CPU a request by the parts in ``key`` (a thread, a child
    process), the parts that reach ``THREAD_SHOWN_US`` in some mode."""
    parts = sorted({p for m in modes.values() for p, us in m.get(key, {}).items()
                    if us >= THREAD_SHOWN_US})
    if not parts:
        return
    print(f"\n{title} (medians, microseconds a request)")
    print(f"{'mode':16s}" + "".join(f"{p:>17s}" for p in parts))
    for mode, m in modes.items():
        print(f"{mode:16s}" + "".join(f"{m.get(key, {}).get(p, 0.0):17.2f}" for p in parts))


def report(result: dict[str, Any]) -> None:
    """Print ``measure``'s figures: a table of the modes, one of their CPU, the spans."""
    modes = result["modes"]
    print(f"\n{result['model']}, {result['clients']} clients, {result['rounds']} rounds of "
          f"{result['slice_s']:g} s per mode (medians; ratios to 'off' in this run)")
    print(f"{'mode':16s}{'req/s':>9s}{'ratio':>8s}{'p99 ms':>9s}{'ratio':>8s}{'mean batch':>12s}"
          f"{'paired req/s ratio (95 %)':>28s}{'paired p99 ratio (95 %)':>26s}")
    for mode, m in modes.items():
        paired = ""
        if mode != "off":
            paired = "".join(f"{'-' if iv is None else iv.text():>{width}s}"
                             for iv, width in ((m["paired_rps"], 28), (m["paired_p99"], 26)))
        print(f"{mode:16s}{_num(m['rps'], 9, 0)}{_num(m['rps_ratio'], 8, 3)}"
              f"{_num(m['p99_ms'], 9, 2)}{_num(m['p99_ratio'], 8, 3)}"
              f"{_num(m['mean_batch'], 12, 1)}{paired}")
    print("(paired: the geometric mean over the rounds of each round's mode / off, and its "
          "bootstrap 95 % interval: a target is met when the whole interval is)")
    line = resolution(modes.get("off_again", {}).get("paired_rps"))
    if line:
        print(line)
    print("\nCPU per request (medians, microseconds): where each mode's cost goes")
    parts = list(modes["off"]["cpu_us"])
    print(f"{'mode':16s}" + "".join(f"{p:>22s}" for p in parts) + f"{'in all':>9s}"
          f"{'share of bound':>16s}{'OTLP receiver':>15s}{'after the slice':>17s}")
    for mode, m in modes.items():
        print(f"{mode:16s}" + "".join(f"{m['cpu_us'][p]:22.1f}" for p in parts)
              + f"{m['cpu_us_total']:9.1f}{m['share_of_bound']:16.0%}{m['receiver_us']:15.1f}"
              + _num(m.get("after_us"), 17, 1))
    print("(the OTLP receiver shares the machine's cores"
          + (", in the idle CPU class: it takes only the CPU time serving leaves,"
             if result.get("receiver_idle") else ", at normal priority,")
          + " and is not in 'in all' nor in the bound: a collector runs elsewhere in a "
          "deployment; 'after the slice': the server's and its children's CPU while the "
          "benchmark waited for them to go quiet, a request of the slice: work a slice left, "
          "which a slice this short does not pay for and a steady load does)")
    _split(modes, "threads_us", "The serving process by thread")
    _split(modes, "children_us", "Its child processes, by child")
    print(f"traced requests {result['traced']:,} (request_traces rows {result['trace_rows']:,}), "
          f"spans received {result['spans_received']:,}, spans dropped (reported) "
          f"{result['spans_dropped']:,}")


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
    ap.add_argument("--receiver-normal", action="store_true",
                    help="run the OTLP receiver at normal CPU priority, competing with the "
                         "server for the cores (default: the idle class, as a collector "
                         "elsewhere)")
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
    with Receiver(idle=not args.receiver_normal) as receiver:
        if args.side_by_side:
            side_by_side(args.side_by_side, args.rounds, args.slice_s, args.clients, args.model,
                         receiver)
            return
        db = Path(tempfile.mkdtemp()) / "tracing.db"
        server = Server([sys.executable, "-m", "runtime", "serve", "--model", args.model,
                         "--port", "0", "--db", f"sqlite:///{db}",
                         "--otlp-traces-endpoint", receiver.endpoint])
        try:
            result = measure(server.url, db, args.model, args.modes.split(","), args.rounds,
                             args.slice_s, args.clients, receiver, server.proc.pid)
        finally:
            server.stop()
        after_stop(result, receiver, db)
    report(result)


if __name__ == "__main__":
    main()
