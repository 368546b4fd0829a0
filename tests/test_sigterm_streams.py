"""SIGTERM while streamed completions run, against a real ``batchscope serve`` process.

The small-scale, deterministic form of ``benchmarks/reliability/sigterm_streams.py``
(whose client code it uses). Two streams and one whole completion run on ``gated``
(``runtime.models.toys.GatedDecoder``), held mid-generation by a gate file the test
creates once each stream has a token: they cannot finish, whatever the machine's
speed, so the drain must end them, and they keep the server draining until its
reserve for stopping. Two streams on ``decoder`` run freely (they finish in the drain,
or are ended by it: either way with ``[DONE]``), and 8 closed-loop KServe clients run
on ``mlp``. Then SIGTERM; every wait is a bounded wait on a count.
"""

from __future__ import annotations

import re
import sys
import threading
import time

import httpx
import pytest

from benchmarks.reliability.server import Server
from benchmarks.reliability.sigterm_streams import (MLP_BODY, Client, Probe, Progress, Stream,
                                                    completion_body, host_port, probes,
                                                    route, run_client, run_stream,
                                                    send_probe, sigterm_and_watch, summarize)
from runtime.models.toys import GATE_ENV

pytestmark = pytest.mark.slow

#: the server's drain timeout here; of it, 1 s is its reserve for stopping
DRAIN_TIMEOUT_S = 6.0
CLIENTS = 8
WAIT_S = 60.0


def whole_completion(host: str, port: int, probe: Probe, progress: Progress) -> None:
    send_probe(host, port, probe)
    progress.add("whole answered")


def gated_in_engine(url: str) -> int:
    """Requests the gated model holds (running or waiting)."""
    stats = httpx.get(f"{url}/v2/models/gated/batching/stats", timeout=10.0).json()
    return stats["running"] + stats["waiting"]


def wait_for(check, what: str, timeout_s: float = WAIT_S):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def test_sigterm_drains_streams_answers_what_was_taken_and_refuses_the_rest(tmp_path,
                                                                           monkeypatch):
    gate = tmp_path / "gate"
    monkeypatch.setenv(GATE_ENV, str(gate))
    server = Server([sys.executable, "-m", "runtime", "--log-level", "info", "serve",
                     "--port", "0", "--no-record", "--model", "mlp", "--model", "decoder",
                     "--model", "runtime.models.toys:GatedDecoder",
                     "--drain-timeout-s", str(DRAIN_TIMEOUT_S)])
    host, port = host_port(server.url)
    progress, sigterm = Progress(), threading.Event()
    held = [Stream(route(chat), completion_body("gated", chat, 900)) for chat in (False, True)]
    free = [Stream(route(chat), completion_body("decoder", chat, 900)) for chat in (False, True)]
    whole = Probe("POST", "/v1/completions", completion_body("gated", False, 900, stream=False))
    clients = [Client() for _ in range(CLIENTS)]
    threads = []

    def start(target, *args) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        thread.start()
        threads.append(thread)

    try:
        for i, stream in enumerate(held):
            start(run_stream, host, port, stream, progress, f"held{i}")
        assert progress.wait(lambda c: c["held0"] and c["held1"], WAIT_S), progress.counts
        gate.touch()  # from the next step on, the gated model generates no more
        start(whole_completion, host, port, whole, progress)
        wait_for(lambda: gated_in_engine(server.url) == 3, "the gated model to hold 3 requests")
        for i, stream in enumerate(free):
            start(run_stream, host, port, stream, progress, f"free{i}")
        for client in clients:
            start(run_client, host, port, "/v2/models/mlp/infer", MLP_BODY, client, sigterm,
                  progress)
        assert progress.wait(lambda c: c["free0"] and c["free1"]
                             and c["answers"] >= 2 * CLIENTS, WAIT_S), progress.counts
        assert progress.counts["streams ended"] == 0 and not progress.counts["whole answered"]

        watch, waiter = sigterm_and_watch(server, sigterm)
        # the held streams keep the server draining for 5 s: time for every client to
        # get its refusal, and for the probes to be answered while it drains
        assert progress.wait(lambda c: c["clients ended"] == CLIENTS, WAIT_S), progress.counts
        probed = probes()
        for probe in probed:
            send_probe(host, port, probe)
        waiter.join(WAIT_S)
        for thread in threads:
            thread.join(WAIT_S)
        assert not any(t.is_alive() for t in threads)
    finally:
        if server.proc.poll() is None:
            server.stop()
    report = summarize(held + free, clients, probed, watch, DRAIN_TIMEOUT_S)
    log = "".join(server.tail)

    # 1. running streams end with [DONE], never cut; the held ones with an error event first
    assert report["streams_done"] == 4 and report["streams_cut"] == 0, report
    for stream in held:
        assert stream.error is not None and stream.error["code"] == "shutting_down", stream
        assert stream.tokens >= 1 and stream.ended_with_done
    # ... the whole completion taken in is answered, once: 503 in OpenAI's shape
    assert whole.status == 503 and whole.openai_shaped, whole
    assert whole.answer["error"]["code"] == "shutting_down"
    # ... and so is every KServe request: no reset, none unanswered; each client's answers
    # are 200s, then one 503 with Retry-After once the server drains
    assert report["resets"] == 0 and report["kserve_unanswered"] == 0, report
    for client in clients:
        *before, last = client.outcomes
        assert all(o.status == 200 for o in before), client
        assert last.after_sigterm and last.status == 503 and last.retry_after == "1", client

    # 2. new requests while draining: 503 with Retry-After, in each route's error shape
    by_path = {p.path: p for p in probed}
    for path in ("/v1/completions", "/v1/chat/completions"):
        probe = by_path[path]
        assert probe.status == 503 and probe.retry_after == "1" and probe.openai_shaped, probe
        assert probe.answer["error"]["code"] == "shutting_down"
        assert probe.connection == "close"
    for path in ("/v2/models/mlp/infer", "/v2/health/ready"):
        probe = by_path[path]
        assert probe.status == 503 and probe.retry_after == "1" and probe.kserve_shaped, probe
    assert by_path["/v2/health/live"].status == 200  # alive until it exits

    # 3. exit 0 within the drain timeout: the server's own account of it, and the exit as
    # seen from here (which adds the signal's delivery and the process' end)
    assert report["exit_code"] == 0, log
    stopped = re.search(r"stopped (\d+\.\d+) s after the signal", log)
    assert stopped is not None, log
    assert float(stopped.group(1)) <= DRAIN_TIMEOUT_S, log
    ended = re.search(r"(\d+) request\(s\) still running", log)  # the held ones, at least
    assert ended is not None and int(ended.group(1)) >= 3, log
    assert report["exit_s"] is not None and report["exit_s"] <= DRAIN_TIMEOUT_S + 1.0, report
