"""A generation model served next to a request model: /v1/completions and live tuning."""

from __future__ import annotations

import time

import httpx
import pytest

from batchscope.storage import control
from batchscope.storage.db import make_engine
from runtime.api.config import ServerConfig
from runtime.models.decoder import TinyDecoder
from runtime.models.toys import DoubleModel
from runtime.server.service import Service, ServiceThread

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
