"""Replicas on a real local Ray cluster (a head and one more node) behind Ray Serve's proxy.

Requests reach both replicas through Ray Serve's router, each replica registers as its
own instance and records into the shared database, and a change sent to every instance
of a model is acknowledged by each replica on its own.
"""

from __future__ import annotations

import json
import os
import time

import httpx
import pytest

from batchscope.storage import control
from batchscope.storage.db import make_engine
from tests.factories import free_port, wait_until

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
cluster_utils = pytest.importorskip("ray.cluster_utils")

from runtime.fleet.ray_serve import (APP_NAME, SPREAD_ON_ONE_MACHINE, FleetSpec,  # noqa: E402
                                     Replicas, build_application, with_public_url)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

BODY = json.dumps({"inputs": [{"name": "INPUT0", "shape": [256], "datatype": "FP32",
                               "data": [0.01] * 256}]})


@pytest.fixture(scope="module")
def ray_cluster():
    # every node of this cluster is this machine: let the proxy route to both nodes
    saved = {k: os.environ.get(k) for k in SPREAD_ON_ONE_MACHINE}
    os.environ.update(SPREAD_ON_ONE_MACHINE)
    cluster = cluster_utils.Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
    try:
        cluster.wait_for_nodes()
        yield cluster
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            cluster.shutdown()
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def test_two_replicas_serve_record_and_acknowledge_a_fleet_wide_change(ray_cluster, tmp_path):
    url = f"sqlite:///{tmp_path / 'fleet.db'}"
    db = make_engine(url)  # the schema exists before the replicas start
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    spec = with_public_url(FleetSpec(models=("mlp",), database_url=url,
                                     heartbeat_interval_s=0.5, control_poll_interval_s=0.2),
                           "127.0.0.1", port)
    serve.run(build_application(spec, Replicas(count=2)), name=APP_NAME, route_prefix="/")
    base = f"http://127.0.0.1:{port}"

    def two_live() -> bool:
        return len(control.live_instances(db, now=time.time())) == 2
    assert wait_until(two_live, limit=480, interval_s=0.25), "two replicas registered"
    instances = {i.id for i in control.live_instances(db, now=time.time())}
    nodes = {i.split("-")[-2] for i in instances}
    assert len(nodes) == 2, f"one replica per node expected, got {instances}"

    with httpx.Client(base_url=base, timeout=30) as client:
        meta = client.get("/v2/models/mlp")
        assert meta.status_code == 200, meta.text
        answers = [client.post("/v2/models/mlp/infer", content=BODY,
                               headers={"content-type": "application/json"})
                   for _ in range(200)]
    assert all(a.status_code == 200 for a in answers), {a.status_code for a in answers}

    from sqlalchemy import text

    def rows_by_instance() -> dict[str, int]:
        with db.connect() as conn:
            return dict(conn.execute(text(
                "SELECT instance_id, COUNT(*) FROM requests GROUP BY instance_id")).all())
    assert wait_until(lambda: sum(rows_by_instance().values()) >= 200, limit=240,
                      interval_s=0.25), rows_by_instance()
    counts = rows_by_instance()
    assert set(counts) == instances and all(n > 0 for n in counts.values()), counts

    command = control.request_change(db, model="mlp", changes={"max_batch_size": 8},
                                     requested_by="test")

    def acked_by_both() -> bool:
        return len(control.command_status(db, command).acks) == 2
    assert wait_until(acked_by_both, limit=240, interval_s=0.25), control.command_status(db, command)
    status = control.command_status(db, command)
    assert {a.instance_id for a in status.acks} == instances
    assert all(a.status == "applied" for a in status.acks), status.acks
    for instance in instances:
        version, settings = control.current_settings(db, instance, "mlp")
        assert settings["max_batch_size"] == 8 and version >= 2
    serve.delete(APP_NAME)
    db.dispose()


@pytest.mark.parametrize("argv, says", [
    (["--replicas", "0"], "replicas=0 must be a positive integer"),
    (["--min-replicas", "2"], "give both --min-replicas and --max-replicas"),
    (["--min-replicas", "3", "--max-replicas", "2"], "need 0 <= min <= max"),
    (["--ray-address", "auto"], "--ray-address goes with --replicas"),
    (["--replicas", "2", "--port", "0"], "needs a fixed --port"),
    (["--replicas", "2", "--grpc-port", "8001"], "--grpc-port is not served by replicas"),
])
def test_fleet_flags_are_checked_before_ray_starts(argv, says, capsys):
    from runtime.tools.cli import main

    assert main(["serve", "--model", "mlp", "--no-record", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1, err
