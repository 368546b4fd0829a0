"""One bad model must not hurt the others: a poison model and a hanging one beside ``mlp``.

One command, bounded in time, loopback only::

    python -m benchmarks.reliability.bad_models                 # ~40 s, device process
    python -m benchmarks.reliability.bad_models --thread        # models on the device thread
    python -m benchmarks.reliability.bad_models --duration-s 30 --hang-s 12 --timeout-ms 2000

It starts ``batchscope serve`` (torch on one thread, no recording) with three models:

* ``mlp``, healthy, under a closed loop of ``--mlp-clients`` clients the whole time;
* ``poison`` (``runtime.models.toys:FailingModel``: it raises on a batch holding an
  input with a negative first value), under ``--poison-clients`` clients of which a
  fraction ``--poison`` of the requests are poison; a request that is not poison and
  fails is an innocent one failed (the target is 0);
* ``hanging`` (``runtime.models.toys:HangingModel``) with ``execution_timeout_ms`` set
  to ``--timeout-ms``: every ``--hang-every-s`` one request makes its batch hang for
  ``--hang-s``; a client also sends it a normal request every 0.5 s.

It prints the innocent requests failed, the poison requests and how they were
answered, the answers to the hanging requests and how long they took, mlp's success
rate and latency while a batch of ``hanging`` hangs (from each hanging request's
send time to ``--hang-s`` later) and overall, mlp requests never answered, the
restarts (device process) or new device threads, and the server's log lines and
tracebacks per failed request. Server and clients share this machine (and, on a
shared machine, other work), so latencies are upper bounds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.bench_serving import serve_cmd  # noqa: E402
from benchmarks.reliability.server import Server  # noqa: E402
from batchscope.load.loadgen import build_payloads, fetch_metadata, run_async  # noqa: E402

#: a client gives up on an answer after this long (it then counts as unanswered)
CLIENT_TIMEOUT_S = 40.0
#: phrases counted in the server's log
LOG_MARKS = ("Traceback", "killed and restarted", "new device thread", "device process serves",
             "since the last line")
MODELS = ("mlp", "poison=runtime.models.toys:FailingModel",
          "hanging=runtime.models.toys:HangingModel")


# -- the clients ------------------------------------------------------------------------
@dataclass
class Sample:
    sent: float
    done: float = float("nan")
    #: HTTP status, 0 when no answer came
    status: int = 0
    kind: str = ""


@dataclass
class Tally:
    samples: list[Sample] = field(default_factory=list)
    #: the first answer body of each kind and status other than 200
    bodies: dict[str, str] = field(default_factory=dict)


def _request(host: str, port: int, path: str, body: bytes) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


class Client:
    """One keep-alive connection, one request at a time."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        for attempt in range(2):  # once more on a fresh connection if the idle one closed
            if self.writer is None:
                self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
            try:
                self.writer.write(_request(self.host, self.port, path, body))
                head = await self.reader.readuntil(b"\r\n\r\n")
                status = int(head[9:12])
                match = re.search(rb"(?i)content-length:\s*(\d+)", head)
                data = await self.reader.readexactly(int(match.group(1)) if match else 0)
                if re.search(rb"(?i)connection:\s*close", head):
                    self.close()
                return status, data
            except (OSError, asyncio.IncompleteReadError):
                self.close()
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


async def one(client: Client, tally: Tally, path: str, body: bytes, kind: str = "") -> Sample:
    sample = Sample(time.perf_counter(), kind=kind)
    tally.samples.append(sample)
    try:
        status, data = await asyncio.wait_for(client.post(path, body), CLIENT_TIMEOUT_S)
    except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError):
        client.close()
        return sample
    sample.done, sample.status = time.perf_counter(), status
    key = f"{kind} {status}".strip()
    if status != 200 and key not in tally.bodies:
        tally.bodies[key] = data[:200].decode(errors="replace")
    return sample


def vec_body(values: Sequence[float]) -> bytes:
    return json.dumps({"inputs": [{"name": "INPUT0", "shape": [4], "datatype": "FP32",
                                   "data": [float(v) for v in values]}]}).encode()


