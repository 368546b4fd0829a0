"""The load generator: option parsing, payloads, and bounded runs against a real server."""

from __future__ import annotations

import orjson
import pytest

from runtime.api.config import BatchingConfig, ServerConfig
from batchscope.load.loadgen import LoadError, build_payloads, parse_lengths, parse_priority, run_load
from runtime.models.toys import DoubleModel, VarLenModel
from runtime.server.service import Service, ServiceThread

VARLEN_META = {"name": "varlen", "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [-1]}]}


def test_length_and_priority_specs():
    assert parse_lengths("uniform:8:128") == ("uniform", (8, 128))
    assert parse_lengths("fixed:64") == ("fixed", (64,))
    assert parse_lengths("choice:16,64") == ("choice", (16, 64))
    for bad in ("uniform:9:3", "fixed:0", "gauss:1", "uniform:a:b"):
        with pytest.raises(LoadError, match="is not understood"):
            parse_lengths(bad)
    assert parse_priority("2") == [(2, 1.0)]
    assert parse_priority("1=0.25,3=0.75") == [(1, 0.25), (3, 0.75)]
    with pytest.raises(LoadError):
        parse_priority("1=-1")


def test_payloads_follow_metadata_lengths_and_parameters():
    bodies = build_payloads(VARLEN_META, lengths="uniform:3:5", priority="1=1,3=1",
                            timeout_ms=2.5, bypass=True, seed=1)
    docs = [orjson.loads(b) for b in bodies]
    lengths = {d["inputs"][0]["shape"][0] for d in docs}
    assert lengths == {3, 4, 5}
    assert all(len(d["inputs"][0]["data"]) == d["inputs"][0]["shape"][0] for d in docs)
    assert {d["parameters"]["priority"] for d in docs} == {1, 3}
    assert all(d["parameters"]["timeout"] == 2500 and d["parameters"]["realtime"] for d in docs)
    assert bodies == build_payloads(VARLEN_META, lengths="uniform:3:5", priority="1=1,3=1",
                                    timeout_ms=2.5, bypass=True, seed=1)


@pytest.fixture(scope="module")
def url():
    service = Service({"double": DoubleModel(), "varlen": VarLenModel()},
                      {"double": BatchingConfig(max_batch_size=8)}, ServerConfig(record=False))
    with ServiceThread(service) as runner:
        yield runner.url


@pytest.mark.slow
def test_closed_loop_stops_at_max_requests(url):
    report = run_load(url, "double", concurrency=4, duration_s=60, max_requests=40)
    assert report.sent == 40 and report.ok == 40 and report.errors_by_status == {}
    assert report.latency_p50_ms <= report.latency_p99_ms <= report.latency_max_ms


@pytest.mark.slow
def test_open_loop_counts_every_arrival_and_errors_by_status(url):
    report = run_load(url, "varlen", rate=400, duration_s=60, max_requests=30,
                      lengths="choice:4,2000")   # 2000 > max_length 1024 -> 422
    assert report.mode == "open" and report.sent == 30
    assert report.ok + report.errors_by_status.get("422", 0) == 30
    assert report.ok > 0 and report.errors_by_status.get("422", 0) > 0


@pytest.mark.slow
def test_unknown_model_is_a_load_error(url):
    with pytest.raises(LoadError, match="model 'nope' is not served"):
        run_load(url, "nope", duration_s=1)
