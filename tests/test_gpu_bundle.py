"""The GPU machine can import what the GPU script and the server import: every
third-party distribution they load is in its image or among the carried wheels."""

from __future__ import annotations

import json
import subprocess
import sys

from benchmarks.gpu.wheels import IMAGE, NEEDED

PROBE = r"""
import importlib.metadata as md, json, sys
import runtime.tools.cli, runtime.server.service, runtime.engine.engine, runtime.device.process
import runtime.server.grpc, runtime.generation.engine, runtime.engine.otel, runtime.device.nvtx
import batchscope.storage.recorder, batchscope.storage.writer_process, batchscope.telemetry
import batchscope.tuning.search, batchscope.trace
import benchmarks.gpu_check, benchmarks.gpu_full
import os
owners = md.packages_distributions()
files = {}
def owner(dist, path):
    if dist not in files:
        base = md.distribution(dist)
        files[dist] = {os.path.realpath(base.locate_file(f)) for f in base.files or ()}
    return os.path.realpath(path) in files[dist]
found = set()
for name, module in list(sys.modules.items()):
    dists = owners.get(name.partition(".")[0], ())
    path = getattr(module, "__file__", None)
    if len(dists) > 1:  # a namespace (google.*): the one that holds the module's file
        dists = [d for d in dists if path and owner(d, path)]
    for dist in dists:
        found.add(dist.lower().replace("_", "-"))
print(json.dumps(sorted(found)))
"""


def test_every_imported_distribution_is_on_the_gpu_machine_or_carried():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         check=True, timeout=120).stdout
    imported = set(json.loads(out.strip().splitlines()[-1]))
    ours = {"batchscope"}
    # imported when they are there, not needed: starlette's form parser; grpc's helpers
    optional = {"python-multipart", "grpcio-reflection", "grpcio-tools",
                "grpcio-health-checking"}
    missing = imported - set(IMAGE) - set(NEEDED) - ours - optional
    assert not missing, f"add these to benchmarks/gpu/wheels.py NEEDED: {sorted(missing)}"


def test_the_launcher_is_valid_bash():
    subprocess.run(["bash", "-n", "benchmarks/gpu/launch.sh"], check=True)


def test_the_gpu_check_dry_runs_on_the_cpu(tmp_path):
    """``--device cpu`` runs the executor section (padded encoder batches through
    ``run_batch``) and says which sections need CUDA."""
    from benchmarks import gpu_check
    out = tmp_path / "gpu_check.json"
    assert gpu_check.main(["--device", "cpu", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    runs = doc["executor"]["runs"]
    assert doc["all_ok"] and len(runs) == 4 and all(r["outcome"] == "ok" for r in runs)
    assert all(r["compute_ms"] > 0 and r["input_ms"] >= 0 for r in runs)
    assert "need CUDA" in doc["skipped"] and doc["executor"]["split_and_retry"].startswith("skipped")
