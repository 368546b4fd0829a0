"""Slow clients against ``batchscope serve --model mlp``: do normal clients still get in?

One command, bounded in time, loopback only::

    python -m benchmarks.reliability.slow_clients               # ~40 s
    python -m benchmarks.reliability.slow_clients --slow 1100 --during-s 20 --nofile 1024

It starts ``batchscope serve --model mlp`` with its defaults (torch on one thread, no
recording) under an open-file limit of ``--nofile`` (1,024 by default, a common
default limit), then:

1. before: 8 normal clients (closed loop, keep-alive) for ``--before-s``;
2. during: ``--slow`` slow connections are opened (half of them trickle their request
   head, a byte a second, never finishing it; the other half send a head declaring a
   4 KiB body and 10 bytes of it, then nothing), while the normal clients go on for
   ``--during-s``. Each slow connection is watched until the server answers or closes
   it, or until ``--slow-max-s`` after it opened, when the client gives up on it;
3. after: the normal clients again for ``--after-s``.

It prints, for the slow connections: how many the server closed, with which status
(408 timeout, 503 at the connection limit, or closed without an answer), the time
from opening to being closed (min / median / max) and how many were still open when
the client gave up; for the normal clients of each phase: requests, success rate
(200 answers / requests sent) and latency p50 / p99. Server and clients share the
machine (and it may be shared with other work), so latencies are an upper bound.
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.bench_serving import process, serve_cmd  # noqa: E402
from batchscope.load.loadgen import build_payloads, fetch_metadata, run_async, run_load  # noqa: E402

#: a trickling connection sends one more header byte this often
TRICKLE_S = 1.0
#: slow connections are opened in groups of this many, one group per OPEN_EVERY_S
OPEN_GROUP = 50
OPEN_EVERY_S = 0.05
NORMAL_CLIENTS = 8


@dataclass
class Slow:
    kind: str
    opened_s: float = 0.0
    ended_s: float | None = None
    status: int | None = None
    outcome: str = "open"


async def one_slow(kind: str, host: str, port: int, give_up_s: float) -> Slow:
    """Open a slow connection and watch it until the server ends it or we give up."""
    slow = Slow(kind, opened_s=time.monotonic())
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 10.0)
    except (OSError, asyncio.TimeoutError):
        slow.outcome, slow.ended_s = "connect failed", time.monotonic()
        return slow
    path = "/v2/models/mlp/infer"
    if kind == "head":
        writer.write(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nX-Pad: ".encode())
    else:
        writer.write(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json"
                     f"\r\nContent-Length: 4096\r\n\r\n{{\"inputs\": ".encode())
    buf = b""
    deadline = slow.opened_s + give_up_s
    try:
        while time.monotonic() < deadline:
            try:
                data = await asyncio.wait_for(reader.read(65536), TRICKLE_S)
            except asyncio.TimeoutError:
                if kind == "head":
                    writer.write(b"a")
                continue
            if not data:
                break
            buf += data
            if slow.status is None and b"\r\n" in buf:
                slow.status = int(buf.split(b"\r\n", 1)[0].split()[1])
        else:
            return slow  # still open: we give up on it (outcome stays "open")
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()
    slow.ended_s = time.monotonic()
    slow.outcome = f"answered {slow.status}" if slow.status else "closed without an answer"
    return slow


async def open_slow(count: int, host: str, port: int, give_up_s: float) -> list[Slow]:
    tasks = []
    for i in range(count):
        tasks.append(asyncio.ensure_future(one_slow("head" if i % 2 == 0 else "body", host,
                                                    port, give_up_s)))
        if i % OPEN_GROUP == OPEN_GROUP - 1:
            await asyncio.sleep(OPEN_EVERY_S)
    return list(await asyncio.gather(*tasks))


def normal_load(url: str, duration_s: float, payloads: list[bytes]) -> dict[str, Any]:
    report = run_load(url, "mlp", concurrency=NORMAL_CLIENTS, duration_s=duration_s,
                      payloads=payloads)
    sent = max(report.sent, 1)
    return {"sent": report.sent, "ok": report.ok, "success": report.ok / sent,
            "errors": report.errors_by_status, "p50_ms": report.latency_p50_ms,
            "p99_ms": report.latency_p99_ms}


def print_load(phase: str, r: dict[str, Any]) -> None:
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:.1f} ms"

    print(f"  {phase:7s} {r['sent']:6d} sent, {r['ok']:6d} ok ({100 * r['success']:5.1f} %), "
          f"p50 {ms(r['p50_ms'])}, p99 {ms(r['p99_ms'])}, errors {r['errors'] or 'none'}",
          flush=True)


def print_slow(slows: list[Slow], start_s: float) -> None:
    by_outcome: dict[str, int] = {}
    for s in slows:
        key = f"{s.kind}: {s.outcome}"
        by_outcome[key] = by_outcome.get(key, 0) + 1
    closed = [s for s in slows if s.outcome not in ("open", "connect failed")]
    print(f"slow connections: {len(slows)} opened, {len(closed)} closed by the server, "
          f"{sum(s.outcome == 'open' for s in slows)} still open when the client gave up, "
          f"{sum(s.outcome == 'connect failed' for s in slows)} failed to connect")
    for key in sorted(by_outcome):
        print(f"  {key:45s} {by_outcome[key]:5d}")
    for kind in ("head", "body"):
        ends = sorted(s.ended_s - s.opened_s for s in closed if s.kind == kind)
        if ends:
            print(f"  {kind}: closed {min(ends):.1f} / {statistics.median(ends):.1f} / "
                  f"{max(ends):.1f} s after opening (min / median / max)")
    if closed:
        last = max(s.ended_s for s in closed) - start_s
        print(f"  the last one was closed {last:.1f} s after the first slow connection opened")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--slow", type=int, default=1100, help="slow connections to open")
    ap.add_argument("--nofile", type=int, default=1024,
                    help="the server's open-file limit (soft RLIMIT_NOFILE)")
    ap.add_argument("--before-s", type=float, default=3.0)
    ap.add_argument("--during-s", type=float, default=20.0)
    ap.add_argument("--after-s", type=float, default=5.0)
    ap.add_argument("--slow-max-s", type=float, default=25.0,
                    help="the client gives up on a slow connection this long after opening it")
    args = ap.parse_args(argv)
    if args.slow < 0 or args.slow > 5000:
        ap.error("--slow must be between 0 and 5000")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = args.slow + 256
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, hard), hard))
    cmd = ["sh", "-c", f'ulimit -n {int(args.nofile)} && exec "$@"', "serve",
           *serve_cmd(models=("mlp",))]
    print(f"batchscope serve --model mlp, defaults, open-file limit {args.nofile}; "
          f"{args.slow} slow connections; {NORMAL_CLIENTS} normal clients", flush=True)
    with process(cmd, ready="serving") as url:
        host, port = url.removeprefix("http://").split(":")
        payloads = build_payloads(run_async(fetch_metadata(url, "mlp")))
        print("normal clients:", flush=True)
        print_load("before", normal_load(url, args.before_s, payloads))
        slows: list[Slow] = []
        start_s = time.monotonic()

        def drive() -> None:
            slows.extend(run_async(open_slow(args.slow, host, int(port), args.slow_max_s)))

        driver = threading.Thread(target=drive, daemon=True)
        driver.start()
        time.sleep(min(2.0, args.during_s / 4))  # most slow connections are open by now
        print_load("during", normal_load(url, args.during_s, payloads))
        driver.join(args.slow_max_s + 30.0)
        print_load("after", normal_load(url, args.after_s, payloads))
    if driver.is_alive():
        print("the slow-connection driver did not finish in time", flush=True)
        return 1
    print_slow(slows, start_s)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
