"""Cost of the HTTP/1.1 layer on its hot path, without sockets: parse + dispatch + answer.

One ``Connection`` of ``runtime.server.http1`` is fed small keep-alive ``/infer``
requests one at a time through ``data_received`` (as the event loop would), over a
fake transport that only counts the bytes written; the fast hook answers each at once.
So the figure is the server's own per-request cost: httptools parsing, the callbacks,
the dispatch and the response head, with no model, no engine and no kernel.

    python -m benchmarks.reliability.http1_hot_path
    python -m benchmarks.reliability.http1_hot_path --module-file /tmp/http1_old.py

``--module-file`` loads a single-file copy of the server (``runtime/server/http1.py`` as it
was before it became a package, from ``git show``) so both are measured by the same
loop, in the same process run. ``--early`` gives the fast
hook an ``early`` method that always returns None (the cost of the early call point);
``--refuse`` one that refuses every request, with an ``edge`` method too (so the server
refuses before the parser, as it does while shedding) unless ``--no-edge``.
Prints the best of ``--repeats`` runs, in requests per second and microseconds each.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib.util
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

BODY = (b'{"inputs":[{"name":"INPUT0","shape":[1,16],"datatype":"FP32","data":'
        b'[0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9,1.0,1.1,1.2,1.3,1.4,1.5,1.6]}]}')
REQUEST = (b"POST /v2/models/mlp/infer HTTP/1.1\r\nHost: 127.0.0.1:8000\r\n"
           b"User-Agent: python-httpx/0.27\r\nAccept: */*\r\nAccept-Encoding: gzip\r\n"
           b"Connection: keep-alive\r\nContent-Type: application/json\r\n"
           b"Content-Length: %d\r\n\r\n%b" % (len(BODY), BODY))
ANSWER = b'{"model_name":"mlp","model_version":"1","outputs":[{"name":"OUT","shape":[1,4],' \
         b'"datatype":"FP32","data":[1.0,2.0,3.0,4.0]}]}'
HEADERS = [(b"content-type", b"application/json")]


class CountingTransport:
    """The parts of ``asyncio.Transport`` the connection uses; counts what is written."""

    def __init__(self) -> None:
        self.written = 0

    def write(self, data: bytes) -> None:
        self.written += len(data)

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def can_write_eof(self) -> bool:
        return False

    def close(self) -> None:
        pass

    def is_closing(self) -> bool:
        return False


class Hook:
    """Answers every request at once, as the inference hook does on success."""

    def __call__(self, conn, method, path, headers, body, answer) -> bool:
        answer(200, HEADERS, ANSWER)
        return True


class EarlyHook(Hook):
    def early(self, method, path, headers):
        return None


REFUSAL = (429, [(b"content-type", b"application/json"), (b"retry-after", b"1")],
           b'{"error":"model \'mlp\' has 1024 requests waiting; retry later"}')


class HeadRefusingHook(Hook):
    """Refuses every request on its head, as the inference hook does when the queue is full."""

    def early(self, method, path, headers):
        return REFUSAL


class RefusingHook(HeadRefusingHook):
    """... and has an ``edge`` method, so that once shedding the server refuses requests
    before they reach the parser."""

    def edge(self, target):
        return REFUSAL


def load_module(path: str | None) -> ModuleType:
    if path is None:
        from runtime.server import http1

        return http1
    spec = importlib.util.spec_from_file_location("http1_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def measure(http1: ModuleType, *, n: int, early: bool, refuse: bool = False,
            edge: bool = True) -> float:
    """Seconds for ``n`` requests through one connection."""
    loop = asyncio.new_event_loop()
    try:
        refusing = RefusingHook if edge else HeadRefusingHook
        hook = refusing() if refuse else EarlyHook() if early else Hook()
        server = http1.HttpServer(None, fast=hook)
        server.loop = loop
        # an older single-file copy named it _Connection
        conn = getattr(http1, "Connection", None) or http1._Connection
        conn = conn(server)
        transport = CountingTransport()
        conn.connection_made(transport)
        feed = conn.data_received
        request = REQUEST
        gc.collect()
        gc.disable()
        try:
            start = time.perf_counter()
            for _ in range(n):
                feed(request)
            elapsed = time.perf_counter() - start
        finally:
            gc.enable()
        if transport.written < n * len(REFUSAL[2] if refuse else ANSWER):
            raise RuntimeError(f"only {transport.written} bytes were answered for {n} requests")
        return elapsed
    finally:
        loop.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--module-file", help="a copy of http1.py to measure instead")
    ap.add_argument("--requests", type=int, default=100_000)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--early", action="store_true", help="the fast hook has an early method")
    ap.add_argument("--refuse", action="store_true",
                    help="the early method refuses every request (the cost of shedding)")
    ap.add_argument("--no-edge", action="store_true",
                    help="with --refuse: the hook has no edge method, so every refused request "
                         "goes through the parser")
    args = ap.parse_args(argv)
    http1 = load_module(args.module_file)
    kw = {"early": args.early, "refuse": args.refuse, "edge": not args.no_edge}
    measure(http1, n=2000, **kw)  # warm up
    best = min(measure(http1, n=args.requests, **kw) for _ in range(args.repeats))
    per_us = best / args.requests * 1e6
    mode = (" (refusing on the head, no edge)" if args.refuse and args.no_edge else
            " (refusing at the edge)" if args.refuse else " (early hook)" if args.early else "")
    print(f"{args.module_file or 'runtime.server.http1'}"
          f"{mode}: "
          f"{args.requests / best:,.0f} req/s, {per_us:.2f} us per request "
          f"(best of {args.repeats} x {args.requests})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
