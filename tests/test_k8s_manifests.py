"""``batchscope k8s``: the manifests validate offline (built-in kinds against the
Kubernetes schemas kubernetes-validate bundles, the VPA and ServiceMonitor against the
CRD schemas in ``batchscope/deploy/schemas``), hang together, and broken ones fail."""

from __future__ import annotations

import copy
import subprocess
import sys
import time
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from batchscope.deploy import k8s
from batchscope.storage.records import BatchRow, DeviceRow
from batchscope.storage.recorder import Recorder

K8S_VERSION = kubernetes_validate.latest_version()
ROOT = Path(__file__).resolve().parent.parent
GIB = 2 ** 30


def validate(doc: dict) -> None:
    """Raise when ``doc`` is not a valid object of its kind."""
    if doc["kind"] in ("VerticalPodAutoscaler", "ServiceMonitor"):
        jsonschema.Draft202012Validator(k8s.crd_schema(doc["kind"])).validate(doc)
    else:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def cli(tmp_path, *args: str) -> tuple[int, list[dict], str]:
    out = tmp_path / "out.yaml"
    code = k8s.main([*args, "--out", str(out)])
    text = out.read_text() if out.exists() else ""
    return code, [d for d in yaml.safe_load_all(text) if d] if text else [], text


def by_kind(docs: list[dict]) -> dict:
    return {d["kind"]: d for d in docs}


def container(docs: list[dict]) -> dict:
    return by_kind(docs)["Deployment"]["spec"]["template"]["spec"]["containers"][0]


