"""The demo's traffic driver stops after its cycles, and ``bench_demo_autopilot`` reads a
recorded pass: requests by outcome, seconds over the SLO, the autopilot's decisions."""

from __future__ import annotations

import math

import pytest

from benchmarks.bench_demo_autopilot import p99, summarize
from batchscope.load.loadgen import run_async
from runtime.api.config import BatchingConfig, ServerConfig
from runtime.server.service import Service, ServiceThread
from runtime.tools import demo
from runtime.tools.cli import load_models


def test_demo_refuses_zero_cycles(capsys):
    assert demo.main(["--cycles", "0"]) == 2
    assert "--cycles must be 1 or more" in capsys.readouterr().err


def test_p99_is_the_value_below_which_99_percent_lie():
    assert p99([float(i) for i in range(1, 101)]) == 99.0
    assert p99([3.0]) == 3.0 and math.isinf(p99([1.0] * 50 + [math.inf]))


@pytest.mark.slow
def test_one_short_pass_is_recorded_and_summarized(tmp_path):
    db_path = tmp_path / "demo.db"
    server = ServerConfig(database_url=f"sqlite:///{db_path}", heartbeat_interval_s=0.2)
    models, _ = load_models(["mlp"])
    config = BatchingConfig(max_batch_size=32, max_queue_size=256, max_queue_delay_ms=2.0,
                            autopilot_slo_p99_ms=50.0)
    service = Service(models, {"mlp": config}, server, instance_id="demo-pass")
    phases = (demo.Phase("quiet", 1.5, (demo.Flow("mlp", 40),)),
              demo.Phase("busy", 1.5, (demo.Flow("mlp", 120, timeout_ms=5000),)))
    with ServiceThread(service) as runner:
        run_async(demo.drive(runner.url, phases, cycles=1, models=("mlp",)))  # returns
    figures = summarize(db_path, slo_ms=50.0)
    # Poisson arrivals at 40 then 120 req/s for 1.5 s each: about 240 requests, all served
    assert 120 <= figures["requests"] <= 400, figures
    assert figures["ok"] == figures["requests"] and figures["failed"] == 0
    assert figures["expired"] == figures["rejected"] == 0
    assert figures["seconds"] >= 3 and 0 <= figures["violation_s"] <= figures["judged_s"]
    assert figures["goodput_rps"] * figures["seconds"] <= figures["ok"]
    assert figures["p99_ok_ms"] is not None and figures["p99_ok_ms"] > 0
    assert isinstance(figures["decisions"], list)


def test_summarize_says_when_nothing_was_recorded(tmp_path):
    from sqlalchemy import create_engine

    from batchscope.storage.schema import Base

    db_path = tmp_path / "empty.db"
    engine = create_engine(f"sqlite:///{db_path}")
    Base.metadata.create_all(engine)
    engine.dispose()
    with pytest.raises(RuntimeError, match="no mlp requests were recorded"):
        summarize(db_path)
