"""The offline benchmark loop and the no-batching baseline server, driven for real."""

from __future__ import annotations

import os
import sys
import threading
import time

import numpy as np
import pytest
from fastapi.testclient import TestClient

from benchmarks.baseline_server import create_app, load_models
from benchmarks.bench_offline import offline_throughput, run_offline
from benchmarks.common import format_table, make_inputs, torch_threads
from runtime.models.encoder import EncoderModel


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():  # the suite shares two cores: spinning intra-op threads slow everyone
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def client():
    models = load_models(["mlp", "encoder"])
    with TestClient(create_app(models)) as c:
        yield c, models


def test_offline_counts_items_and_padding():
    model = EncoderModel()
    model.setup("cpu")
    reqs = make_inputs("encoder", 16, seed=3)
    res = offline_throughput(model, reqs, 4, order="sorted", duration_s=60.0, max_batches=4, warmup_batches=0)
    assert (res.batches, res.items, res.batch_size) == (4, 16, 4)
    lengths = sorted(len(r["INPUT_IDS"]) for r in reqs)
    padded = sum(4 * max(lengths[i:i + 4]) for i in range(0, 16, 4))
    assert res.padding_efficiency == pytest.approx(sum(lengths) / padded)
    random_order = offline_throughput(model, reqs, 4, order="random", duration_s=60.0, max_batches=4,
                                      warmup_batches=0)
    assert random_order.padding_efficiency < res.padding_efficiency


def test_run_offline_rows_and_ratios():
    rows = run_offline(["mlp"], [1, 4], duration_s=0.0, pool_size=16)
    assert [r["batches"] for r in rows] == [16, 4]   # one whole pass over the pool
    assert [(r["model"], r["order"], r["batch_size"]) for r in rows] == [("mlp", "fixed", 1), ("mlp", "fixed", 4)]
    assert rows[0]["speedup_vs_batch1"] == 1.0 and rows[1]["items_per_s"] > 0
    table = format_table(rows, ["model", "batch_size", "items_per_s"])
    assert table.splitlines()[0].split() == ["model", "batch_size", "items_per_s"]


def test_make_inputs_is_seeded():
    a, b = make_inputs("encoder", 5, seed=1), make_inputs("encoder", 5, seed=1)
    assert all(np.array_equal(x["INPUT_IDS"], y["INPUT_IDS"]) for x, y in zip(a, b))
    assert all(8 <= len(x["INPUT_IDS"]) <= 128 for x in make_inputs("encoder", 50))
    with pytest.raises(ValueError, match="no input generator"):
        make_inputs("other", 1)


def test_baseline_server_answers_like_the_model(client):
    c, models = client
    assert c.get("/v2/health/ready").status_code == 200
    meta = c.get("/v2/models/encoder").json()
    assert meta["inputs"] == [{"name": "INPUT_IDS", "datatype": "INT64", "shape": [-1]}]
    ids = list(range(1, 21))
    r = c.post("/v2/models/encoder/infer", json={"id": "r1", "inputs": [
        {"name": "INPUT_IDS", "datatype": "INT64", "shape": [1, 20], "data": ids}]})
    assert r.status_code == 200, r.text
    doc = r.json()
    assert doc["id"] == "r1" and doc["outputs"][0]["name"] == "EMBEDDING"
    assert doc["outputs"][0]["shape"] == [1, 256]
    model = models["encoder"]
    want = model.split(model.predict(model.collate([model.decode({"INPUT_IDS": np.array(ids)})], None)), 1)
    np.testing.assert_allclose(doc["outputs"][0]["data"], want[0]["EMBEDDING"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path, body, status, words", [
    ("/v2/models/nope/infer", {"inputs": []}, 404, "not served here"),
    ("/v2/models/mlp/infer", {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [3],
                                          "data": [1, 2, 3]}]}, 400, "FP32 [256]"),
    ("/v2/models/encoder/infer", {"inputs": [{"name": "INPUT_IDS", "datatype": "INT64", "shape": [2],
                                              "data": [1, 99999]}]}, 422, "token id 99999"),
    ("/v2/models/mlp/infer", {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [256],
                                          "data": [1.0]}]}, 400, "needs 256 values"),
    ("/v2/models/mlp/infer", {"nothing": 1}, 400, '"inputs" list'),
])
def test_baseline_server_errors(client, path, body, status, words):
    c, _ = client
    r = c.post(path, json=body)
    assert r.status_code == status and words in r.json()["error"]


