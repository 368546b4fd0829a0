"""Replicas on a real local Ray cluster (a head and one more node) behind Ray Serve's proxy.

Requests reach both replicas through Ray Serve's router, each replica registers as its
own instance and records into the shared database, and a change sent to every instance
of a model is acknowledged by each replica on its own. The database is the one a fleet
shares, PostgreSQL: the suite's throw-away server, which every replica process reaches by
its URL over TCP on 127.0.0.1. This is the slowest test of the suite, so it runs on that
one database (on a SQLite file instead when the run leaves PostgreSQL out on purpose,
``BATCHSCOPE_TEST_BACKENDS=sqlite``).
"""

from __future__ import annotations

import json
import os
import time

import httpx
import psutil
import pytest
from sqlalchemy import text
from sqlalchemy.engine import make_url

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
REQUESTS = 200
#: the database the replicas share (see the module's docstring)
FLEET_BACKEND = ("postgresql" if "postgresql" in os.environ.get(
    "BATCHSCOPE_TEST_BACKENDS", "sqlite,postgresql").split(",") else "sqlite")


#: attempts at starting the local cluster (see ``_two_node_cluster``)
CLUSTER_ATTEMPTS = 3


def _two_node_cluster() -> cluster_utils.Cluster:
    """A head and one more node. Ray gives a node's raylet a fixed 30 s to register with
    its GCS and raises otherwise; on a busy 2-core machine that start-up (not what this
    module tests) fails now and then, for the head as for the second node, so a cluster
    that did not come up is stopped (with whatever the failed node had started) and
    started again, a bounded number of times."""
    for attempt in range(1, CLUSTER_ATTEMPTS + 1):
        before = {child.pid for child in psutil.Process().children(recursive=True)}
        cluster = None
        try:
            cluster = cluster_utils.Cluster(initialize_head=True, head_node_args={
                "num_cpus": 1, "include_dashboard": False})
            cluster.add_node(num_cpus=1)
            return cluster
        except Exception as exc:  # Ray raises a bare Exception for the start-up timeout
            if cluster is not None:
                cluster.shutdown()
            _stop_started_since(before)
            if attempt == CLUSTER_ATTEMPTS or "timed out during startup" not in str(exc):
                raise
    raise AssertionError("unreachable")


def _stop_started_since(before: set[int]) -> None:
    """Kill the processes this one started since ``before`` was taken: a node whose
    start-up failed leaves its GCS server and raylet running, and no handle on them."""
    started = [child for child in psutil.Process().children(recursive=True)
               if child.pid not in before]
    for child in started:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(started, timeout=10)


@pytest.fixture(scope="module")
def proxy_port():
    """A local Ray cluster of two nodes with Ray Serve's proxy on 127.0.0.1: its port."""
    # every node of this cluster is this machine: let the proxy route to both nodes
    saved = {k: os.environ.get(k) for k in SPREAD_ON_ONE_MACHINE}
    os.environ.update(SPREAD_ON_ONE_MACHINE)
    cluster = _two_node_cluster()
    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
    try:
        cluster.wait_for_nodes()
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield port
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


@pytest.fixture
def fleet_db(db_url, backend, request):
    """The shared database (schema created before the replicas start) and its URL."""
    if backend == "postgresql":  # the replicas reach the suite's server over TCP
        server = request.getfixturevalue("postgresql_proc")
        where = make_url(db_url)
        assert (where.host, where.port) == ("127.0.0.1", int(server.port)), db_url
    db = make_engine(db_url)
    yield db, db_url
    db.dispose()


@pytest.fixture
def fleet_url(proxy_port, fleet_db):
    """Two replicas recording into ``fleet_db`` behind the proxy: its URL. The replicas
    are deleted before the database goes."""
    db, url = fleet_db
    spec = with_public_url(FleetSpec(models=("mlp",), database_url=url,
                                     heartbeat_interval_s=0.5, control_poll_interval_s=0.2),
                           "127.0.0.1", proxy_port)
    serve.run(build_application(spec, Replicas(count=2)), name=APP_NAME, route_prefix="/")
    try:
        yield f"http://127.0.0.1:{proxy_port}"
    finally:
        serve.delete(APP_NAME)


