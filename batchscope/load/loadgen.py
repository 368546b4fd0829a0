"""``batchscope load``: a closed- or open-loop load generator for the KServe v2 API.

Closed loop: ``concurrency`` connections, each sends its next request as soon as
the previous answer arrives. Open loop: arrivals on a schedule (Poisson at ``rate``
per second, or a recorded one: ``batchscope.load.replay``); each arrival takes an
idle keep-alive connection (or opens one, up to ``max_connections``) and its latency
counts from its scheduled arrival, so a slow server cannot hide queueing from the
numbers. Runs are bounded by ``duration_s`` and ``max_requests``.

The client is a minimal HTTP/1.1 keep-alive client (an ``asyncio.Protocol`` per
connection, one future per request) with request bytes prepared up front (a pool of
payloads drawn from the model's metadata), so the generator itself costs little per
request (about 10 us of CPU against a trivial server). ``measure_ceiling()`` runs it
against a trivial server to tell how fast the generator alone can go.

What it sends is ``batchscope.load.payloads``'s, the client ``batchscope.load.client``'s;
their names are importable from here too.

Every outcome is kept in a ``Tally`` with the time it finished, so the same loops serve
a bounded run (one ``LoadReport``) and a load that runs until stopped and is read
window by window (``batchscope.load.background``).
"""

from __future__ import annotations

import asyncio
import itertools
import math
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator, Sequence

import numpy as np

from batchscope.load.client import (TRANSPORT_ERRORS, KeepAlive, exchange, fetch_metadata,
                                    request_bytes, split_url)
from batchscope.load.payloads import (PAYLOAD_POOL, LoadError, build_payloads, infer_body,
                                      is_variable_length, item_metadata, longest_length,
                                      parse_lengths, parse_priority)

__all__ = ["LoadError", "LoadReport", "Tally", "Until", "closed_loop", "open_loop",
           "poisson_arrivals", "check_options", "run_load", "run_load_async", "run_async",
           "measure_ceiling", "PAYLOAD_POOL", "build_payloads", "infer_body",
           "is_variable_length", "item_metadata", "longest_length", "parse_lengths",
           "parse_priority", "fetch_metadata", "request_bytes", "split_url"]

DRAIN_GRACE_S = 10.0
#: the status kept for a request whose connection failed, and for one still open at the end
CONNECTION_FAILED = 0
UNFINISHED = -1
_STATUS_NAMES = {CONNECTION_FAILED: "connection", UNFINISHED: "unfinished"}


# -- report -----------------------------------------------------------------------------
@dataclass
class LoadReport:
    mode: str
    model: str
    duration_s: float
    sent: int
    ok: int
    #: non-200 answers by status code, plus "connection" for transport failures and
    #: "unfinished" for requests still open when the run ended
    errors_by_status: dict[str, int] = field(default_factory=dict)
    throughput_rps: float = 0.0
    offered_rps: float | None = None
    concurrency: int | None = None
    latency_p50_ms: float | None = None
    latency_p95_ms: float | None = None
    latency_p99_ms: float | None = None
    latency_mean_ms: float | None = None
    latency_max_ms: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        def ms(v: float | None) -> str:
            return "-" if v is None else f"{v:.2f}"

        errors = ", ".join(f"{k}: {v}" for k, v in sorted(self.errors_by_status.items())) or "none"
        offered = f", offered {self.offered_rps:.0f}/s" if self.offered_rps else ""
        return (f"{self.mode} loop on {self.model!r}: {self.sent} sent, {self.ok} ok in "
                f"{self.duration_s:.2f} s -> {self.throughput_rps:.1f} req/s{offered}\n"
                f"latency ms  p50 {ms(self.latency_p50_ms)}  p95 {ms(self.latency_p95_ms)}  "
                f"p99 {ms(self.latency_p99_ms)}  mean {ms(self.latency_mean_ms)}  "
                f"max {ms(self.latency_max_ms)}\nerrors by status: {errors}")


def status_name(status: int) -> str:
    """``"503"``, or ``"connection"`` / ``"unfinished"`` for the two kept without an answer."""
    return _STATUS_NAMES.get(status, str(status))