@pytest.mark.slow
def test_bench_adapters_runs_every_scenario(capsys):
    """The adapters benchmark end to end, briefly: every scenario answers, the mean batch
    sizes follow the batching (a batch of one adapter never holds more than its clients),
    and the ceiling and the slot cache's check are printed."""
    import json

    from benchmarks.bench_adapters import main

    assert main(["--model", "wide", "--duration-s", "0.4", "--clients", "16",
                 "--max-batch-size", "16", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert all(rate > 0 for rate in result["requests_per_s"].values())
    sizes = result["mean_batch"]
    assert 1 <= sizes["per_adapter"] <= 2  # 16 clients over 8 adapters: 2 per adapter
    assert sizes["mixed"] <= 16
    assert result["ceiling"]["ratio"] > 0
    assert result["lru"]["mismatches"] == 0


def test_cpu_share_reads_a_process_tree_and_works_out_the_bound():
    """The CPU of a server's children is counted (a child that does a fixed amount of
    work and then waits, under a parent that only waits), by child too, and the bound
    follows from the CPU per request."""
    import subprocess
    import sys

    from benchmarks.cpu_share import CpuShare, tree_cpu_s

    child = ("import sys; from batchscope.threadnames import name_native; "
             "name_native('batchscope-summer'); sum(range(20_000_000)); "
             "print('done', flush=True); sys.stdin.read()")
    parent = subprocess.Popen([sys.executable, "-c",
                               f"import subprocess, sys; subprocess.run([sys.executable, '-c', {child!r}])"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        with CpuShare(parent.pid, cores=2) as cpu:
            assert parent.stdout.readline() == "done\n"  # the child did its work and waits
            assert len(tree_cpu_s(parent.pid)) == 2
        assert cpu.used["its child processes"] > 0.05  # 20M additions: about a second
        assert cpu.used["its child processes"] > 5 * cpu.used["serving process"]
        # split by child, by the name it gave itself (``batchscope.threadnames``)
        assert cpu.children["summer"] == pytest.approx(cpu.used["its child processes"])
    finally:
        parent.stdin.close()
        parent.wait(30)
    cpu.used = {"serving process": 0.5, "its child processes": 0.3, "load generator": 0.2}
    cpu.wall_s = 1.0
    summary = cpu.summary(10_000)  # 100 us of CPU per request, 10,000 req/s on 2 cores
    assert summary["total_cpu_us_per_request"] == pytest.approx(100.0)
    assert summary["cpu_bound_rps"] == pytest.approx(20_000.0)
    assert summary["share_of_cpu_bound"] == pytest.approx(0.5)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="threads are read from /proc")
def test_cpu_share_splits_the_serving_process_by_named_thread():
    """A thread that names itself (``batchscope.threadnames``) and spins is found by its
    name, its CPU inside the block counted to it (a thread is read while it lives: the
    serving process's threads live as long as it does)."""
    from benchmarks.cpu_share import CpuShare, thread_cpu_s
    from batchscope.threadnames import name_native

    spun, done = threading.Event(), threading.Event()

    def spin() -> None:
        name_native("batchscope-spin")
        end = time.thread_time() + 0.3
        while time.thread_time() < end:
            pass
        spun.set()
        done.wait(30)

    worker = threading.Thread(target=spin)
    try:
        with CpuShare(os.getpid(), cores=2) as cpu:
            worker.start()
            assert spun.wait(30)
    finally:
        done.set()
        worker.join(30)
    assert 0.25 < cpu.threads["spin"] < 5.0
    assert "spin" not in thread_cpu_s(os.getpid())  # ended: nothing left to read
    summary = cpu.summary(1_000)
    assert summary["serving_threads_us"]["spin"] == pytest.approx(cpu.threads["spin"] * 1e3)


def test_short_runs_ratios_are_the_medians_of_each_rounds_ratios():
    from benchmarks.short_runs import CLIENTS, ratios

    def fig(rps, p50=1.0, p99=2.0, **more):
        return {"throughput_rps": rps, "latency_p50_ms": p50, "latency_p99_ms": p99, **more}

    rounds = []
    for ours, plain, ceiling in ((90.0, 100.0, 90.0), (120.0, 100.0, 100.0), (100.0, 100.0, 125.0)):
        got = {"offline/mlp": ceiling}
        for c in CLIENTS:
            got[f"a/mlp/c{c}"], got[f"b/mlp/c{c}"] = fig(ours), fig(plain)
        got["a/mlp/open"], got["b/mlp/open"] = fig(1, p99=ours / 50), fig(1, p99=2.0)
        rounds.append(got)
    got = ratios({"rounds": rounds}, "a", "b", models=("mlp",))
    assert got["short_mlp_c64_throughput_vs_plain"] == 1.0       # 0.9, 1.2, 1.0
    assert got["short_mlp_c64_vs_offline"] == 1.0                  # 1.0, 1.2, 0.8
    assert got["short_mlp_open20_p99_vs_plain"] == 1.0             # 0.9, 1.2, 1.0
    assert got["short_mlp_c1_p50_minus_plain_ms"] == 0.0
