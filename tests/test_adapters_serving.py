"""LoRA adapters end to end: ``batchscope serve --adapter`` with the encoder in its device
process, requests over KServe v2 HTTP (the parameter ``adapter``), gRPC and OpenAI
embeddings (``model: "encoder:<adapter>"``), the control API's load and unload, and the
errors: 404 for an unknown adapter, 422 for one that does not fit, 507 past the budget."""

from __future__ import annotations

import asyncio
import os

import httpx
import numpy as np
import pytest
import torch

from runtime.adapters.demo import write_demo_adapters
from runtime.adapters.lora import random_pairs, write_peft
from runtime.models.encoder import ADAPTER_TARGETS, EncoderModel
from tests.factories import serving


def _ids(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(1, 1000, n).tolist()


def _infer(client: httpx.Client, url: str, ids: list[int], adapter: str | None = None):
    body = {"inputs": [{"name": "INPUT_IDS", "datatype": "INT64", "shape": [len(ids)],
                        "data": ids}]}
    if adapter is not None:
        body["parameters"] = {"adapter": adapter}
    return client.post(f"{url}/v2/models/encoder/infer", json=body)


def _expected(adapter_dir: str | None, ids: list[int]) -> np.ndarray:
    """The request alone, in this process, with its adapter."""
    from runtime.adapters.lora import AdapterRef

    model = EncoderModel()
    model.setup("cpu")
    batch = model.collate([torch.tensor(ids)], None)
    if adapter_dir is None:
        return model.predict(batch)[0].numpy()
    model.adapter_bank.prepare({0: AdapterRef("x", adapter_dir, 1)})
    with model.adapter_bank.activate([0]):
        return model.predict(batch)[0].numpy()


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, str]:
    return write_demo_adapters(str(tmp_path_factory.mktemp("demo-adapters")), 3)


@pytest.fixture(scope="module")
def server(adapters):
    args = ["--model", "encoder", "--port", "0", "--no-record", "--torch-threads", "1",
            "--set", "encoder.adapter_memory_mb=2"]
    for name in ("enc-0", "enc-1"):
        args += ["--adapter", f"{name}={adapters[name]}"]
    with serving(args) as url:
        yield url


def test_mixed_requests_get_their_adapters_answers(server, adapters):
    with httpx.Client(timeout=60) as client:
        meta = client.get(f"{server}/v2/models/encoder").json()
        assert meta["adapters"] == ["enc-0", "enc-1"]

        async def many():
            async with httpx.AsyncClient(timeout=60) as aclient:
                jobs = []
                for i in range(12):
                    name = [None, "enc-0", "enc-1"][i % 3]
                    body = {"inputs": [{"name": "INPUT_IDS", "datatype": "INT64",
                                        "shape": [10 + i], "data": _ids(i, 10 + i)}]}
                    if name:
                        body["parameters"] = {"adapter": name}
                    jobs.append(aclient.post(f"{server}/v2/models/encoder/infer", json=body))
                return await asyncio.gather(*jobs)

        answers = asyncio.run(many())
        for i, answer in enumerate(answers):
            assert answer.status_code == 200, answer.text
            name = [None, "enc-0", "enc-1"][i % 3]
            got = np.array(answer.json()["outputs"][0]["data"], dtype=np.float32)
            want = _expected(adapters[name] if name else None, _ids(i, 10 + i))
            np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
        listed = client.get(f"{server}/v2/models/encoder/adapters").json()["adapters"]
        assert [a["name"] for a in listed] == ["enc-0", "enc-1"]
        assert {a["slot"] for a in listed} == {0, 1}


def test_unknown_adapter_is_404_naming_the_loaded_ones(server):
    with httpx.Client(timeout=60) as client:
        answer = _infer(client, server, _ids(1, 5), "nope")
        assert answer.status_code == 404
        assert "enc-0" in answer.json()["error"] and "enc-1" in answer.json()["error"]
        answer = client.post(f"{server}/v1/embeddings",
                             json={"model": "encoder:nope", "input": "hello"})
        assert answer.status_code == 404 and "encoder:enc-0" in answer.text


def test_openai_embeddings_with_an_adapter(server, adapters):
    with httpx.Client(timeout=60) as client:
        answer = client.post(f"{server}/v1/embeddings",
                             json={"model": "encoder:enc-1", "input": [[5, 6, 7, 8]]})
        assert answer.status_code == 200, answer.text
        doc = answer.json()
        assert doc["model"] == "encoder:enc-1"
        np.testing.assert_allclose(np.array(doc["data"][0]["embedding"], dtype=np.float32),
                                   _expected(adapters["enc-1"], [5, 6, 7, 8]), atol=1e-5, rtol=0)


