"""A generation model served next to a request model: /v1/completions, live tuning,
clients that leave, and the generation series of ``/metrics``."""

from __future__ import annotations

import asyncio
import socket
import time

import httpx
import orjson
import pytest

from batchscope.storage import control
from batchscope.storage.db import make_engine
from runtime.api.config import ServerConfig
from runtime.generation.config import GenerationConfig
from runtime.generation.engine import GenerationEngine
from runtime.generation.toys import SteppedModel
from runtime.models.decoder import TinyDecoder
from runtime.models.toys import DoubleModel
from runtime.server.metrics import MetricsRecorder
from runtime.server.service import Service, ServiceThread
from tests.factories import request, samples, wait_until

pytestmark = pytest.mark.slow


def test_completions_and_database_commands_reach_the_generation_engine(tmp_path):
    db_url = f"sqlite:///{tmp_path / 'gen.db'}"
    service = Service({"double": DoubleModel()}, None,
                      ServerConfig(database_url=db_url, control_poll_interval_s=0.05),
                      generation={"decoder": TinyDecoder(d_model=32, n_layers=1)},
                      instance_id="gen-test")
    with ServiceThread(service) as runner, httpx.Client(base_url=runner.url, timeout=60) as http:
        r = http.post("/v1/completions", json={"model": "decoder", "prompt": "hi",
                                               "max_tokens": 4})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] >= 1
        assert http.get("/v2/models/double/ready").status_code == 200
        db = make_engine(db_url)
        assert control.current_settings(db, "gen-test", "decoder")[0] == 1
        good = control.request_change(db, model="decoder", changes={"max_num_seqs": 4},
                                      requested_by="dash")
        bad = control.request_change(db, model="decoder", changes={"max_num_seqs": 0},
                                     requested_by="dash")
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and control.command_status(db, bad).status == "pending":
            time.sleep(0.02)
        assert control.command_status(db, good).status == "applied"
        assert control.command_status(db, bad).status == "refused"
        assert service.generation.engines["decoder"].get_settings()[1].max_num_seqs == 4


def test_300_non_streamed_requests_whose_clients_leave_stop_generating():
    """Every client sends a completion of 100 tokens and closes its connection while the
    first step is held: no token is generated for any of them, and every KV block is
    free again."""
    model = SteppedModel(TinyDecoder(d_model=32, n_layers=1))
    service = Service({"double": DoubleModel()}, None, ServerConfig(record=False),
                      generation={"decoder": model})
    body = orjson.dumps({"model": "decoder", "prompt": "nobody waits for this",
                         "max_tokens": 100, "ignore_eos": True})
    with ServiceThread(service) as runner:
        engine = service.generation.engines["decoder"]
        host, port = runner.url.removeprefix("http://").split(":")
        before = engine.stats()
        model.hold()
        socks = []
        try:
            for _ in range(300):
                sock = socket.create_connection((host, int(port)), timeout=10)
                sock.sendall(request("POST", "/v1/completions", body,
                                     headers={"Content-Type": "application/json"}))
                socks.append(sock)
            assert wait_until(lambda: engine.stats()["running"] + engine.stats()["waiting"]
                              == 300, limit=6000), engine.stats()
            steps_held = model.steps_done
            for sock in socks:
                sock.close()
            assert wait_until(lambda: engine.stats()["requests"]["cancelled"] == 300,
                              limit=6000), engine.stats()["requests"]
        finally:
            model.release()
        assert wait_until(lambda: engine.stats()["blocks_used"] == 0)
        after = engine.stats()
    assert after["running"] == after["waiting"] == 0
    assert after["tokens_generated"] == before["tokens_generated"] == 0
    assert after["requests"]["ok"] == 0
    assert model.steps_done <= steps_held + 1  # at most the step that was at the gate


def test_generation_series_follow_vllm_names_and_buckets():
    """A real engine's records and stats folded into the vLLM-named series."""
    metrics = MetricsRecorder()
    model = SteppedModel(TinyDecoder(d_model=32, n_layers=1, max_model_len=128))
    engine = GenerationEngine(model, GenerationConfig(block_size=8, num_cache_blocks=32,
                                                      max_model_len=128),
                              recorder=metrics)
    metrics.bind(stats=lambda: {"decoder": engine.stats()})

    async def run() -> dict:
        await engine.start()
        try:
            async def one(prompt: str, n: int) -> None:
                async for _ in engine.generate(prompt_text=prompt, max_new_tokens=n,
                                               ignore_eos=True):
                    pass
            await asyncio.gather(one("abc", 5), one("hello", 3))
            model.hold()
            held = engine.submit(prompt_text="held", max_new_tokens=4, ignore_eos=True)
            while engine.stats()["running"] != 1:
                await asyncio.sleep(0.005)
            during = samples(metrics)  # one request running, its blocks taken
            model.release()
            async for _ in held:
                pass
            return during
        finally:
            model.release()
            await engine.stop()

    during = asyncio.run(run())
    after = samples(metrics)
    label = (("model_name", "decoder"),)
    assert during[("batchscope_num_requests_running", label)] == 1
    assert during[("batchscope_num_requests_waiting", label)] == 0
    assert during[("batchscope_kv_cache_usage_perc", label)] == 1 / 32
    assert after[("batchscope_num_requests_running", label)] == 0
    assert after[("batchscope_kv_cache_usage_perc", label)] == 0
    assert after[("batchscope_prompt_tokens_total", label)] == 3 + 5 + 4
    assert after[("batchscope_generation_tokens_total", label)] == 5 + 3 + 4
    assert after[("batchscope_num_preemptions_total", label)] == 0
    assert after[("batchscope_time_to_first_token_seconds_count", label)] == 3
    assert after[("batchscope_e2e_request_latency_seconds_count", label)] == 3
    # one observation per token after the first
    assert after[("batchscope_time_per_output_token_seconds_count", label)] == 4 + 2 + 3
    # vLLM's largest finite buckets
    assert ("batchscope_time_to_first_token_seconds_bucket", (("le", "2560.0"),) + label) in after
    assert ("batchscope_time_per_output_token_seconds_bucket", (("le", "80.0"),) + label) in after
    assert ("batchscope_e2e_request_latency_seconds_bucket", (("le", "7680.0"),) + label) in after


def test_metrics_of_a_served_generation_model():
    service = Service({"double": DoubleModel()}, None, ServerConfig(record=False),
                      generation={"decoder": TinyDecoder(d_model=32, n_layers=1)})
    with ServiceThread(service) as runner, httpx.Client(base_url=runner.url, timeout=60) as http:
        for _ in range(2):
            r = http.post("/v1/completions", json={"model": "decoder", "prompt": "hi",
                                                   "max_tokens": 4, "ignore_eos": True})
            assert r.status_code == 200, r.text
        text = http.get("/metrics").text
    assert 'batchscope_time_to_first_token_seconds_count{model_name="decoder"} 2.0' in text
    assert 'batchscope_time_per_output_token_seconds_count{model_name="decoder"} 6.0' in text
    assert 'batchscope_e2e_request_latency_seconds_count{model_name="decoder"} 2.0' in text