async def run(url: str, args: argparse.Namespace) -> dict:
    host, port = url.removeprefix("http://").split(":")
    port = int(port)
    mlp_bodies = build_payloads(await fetch_metadata(url, "mlp"))
    rng = random.Random(11)
    mlp, poison, hanging, hangs = Tally(), Tally(), Tally(), Tally()
    start = time.perf_counter()
    end = start + args.duration_s

    async def mlp_client(i: int) -> None:
        client = Client(host, port)
        n = i
        while time.perf_counter() < end:
            await one(client, mlp, "/v2/models/mlp/infer", mlp_bodies[n % len(mlp_bodies)])
            n += 1
        client.close()

    async def poison_client() -> None:
        client = Client(host, port)
        while time.perf_counter() < end:
            bad = rng.random() < args.poison
            first = -1.0 if bad else rng.uniform(0.0, 10.0)
            await one(client, poison, "/v2/models/poison/infer", vec_body([first, 1, 2, 3]),
                      "poison" if bad else "innocent")
        client.close()

    async def hanging_normal() -> None:
        client = Client(host, port)
        while time.perf_counter() < end:
            await one(client, hanging, "/v2/models/hanging/infer", vec_body([1, 0, 0, 0]))
            await asyncio.sleep(0.5)
        client.close()

    async def hang_sender() -> None:
        await asyncio.sleep(1.0)
        while time.perf_counter() + args.hang_s / 2 < end:
            client = Client(host, port)
            sent = asyncio.ensure_future(one(client, hangs, "/v2/models/hanging/infer",
                                             vec_body([99, args.hang_s, 0, 0])))
            await asyncio.sleep(args.hang_every_s)
            await sent
            client.close()

    tasks = [mlp_client(i) for i in range(args.mlp_clients)]
    tasks += [poison_client() for _ in range(args.poison_clients)]
    tasks += [hanging_normal(), hang_sender()]
    await asyncio.gather(*tasks)
    return {"mlp": mlp, "poison": poison, "hanging": hanging, "hangs": hangs, "start": start}


# -- the report -------------------------------------------------------------------------
def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def report(result: dict, args: argparse.Namespace, lines: int, marks: dict[str, int],
           mode: str) -> dict:
    mlp, poison, hanging, hangs = (result[k] for k in ("mlp", "poison", "hanging", "hangs"))
    windows = [(h.sent, h.sent + args.hang_s) for h in hangs.samples]

    def during(s: Sample) -> bool:
        return any(lo <= s.sent < hi for lo, hi in windows)

    def rate(samples: list[Sample]) -> float:
        return sum(s.status == 200 for s in samples) / max(1, len(samples))

    mlp_hang = [s for s in mlp.samples if during(s)]
    mlp_calm = [s for s in mlp.samples if not during(s)]
    innocent = [s for s in poison.samples if s.kind == "innocent"]
    bad = [s for s in poison.samples if s.kind == "poison"]
    failures = (sum(s.status != 200 for s in poison.samples)
                + sum(s.status != 200 for s in hanging.samples + hangs.samples))
    out = {
        "mode": mode,
        "innocent_failed": sum(s.status != 200 for s in innocent),
        "innocent_sent": len(innocent),
        "innocent_statuses": dict(sorted(_statuses(innocent).items())),
        "poison_sent": len(bad),
        "poison_statuses": dict(sorted(_statuses(bad).items())),
        "hang_requests": len(hangs.samples),
        "hang_statuses": dict(sorted(_statuses(hangs.samples).items())),
        "hang_answer_s": [round(s.done - s.sent, 2) for s in hangs.samples],
        "hanging_normal_statuses": dict(sorted(_statuses(hanging.samples).items())),
        "mlp_success_during_hangs": rate(mlp_hang),
        "mlp_requests_during_hangs": len(mlp_hang),
        "mlp_p50_ms_during_hangs": 1000 * pct([s.done - s.sent for s in mlp_hang
                                               if s.status == 200], 0.5),
        "mlp_p99_ms_during_hangs": 1000 * pct([s.done - s.sent for s in mlp_hang
                                               if s.status == 200], 0.99),
        "mlp_max_ms_during_hangs": 1000 * max([s.done - s.sent for s in mlp_hang
                                               if s.status == 200], default=float("nan")),
        "mlp_p99_ms_outside_hangs": 1000 * pct([s.done - s.sent for s in mlp_calm
                                                if s.status == 200], 0.99),
        "mlp_slowest": [(round(s.sent - result["start"], 2), round(s.done - s.sent, 3))
                        for s in sorted(mlp.samples, key=lambda s: s.sent - s.done)[:5]],
        "hangs_sent_at": [round(h.sent - result["start"], 2) for h in hangs.samples],
        "mlp_success_overall": rate(mlp.samples),
        "mlp_requests": len(mlp.samples),
        "mlp_unanswered": sum(s.status == 0 for s in mlp.samples),
        "restarts": marks.get("killed and restarted", 0),
        "new_device_threads": marks.get("new device thread", 0),
        "failed_requests": failures,
        "server_log_lines": lines,
        "log_lines_per_failure": lines / max(1, failures),
        "tracebacks": marks.get("Traceback", 0),
        "bodies": {**{f"poison {k}": v for k, v in poison.bodies.items()},
                   **{f"hang {k}": v for k, v in hangs.bodies.items()},
                   **{f"hanging {k}": v for k, v in hanging.bodies.items()}},
    }
    return out


