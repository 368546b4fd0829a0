"""The HTTP control API answers for generation models too, through a real server;
``batchscope serve``'s per-model settings reach the generation model."""

from __future__ import annotations

import argparse

import httpx
import pytest

from runtime.tools.cli import UsageError, model_settings
from runtime.api.config import BatchingConfig, ServerConfig
from runtime.generation.config import GenerationConfig
from runtime.models.decoder import TinyDecoder
from runtime.models.toys import DoubleModel
from runtime.server.service import Service, ServiceThread


def _args(**kw) -> argparse.Namespace:
    base = {"model_config": [], "sets": [], "no_bucketing": False}
    base.update(kw)
    return argparse.Namespace(**base)


@pytest.mark.slow
def test_control_api_reads_and_changes_a_generation_model(tmp_path):
    decoder = TinyDecoder(d_model=32, n_layers=1)
    decoder.generation_config = GenerationConfig.for_model(decoder.max_model_len,
                                                           {"max_num_seqs": 6})
    service = Service({"double": DoubleModel()}, None, ServerConfig(record=False),
                      generation={"decoder": decoder}, instance_id="ctl-gen")
    with ServiceThread(service) as runner, httpx.Client(base_url=runner.url, timeout=60) as http:
        r = http.get("/v2/models/decoder/batching")
        assert r.status_code == 200, r.text
        doc = r.json()
        assert doc["kind"] == "generate" and doc["settings"]["max_num_seqs"] == 6
        first_version = doc["version"]

        r = http.patch("/v2/models/decoder/batching", json={"max_num_seqs": 3},
                       headers={"X-Requested-By": "tester"})
        assert r.status_code == 200, r.text
        assert r.json()["settings"]["max_num_seqs"] == 3
        assert r.json()["version"] == first_version + 1
        assert r.json()["requested_by"] == "tester"

        # invalid: 422 with the reason, nothing changes
        for bad in ({"max_num_seqs": 0}, {"max_batch_size": 4}, {"block_size": 8}):
            r = http.post("/v2/models/decoder/batching", json=bad)
            assert r.status_code == 422, (bad, r.text)
            assert list(bad)[0] in r.text
        assert service.generation.engines["decoder"].get_settings() == (
            first_version + 1, GenerationConfig.for_model(decoder.max_model_len,
                                                          {"max_num_seqs": 3}))

        r = http.post("/v1/completions", json={"model": "decoder", "prompt": "hi",
                                               "max_tokens": 3})
        assert r.status_code == 200, r.text
        stats = http.get("/v2/models/decoder/batching/stats").json()
        assert stats["kind"] == "generate"
        assert stats["settings_version"] == first_version + 1
        assert stats["requests"] and stats["steps"] >= 1
        # /v2/models/{name}/stats is Triton's statistics of request models: it says where
        # a generation model's are
        r = http.get("/v2/models/decoder/stats")
        assert r.status_code == 404 and "/v2/models/decoder/batching/stats" in r.json()["error"]

        # request models still answer as before; unknown names list both kinds
        assert http.get("/v2/models/double/batching").json()["kind"] == "request"
        r = http.get("/v2/models/nope/batching/stats")
        assert r.status_code == 404 and "decoder" in r.text and "double" in r.text


def test_serve_settings_configure_generation_models(tmp_path):
    gen_file = tmp_path / "gen.json"
    gen_file.write_text('{"max_num_seqs": 8, "mode": "static"}')
    decoder = TinyDecoder(d_model=16, n_layers=1)
    models = {"double": DoubleModel()}
    configs = model_settings(_args(max_batch_size=4, model_config=[f"decoder={gen_file}"],
                                   sets=["decoder.max_num_seqs=16", "double.policy=\"static\""]),
                             models, {"decoder": decoder})
    assert configs["double"] == BatchingConfig(max_batch_size=4, policy="static")
    assert configs["decoder"].max_num_seqs == 16 and configs["decoder"].mode == "static"
    assert decoder.generation_config == configs["decoder"]

    for sets, expected in ((["decoder.max_batch_size=4"], "unknown setting"),
                           (["decoder.max_num_seqs=0"], "max_num_seqs=0"),
                           ([f"decoder.max_model_len={decoder.max_model_len + 1}"],
                            "attend over"),
                           (["other.max_num_seqs=2"], "NAME one of")):
        with pytest.raises(UsageError, match=expected):
            model_settings(_args(sets=sets), models, {"decoder": TinyDecoder(d_model=16,
                                                                                n_layers=1)})