def test_default_output_validates_and_hangs_together(tmp_path):
    code, docs, text = cli(tmp_path, "--model", "mlp", "--namespace", "ml")
    assert code == 0
    assert [d["kind"] for d in docs] == ["Deployment", "Service", "VerticalPodAutoscaler",
                                         "ServiceMonitor"]
    for doc in docs:
        validate(doc)
    assert k8s.check_links(docs) == []
    assert text.startswith("# batchscope k8s for model mlp: default resources")
    c = container(docs)
    assert c["command"] == ["batchscope"] and c["args"][:3] == ["serve", "--model", "mlp"]
    assert c["args"][c["args"].index("--host") + 1] == "0.0.0.0"
    assert c["livenessProbe"]["httpGet"] == {"path": "/v2/health/live", "port": "http"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": "http"}
    assert c["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    assert c["resources"] == k8s.DEFAULT_RESOURCES
    assert {e["name"] for e in c["env"]} == {"BATCHSCOPE_DB_URL", "BATCHSCOPE_CONTROL_TOKEN"}
    mon = by_kind(docs)["ServiceMonitor"]["spec"]
    assert mon["endpoints"][0]["path"] == "/metrics" and mon["namespaceSelector"] == {"matchNames": ["ml"]}
    assert all(d["metadata"]["namespace"] == "ml" for d in docs)


def test_options_shape_the_output(tmp_path):
    code, docs, _ = cli(tmp_path, "--model", "examples/my_model.py:MyModel", "--device", "cuda",
                        "--replicas", "3", "--no-record", "--vpa-mode", "Off")
    assert code == 0
    for doc in docs:
        validate(doc)
    assert by_kind(docs)["Deployment"]["metadata"]["name"] == "batchscope-mymodel"
    assert by_kind(docs)["Deployment"]["spec"]["replicas"] == 3
    c = container(docs)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "--no-record" in c["args"] and "--torch-threads" not in c["args"]
    assert [e["name"] for e in c["env"]] == ["BATCHSCOPE_CONTROL_TOKEN"]
    assert by_kind(docs)["VerticalPodAutoscaler"]["spec"]["updatePolicy"]["updateMode"] == "Off"
    code, docs, _ = cli(tmp_path, "--model", "mlp", "--only", "vpa,service")
    assert [d["kind"] for d in docs] == ["Service", "VerticalPodAutoscaler"]


def recorded_db(db) -> None:
    """Two hours of a CPU replica of mlp: 50 % of 8 CPUs, 3 GiB resident."""
    rec = Recorder(db, flush_interval_s=0.01)
    end = time.time()
    rec.put_many([DeviceRow(instance_id="r1", at=end - 7200 + i * 10, device="cpu", kind="cpu",
                            utilization_pct=50.0, process_rss_bytes=3 * GIB) for i in range(720)])
    rec.put(BatchRow(instance_id="r1", model="mlp", seq=1, policy="dynamic", settings_version=1,
                     max_batch_size=16, bucket=None, batch_size=4, real_elements=4,
                     padded_elements=4, queue_wait_min_s=0.0, queue_wait_mean_s=0.0,
                     queue_wait_max_s=0.0, compute_s=0.01, started_at=end - 61, ended_at=end - 60))
    rec.flush()
    rec.close()


def test_resources_from_the_recorded_usage(tmp_path, db, db_url):
    recorded_db(db)
    code, docs, text = cli(tmp_path, "--model", "mlp", "--db", db_url, "--host-cpus", "8")
    assert code == 0
    for doc in docs:
        validate(doc)
    res = container(docs)["resources"]
    # 4 cores measured: the target is the bucket end of 4 cores plus 15 %
    assert 4.6 <= k8s._cores(res["requests"]["cpu"]) <= 4.9
    assert res["requests"]["memory"].endswith("Mi") and res["requests"]["memory"] != "2Gi"
    assert container(docs)["args"][container(docs)["args"].index("--torch-threads") + 1] == "5"
    policy = by_kind(docs)["VerticalPodAutoscaler"]["spec"]["resourcePolicy"]["containerPolicies"][0]
    assert set(policy["minAllowed"]) == {"cpu", "memory"}
    assert "maxAllowed" not in policy  # two hours of history do not bound it yet
    assert "resources recommended from recorded usage of r1" in text


def test_no_recorded_usage_falls_back_to_defaults(tmp_path, db, db_url, capsys):
    code, docs, _ = cli(tmp_path, "--model", "mlp", "--db", db_url)
    assert code == 0 and container(docs)["resources"] == k8s.DEFAULT_RESOURCES
    assert "no recorded usage of model 'mlp'" in capsys.readouterr().err


@pytest.mark.parametrize("args, says", [
    (["--model", "mlp", "--name", "Bad_Name"], "is not a Kubernetes name"),
    (["--model", "mlp", "--replicas", "-1"], "--replicas"),
    (["--model", "mlp", "--port", "70000"], "--port"),
    (["--model", "mlp", "--only", "pods"], "--only"),
    (["--model", "mlp", "--scrape-interval", "15 seconds"], "not a duration"),
    (["--model", "mlp", "--db", "sqlite:////nowhere/at/all.db"], "cannot open --db"),
    (["--name", "x"], "--model"),
])
def test_mistakes_exit_2_with_one_line(tmp_path, capsys, args, says):
    assert k8s.main([*args, "--out", str(tmp_path / "o.yaml")]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and "\n" not in err and "Traceback" not in err
    assert not (tmp_path / "o.yaml").exists()


def test_broken_builtin_manifests_fail_validation():
    spec = k8s.Spec(model="mlp", name="batchscope-mlp")
    good = k8s.deployment(spec, k8s.DEFAULT_RESOURCES)
    validate(good)
    broken = []
    for change in ("port as text", "no selector", "unknown field", "probe without port"):
        d = copy.deepcopy(good)
        c = d["spec"]["template"]["spec"]["containers"][0]
        if change == "port as text":
            c["ports"][0]["containerPort"] = "8000"
        elif change == "no selector":
            del d["spec"]["selector"]
        elif change == "unknown field":
            d["spec"]["replica"] = 2
        else:
            del c["livenessProbe"]["httpGet"]["port"]
        broken.append(d)
    svc = k8s.service(spec)
    svc["spec"]["ports"][0]["port"] = "http"
    broken.append(svc)
    for doc in broken:
        with pytest.raises(kubernetes_validate.ValidationError):
            validate(doc)


def test_broken_custom_resources_fail_validation():
    spec = k8s.Spec(model="mlp", name="batchscope-mlp")
    vpa, mon = k8s.vpa(spec, None), k8s.service_monitor(spec)
    validate(vpa)
    validate(mon)
    cases = []
    for path, value in ((("spec", "updatePolicy", "updateMode"), "Sometimes"),
                        (("spec", "resourcePolicy", "containerPolicies", 0, "controlledValues"), "All"),
                        (("spec", "resourcePolicy", "containerPolicies", 0, "minAllowed"), {"cpu": "lots"}),
                        (("spec", "targetRef"), None),
                        (("apiVersion",), "autoscaling.k8s.io/v1beta1")):
        cases.append(_set(vpa, path, value))
    for path, value in ((("spec", "endpoints", 0, "interval"), "15 seconds"),
                        (("spec", "endpoints", 0, "scheme"), "ftp"),
                        (("spec", "selector"), None),
                        (("spec", "endpoints"), None),
                        (("metadata", "name"), "Not A Name")):
        cases.append(_set(mon, path, value))
    for doc in cases:
        with pytest.raises(jsonschema.ValidationError):
            validate(doc)


def _set(doc: dict, path: tuple, value) -> dict:
    """A copy of ``doc`` with ``path`` set to ``value`` (None deletes it)."""
    out = copy.deepcopy(doc)
    parent = out
    for key in path[:-1]:
        parent = parent[key]
    if value is None:
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    return out


def test_links_between_the_documents_are_checked():
    spec = k8s.Spec(model="mlp", name="batchscope-mlp")
    docs = k8s.manifests(spec)
    assert k8s.check_links(docs) == []
    bad = copy.deepcopy(docs)
    bad[1]["spec"]["selector"]["app.kubernetes.io/instance"] = "other"  # Service misses the pods
    bad[0]["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["port"] = "web"
    bad[2]["spec"]["targetRef"]["name"] = "elsewhere"
    bad[3]["spec"]["endpoints"][0]["port"] = "metrics"
    problems = k8s.check_links(bad)
    assert len(problems) == 4, problems


@pytest.mark.slow
def test_runs_without_the_dashboard_packages(tmp_path):
    """A serving install has no pandas, streamlit or plotly: the command must not need them."""
    script = ("import sys\n"
              "from batchscope.deploy import k8s\n"
              f"code = k8s.main(['--model', 'mlp', '--out', {str(tmp_path / 'o.yaml')!r}])\n"
              "loaded = [m for m in ('pandas', 'streamlit', 'plotly') if m in sys.modules]\n"
              "assert not loaded, loaded\n"
              "sys.exit(code)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert len(list(yaml.safe_load_all((tmp_path / "o.yaml").read_text()))) == 4