def _statuses(samples: list[Sample]) -> dict[int, int]:
    out: dict[int, int] = {}
    for s in samples:
        out[s.status] = out.get(s.status, 0) + 1
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration-s", type=float, default=30.0)
    parser.add_argument("--hang-s", type=float, default=12.0,
                        help="how long each hanging batch hangs")
    parser.add_argument("--hang-every-s", type=float, default=14.0)
    parser.add_argument("--timeout-ms", type=float, default=None,
                        help="execution_timeout_ms of the hanging model (default: the "
                             "server's defaults, execution_timeout_auto on)")
    parser.add_argument("--poison", type=float, default=0.02,
                        help="fraction of the poison model's requests that are poison")
    parser.add_argument("--mlp-clients", type=int, default=16)
    parser.add_argument("--poison-clients", type=int, default=16)
    parser.add_argument("--thread", action="store_true",
                        help="run the models on the device thread (--no-device-process)")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)

    extra = ([] if args.timeout_ms is None
             else ["--set", f"hanging.execution_timeout_ms={args.timeout_ms:g}"])
    if args.thread:
        extra.append("--no-device-process")
    server = Server(serve_cmd(*extra, models=MODELS), timeout_s=180.0, marks=LOG_MARKS)
    mode = "device thread" if args.thread else "device process"
    try:
        lines_before, _ = server.counts()
        result = run_async(run(server.url, args))
        time.sleep(0.5)  # the last log lines
        lines_after, marks = server.counts()
    finally:
        server.stop()
    out = report(result, args, lines_after - lines_before, marks, mode)
    print(f"bad models ({mode}): {args.duration_s:g} s, poison {100 * args.poison:g} %, "
          f"{args.hang_s:g} s hangs every {args.hang_every_s:g} s, "
          + ("defaults (execution_timeout_auto)" if args.timeout_ms is None
             else f"execution_timeout_ms={args.timeout_ms:g}"))
    print(f"  innocent requests failed    {out['innocent_failed']} of {out['innocent_sent']} "
          f"(target 0), answered {out['innocent_statuses']}")
    print(f"  poison requests             {out['poison_sent']}, answered {out['poison_statuses']}")
    print(f"  hanging requests            {out['hang_requests']}, answered "
          f"{out['hang_statuses']} after {out['hang_answer_s']} s")
    print(f"  hanging model, normal reqs  {out['hanging_normal_statuses']}")
    print(f"  mlp while a batch hangs     {100 * out['mlp_success_during_hangs']:.1f} % ok of "
          f"{out['mlp_requests_during_hangs']}; p50 {out['mlp_p50_ms_during_hangs']:.1f} ms, "
          f"p99 {out['mlp_p99_ms_during_hangs']:.1f} ms, "
          f"max {out['mlp_max_ms_during_hangs']:.0f} ms (p99 outside hangs "
          f"{out['mlp_p99_ms_outside_hangs']:.1f} ms)")
    print(f"  mlp slowest (sent at s, took s) {out['mlp_slowest']}; hangs sent at "
          f"{out['hangs_sent_at']} s")
    print(f"  mlp overall                 {100 * out['mlp_success_overall']:.1f} % ok of "
          f"{out['mlp_requests']}; unanswered {out['mlp_unanswered']}")
    print(f"  restarts / new threads      {out['restarts']} / {out['new_device_threads']}")
    print(f"  server log lines            {out['server_log_lines']} for "
          f"{out['failed_requests']} failed requests "
          f"({out['log_lines_per_failure']:.3f} per failure), {out['tracebacks']} traceback(s)")
    for key, body in out["bodies"].items():
        print(f"    {key}: {body}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