def test_grpc_parameter_adapter_is_read_by_the_shared_codec():
    from runtime.server.kserve import InferRequest, apply_scheduling

    req = InferRequest({})
    apply_scheduling({"adapter": "enc-0"}, 3, req)
    assert req.adapter == "enc-0"


def test_load_refuses_what_does_not_fit_and_unload_finishes_queued(server, adapters, tmp_path):
    with httpx.Client(timeout=60) as client:
        wrong = str(tmp_path / "wrong")
        bad_targets = {"encoder.layers.0.linear1": (128, 1024)}
        write_peft(wrong, random_pairs(bad_targets, 8, seed=3))
        answer = client.post(f"{server}/v2/models/encoder/adapters",
                             json={"name": "wrong", "path": wrong})
        assert answer.status_code == 422 and "[8, 256]" in answer.json()["error"]
        big = str(tmp_path / "big")
        write_peft(big, random_pairs(ADAPTER_TARGETS, 64, seed=4))
        answer = client.post(f"{server}/v2/models/encoder/adapters",
                             json={"name": "big", "path": big})
        assert answer.status_code == 507 and "adapter_memory_mb" in answer.json()["error"]
        names = [a["name"] for a in client.get(f"{server}/v2/models/encoder/adapters").json()["adapters"]]
        assert names == ["enc-0", "enc-1"]  # nothing changed

        answer = client.post(f"{server}/v2/models/encoder/adapters",
                             json={"name": "enc-2", "path": adapters["enc-2"]})
        assert answer.status_code == 201, answer.text
        assert _infer(client, server, _ids(2, 9), "enc-2").status_code == 200

        async def unload_while_queued():
            async with httpx.AsyncClient(timeout=60) as aclient:
                body = {"inputs": [{"name": "INPUT_IDS", "datatype": "INT64", "shape": [64],
                                    "data": _ids(3, 64)}], "parameters": {"adapter": "enc-2"}}
                queued = [asyncio.ensure_future(aclient.post(
                    f"{server}/v2/models/encoder/infer", json=body)) for _ in range(16)]
                await asyncio.sleep(0.05)
                gone = await aclient.delete(f"{server}/v2/models/encoder/adapters/enc-2")
                return gone, await asyncio.gather(*queued)

        gone, answers = asyncio.run(unload_while_queued())
        assert gone.status_code == 200, gone.text
        assert all(a.status_code in (200, 404) for a in answers)
        assert any(a.status_code == 200 for a in answers)
        assert _infer(client, server, _ids(2, 9), "enc-2").status_code == 404


def test_the_load_command_spreads_requests_over_the_adapters_named(server):
    import json
    import subprocess
    import sys

    load = subprocess.run(
        [sys.executable, "-m", "runtime.tools.cli", "load", "--url", server, "--model",
         "encoder", "--concurrency", "4", "--duration-s", "30", "--max-requests", "60",
         "--lengths", "fixed:8", "--adapter", "enc-0", "--adapter", "enc-1", "--adapter",
         "base", "--json"], capture_output=True, text=True, timeout=120)
    assert load.returncode == 0, load.stderr
    report = json.loads(load.stdout)
    assert report["sent"] == report["ok"] == 60 and report["errors_by_status"] == {}
    stats = httpx.get(f"{server}/metrics", timeout=10).text
    served = {line.split('adapter="')[1].split('"')[0] for line in stats.splitlines()
              if line.startswith("batchscope_adapter_requests_total{")
              and 'model="encoder"' in line}
    assert {"enc-0", "enc-1"} <= served


def test_demo_adapters_are_written_whole_and_reused(tmp_path, monkeypatch):
    """Each adapter lands by a rename, so a folder there is complete; a second writer of the
    same root (another demo) keeps what is there; the cache's name follows the recipe."""
    from runtime.adapters import demo

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    root = demo.cached_root()
    assert root.startswith(str(tmp_path / "cache" / "batchscope" / "demo-adapters" / "encoder-"))
    first = write_demo_adapters(root, 2)
    weights = os.path.join(first["enc-0"], "adapter_model.safetensors")
    made = os.stat(weights).st_mtime_ns
    assert write_demo_adapters(root, 2) == first
    assert os.stat(weights).st_mtime_ns == made  # reused, not written again
    assert sorted(os.listdir(root)) == ["enc-0", "enc-1"]  # no half-written folder
    monkeypatch.setattr(demo, "SEED", demo.SEED + 1)
    assert demo.cached_root() != root  # other weights, another folder
