"""``batchscope.gctune.settle``: what a long-running process holds leaves the collector's
scans and its young generation is collected every ``YOUNG_OBJECTS`` allocations; the
older generations keep their thresholds. Run in a child interpreter, so this test
process's collector is left as it is."""

from __future__ import annotations

import json
import subprocess
import sys

from batchscope.gctune import YOUNG_OBJECTS

_CHILD = """
import gc, json
before = gc.get_threshold()
held = [[i] for i in range(1000)]  # what a process keeps for its life
from batchscope import gctune
gctune.settle()
print(json.dumps({"before": before, "after": gc.get_threshold(),
                  "frozen": gc.get_freeze_count(),
                  "held_tracked_young": sum(1 for o in gc.get_objects(0) if o in held)}))
"""


def test_settle_freezes_and_raises_the_young_generation():
    out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True,
                         timeout=60, check=True)
    got = json.loads(out.stdout)
    assert got["after"][0] == YOUNG_OBJECTS
    assert got["after"][1:] == got["before"][1:]
    assert got["frozen"] >= 1000  # the kept lists among them
    assert got["held_tracked_young"] == 0  # none of them is scanned by a young collection


_EMBEDDED = """
import gc, json
import httpx
from runtime.api.config import ServerConfig
from runtime.server.service import Service, ServiceThread
from runtime.tools import cli

before = gc.get_threshold()
models, generation = cli.load_models(["mlp"])
runner = ServiceThread(Service(models, {}, ServerConfig(record=False), generation=generation))
url = runner.start()
try:
    body = {"inputs": [{"name": "INPUT0", "shape": [1, 256], "datatype": "FP32",
                        "data": [0.5] * 256}]}
    status = httpx.post(f"{url}/v2/models/mlp/infer", json=body, timeout=30).status_code
finally:
    runner.stop()
print(json.dumps({"status": status, "before": before, "after": gc.get_threshold(),
                  "frozen": gc.get_freeze_count()}))
"""


def test_an_embedded_service_leaves_the_hosts_collector_alone():
    """A service in a thread of another program serves without freezing the host's heap
    or changing its thresholds (only ``batchscope serve``, a process of its own, does)."""
    out = subprocess.run([sys.executable, "-c", _EMBEDDED], capture_output=True, text=True,
                         timeout=120, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["status"] == 200
    assert got["after"] == got["before"]
    assert got["frozen"] == 0
