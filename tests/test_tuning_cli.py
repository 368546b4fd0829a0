"""``batchscope tune``: mistakes on the command line are one line on stderr and exit
status 2, before anything is sent; a short session against a real server prints the
result sentence and leaves the settings as they were."""

from __future__ import annotations

import json
import socket

import pytest

from runtime.api.config import ServerConfig
from runtime.models.toys import DoubleModel
from runtime.server.service import Service, ServiceThread
from runtime.tools.cli import main

BASE = ["tune", "--model", "double", "--slo-p99-ms", "50"]


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("argv, says", [
    (["tune", "--model", "m"], "the following arguments are required: --slo-p99-ms"),
    (BASE + ["--slo-p99-ms", "-5"], "--slo-p99-ms -5.0 must be a positive number"),
    (BASE + ["--budget-s", "0"], "--budget-s 0.0 must be a positive number"),
    (BASE + ["--load", "replay"], "--load replay reads the recorded traffic from a database"),
    (BASE + ["--load", "nowhere"], "argument --load: invalid choice: 'nowhere'"),
    (BASE + ["--concurrency", "4", "--rate", "10"], "not allowed with argument --concurrency"),
    (BASE + ["--concurrency", "0"], "--concurrency 0 must be at least 1"),
    (BASE + ["--objective", "latency"], "give --rate R"),
    (BASE + ["--max-batch-sizes", "8,lots"], "--max-batch-sizes '8,lots' is not understood"),
    (BASE + ["--max-batch-sizes", "0,8"], "max_batch_size=0 must be an integer from 1 to 4096"),
    (BASE + ["--queue-delays-ms", "none,-1"], "max_queue_delay_ms=-1.0 must be null"),
    (BASE + ["--policies", "eager"], "use some of static, dynamic, adaptive"),
    (BASE + ["--lengths", "gauss:3"], "--lengths 'gauss:3' is not understood"),
    (BASE + ["--load", "live", "--concurrency", "8"], "--load live sends no load of its own"),
    (BASE + ["--db", "/tmp/x.db", "--load", "replay"], "is a path, not a database URL"),
    (BASE + ["--control-token", "short"], "has 5 characters; use at least 16"),
    (BASE + ["--url", f"http://127.0.0.1:{closed_port()}"], "cannot reach http://127.0.0.1:"),
    (BASE + ["--url", "ftp://x"], "--url 'ftp://x' must look like http://127.0.0.1:8000"),
])
def test_mistakes_are_one_line_and_exit_2(argv, says, capsys, monkeypatch):
    monkeypatch.delenv("BATCHSCOPE_CONTROL_TOKEN", raising=False)
    assert main(argv) == 2
    out = capsys.readouterr()
    assert says in out.err and len(out.err.strip().splitlines()) == 1, out.err
    assert "Traceback" not in out.err and out.out == ""


@pytest.mark.slow
def test_a_short_session_prints_the_sentence_and_restores(capsys):
    service = Service({"double": DoubleModel()}, None, ServerConfig(record=False))
    with ServiceThread(service) as runner:
        before = service.engine.get_settings("double")[1].to_dict()
        code = main(["tune", "--url", runner.url, "--model", "double", "--slo-p99-ms", "1000",
                     "--budget-s", "3", "--window-s", "0.25", "--settle-s", "0.05", "--warmup-s", "0.2",
                     "--concurrency", "4", "--policies", "dynamic", "--max-batch-sizes", "4,8",
                     "--queue-delays-ms", "none", "--preferred", "none", "--json"])
        after = service.engine.get_settings("double")[1].to_dict()
    assert code == 0
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert doc["model"] == "double" and doc["trials"] and doc["outcome"] == (
        "restored the starting settings")
    assert "trials" in doc["sentence"] and doc["start"]["max_batch_size"] == 32
    assert after == before
