"""A short check to run on a machine with a CUDA GPU (well under 2 minutes).

1. CUDA graphs: for ``mlp`` and ``encoder`` (length 64) at batch 1, 2, 4, 8, the graph
   output must match eager execution; the time per batch of both is measured.
2. Device telemetry through NVML (``batchscope.telemetry.DeviceSampler``).
3. A provoked CUDA out-of-memory error is caught as ``torch.cuda.OutOfMemoryError``
   and the device keeps working afterwards.
4. A model whose forward pass synchronises cannot be captured: the runner must fall
   back to eager execution and remember it.

Each section writes its result into the JSON summary as soon as it finishes:

    python -m benchmarks.gpu_check --out gpu_check.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
import traceback
from typing import Any, Callable

import torch

if __package__ in (None, ""):
    import common  # noqa: F401  (puts the repository root on sys.path)
from benchmarks.common import make_inputs
from batchscope.storage.records import ListRecorder
from batchscope.telemetry import DeviceSampler
from runtime.device import memory as devicemem
from runtime.device.cudagraphs import CudaGraphRunner
from runtime.models.loader import load_model
from runtime.models.mlp import MLPModel

BATCH_SIZES = (1, 2, 4, 8)


def _timed_ms(fn: Callable[[], Any], iters: int) -> float:
    """Median milliseconds of one call, synchronising around each."""
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def check_graphs(device: str, iters: int) -> list[dict[str, Any]]:
    rows = []
    for name in ("mlp", "encoder"):
        model = load_model(name)
        model.setup(device)
        runner = CudaGraphRunner(model, device, capture_sizes=BATCH_SIZES, max_batch_size=max(BATCH_SIZES))
        requests = make_inputs(name, max(BATCH_SIZES), seed=7, min_length=20, max_length=64)
        for n in BATCH_SIZES:
            items = [model.decode(r) for r in requests[:n]]
            batch = model.collate(items, 64 if model.variable_length else None)
            eager = model.predict(batch)
            out, as_graph = runner.run(batch, n)
            err = float((out - eager).abs().max())
            eager_ms = _timed_ms(lambda: model.predict(batch), iters)
            graph_ms = _timed_ms(lambda: runner.run(batch, n), iters)
            rows.append({"model": name, "batch_size": n, "ran_as_graph": as_graph, "max_abs_diff": err,
                         "matches_eager": bool(as_graph and err < 1e-3), "eager_ms": eager_ms,
                         "graph_ms": graph_ms, "speedup": eager_ms / graph_ms if graph_ms else None})
            print(f"{name:8s} n={n}: graph={as_graph} diff={err:.2e} eager {eager_ms:.3f} ms "
                  f"graph {graph_ms:.3f} ms x{eager_ms / graph_ms:.2f}", flush=True)
        rows.append({"model": name, "runner_stats": runner.stats()})
    return rows


def check_nvml(device: str) -> dict[str, Any]:
    sampler = DeviceSampler("gpu-check", ListRecorder(), torch_device=device)
    x = torch.randn(4096, 4096, device=device)
    for _ in range(20):
        x = x @ x / 64
    first = sampler.sample()[0]
    torch.cuda.synchronize()
    second = sampler.sample()[0]
    sampler.stop()
    return {"describe": sampler.describe(), "kind": sampler.kind,
            "samples": [dataclasses.asdict(r) for r in (first, second)]}


def check_oom(device: str) -> dict[str, Any]:
    total = torch.cuda.get_device_properties(device).total_memory
    result: dict[str, Any] = {"total_bytes": int(total)}
    try:
        torch.empty(int(total * 2), dtype=torch.uint8, device=device)
        result["caught_as_OutOfMemoryError"] = False
    except torch.cuda.OutOfMemoryError as exc:
        result["caught_as_OutOfMemoryError"] = True
        result["message"] = str(exc).splitlines()[0][:200]
    devicemem.free_cached(device)
    model = MLPModel()
    model.setup(device)
    out = model.predict(model.collate([r["INPUT0"] for r in make_inputs("mlp", 4)], None))
    result["works_after"] = bool(torch.isfinite(out).all())
    result["memory"] = devicemem.figures(device)
    return result


class SyncingMLP(MLPModel):
    """Reads a value back to the host inside the forward pass: not capturable."""

    name = "syncing-mlp"

    def predict(self, batch):
        out = super().predict(batch)
        if float(out.sum().item()) == float("inf"):
            return out * 0
        return out


def check_fallback(device: str) -> dict[str, Any]:
    model = SyncingMLP()
    model.setup(device)
    runner = CudaGraphRunner(model, device, capture_sizes=(1, 2, 4), max_batch_size=4)
    batch = model.collate([r["INPUT0"] for r in make_inputs("mlp", 3)], None)
    out1, g1 = runner.run(batch, 3)
    out2, g2 = runner.run(batch, 3)
    return {"first_ran_as_graph": g1, "second_ran_as_graph": g2,
            "outputs_equal": bool(torch.allclose(out1, out2)), "stats": runner.stats()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="CUDA graphs, NVML and OOM checks on a GPU")
    parser.add_argument("--out", default="gpu_check.json")
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args(argv)
    summary: dict[str, Any] = {"torch": torch.__version__, "cuda_available": torch.cuda.is_available()}
    if not torch.cuda.is_available():
        summary["error"] = "no CUDA device: run this on a GPU machine"
        print(json.dumps(summary))
        with open(args.out, "w") as fh:
            json.dump(summary, fh, indent=2)
        return 1
    torch.set_num_threads(1)
    summary["device_name"] = torch.cuda.get_device_name(args.device)
    sections = [("graphs", lambda: check_graphs(args.device, args.iters)),
                ("nvml", lambda: check_nvml(args.device)),
                ("oom", lambda: check_oom(args.device)),
                ("fallback", lambda: check_fallback(args.device))]
    ok = True
    for key, fn in sections:
        t0 = time.perf_counter()
        try:
            summary[key] = fn()
        except Exception as exc:
            ok = False
            summary[key] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-2000:]}
        summary[f"{key}_s"] = round(time.perf_counter() - t0, 2)
        with open(args.out, "w") as fh:
            json.dump(summary, fh, indent=2, default=str)
        print(f"== {key} done in {summary[f'{key}_s']} s", flush=True)
    graphs = [r for r in summary.get("graphs", []) if isinstance(r, dict) and "batch_size" in r]
    ok = ok and bool(graphs) and all(r["matches_eager"] for r in graphs)
    ok = ok and summary.get("oom", {}).get("caught_as_OutOfMemoryError") is True
    ok = ok and summary.get("fallback", {}).get("second_ran_as_graph") is False
    summary["all_ok"] = ok
    with open(args.out, "w") as fh:
        json.dump(summary, fh, indent=2, default=str)
    print(json.dumps({k: v for k, v in summary.items() if k != "graphs"}, indent=2, default=str))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
