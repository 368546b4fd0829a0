"""The real server on an ephemeral 127.0.0.1 port, driven by tritonclient and httpx.

Batches are made deterministic with ``DoubleModel(hold=...)``: one request runs and
blocks inside ``predict``, the test queues more (watching ``/batching/stats`` until they all
wait), then releases the model; the next batches then show how the batcher cut them.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import tritonclient.http as triton
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.utils import InferenceServerException

from batchscope.storage import control
from batchscope.storage.db import make_engine
from runtime.api.config import BatchingConfig, ServerConfig
from runtime.models.toys import DoubleModel, FailingModel, VarLenModel
from runtime.server.service import Service, ServiceThread

pytestmark = pytest.mark.slow

WAIT_S = 20.0


def wait_until(check, what: str, timeout_s: float = WAIT_S):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    db_url = f"sqlite:///{tmp_path_factory.mktemp('db') / 'bs.db'}"
    hold = threading.Event()
    hold.set()
    held = DoubleModel(hold=hold)
    models = {"double": DoubleModel(), "held": held, "failing": FailingModel(),
              "varlen": VarLenModel()}
    configs = {"held": BatchingConfig(max_batch_size=8, max_queue_size=4),
               "double": BatchingConfig(max_batch_size=16)}
    cfg = ServerConfig(database_url=db_url, heartbeat_interval_s=0.2,
                       control_poll_interval_s=0.05)
    service = Service(models, configs, cfg, instance_id="test-server")
    runner = ServiceThread(service)
    url = runner.start()
    client = httpx.Client(base_url=url, timeout=30.0)
    yield {"url": url, "http": client, "held": held, "hold": hold, "service": service,
           "db": make_engine(db_url)}
    hold.set()
    client.close()
    runner.stop()


def triton_client(server) -> triton.InferenceServerClient:
    return triton.InferenceServerClient(server["url"].removeprefix("http://"),
                                        network_timeout=30.0, connection_timeout=30.0)


def double_input(values, binary=True) -> triton.InferInput:
    arr = np.asarray(values, dtype=np.float32).reshape(1, 4)
    inp = triton.InferInput("INPUT0", [1, 4], "FP32")
    inp.set_data_from_numpy(arr, binary_data=binary)
    return inp


def json_body(values, **params) -> dict:
    body = {"inputs": [{"name": "INPUT0", "shape": [4], "datatype": "FP32", "data": list(values)}]}
    if params:
        body["parameters"] = params
    return body


def queue_depth(server, model="held") -> int:
    return server["http"].get(f"/v2/models/{model}/batching/stats").json()["queue_depth"]


def held_burst(server, bodies: list[dict]) -> tuple[list[int], list[httpx.Response]]:
    """Run one request into the held model, queue ``bodies`` behind it, release.

    Returns the sizes of the batches that ran after the release and every answer."""
    held, hold, http = server["held"], server["hold"], server["http"]
    hold.clear()
    held.entered.clear()
    pool = ThreadPoolExecutor(max_workers=len(bodies) + 1)
    first = pool.submit(http.post, "/v2/models/held/infer", json=json_body([9, 9, 9, 9]))
    wait_until(held.entered.is_set, "the first batch to start")
    before = len(held.batch_sizes)
    futures = [pool.submit(http.post, "/v2/models/held/infer", json=b) for b in bodies]
    wait_until(lambda: queue_depth(server) == len(bodies), f"{len(bodies)} queued requests")
    hold.set()
    answers = [first.result(timeout=WAIT_S)] + [f.result(timeout=WAIT_S) for f in futures]
    pool.shutdown()
    return held.batch_sizes[before:], answers


# -- health and metadata ----------------------------------------------------------------
def test_health_and_metadata_through_tritonclient(server):
    client = triton_client(server)
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("double") and not client.is_model_ready("nope")
    meta = client.get_server_metadata()
    assert meta["name"] == "batchscope" and "binary_tensor_data" in meta["extensions"]
    model = client.get_model_metadata("varlen")
    assert model["name"] == "varlen" and model["versions"] == ["1"]
    # every request model batches: the leading -1 is the batch dimension
    assert model["inputs"] == [{"name": "INPUT0", "datatype": "FP32", "shape": [-1, -1]}]
    assert [o["name"] for o in model["outputs"]] == ["SUM", "PADDED"]
    assert client.get_model_metadata("double", model_version="1")["name"] == "double"
    with pytest.raises(InferenceServerException) as info:
        client.get_model_metadata("double", model_version="7")
    assert info.value.status() == "404" and "no version '7'" in info.value.message()


# -- inference ------------------------------------------------------------------------------
@pytest.mark.parametrize("binary", [True, False])
def test_tritonclient_infer_with_priority_and_timeout(server, binary):
    client = triton_client(server)
    out = triton.InferRequestedOutput("OUTPUT0", binary_data=binary)
    result = client.infer("double", [double_input([1, 2, 3, 4], binary)], outputs=[out],
                          priority=1, timeout=5_000_000, request_id="abc")
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), [[2, 4, 6, 8]])
    assert result.get_response()["id"] == "abc"


def test_variable_length_json_request(server):
    r = server["http"].post("/v2/models/varlen/infer", json={"inputs": [
        {"name": "INPUT0", "shape": [3], "datatype": "FP32", "data": [1, 2, 3]}]})
    assert r.status_code == 200, r.text
    outputs = {o["name"]: o for o in r.json()["outputs"]}
    assert outputs["SUM"]["data"] == [6.0] and outputs["PADDED"]["datatype"] == "INT64"


def test_tritonclient_sees_clear_errors(server):
    client = triton_client(server)
    with pytest.raises(InferenceServerException) as info:
        client.infer("double", [double_input([1, 2, 3, 4])], priority=9)
    assert info.value.status() == "422" and "priority 9 is out of range" in info.value.message()
    with pytest.raises(InferenceServerException) as info:
        client.infer("nope", [double_input([1, 2, 3, 4])])
    assert info.value.status() == "404" and "unknown model 'nope'" in info.value.message()
    wrong = triton.InferInput("INPUT0", [1, 3], "FP32")
    wrong.set_data_from_numpy(np.zeros((1, 3), np.float32))
    with pytest.raises(InferenceServerException) as info:
        client.infer("double", [wrong])
    assert info.value.status() == "400" and "must have shape [4]" in info.value.message()


@pytest.mark.parametrize("content, status, fragment", [
    (b"{oops", 400, "not valid JSON"),
    (b'{"inputs": [{"name": "INPUT0", "shape": [4], "datatype": "INT32", "data": [1,2,3,4]}]}',
     400, "must have datatype FP32, got INT32"),
    (b'{"inputs": [{"name": "OTHER", "shape": [4], "datatype": "FP32", "data": [1,2,3,4]}]}',
     400, "has no input(s) ['OTHER']"),
    (b'{"inputs": [{"name": "INPUT0", "shape": [2, 2], "datatype": "FP32", "data": [1,2,3,4]}]}',
     400, "must have shape [4]"),
    (b'{"inputs": [{"name": "INPUT0", "shape": [4], "datatype": "FP32", "data": [1,2,3,4]}],'
     b' "parameters": {"priority": 4}}', 422, "priority 4 is out of range"),
    (b'{"inputs": []}', 400, "non-empty \\\"inputs\\\""),
])
def test_bad_inputs_get_their_clear_error(server, content, status, fragment):
    r = server["http"].post("/v2/models/double/infer", content=content)
    assert r.status_code == status
    assert fragment.replace("\\\"", '"') in r.json()["error"]


def test_missing_input_names_the_tensor(server):
    r = server["http"].post("/v2/models/double/infer", content=b'{"inputs": [{"name": "INPUT0", '
                            b'"shape": [4], "datatype": "FP32", "data": [1, 2, 3, 4]}], '
                            b'"outputs": 3}')
    assert r.status_code == 400 and "'outputs' must be a list" in r.json()["error"]


def test_model_error_is_a_500_without_a_trace(server):
    r = server["http"].post("/v2/models/failing/infer", json=json_body([-1, 0, 0, 0]))
    assert r.status_code == 500
    error = r.json()["error"]
    assert error and "Traceback" not in error and 'File "' not in error
    ok = server["http"].post("/v2/models/failing/infer", json=json_body([1, 0, 0, 0]))
    assert ok.status_code == 200


def test_queue_full_is_429_with_retry_after_and_expired_is_503(server):
    # 3 waiting + 1 with a 5 s timeout fill the queue (max_queue_size=4); the 6th call is
    # refused at once while the model is still held. Expiry runs on its own timer, so the
    # timed request is answered 503 at its deadline while the model is still held.
    bodies = [json_body([k, 0, 0, 0]) for k in range(3)] + [json_body([7, 0, 0, 0],
                                                                      timeout=5_000_000)]
    held, hold, http = server["held"], server["hold"], server["http"]
    hold.clear()
    held.entered.clear()
    with ThreadPoolExecutor(max_workers=6) as pool:
        first = pool.submit(http.post, "/v2/models/held/infer", json=json_body([9, 9, 9, 9]))
        wait_until(held.entered.is_set, "the first batch to start")
        futures = [pool.submit(http.post, "/v2/models/held/infer", json=b) for b in bodies]
        wait_until(lambda: queue_depth(server) == 4, "a full queue")
        refused = http.post("/v2/models/held/infer", json=json_body([5, 5, 5, 5]))
        futures[-1].result(WAIT_S)
        hold.set()
        answers = [first.result(WAIT_S)] + [f.result(WAIT_S) for f in futures]
    assert refused.status_code == 429
    assert int(refused.headers["Retry-After"]) >= 1
    assert "max_queue_size" in refused.json()["error"]
    assert [a.status_code for a in answers] == [200, 200, 200, 200, 503]
    assert answers[-1].json()["error"]


def test_binary_header_with_bad_length_is_400(server):
    r = server["http"].post("/v2/models/double/infer", content=b'{"inputs": []}',
                            headers={"Inference-Header-Content-Length": "999"})
    assert r.status_code == 400 and "Inference-Header-Content-Length" in r.json()["error"]


# -- batching and live settings ---------------------------------------------------------------
def test_batches_form_under_concurrency_and_are_recorded(server):
    sizes, answers = held_burst(server, [json_body([k, 1, 1, 1]) for k in range(4)])
    assert all(a.status_code == 200 for a in answers)
    assert sizes == [4]
    db = server["db"]
    from sqlalchemy import text

    def recorded():
        with db.connect() as conn:
            return conn.execute(text("SELECT max(batch_size) FROM batches WHERE model='held' "
                                     "AND instance_id='test-server'")).scalar()
    assert wait_until(lambda: (recorded() or 0) >= 4, "the batch of 4 in the database")


def test_max_batch_size_changed_over_http_applies_to_next_batches(server):
    http = server["http"]
    r = http.patch("/v2/models/held/batching", json={"max_batch_size": 2},
                   headers={"X-Requested-By": "pytest"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["settings"]["max_batch_size"] == 2 and body["requested_by"] == "pytest"
    got = http.get("/v2/models/held/batching").json()
    assert got["version"] == body["version"] and got["settings"]["max_batch_size"] == 2
    sizes, answers = held_burst(server, [json_body([k, 0, 0, 0]) for k in range(4)])
    assert sizes == [2, 2] and all(a.status_code == 200 for a in answers)
    # published to the database for the dashboard
    db = server["db"]
    assert wait_until(lambda: (control.current_settings(db, "test-server", "held") or (0, {}))[1]
                      .get("max_batch_size") == 2, "the published settings")
    http.post("/v2/models/held/batching", json={"max_batch_size": 8})


def test_invalid_settings_change_is_422_and_changes_nothing(server):
    http = server["http"]
    before = http.get("/v2/models/held/batching").json()
    r = http.post("/v2/models/held/batching", json={"max_batch_size": 0})
    assert r.status_code == 422 and "max_batch_size=0" in r.json()["error"]
    r = http.post("/v2/models/held/batching", content=b"[1]")
    assert r.status_code == 400
    assert http.get("/v2/models/held/batching").json() == before
    assert http.get("/v2/models/nope/batching").status_code == 404


def test_database_command_changes_the_next_batches(server):
    db = server["db"]
    cid = control.request_change(db, model="held", changes={"max_batch_size": 3},
                                 requested_by="dashboard", instance_id="test-server")
    status = wait_until(lambda: (s := control.command_status(db, cid)).status != "pending" and s,
                        "the command to be handled")
    assert status.status == "applied" and status.applied_version is not None
    assert server["http"].get("/v2/models/held/batching").json()["version"] == status.applied_version
    sizes, _ = held_burst(server, [json_body([k, 0, 0, 0]) for k in range(4)])
    assert sizes == [3, 1]
    bad = control.request_change(db, model="held", changes={"policy": "sometimes"},
                                 requested_by="dashboard")
    refused = wait_until(lambda: (s := control.command_status(db, bad)).status != "pending" and s,
                         "the bad command to be handled")
    assert refused.status == "refused" and "policy='sometimes'" in refused.reason
    server["http"].post("/v2/models/held/batching", json={"max_batch_size": 8})


def test_instance_is_registered_with_heartbeats(server):
    db = server["db"]
    live = control.live_instances(db, now=time.time())
    mine = [i for i in live if i.id == "test-server"]
    assert mine and mine[0].url == server["url"]
    assert set(mine[0].models) == {"double", "held", "failing", "varlen"}
    first = mine[0].last_seen_at
    wait_until(lambda: [i for i in control.live_instances(db, now=time.time())
                        if i.id == "test-server"][0].last_seen_at > first, "a later heartbeat")


# -- metrics ---------------------------------------------------------------------------------
def test_metrics_parse_and_count_requests(server):
    for k in range(3):
        assert server["http"].post("/v2/models/double/infer", json=json_body([k, 0, 0, 0])).status_code == 200
    text_body = server["http"].get("/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text_body)}
    for name in ("batchscope_batch_size", "batchscope_queue_wait_seconds",
                 "batchscope_batch_compute_seconds", "batchscope_request_latency_seconds",
                 "batchscope_requests", "batchscope_batches", "batchscope_queue_depth",
                 "batchscope_recorder_dropped_records"):
        assert name in families, name
    ok = [s.value for s in families["batchscope_requests"].samples
          if s.name == "batchscope_requests_total" and s.labels == {"model": "double", "outcome": "ok"}]
    assert ok and ok[0] >= 3
    depth = {s.labels["model"] for s in families["batchscope_queue_depth"].samples}
    assert depth == {"double", "held", "failing", "varlen"}


def test_stats_endpoint(server):
    stats = server["http"].get("/v2/models/double/batching/stats").json()
    assert stats["model"] == "double" and stats["queue_depth"] == 0
    assert stats["effective_max_batch_size"] == 16 and stats["requests"] >= 1
