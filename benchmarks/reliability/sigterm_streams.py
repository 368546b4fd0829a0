"""SIGTERM while streamed completions run: does ``batchscope serve`` drain, or cut?

One command, bounded in time, loopback only::

    python -m benchmarks.reliability.sigterm_streams             # ~20 s
    python -m benchmarks.reliability.sigterm_streams --streams 12 --clients 64 --max-tokens 960

It starts ``batchscope serve --port 0 --no-record --model mlp --model decoder`` and runs:

* ``--streams`` streamed completions on ``decoder`` (``"stream": true``, ``"ignore_eos":
  true``), alternately ``/v1/completions`` and ``/v1/chat/completions``; half of them
  ask for ``--max-tokens`` in ``--long-n`` choices each (about 16 s of generating on a
  2-vCPU machine: they outlive the drain timeout), the other half for
  ``--short-tokens`` in one choice (few enough to finish within it);
* ``--clients`` closed-loop KServe clients on ``mlp`` (one thread and one keep-alive
  connection each, plain ``http.client``).

Once every stream has ``--sigterm-after`` tokens and every client two answers, it sends
SIGTERM. From then on each client goes on until its first answer that is not a 200 (a
client told to retry goes elsewhere) or its first failed connection; a few new requests
(OpenAI and KServe, streamed and not) probe the server as it drains.

It prints: the streams that ended with ``data: [DONE]`` (finished, or ended by the drain
with an error event first) and those cut; the requests sent, answered and unanswered
(connection closed or reset before an answer); the 503s with ``Retry-After`` after
SIGTERM; connection resets; connections refused (nothing listening any more: after the
exit); the seconds from SIGTERM to the process' exit against the drain timeout. The
client threads share the machine with the server, so the timings are upper bounds.
"""

from __future__ import annotations

import argparse
import http.client
import signal
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import orjson

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.reliability.server import Server  # noqa: E402

#: the server's drain timeout when ``--drain-timeout-s`` is not given (the CLI default)
DEFAULT_DRAIN_TIMEOUT_S = 5.0
#: how long one client waits for one answer (a hung server shows as a timeout)
CLIENT_TIMEOUT_S = 30.0
#: bounded waits for the load to get going, and for the clients once SIGTERM is sent
START_WAIT_S = 120.0
END_WAIT_S = 60.0
JSON = {"Content-Type": "application/json"}
MLP_BODY = orjson.dumps({"inputs": [{"name": "INPUT0", "shape": [256], "datatype": "FP32",
                                     "data": [((i * 37) % 101) / 101.0 for i in range(256)]}]})
#: what a failed connection raises, as the client sees it: no answer came
FAILURES = (OSError, http.client.HTTPException)


def completion_body(model: str, chat: bool, max_tokens: int, stream: bool = True,
                    n: int = 1) -> bytes:
    doc: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "ignore_eos": True,
                           "stream": stream, "n": n}
    if chat:
        doc["messages"] = [{"role": "user", "content": "Tell me everything."}]
    else:
        doc["prompt"] = "Once upon a time"
    return orjson.dumps(doc)


def route(chat: bool) -> str:
    return "/v1/chat/completions" if chat else "/v1/completions"


def is_reset(failure: str | None) -> bool:
    """True for a failure where the connection was reset or closed under a request."""
    return failure in ("ConnectionResetError", "BrokenPipeError", "RemoteDisconnected",
                       "IncompleteRead", "ConnectionAbortedError")


