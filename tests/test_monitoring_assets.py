"""The Grafana dashboard and the alert rules that ship with the runtime.

The rules are checked and unit-tested by Prometheus' own ``promtool`` (Debian's
``prometheus`` package, which ``tests/run.sh`` installs), and every series the dashboard
and the rules query is one a real server exports on ``/metrics``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
import yaml

from runtime.api.config import ServerConfig
from runtime.models.decoder import TinyDecoder
from runtime.models.toys import DoubleModel
from runtime.monitoring import ASSETS, asset_path, asset_text
from runtime.server.service import Service, ServiceThread

PROMTOOL = shutil.which("promtool")
# skipped on a developer's machine without it; in CI (CI=true) tests/run.sh installs it,
# and a missing promtool fails there instead of skipping
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None and not os.environ.get("CI"),
    reason="promtool is missing: apt-get install prometheus (tests/run.sh does)")


def _expressions() -> list[str]:
    dash = json.loads(asset_text("grafana-dashboard.json"))
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    rules = yaml.safe_load(asset_text("alerts.yml"))
    exprs += [r["expr"] for g in rules["groups"] for r in g["rules"]]
    return exprs


def _series(expr: str) -> set[str]:
    """The series names in a PromQL expression (label matchers and strings removed)."""
    expr = re.sub(r'\{[^}]*\}|"[^"]*"', "", expr)
    return set(re.findall(r"\bbatchscope_[a-zA-Z0-9_]*", expr))


def test_assets_are_installed_and_parse():
    for name in ASSETS:
        assert asset_path(name).is_file(), name
    dash = json.loads(asset_text("grafana-dashboard.json"))
    assert dash["uid"] == "batchscope" and len(dash["panels"]) >= 15
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    rules = yaml.safe_load(asset_text("alerts.yml"))
    alerts = [r["alert"] for g in rules["groups"] for r in g["rules"]]
    assert len(alerts) == len(set(alerts)) >= 8
    for rule in (r for g in rules["groups"] for r in g["rules"]):
        assert rule["annotations"]["summary"], rule["alert"]


@needs_promtool
def test_promtool_accepts_the_rules():
    out = subprocess.run([PROMTOOL, "check", "rules", str(asset_path("alerts.yml"))],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


@needs_promtool
def test_rules_fire_on_bad_series_and_stay_quiet_on_healthy_ones(tmp_path):
    shutil.copy(asset_path("alerts.yml"), tmp_path / "alerts.yml")
    test_file = tmp_path / "alerts_test.yml"
    text = (Path(__file__).parent / "data" / "alerts_test.yml").read_text()
    test_file.write_text(text.replace("ALERTS_PATH", "alerts.yml"))
    out = subprocess.run([PROMTOOL, "test", "rules", str(test_file)], capture_output=True,
                         text=True, timeout=60, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.slow
def test_every_queried_series_is_exported_by_a_real_server():
    service = Service({"double": DoubleModel()}, None, ServerConfig(record=False),
                      generation={"decoder": TinyDecoder(d_model=32, n_layers=1)})
    with ServiceThread(service) as runner, httpx.Client(base_url=runner.url, timeout=60) as http:
        body = {"inputs": [{"name": "INPUT0", "shape": [4], "datatype": "FP32",
                            "data": [1, 2, 3, 4]}]}
        assert http.post("/v2/models/double/infer", json=body).status_code == 200
        r = http.post("/v1/completions", json={"model": "decoder", "prompt": "hi",
                                               "max_tokens": 3})
        assert r.status_code == 200, r.text
        exported = set()
        for line in http.get("/metrics").text.splitlines():
            if line and not line.startswith("#"):
                exported.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    wanted = set()
    for expr in _expressions():
        wanted |= _series(expr)
    missing = sorted(wanted - exported)
    assert wanted and not missing, f"queried but not exported: {missing}"