class Tally:
    """Every outcome of a run in the order they finished: when (``time.perf_counter``),
    the latency in seconds and the status (200, another HTTP status, ``CONNECTION_FAILED``
    or ``UNFINISHED``). Appended on the load's event loop only; other threads may read."""

    __slots__ = ("done_at", "latency_s", "status", "sent")

    def __init__(self) -> None:
        self.done_at: list[float] = []
        self.latency_s: list[float] = []
        self.status: list[int] = []
        self.sent = 0

    def record(self, status: int, latency_s: float, now: float) -> None:
        self.latency_s.append(latency_s)
        self.status.append(status)
        self.done_at.append(now)  # last: a reader bounded by done_at sees whole entries

    def report(self, mode: str, model: str, duration_s: float, **extra: Any) -> LoadReport:
        status = np.asarray(self.status[:len(self.done_at)], dtype=np.int64)
        lat = np.asarray(self.latency_s[:len(status)]) * 1000.0
        ok = lat[status == 200]
        errors: dict[str, int] = {}
        for code in status[status != 200].tolist():
            errors[status_name(code)] = errors.get(status_name(code), 0) + 1
        rep = LoadReport(mode=mode, model=model, duration_s=duration_s, sent=self.sent,
                         ok=int(ok.size), errors_by_status=errors,
                         throughput_rps=ok.size / duration_s if duration_s > 0 else 0.0, **extra)
        if ok.size:
            p50, p95, p99 = np.percentile(ok, [50, 95, 99])
            rep.latency_p50_ms, rep.latency_p95_ms, rep.latency_p99_ms = float(p50), float(p95), float(p99)
            rep.latency_mean_ms, rep.latency_max_ms = float(ok.mean()), float(ok.max())
        return rep


class Until:
    """When a loop stops sending: ``at`` in ``time.perf_counter`` seconds (movable)."""

    __slots__ = ("at",)

    def __init__(self, at: float) -> None:
        self.at = at


# -- the two loops -------------------------------------------------------------------
async def closed_loop(host: str, port: int, requests: Sequence[bytes], concurrency: int,
                      until: Until, max_requests: int, tally: Tally) -> None:
    """``concurrency`` connections, each sending its next request when its answer came."""
    clock = time.perf_counter

    async def worker(offset: int) -> None:
        conn: KeepAlive | None = None
        i = offset
        try:
            while tally.sent < max_requests and clock() < until.at:
                tally.sent += 1
                req = requests[i % len(requests)]
                i += 1
                t0 = clock()
                try:
                    conn, status = await exchange(conn, host, port, req)
                except TRANSPORT_ERRORS:
                    now = clock()
                    tally.record(CONNECTION_FAILED, now - t0, now)
                    conn = None
                    await asyncio.sleep(0.01)
                    continue
                now = clock()
                tally.record(status, now - t0, now)
        finally:
            if conn is not None:
                conn.close()

    await asyncio.gather(*(worker(k * 7) for k in range(concurrency)))


def poisson_arrivals(requests: Sequence[bytes], rate: float,
                     seed: int = 0) -> Iterator[tuple[bytes, float]]:
    """``(request, seconds to the next arrival)`` forever: Poisson arrivals at ``rate``/s."""
    rng = random.Random(seed)
    for i in itertools.count():
        yield requests[i % len(requests)], rng.expovariate(rate)


async def open_loop(host: str, port: int, arrivals: Iterator[tuple[bytes | None, float]],
                    until: Until, max_requests: int, max_connections: int, tally: Tally,
                    drain_grace_s: float = DRAIN_GRACE_S) -> None:
    """Send each arrival at its time on an idle connection (or a new one, up to
    ``max_connections``); its latency counts from when it was due. An arrival whose
    request is ``None`` is skipped (a paused load keeps its schedule without sending)."""
    idle: list[KeepAlive] = []
    slot = asyncio.Semaphore(max_connections)
    tasks: set[asyncio.Task] = set()
    clock = time.perf_counter

    async def one(req: bytes, scheduled: float) -> None:
        async with slot:
            try:
                conn, status = await exchange(idle.pop() if idle else None, host, port, req)
            except TRANSPORT_ERRORS:
                now = clock()
                tally.record(CONNECTION_FAILED, now - scheduled, now)
                return
            idle.append(conn)
        now = clock()
        tally.record(status, now - scheduled, now)

    next_at = clock()
    try:
        while tally.sent < max_requests:
            now = clock()
            if next_at >= until.at:
                break
            while next_at <= now and tally.sent < max_requests:
                req, gap_s = next(arrivals)
                if req is None:
                    next_at += gap_s
                    continue
                task = asyncio.ensure_future(one(req, next_at))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                tally.sent += 1
                next_at += gap_s
            await asyncio.sleep(max(0.0, min(next_at, until.at) - clock()))
        if tasks:
            _, pending = await asyncio.wait(set(tasks), timeout=drain_grace_s)
            for task in pending:
                task.cancel()
                tally.record(UNFINISHED, 0.0, clock())
    finally:
        for task in list(tasks):
            task.cancel()
        for conn in idle:
            conn.close()