class Progress:
    """Counts the clients' threads move forward, and waits on them (bounded)."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.counts: Counter[str] = Counter()

    def add(self, key: str, n: int = 1) -> None:
        with self.cond:
            self.counts[key] += n
            self.cond.notify_all()

    def wait(self, check: Callable[[Counter[str]], bool], timeout_s: float) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: check(self.counts), timeout_s)


# -- streams ------------------------------------------------------------------------------
@dataclass
class Stream:
    """One streamed completion, as its client saw it."""

    path: str
    body: bytes
    status: int | None = None
    retry_after: str | None = None
    #: events that carried a token (its text may be empty: a byte mid-character)
    tokens: int = 0
    finish_reasons: int = 0
    #: the ``error`` object of an error event
    error: dict | None = None
    done: bool = False
    #: the body ended properly (the chunked terminator) after ``[DONE]``
    clean_end: bool = False
    #: the exception that ended the connection, when one did
    failure: str | None = None
    answer: bytes = b""

    @property
    def outcome(self) -> str:
        if self.status is None:
            return f"no answer ({self.failure})"
        if self.status != 200:
            return f"answered {self.status} before streaming"
        if self.done and self.clean_end:
            return "ended by the drain: error event, [DONE]" if self.error else \
                "finished: finish_reason, [DONE]"
        return f"cut ({self.failure or 'closed'}) after {self.tokens} tokens"

    @property
    def ended_with_done(self) -> bool:
        return self.status == 200 and self.done and self.clean_end

    @property
    def cut(self) -> bool:
        return self.status == 200 and not self.ended_with_done


def run_stream(host: str, port: int, stream: Stream, progress: Progress, key: str) -> None:
    """Send ``stream`` and read its events until the body ends; each token adds one to
    ``progress[key]``."""
    conn = http.client.HTTPConnection(host, port, timeout=CLIENT_TIMEOUT_S)
    try:
        conn.request("POST", stream.path, stream.body, JSON)
        resp = conn.getresponse()
        stream.status = resp.status
        stream.retry_after = resp.getheader("retry-after")
        if resp.status != 200:
            stream.answer = resp.read()
            return
        while True:
            line = resp.readline()
            if not line:
                stream.clean_end = stream.done
                return
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                stream.done = True
                continue
            event = orjson.loads(data)
            if "error" in event:
                stream.error = event["error"]
                continue
            for choice in event.get("choices") or ():
                if choice.get("finish_reason"):
                    stream.finish_reasons += 1
                elif "role" not in (choice.get("delta") or {}):  # not chat's opening
                    stream.tokens += 1
                    progress.add(key)
    except FAILURES as exc:
        stream.failure = type(exc).__name__
    finally:
        conn.close()
        progress.add("streams ended")


# -- KServe clients -----------------------------------------------------------------------
@dataclass
class Outcome:
    """One request of a closed-loop client."""

    after_sigterm: bool
    status: int | None = None
    retry_after: str | None = None
    failure: str | None = None


@dataclass
class Client:
    outcomes: list[Outcome] = field(default_factory=list)


def run_client(host: str, port: int, path: str, body: bytes, client: Client,
               sigterm: threading.Event, progress: Progress) -> None:
    """Closed loop until the first answer other than 200, or the first failed
    connection, after ``sigterm`` is set (before it, failures are counted and the loop
    goes on, on a new connection)."""
    conn = http.client.HTTPConnection(host, port, timeout=CLIENT_TIMEOUT_S)
    try:
        while True:
            out = Outcome(after_sigterm=sigterm.is_set())
            client.outcomes.append(out)
            try:
                conn.request("POST", path, body, JSON)
                resp = conn.getresponse()
                resp.read()
                out.status, out.retry_after = resp.status, resp.getheader("retry-after")
            except FAILURES as exc:
                out.failure = type(exc).__name__
                conn.close()
            progress.add("answers" if out.status is not None else "failures")
            # a request sent just before SIGTERM may still be refused by the draining server
            # (it had not been read yet): what counts is whether it was answered after it
            out.after_sigterm = out.after_sigterm or sigterm.is_set()
            if out.after_sigterm and out.status != 200:
                return
            if out.failure == "ConnectionRefusedError" and not sigterm.is_set():
                time.sleep(0.01)  # before SIGTERM this is a startup hiccup: retry soon
    finally:
        conn.close()
        progress.add("clients ended")


# -- probes while draining ----------------------------------------------------------------
@dataclass
class Probe:
    method: str
    path: str
    body: bytes | None
    status: int | None = None
    retry_after: str | None = None
    connection: str | None = None
    answer: Any = None
    failure: str | None = None

    @property
    def openai_shaped(self) -> bool:
        error = self.answer.get("error") if isinstance(self.answer, dict) else None
        return isinstance(error, dict) and {"message", "type", "param", "code"} <= error.keys()

    @property
    def kserve_shaped(self) -> bool:
        return isinstance(self.answer, dict) and isinstance(self.answer.get("error"), str)


def probes(models: tuple[str, str] = ("decoder", "mlp")) -> list[Probe]:
    """New requests for a draining server: OpenAI (whole and streamed, completions and
    chat), KServe, readiness and liveness."""
    generation, request_model = models
    return [Probe("POST", "/v1/completions", completion_body(generation, False, 8, False)),
            Probe("POST", "/v1/chat/completions", completion_body(generation, True, 8, True)),
            Probe("POST", f"/v2/models/{request_model}/infer", MLP_BODY),
            Probe("GET", "/v2/health/ready", None),
            Probe("GET", "/v2/health/live", None)]


def send_probe(host: str, port: int, probe: Probe) -> None:
    """One request on a new connection."""
    conn = http.client.HTTPConnection(host, port, timeout=CLIENT_TIMEOUT_S)
    try:
        conn.request(probe.method, probe.path, probe.body, JSON if probe.body else {})
        resp = conn.getresponse()
        raw = resp.read()
        probe.status, probe.retry_after = resp.status, resp.getheader("retry-after")
        probe.connection = resp.getheader("connection")
        try:
            probe.answer = orjson.loads(raw)
        except orjson.JSONDecodeError:
            probe.answer = raw
    except FAILURES as exc:
        probe.failure = type(exc).__name__
    finally:
        conn.close()


# -- the run ------------------------------------------------------------------------------
@dataclass
class ExitWatch:
    """When the server process ended, seen from a thread that waits for it."""

    sigterm_s: float | None = None
    exit_s: float | None = None
    code: int | None = None

    @property
    def seconds(self) -> float | None:
        if self.sigterm_s is None or self.exit_s is None:
            return None
        return self.exit_s - self.sigterm_s


def sigterm_and_watch(server: Server, sigterm: threading.Event) -> tuple[ExitWatch, threading.Thread]:
    """Send SIGTERM (``sigterm`` set just before) and time the exit from a thread."""
    watch = ExitWatch()

    def wait() -> None:
        watch.code = server.proc.wait()
        watch.exit_s = time.monotonic()

    sigterm.set()
    watch.sigterm_s = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    return watch, waiter


def host_port(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def summarize(streams: list[Stream], clients: list[Client], probed: list[Probe],
              watch: ExitWatch, drain_timeout_s: float) -> dict[str, Any]:
    """The figures the run prints (also what the test checks)."""
    outcomes = [o for c in clients for o in c.outcomes]
    after = [o for o in outcomes if o.after_sigterm]
    all_after = after + [Outcome(True, p.status, p.retry_after, p.failure) for p in probed]
    stream_failures = [s.failure for s in streams if s.failure]
    return {
        "streams": len(streams),
        "streams_done": sum(s.ended_with_done for s in streams),
        "streams_finished": sum(s.ended_with_done and s.error is None for s in streams),
        "streams_error_event": sum(s.ended_with_done and s.error is not None for s in streams),
        "streams_cut": sum(s.cut for s in streams),
        "streams_unanswered": sum(s.status is None for s in streams),
        "stream_outcomes": dict(Counter(s.outcome for s in streams)),
        "kserve_sent": len(outcomes),
        "kserve_answered": sum(o.status is not None for o in outcomes),
        "kserve_unanswered": sum(o.status is None and o.failure != "ConnectionRefusedError"
                                 for o in outcomes),
        "kserve_refused": sum(o.failure == "ConnectionRefusedError" for o in outcomes),
        "kserve_by_status": dict(Counter(o.status for o in outcomes if o.status is not None)),
        "kserve_200_after_sigterm": sum(o.status == 200 for o in after),
        "retry_after_503s": sum(o.status == 503 and o.retry_after is not None for o in all_after),
        "plain_503s": sum(o.status == 503 and o.retry_after is None for o in all_after),
        "resets": sum(is_reset(o.failure) for o in outcomes) +
                  sum(is_reset(p.failure) for p in probed) +
                  sum(is_reset(f) for f in stream_failures),
        "refused_connections": sum(o.failure == "ConnectionRefusedError" for o in all_after),
        "other_failures": dict(Counter(o.failure for o in outcomes + all_after
                                       if o.failure and not is_reset(o.failure)
                                       and o.failure != "ConnectionRefusedError")),
        "probes": {f"{p.method} {p.path}": (p.status, p.retry_after, p.failure) for p in probed},
        "exit_code": watch.code,
        "exit_s": watch.seconds,
        "drain_timeout_s": drain_timeout_s,
    }


def print_report(r: dict[str, Any]) -> None:
    n = r["streams"]
    print(f"streams ended with [DONE]      {r['streams_done']}/{n}  "
          f"({r['streams_finished']} finished, {r['streams_error_event']} ended by the drain "
          "with an error event first)")
    never = r["streams_unanswered"]
    print(f"streams cut                    {r['streams_cut']}/{n}"
          + (f"  ({never} never answered)" if never else ""))
    for outcome, count in sorted(r["stream_outcomes"].items()):
        print(f"  {outcome:45s} {count:4d}")
    print(f"requests answered              {r['kserve_answered'] + n - never} of "
          f"{r['kserve_sent'] + n - r['kserve_refused']}, unanswered "
          f"{r['kserve_unanswered'] + never}  (KServe {r['kserve_answered']}: "
          f"{r['kserve_by_status']}, of them 200 though sent after SIGTERM, before the "
          f"server handled it: {r['kserve_200_after_sigterm']}; streams {n - never})")
    print(f"503 with Retry-After after SIGTERM  {r['retry_after_503s']}  "
          f"(503 without it: {r['plain_503s']})")
    print(f"connection resets              {r['resets']}")
    other = r["other_failures"]
    print(f"connections refused (after exit) {r['refused_connections']}"
          + (f"  other failures: {other}" if other else ""))
    for what, (status, retry, failure) in r["probes"].items():
        print(f"  probe {what:32s} {failure or status}"
              f"{f'  Retry-After: {retry}' if retry else ''}")
    exit_s = r["exit_s"]
    shown = "did not exit" if exit_s is None else f"{exit_s:.2f} s"
    print(f"SIGTERM to exit                {shown}  (drain timeout {r['drain_timeout_s']:g} s; "
          f"exit code {r['exit_code']})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=12)
    ap.add_argument("--clients", type=int, default=64, help="closed-loop KServe clients on mlp")
    ap.add_argument("--max-tokens", type=int, default=960,
                    help="max_tokens of half the streams (too many to finish in the drain)")
    ap.add_argument("--long-n", type=int, default=4,
                    help="choices (n) of each of those: more sequences make each step slower")
    ap.add_argument("--short-tokens", type=int, default=120,
                    help="max_tokens of the other half (few enough to finish in it)")
    ap.add_argument("--sigterm-after", type=int, default=20,
                    help="SIGTERM once every stream has this many tokens")
    ap.add_argument("--drain-timeout-s", type=float, default=None,
                    help="passed to the server (default: its own, 5 s)")
    args = ap.parse_args(argv)
    if not 0 <= args.streams <= 200 or not 0 <= args.clients <= 1000:
        ap.error("--streams must be 0..200 and --clients 0..1000")
    drain_timeout_s = args.drain_timeout_s or DEFAULT_DRAIN_TIMEOUT_S
    cmd = [sys.executable, "-m", "runtime", "serve", "--port", "0", "--no-record",
           "--model", "mlp", "--model", "decoder"]
    if args.drain_timeout_s is not None:
        cmd += ["--drain-timeout-s", str(args.drain_timeout_s)]
    print(f"batchscope serve --model mlp --model decoder; {args.streams} streams "
          f"(half max_tokens {args.max_tokens} x n={args.long_n}, half {args.short_tokens}), "
          f"{args.clients} KServe "
          f"clients; SIGTERM once every stream has {args.sigterm_after} tokens", flush=True)
    server = Server(cmd, marks=("still running",))
    host, port = host_port(server.url)
    progress = Progress()
    sigterm = threading.Event()
    long_ones = [i % 4 < 2 for i in range(args.streams)]
    streams = [Stream(route(i % 2 == 1), completion_body(
        "decoder", i % 2 == 1, args.max_tokens if long else args.short_tokens,
        n=args.long_n if long else 1)) for i, long in enumerate(long_ones)]
    clients = [Client() for _ in range(args.clients)]
    threads = [threading.Thread(target=run_stream, args=(host, port, s, progress, f"s{i}"),
                                daemon=True) for i, s in enumerate(streams)]
    threads += [threading.Thread(target=run_client, args=(host, port, "/v2/models/mlp/infer",
                                                          MLP_BODY, c, sigterm, progress),
                                 daemon=True) for c in clients]
    watch = ExitWatch()
    try:
        for t in threads:
            t.start()
        going = progress.wait(lambda c: c["streams ended"] > 0 or (
            all(c[f"s{i}"] >= args.sigterm_after for i in range(args.streams))
            and c["answers"] >= 2 * args.clients), START_WAIT_S)
        if not going or progress.counts["streams ended"]:
            print(f"the load did not get going within {START_WAIT_S:g} s, or a stream ended "
                  f"before SIGTERM: {dict(progress.counts)}")
            for s in streams:
                if s.status is not None and s.status != 200:
                    print(f"  {s.path} answered {s.status}: {s.answer[:300]!r}")
            return 1
        watch, waiter = sigterm_and_watch(server, sigterm)
        progress.wait(lambda c: c["clients ended"] >= args.clients, END_WAIT_S)
        probed = probes()
        for p in probed:
            send_probe(host, port, p)
        waiter.join(END_WAIT_S)
        for t in threads:
            t.join(max(0.1, END_WAIT_S - (time.monotonic() - watch.sigterm_s)))
    finally:
        if server.proc.poll() is None:
            server.stop()
    print_report(summarize(streams, clients, probed, watch, drain_timeout_s))
    lines, marks = server.counts()
    if marks:
        print(f"server log: {marks.get('still running', 0)} 'still running ... ended now' line(s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
