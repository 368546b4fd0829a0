"""Hostile requests against a real ``batchscope serve``: the fast subset of
``python -m benchmarks.reliability.hostile`` (which runs the same strategies for
minutes).

One server process (mlp, encoder, decoder; HTTP and gRPC; recording to a SQLite file of
its own, so that the trace export reads a real database) takes requests drawn by
``hypothesis`` (derandomized: the same requests every run) from each family of
``benchmarks.reliability.hostile``. Every one must be answered with a status under 500
(gRPC: a refusal's status), with a JSON ``error`` when refused, and quickly; a prober
in its own process watches how long the event loop is kept. At the end the server's
memory is within ``MEMORY_LIMIT_MB`` of what it held after warm-up, a good request is
answered 200, and SIGTERM stops it.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from benchmarks.reliability.hostile import (GRPC_STRATEGIES, HTTP_STRATEGIES, MEMORY_LIMIT_MB,
                                            Prober, good_request, start_server, stop_server)
from benchmarks.reliability.server import ROOT

pytestmark = pytest.mark.slow

STRATEGIES = {**HTTP_STRATEGIES, **GRPC_STRATEGIES}
#: a real export starts a process of its own: a few of them
EXAMPLES = {"gzip bomb": 6, "headers": 12, "trace export": 25}
#: examples of every other family
DEFAULT_EXAMPLES = 100
#: a refusal slower than this fails (the benchmark holds them to 1 s; a shared CI core
#: is given room)
LIMIT_S = 5.0
_SETTINGS = settings(deadline=None, derandomize=True, database=None,
                     suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def running(tmp_path_factory):
    before = set(os.listdir(ROOT))
    server, target = start_server(str(tmp_path_factory.mktemp("hostile") / "hostile.db"))
    try:
        for _ in range(10):
            assert good_request(target).status == 200
        state = {"server": server, "target": target, "rss_start": server.rss_mb(),
                 "prober": Prober(target), "sent": 0, "root_before": before}
        yield state
    finally:
        target.close()
        if server.proc.poll() is None:
            server.stop()


@pytest.mark.parametrize("kind", list(STRATEGIES))
def test_every_hostile_request_is_refused_cleanly(running, kind):
    @settings(_SETTINGS, max_examples=EXAMPLES.get(kind, DEFAULT_EXAMPLES))
    @given(data=st.data())
    def check(data):
        attack = data.draw(STRATEGIES[kind])
        outcome = running["target"].send(attack)
        running["sent"] += 1
        assert not outcome.failed(LIMIT_S), (attack, outcome)

    check()


def test_afterwards_memory_is_flat_it_serves_and_stops_on_sigterm(running):
    server, target = running["server"], running["target"]
    assert running["sent"] >= 100
    probes = running["prober"].stop()
    assert probes["failures"] == 0 and probes["probes"] > 0
    assert server.rss_mb() - running["rss_start"] <= MEMORY_LIMIT_MB
    assert good_request(target).status == 200
    assert stop_server(server) < 30
    # no trace file, nor anything else, written into the checkout (tools' hidden folders,
    # such as hypothesis's own, aside)
    new = set(os.listdir(ROOT)) - running["root_before"]
    assert {name for name in new if not name.startswith(".")} == set()