def check_options(*, duration_s: float = 1.0, max_requests: int = 1, rate: float | None = None,
                  concurrency: int | None = 1, lengths: str | None = None,
                  priority: str | int | None = None) -> None:
    """A ``LoadError`` naming the first option that cannot work."""
    if not (duration_s > 0 and math.isfinite(duration_s)):
        raise LoadError(f"--duration-s {duration_s!r} must be a positive number of seconds")
    if max_requests < 1:
        raise LoadError(f"--max-requests {max_requests!r} must be at least 1")
    if rate is not None and not (rate > 0 and math.isfinite(rate)):
        raise LoadError(f"--rate {rate!r} must be a positive number of requests per second")
    if rate is None and (concurrency is None or concurrency < 1):
        raise LoadError(f"--concurrency {concurrency!r} must be at least 1")
    parse_lengths(lengths)
    parse_priority(priority)


async def run_load_async(url: str, model: str, *, concurrency: int | None = 16,
                         rate: float | None = None, duration_s: float = 10.0,
                         max_requests: int = 1_000_000, lengths: str | None = None,
                         priority: str | int | None = None, timeout_ms: float | None = None,
                         bypass: bool = False, seed: int = 0, max_connections: int = 512,
                         payloads: Sequence[bytes] | None = None,
                         path: str | None = None,
                         adapters: Sequence[str | None] = ()) -> LoadReport:
    """Drive ``model`` at ``url``; ``rate`` selects the open loop, else ``concurrency``;
    ``adapters``: the LoRA adapters the requests name, drawn evenly (None: the base)."""
    check_options(duration_s=duration_s, max_requests=max_requests, rate=rate,
                  concurrency=concurrency, lengths=lengths, priority=priority)
    host, port = split_url(url)
    if payloads is None:
        meta = await fetch_metadata(url, model)
        payloads = build_payloads(meta, lengths=lengths, priority=priority,
                                  timeout_ms=timeout_ms, bypass=bypass, seed=seed,
                                  adapters=adapters)
    target = path or f"/v2/models/{model}/infer"
    requests = [request_bytes("POST", host, port, target, body) for body in payloads]
    tally = Tally()
    start = time.perf_counter()
    until = Until(start + duration_s)
    if rate is None:
        await closed_loop(host, port, requests, int(concurrency or 1), until, max_requests, tally)
        return tally.report("closed", model, time.perf_counter() - start, concurrency=concurrency)
    await open_loop(host, port, poisson_arrivals(requests, rate, seed), until, max_requests,
                    max_connections, tally)
    return tally.report("open", model, time.perf_counter() - start, offered_rps=rate)


def run_async(coro: Any) -> Any:
    """Run ``coro`` to completion on a fresh uvloop (or asyncio) event loop."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        return asyncio.run(coro)
    return uvloop.run(coro)


def run_load(url: str, model: str, **options: Any) -> LoadReport:
    """Blocking form of :func:`run_load_async` (uses uvloop when available)."""
    return run_async(run_load_async(url, model, **options))


# -- the generator's own ceiling --------------------------------------------------------
_CANNED = (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}")


class _TrivialProtocol(asyncio.Protocol):
    """Answers every request on a connection with a fixed 200 (pipelining-safe)."""

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self.buf = b""

    def data_received(self, data: bytes) -> None:
        self.buf += data
        out = []
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                break
            n = 0
            for line in self.buf[:end].lower().split(b"\r\n"):
                if line.startswith(b"content-length:"):
                    n = int(line[15:])
            if len(self.buf) < end + 4 + n:
                break
            self.buf = self.buf[end + 4 + n:]
            out.append(_CANNED)
        if out:
            self.transport.write(b"".join(out))


def _trivial_server(conn: Any) -> None:
    """In a child started by ``spawn_child``: serve ``_TrivialProtocol`` and send the port."""
    async def main() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(_TrivialProtocol, "127.0.0.1", 0)
        conn.send(server.sockets[0].getsockname()[1])
        await server.serve_forever()

    run_async(main())


def measure_ceiling(duration_s: float = 3.0, concurrency: int = 64) -> LoadReport:
    """Closed-loop throughput against a trivial server in another process."""
    from batchscope.spawn import spawn_child

    child = spawn_child(_trivial_server, name="batchscope-trivial-server")
    try:
        if not child.conn.poll(30):
            raise RuntimeError("the trivial server did not start within 30 s")
        port = child.conn.recv()
        return run_load(f"http://127.0.0.1:{port}", "trivial", concurrency=concurrency,
                        duration_s=duration_s, payloads=[b"{}"], path="/")
    finally:
        child.process.terminate()
        child.process.join(5)
        child.conn.close()