def counts_by_instance(db, table: str) -> dict[str, int]:
    with db.connect() as conn:
        return dict(conn.execute(text(
            f"SELECT instance_id, COUNT(*) FROM {table} GROUP BY instance_id")).all())


@pytest.mark.parametrize("backend", [FLEET_BACKEND], indirect=True, scope="module")
def test_two_replicas_serve_record_and_acknowledge_a_fleet_wide_change(fleet_url, fleet_db):
    db, _ = fleet_db

    def two_live() -> bool:
        return len(control.live_instances(db, now=time.time())) == 2
    assert wait_until(two_live, limit=480, interval_s=0.25), "two replicas registered"
    live = control.live_instances(db, now=time.time())
    instances = {i.id for i in live}
    nodes = {i.split("-")[-2] for i in instances}
    assert len(nodes) == 2, f"one replica per node expected, got {instances}"
    pids = {i.pid for i in live}
    assert len(pids) == 2 and os.getpid() not in pids, f"two replica processes expected: {pids}"

    with httpx.Client(base_url=fleet_url, timeout=30) as client:
        meta = client.get("/v2/models/mlp")
        assert meta.status_code == 200, meta.text
        answers = [client.post("/v2/models/mlp/infer", content=BODY,
                               headers={"content-type": "application/json"})
                   for _ in range(REQUESTS)]
    assert all(a.status_code == 200 for a in answers), {a.status_code for a in answers}

    # every answered request is a row, written by the replica that answered it
    assert wait_until(lambda: sum(counts_by_instance(db, "requests").values()) >= REQUESTS,
                      limit=240, interval_s=0.25), counts_by_instance(db, "requests")
    requests = counts_by_instance(db, "requests")
    assert set(requests) == instances and all(n > 0 for n in requests.values()), requests
    assert sum(requests.values()) == REQUESTS, requests
    # each replica samples its device into the same database (every 1 s)
    assert wait_until(lambda: set(counts_by_instance(db, "device_samples")) == instances,
                      limit=240, interval_s=0.25), counts_by_instance(db, "device_samples")

    command = control.request_change(db, model="mlp", changes={"max_batch_size": 8},
                                     requested_by="test")

    def acks() -> dict[str, tuple[str, int | None]]:
        with db.connect() as conn:
            return {row[0]: (row[1], row[2]) for row in conn.execute(text(
                "SELECT instance_id, status, applied_version FROM command_acks "
                "WHERE command_id = :id"), {"id": command})}
    assert wait_until(lambda: set(acks()) == instances, limit=240, interval_s=0.25), \
        control.command_status(db, command)
    assert all(status == "applied" for status, _ in acks().values()), acks()
    status = control.command_status(db, command)
    assert {a.instance_id for a in status.acks} == instances
    for instance in instances:
        version, settings = control.current_settings(db, instance, "mlp")
        assert settings["max_batch_size"] == 8 and version == acks()[instance][1] >= 2


@pytest.mark.parametrize("argv, says", [
    (["--replicas", "0"], "replicas=0 must be a positive integer"),
    (["--min-replicas", "2"], "give both --min-replicas and --max-replicas"),
    (["--min-replicas", "3", "--max-replicas", "2"], "need 0 <= min <= max"),
    (["--ray-address", "auto"], "--ray-address goes with --replicas"),
    (["--replicas", "2", "--port", "0"], "needs a fixed --port"),
    (["--replicas", "2", "--grpc-port", "8001"], "--grpc-port is not served by replicas"),
    (["--replicas", "2", "--trace-config", "rate=1", "--nvtx"],
     "--trace-config, --nvtx: not served by replicas yet"),
    (["--replicas", "2", "--otlp-traces-endpoint", "http://127.0.0.1:4317"],
     "--otlp-traces-endpoint: not served by replicas yet"),
])
def test_fleet_flags_are_checked_before_ray_starts(argv, says, capsys):
    from runtime.tools.cli import main

    assert main(["serve", "--model", "mlp", "--no-record", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1, err
